"""Forwarding one request: placement, the optional prefill leg, the send, streaming relay.

A request may be retried on another worker until its first byte reaches the client
(``router.sender``). After the first byte the client owns a partial answer, so a streamed
request migrates instead: the router resumes it on the session's next worker from the tokens
already delivered (``resume``, ``migration``) and the client's stream continues. Only when no
worker can take it over does the stream end with an SSE error event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

from splitserve.common.kv_salts import KVSalts
from splitserve.common.responses_api import CHAIN_HEADER, chain_of, response_id
from splitserve.common.tenants import DEFAULT_TENANT, Tenants
from splitserve.router import disagg
from splitserve.router.body import forwarded
from splitserve.router.body import parse as parse_body
from splitserve.router.config import RouterConfig
from splitserve.router.errors import no_worker
from splitserve.router.forwarding import Forwarding
from splitserve.router.headers import (  # noqa: F401 (the answer's headers, named here too)
    DECODE_HEADER,
    PREDICTED_HEADER,
    PREFILL_HEADER,
    forward_headers,
)
from splitserve.router.membership import Membership
from splitserve.router.metrics import RouterMetrics
from splitserve.router.migration import TOKEN_IDS_FIELD, StreamRelay
from splitserve.router.placement import (
    Decision,
    PlacementRules,
    place,
    uncached_from_body,
)
from splitserve.router.policies import RequestInfo, RoutingPolicy
from splitserve.router.policies.session import SyncedRing
from splitserve.router.prefetch import PrefetchHints
from splitserve.router.prefill_leg import PrefillLeg
from splitserve.router.replies import Reply
from splitserve.router.response_homes import ChainHomes, previous_not_found
from splitserve.router.responses_relay import ResponsesLog, ResponsesRelay, unresumable_reason
from splitserve.router.resume import Resumer
from splitserve.router.resume_mode import resume_mode
from splitserve.router.salts import request_salt, salt_for_vllm
from splitserve.router.sender import Sender
from splitserve.router.session import (
    chain_key,
    keyed_by_chain,
    prefix_key,
    session_key,
)
from splitserve.router.stream_log import StreamLog
from splitserve.router.timing import Timeline, now
from splitserve.router.upstream import Pool
from splitserve.router.vouch import Vouch
from splitserve.router.worker import Worker

if TYPE_CHECKING:
    from splitserve.router.admission import Admission
    from splitserve.router.prompt_tokens import ChatTokenizer

PEER_FIELD = "kv_peer"  # the worker to pull a moved turn's KV from (worker.peer)
# What only the router writes: the first two make a worker contact other hosts, ``resume``
# continues a stream another worker began (router/migration.py).
ROUTER_FIELDS = (PEER_FIELD, "kv_transfer_params", "resume")


class Proxy:
    """Routes and forwards OpenAI requests to the workers in ``membership``."""

    def __init__(
        self,
        config: RouterConfig,
        membership: Membership,
        decode: RoutingPolicy,
        prefill: RoutingPolicy,
        client: Pool,
        metrics: RouterMetrics,
        tokenizer: ChatTokenizer | None = None,
        vouch: Vouch | None = None,
        salts: KVSalts | None = None,
    ) -> None:
        self.config = config
        self.vouch = vouch or Vouch()
        # The workers' salts: the principal's, the tenant's public prefixes apart.
        self.salts = salts or KVSalts(Tenants.open(), self.vouch.secret)
        self.tokenizer = tokenizer  # prompt ids for the policies (the kv-events policy)
        self.membership = membership
        self.policies = {"decode": decode, "prefill": prefill}
        self.client = client
        self.metrics = metrics
        self._home_ring = SyncedRing(config.vnodes)  # over all decode members, healthy or not
        self.rules = PlacementRules(
            config.disaggregate, config.remote_prefill_threshold, config.kv_peer_fetch
        )
        self.hints = PrefetchHints(client, self.vouch)
        self.homes = ChainHomes()  # where moved response chains now live (a hint)
        self.sender = Sender(
            config.max_retries, membership, self.policies, client, metrics, self.vouch
        )
        self.prefill_leg = PrefillLeg(client, self.vouch, metrics, self.sender.failed)
        self.resumer = Resumer(
            config.max_retries,
            membership,
            decode,
            client,
            metrics,
            self.vouch,
            self.sender.pick,
            self.sender.failed,
        )
        self.sender.resume = self.resumer.after

    async def completion(
        self,
        client_headers: Mapping[str, str],
        raw: bytes,
        path: str,
        principal: str,
        timeline: Timeline,
        admission: Admission | None = None,
    ) -> Reply:
        """``POST /v1/chat/completions`` or ``/v1/completions`` for ``principal`` (a tenant,
        or one key of it: ``common.tenants.Key``); ``client_headers`` by lower-case name,
        ``raw`` the request body; ``admission`` counts it in its tenant's in-flight limits
        once its session is known."""
        body = parse_body(raw)
        responses = keyed_by_chain(path)
        # Only the router names peers and transfer sources (workers will call them): a
        # client's are dropped, never signed. (Token ids of a response stream are its too.)
        owned = ROUTER_FIELDS + (("return_token_ids",) if responses else ())
        client_written = [name for name in owned if name in body]
        for name in client_written:
            del body[name]
        vllm = self.config.worker_engine == "vllm"
        rewrite = vllm and salt_for_vllm(body, principal, self.vouch.secret)
        rewrite = rewrite or bool(client_written)
        timeline.parsed = now()
        headers = self._forward_headers(client_headers)
        forwarding = self._place(client_headers, body, timeline, principal)
        forwarding.tenant = principal
        added: dict[str, Any] = {}  # the router's fields in the forwarded body
        chain = None
        if responses:  # keyed by its response chain instead (``session.chain_key``)
            chain = self._place_chain(forwarding, body, headers)
            if vllm and chain is not None:  # vLLM's own field, which becomes the response id
                added["request_id"] = response_id(chain)
        if admission is not None:
            admission.admit(forwarding.info.session_key)
        moved_home = self.homes.placed(chain, self.membership.candidates("decode"))
        decision = moved_home or self._decide(forwarding)
        if decision is None:
            raise no_worker("decode")
        decode = decision.decode
        excluded = [decode.url]
        forwarding.predicted = self._predicted(decode, forwarding.info)
        timeline.routed = now()
        # Prefetch and peer hints speak chat and completions only.
        if self.config.prefetch_hints and forwarding.info.session_key is not None and not responses:
            self.hints.send(decode, body, headers, principal)
        if responses and (vllm or body.get("previous_response_id") is not None):
            # A chained turn's conversation is stored on its decode worker alone (and mostly
            # cached there); vLLM's /v1/responses takes no kv_transfer_params.
            decision = decision._replace(remote_prefill=False, prefill=None)
        if self.rules.disaggregate:
            await self.prefill_leg.run(path, body, headers, forwarding, decision)
        if forwarding.kv_params is not None:
            added.update(disagg.decode_fields(forwarding.kv_params))
        elif decision.peer is not None and decision.peer.healthy and not responses:
            # (still healthy after a prefill leg)
            self.metrics.kv_peer_hints.inc()
            added[PEER_FIELD] = decision.peer.url
        stream = body.get("stream") is True
        if stream and responses:  # relayed for its error event even where not resumable
            refusal = unresumable_reason(body, self.config.worker_engine)
            moved = lambda url: self.homes.moved(chain, url)  # noqa: E731
            forwarding.relay = ResponsesRelay(ResponsesLog.of(body, refusal), body, moved)
            forwarding.headers, forwarding.excluded = headers, excluded
            if refusal is None:
                added.update(TOKEN_IDS_FIELD)
        elif stream and (mode := resume_mode(body, self.config.worker_engine)) is not None:
            log = StreamLog.of(body, chat=path.endswith("/chat/completions"))
            forwarding.relay = StreamRelay(log, body, mode)
            forwarding.headers, forwarding.excluded = headers, excluded
            added.update(TOKEN_IDS_FIELD)
        payload = forwarded(raw, body, added, rewrite)

        def send(worker: Worker) -> Awaitable[Reply]:
            return self.sender.send(worker, "POST", path, payload, headers, stream, forwarding)

        def attempt(worker: Worker) -> Awaitable[Reply]:
            return self.sender.with_retries("decode", forwarding, excluded, worker, send)

        reply = await attempt(decode)
        if responses and previous_not_found(reply):  # the chain moved: ask the others
            holder = lambda: self._next_holder(forwarding, excluded)  # noqa: E731
            reply = await self.homes.find(reply, chain, holder, attempt)
        return reply

    async def models(
        self, client_headers: Mapping[str, str], tenant: str, timeline: Timeline
    ) -> Reply:
        """``GET /v1/models`` from any healthy worker."""
        info = RequestInfo()
        headers = self._forward_headers(client_headers)
        forwarding = Forwarding(info, None, timeline=timeline, tenant=tenant)
        timeline.parsed = timeline.handler
        excluded: list[str] = []
        first = self.sender.pick("decode", info, excluded)
        if first is None:
            raise no_worker("decode")
        return await self.sender.with_retries(
            "decode",
            forwarding,
            excluded,
            first,
            lambda w: self.sender.send(w, "GET", "/v1/models", None, headers, False, forwarding),
        )

    def _place(
        self,
        client_headers: Mapping[str, str],
        body: dict[str, Any],
        timeline: Timeline,
        principal: str = DEFAULT_TENANT,
    ) -> Forwarding:
        """What the policies may know of the request, and its session's home. Its prompt's
        token ids and KV salt are only for the kv-events index, which the router's
        tokenizer is there for."""
        key = session_key(client_headers, body, self.config.prefix_chars)
        uncached = uncached_from_body(body, self.config.chars_per_token, self.rules.disaggregate)
        ids = None if self.tokenizer is None else self.tokenizer.request_ids(body)
        info = RequestInfo(
            session_key=None if key is None else key.key,
            prefix_key=prefix_key(body, self.config.prefix_chars),
            prompt_tokens=int(uncached.elsewhere),
            prompt_token_ids=ids,
            kv_salt="" if self.tokenizer is None else self._kv_salt(body, principal, ids),
            model=body["model"] if isinstance(body.get("model"), str) else None,
        )
        home = None
        if info.session_key is not None:
            ring = self._home_ring.sync([w for w in self.membership.all() if w.serves("decode")])
            home = ring.owner(info.session_key)
        return Forwarding(info, home, uncached, timeline=timeline)

    def _kv_salt(self, body: dict[str, Any], principal: str, ids: list[int] | None) -> str:
        return request_salt(body, principal, self.salts, self.config.worker_engine, ids)

    def _decide(self, forwarding: Forwarding) -> Decision | None:
        """The placement decision (``placement.place``) over the healthy members."""
        home = self.membership.get(forwarding.home) if forwarding.home is not None else None
        return place(
            forwarding.info,
            self.membership.candidates("decode"),
            self._prefill_candidates,
            self.policies["decode"],
            self.policies["prefill"],
            home,
            forwarding.uncached,
            self.rules,
        )

    def _prefill_candidates(self, decode: Worker) -> list[Worker]:
        return self.membership.candidates("prefill", [decode.url])

    def _place_chain(
        self, forwarding: Forwarding, body: dict[str, Any], headers: dict[str, str]
    ) -> str | None:
        """Key a Responses request by its chain, naming a first turn's new chain to the
        worker; the chain (None for a previous response this router's workers did not make).

        A vLLM worker names a response by the request's ``request_id``: the router makes it
        a response id of the chain, so every turn of a chain lands on one vLLM worker too."""
        key, named = chain_key(body)
        headers.update(named)
        forwarding.info = dataclasses.replace(forwarding.info, session_key=key.key)
        ring = self._home_ring.sync([w for w in self.membership.all() if w.serves("decode")])
        forwarding.home = ring.owner(key.key)
        return named.get(CHAIN_HEADER) or chain_of(str(body.get("previous_response_id") or ""))

    def _next_holder(self, forwarding: Forwarding, excluded: list[str]) -> Worker | None:
        """The next decode worker to ask for a turn's previous response (counted)."""
        worker = self.sender.pick("decode", forwarding.info, excluded)
        if worker is not None:
            self.metrics.response_searches.inc()
        return worker

    def _predicted(self, worker: Worker, info: RequestInfo) -> tuple[str, int] | None:
        index = getattr(self.policies["decode"], "index", None)  # the kv-events policy's
        if index is None or not info.prompt_token_ids:
            return None
        matched = index.matches([worker.url], info.prompt_token_ids, info.kv_salt, info.model)
        return worker.url, matched[worker.url]

    def _forward_headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        return forward_headers(client_headers, self.config.worker_api_key)
