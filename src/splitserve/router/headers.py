"""The HTTP headers of a forwarded request, and those the router adds to its answer."""

from __future__ import annotations

import os
from collections.abc import Mapping

from splitserve.router.errors import RouterError
from splitserve.router.forwarding import Forwarding
from splitserve.router.response import Response
from splitserve.router.session import SESSION_HEADER
from splitserve.router.worker import Worker

DECODE_HEADER = "X-Splitserve-Decode-Worker"
# With the kv-events policy: the prompt tokens the router's index expected the decode worker
# to hold when it placed the request (compare ``usage.prompt_tokens_details.cached_tokens``).
PREDICTED_HEADER = "X-Splitserve-Predicted-Cached-Tokens"
PREFILL_HEADER = "X-Splitserve-Prefill-Worker"
_PASSED_RESPONSE_HEADERS = ("content-type", "content-encoding", "cache-control")


def forward_headers(
    client_headers: Mapping[str, str], worker_api_key: str | None
) -> dict[str, str]:
    """What a worker is sent of the client's headers (by lower-case name): its request id
    (or a new one), its session, and ``worker_api_key`` or else its own authorization."""
    request_id = client_headers.get("x-request-id")
    headers = {
        "content-type": "application/json",
        "x-request-id": header_value(request_id) if request_id else os.urandom(16).hex(),
    }
    auth = f"Bearer {worker_api_key}" if worker_api_key else client_headers.get("authorization")
    if auth:
        headers["authorization"] = header_value(auth)
    if session := client_headers.get(SESSION_HEADER):  # workers own KV by session
        headers[SESSION_HEADER] = header_value(session)
    return headers


def reply_headers(
    upstream: Response, worker: Worker, forwarding: Forwarding, sent: dict[str, str]
) -> dict[str, str]:
    """The answer's headers: the worker's content headers, the request id, the workers that
    served it, and what the KV-event index predicted the decode worker held."""
    out = {k: upstream.headers[k] for k in _PASSED_RESPONSE_HEADERS if k in upstream.headers}
    out["x-request-id"] = sent["x-request-id"]
    out[DECODE_HEADER] = worker.url
    # Predicted from the request's own salted chain: only its tenant's blocks count.
    predicted = forwarding.predicted
    if predicted is not None and predicted[0] == worker.url:
        out[PREDICTED_HEADER] = str(predicted[1])
    if forwarding.prefill is not None:
        out[PREFILL_HEADER] = forwarding.prefill.url
    return out


def header_value(value: str) -> str:
    """A client's header value to forward; the upstream client writes values as they are."""
    if "\r" in value or "\n" in value or "\0" in value:
        raise RouterError(400, "a header value has a line break or a NUL")
    return value
