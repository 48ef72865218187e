"""Per-tenant and per-session quotas: what one tenant or one session may run or hold.

A tenant's ``limits`` (the keys file, ``common/tenants.py``) cap

- ``requests_in_flight``: its requests running at once;
- ``session_requests_in_flight``: one session's requests running at once (a session that
  floods the server waits for its own turns, not everyone else);
- ``kv_blocks``: KV blocks its running requests may claim (prompt plus ``max_tokens``);
- ``tokens_per_minute``: prompt plus generated tokens over the last 60 seconds.

Over a limit the answer is a 429 with ``Retry-After``. The router enforces the in-flight
limits for the requests it forwards; each worker enforces all four for what it runs. Counts
live in one process: two router replicas each allow the limit.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from splitserve.common.tenants import Limits, Tenant

WINDOW_S = 60.0
_BUSY_RETRY_S = 1  # in-flight limits free up when a request ends: retry soon


class QuotaExceeded(Exception):
    """A request over one of its tenant's limits; ``retry_after_s`` says when to retry."""

    def __init__(self, limit: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Usage:
    in_flight: int = 0
    blocks: int = 0
    sessions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens)
    token_sum: int = 0


class Ticket:
    """One admitted request's share of its tenant's quotas, returned by ``release``."""

    def __init__(self, quotas: Quotas, tenant: str, session: str | None, blocks: int) -> None:
        self._quotas, self.tenant, self.session, self.blocks = quotas, tenant, session, blocks
        self._open = True

    def release(self, tokens: int = 0) -> None:
        """The request ended having used ``tokens`` (prompt plus generated); idempotent."""
        if self._open:
            self._open = False
            self._quotas._release(self, tokens)


class Quotas:
    """Counts per tenant and session in one process (the event loop's thread)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._usage: dict[str, _Usage] = defaultdict(_Usage)
        self._clock = clock

    def admit(self, tenant: Tenant, session: str | None, blocks: int = 0) -> Ticket:
        """Count a request in, or raise ``QuotaExceeded`` naming the limit it would pass."""
        limits, usage = tenant.limits, self._usage[tenant.id]
        self._check(limits, usage, session, blocks)
        usage.in_flight += 1
        usage.blocks += blocks
        if session is not None:
            usage.sessions[session] += 1
        return Ticket(self, tenant.id, session, blocks)

    def _check(self, limits: Limits, usage: _Usage, session: str | None, blocks: int) -> None:
        if limits.requests_in_flight is not None and usage.in_flight >= limits.requests_in_flight:
            raise QuotaExceeded(
                "requests_in_flight",
                f"the tenant already has {usage.in_flight} requests running (its limit)",
                _BUSY_RETRY_S,
            )
        cap = limits.session_requests_in_flight
        if session is not None and cap is not None and usage.sessions.get(session, 0) >= cap:
            raise QuotaExceeded(
                "session_requests_in_flight",
                f"this session already has {cap} requests running (its limit)",
                _BUSY_RETRY_S,
            )
        if limits.kv_blocks is not None and usage.blocks + blocks > limits.kv_blocks:
            raise QuotaExceeded(
                "kv_blocks",
                f"the request needs {blocks} KV blocks; the tenant's running requests hold "
                f"{usage.blocks} of its {limits.kv_blocks}",
                _BUSY_RETRY_S,
            )
        if limits.tokens_per_minute is not None:
            self._expire(usage)
            if usage.token_sum >= limits.tokens_per_minute:
                wait = usage.tokens[0][0] + WINDOW_S - self._clock()
                raise QuotaExceeded(
                    "tokens_per_minute",
                    f"the tenant used {usage.token_sum} tokens in the last minute "
                    f"(its limit: {limits.tokens_per_minute})",
                    max(1, math.ceil(wait)),
                )

    def _release(self, ticket: Ticket, tokens: int) -> None:
        usage = self._usage[ticket.tenant]
        usage.in_flight -= 1
        usage.blocks -= ticket.blocks
        if ticket.session is not None:
            usage.sessions[ticket.session] -= 1
            if not usage.sessions[ticket.session]:
                del usage.sessions[ticket.session]
        if tokens:
            usage.tokens.append((self._clock(), tokens))
            usage.token_sum += tokens

    def _expire(self, usage: _Usage) -> None:
        horizon = self._clock() - WINDOW_S
        while usage.tokens and usage.tokens[0][0] <= horizon:
            usage.token_sum -= usage.tokens.popleft()[1]

    def in_flight(self, tenant: str) -> int:
        return self._usage[tenant].in_flight if tenant in self._usage else 0
