"""Peer KV fetch: a session's KV follows a turn that the router moved off its home worker.

The router places a session's turns on its home worker (the ring owner of the session key)
unless the home is full; a turn placed elsewhere would recompute the whole conversation.
Instead the router names the home in the request (``kv_peer``), and the chosen worker pulls
from it the leading blocks of the prompt that the home holds and it lacks, over the same
KV data plane prefill workers use::

    worker B (chosen)                                  worker A (home, busy)
    local_blocks(prompt) ── holds all it could use? ──▶ done, compute as usual
    POST A/v1/kv/lease {prompt_token_ids} ───────────▶ engine lock: leading cached run,
                                                        one ref each, lease (short TTL)
    ◀──────────────────────────── kv_transfer_params (or "nothing held")
    DecodeSide.pull ════ KV data plane (tcp/shm) ════▶ KV server reads the leased blocks
                    ─── release ───────────────────▶  lease ends: refs dropped, once
    run the request: the pulled blocks are prefix-cache hits

Every failure on the way (home down or slow, nothing held, hash mismatch, no free blocks,
a broken transfer) leaves the request to compute its prompt locally: the hint can only make
a turn faster, never fail it. Greedy output is the same either way (the last prompt block
is always computed here, see ``BlockManager.reusable_blocks``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from splitserve.common.protocol import make_id
from splitserve.common.tls import client_context
from splitserve.transfer import RemoteKV
from splitserve.worker.auth import WorkerAuth
from splitserve.worker.disagg import DecodeSide, EngineCalls, PrefillSide
from splitserve.worker.disagg_config import DisaggConfig
from splitserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# A peer pulls right after the lease is granted; the lease only guards against a puller
# that never comes back (the KV server renews it while a transfer reads).
PEER_LEASE_TTL_S = 10.0
LEASE_PATH = "/v1/kv/lease"


def peer_url(value: str) -> str:
    """The base URL a ``kv_peer`` hint names; ``ValueError`` unless it is http(s)://host."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"kv_peer must be a worker's http(s) URL, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"kv_peer must be a worker's base URL, got {value!r}")
    return value.rstrip("/")


class PeerKV:
    """Both halves of peer KV fetch on one worker: lending (``lease``, on the home) and
    pulling (``fetch``, on the worker a moved turn landed on)."""

    def __init__(
        self,
        cfg: DisaggConfig,
        server: PrefillSide,
        decode: DecodeSide,
        calls: EngineCalls,
        metrics: WorkerMetrics,
        auth: WorkerAuth,
    ) -> None:
        self.server = server
        self.decode = decode
        self.calls = calls
        self.metrics = metrics
        self.timeout_s = cfg.peer_timeout_s
        self.ca = cfg.peer_ca
        self.auth = auth
        self._http: httpx.AsyncClient | None = None

    # ---- the home: lend the leading cached blocks of a prompt ----------------------------

    async def lease(self, prompt: list[int], salt: str = "") -> dict[str, Any]:
        """The ``POST /v1/kv/lease`` answer for ``prompt``: the leased blocks'
        ``kv_transfer_params``, or none when the device pool holds none of its blocks."""
        params = await self.calls.call_now(lambda e: self._lease_on_engine(e, prompt, salt))
        blocks = 0 if params is None else len(params["block_hashes"])
        self.metrics.kv_peer_leases.labels("granted" if params else "empty").inc()
        return {"object": "kv.lease", "blocks": blocks, "kv_transfer_params": params}

    def _lease_on_engine(self, engine: Any, prompt: list[int], salt: str) -> dict[str, Any] | None:
        # Refs and lease are taken together under the engine's lock (between two model runs,
        # so a busy home answers in milliseconds): a caller that goes away meanwhile leaves
        # a lease that expires, never a reference nobody drops.
        kept = engine.lease_prefix(prompt, salt)
        if kept is None:
            return None
        return self.server.grant(make_id("peer"), kept, len(prompt), PEER_LEASE_TTL_S)

    # ---- the chosen worker: pull what the home holds and this worker lacks ---------------

    async def fetch(
        self,
        prompt: list[int],
        peer: str,
        principal: str,
        cache_salt: str | None = None,
        salt: str = "",
    ) -> str:
        """Pull the prompt's leading KV blocks from ``peer`` where it holds more than this
        worker; returns the outcome (also counted). Never raises for a failed pull. The
        lease is asked on ``principal``'s behalf (a tenant, or one key of it), so the peer
        salts its hashes as this worker does (``salt``)."""
        outcome, reason = await self._fetch(prompt, peer, _Owner(principal, cache_salt, salt))
        self.metrics.kv_peer_fetches.labels(outcome).inc()
        if reason is not None:
            self.metrics.kv_peer_fallbacks.labels(reason).inc()
            log.info("peer KV fetch from %s failed (%s); computing locally", peer, reason)
        return outcome

    async def _fetch(self, prompt: list[int], peer: str, owner: _Owner) -> tuple[str, str | None]:
        usable = self.decode.engine.block_manager.reusable_blocks(len(prompt))
        local = await self.decode.local_blocks(prompt, owner.salt) if usable else 0
        if local >= usable:
            return "held_locally", None
        try:
            remote = await self._lease(peer, prompt, owner)
        except httpx.TimeoutException:
            return "fallback", "timeout"
        except httpx.TransportError:
            return "fallback", "unreachable"
        except (httpx.HTTPError, ValueError) as e:
            log.debug("bad lease answer from %s: %r", peer, e)
            return "fallback", "peer_error"
        if remote is None:
            return "nothing_held", None
        result = await self.decode.pull(prompt, remote, owner.salt, local=local)
        if result.fallback is not None:
            return "fallback", result.fallback
        if not result.remote:
            return "nothing_new", None
        self.metrics.kv_peer_blocks_received.inc(result.blocks)
        return "pulled", None

    async def _lease(self, peer: str, prompt: list[int], owner: _Owner) -> RemoteKV | None:
        """Ask ``peer`` to lease the prompt's blocks; ``ValueError`` on a malformed answer."""
        http = self._client()
        hint: dict[str, Any] = {"prompt_token_ids": prompt}
        if owner.cache_salt:
            hint["cache_salt"] = owner.cache_salt
        body = json.dumps(hint).encode()
        headers = self.auth.signed_headers(owner.principal, "POST", LEASE_PATH, body)
        r = await http.post(peer + LEASE_PATH, content=body, headers=headers)
        r.raise_for_status()
        answer = r.json()
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return None if params is None else RemoteKV.from_params(params)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:  # made on the event loop that uses it
            # trust_env=False: a proxy from the environment must not sit between two peers.
            # https:// peers: verified against --worker-ca, else certifi's roots.
            verify = True if self.ca is None else client_context(self.ca)
            self._http = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, verify=verify)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


@dataclass(frozen=True, slots=True)
class _Owner:
    """Whose KV a fetch moves: the principal asked for, and the salt of its block hashes."""

    principal: str
    cache_salt: str | None
    salt: str
