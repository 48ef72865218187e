"""The request body the router forwards: the client's own bytes, with the router's fields
appended, so that a long prompt is parsed once (for placement) and never re-serialised.

::

    client:    {"messages": [...], "stream": true}
    forwarded: {"messages": [...], "stream": true,"return_token_ids":true}
                                                  ^ the router's fields, after the client's

The bytes are spliced only when the body is plain UTF-8 text of one JSON object without
any of the added keys; otherwise (another encoding, a duplicate key, a field the router
removed) the parsed body is serialised again, as it always was.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.router.errors import RouterError


def parse(raw: bytes) -> dict[str, Any]:
    """The client's body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RouterError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object")
    return body


def forwarded(raw: bytes, body: dict[str, Any], added: dict[str, Any], rewrite: bool) -> bytes:
    """What the worker gets: ``raw`` (parsed as ``body``) with ``added``'s fields appended;
    ``rewrite``: ``body`` no longer says what ``raw`` does (a field was removed)."""
    if rewrite or not body or not _plain(raw) or any(k in body for k in added):
        return json.dumps({**body, **added}).encode()
    if not added:
        return raw
    end = raw.rindex(b"}")
    return b"%s,%s}" % (raw[:end], json.dumps(added).encode()[1:-1])


def _plain(raw: bytes) -> bool:
    """One object in UTF-8 (or ASCII) text: ``{`` first and ``}`` last, but for whitespace.
    UTF-16/32 text or a byte-order mark has other bytes at one end or the other."""
    stripped = raw.strip(b" \t\r\n")
    return stripped[:1] == b"{" and stripped[-1:] == b"}"
