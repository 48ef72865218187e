"""The router's worker pool: who is a member, in which role, and whether each may serve.

Membership changes (command line, ``POST /workers``, ``DELETE /workers/{url}``) and health
outcomes (the probe loop, the proxy) all land here; policies only ever see the candidates
this returns, already filtered by health and role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from splitserve.router.health import CircuitBreaker
from splitserve.router.worker import LoadReport, Worker, healthy_workers, normalize_url


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 3
    cooldown_s: float = 5.0


class Membership:
    """Workers by URL, each with its circuit breaker."""

    def __init__(
        self,
        workers: Iterable[Worker] = (),
        breaker: BreakerConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.breaker_config = breaker or BreakerConfig()
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        for w in workers:
            self.add(w)

    def add(self, worker: Worker) -> bool:
        """Add ``worker``; False when that URL is already a member (its role is updated)."""
        if worker.url in self._workers:
            self._workers[worker.url].role = worker.role
            return False
        self._workers[worker.url] = worker
        cfg = self.breaker_config
        kwargs = {"clock": self._clock} if self._clock is not None else {}
        self._breakers[worker.url] = CircuitBreaker(cfg.failure_threshold, cfg.cooldown_s, **kwargs)
        return True

    def remove(self, url: str) -> Worker | None:
        url = normalize_url(url)
        self._breakers.pop(url, None)
        return self._workers.pop(url, None)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalize_url(url))

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def candidates(self, role: str, exclude: Iterable[str] = ()) -> list[Worker]:
        """Healthy members serving ``role``, minus ``exclude`` (workers already tried)."""
        skip = set(exclude)
        for url, w in self._workers.items():
            w.healthy = self._breakers[url].allows()
        return [w for w in healthy_workers(self._workers.values(), role) if w.url not in skip]

    def report(self, url: str, ok: bool, load: LoadReport | None = None, own: int = 0) -> None:
        """A probe or a proxied request succeeded (``ok``) or failed on ``url``.

        ``own``: how many of ``load``'s requests were this router's (see ``Worker.load``).
        """
        breaker = self._breakers.get(url)
        worker = self._workers.get(url)
        if breaker is None or worker is None:
            return  # removed while the probe was in flight
        if ok:
            breaker.record_success()
        else:
            breaker.record_failure()
        if load is not None:
            worker.report, worker.report_own = load, own
        worker.healthy = breaker.allows()

    def roles(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for w in self._workers.values():
            out.setdefault(w.role, []).append(w.url)
        return out
