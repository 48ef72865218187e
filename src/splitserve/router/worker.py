"""What the router knows about one worker: its address, role, health and load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from splitserve.common.protocol import WORKER_ROLES as ROLES


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's ``/load`` answer (the fields the router uses)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0

    @classmethod
    def from_json(cls, data: dict) -> LoadReport:
        def count(name: str) -> int:
            value = data.get(name, 0)
            return value if isinstance(value, int) and value >= 0 else 0

        return cls(*(count(n) for n in ("running", "waiting", "kv_blocks_used", "kv_blocks_total")))


@dataclass(slots=True, eq=False)
class Worker:
    """One worker. ``url`` is its identity: normalized so that replicas agree on it."""

    url: str
    role: str = "both"
    healthy: bool = True
    report: LoadReport = field(default_factory=LoadReport)
    in_flight: int = 0  # requests this router has sent there and not yet seen finish
    report_own: int = 0  # of ``report``'s requests, how many were this router's own

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")

    @property
    def load(self) -> int:
        """Requests on the worker, as best this router knows.

        This router's own requests come from its in-flight count (exact and immediate); the
        report adds the others' (other replicas, direct clients), lagging by a probe
        interval. The report's own share is subtracted: counting a request that has since
        finished would make a sequential session look like load and push it off its home.
        """
        others = self.report.running + self.report.waiting - self.report_own
        return self.in_flight + max(0, others)

    def serves(self, role: str) -> bool:
        """Whether this worker can take the ``role`` leg (a collocated worker takes both)."""
        return self.role == role or self.role == "both"


def normalize_url(url: str) -> str:
    """``http://h:1/`` and ``http://h:1`` name the same worker; a bare ``h:1`` gets http."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("a worker URL must not be empty")
    if "://" not in url:
        url = f"http://{url}"
    return url


def healthy_workers(workers: Iterable[Worker], role: str | None = None) -> list[Worker]:
    """The workers a request may go to: healthy and, if ``role`` is given, serving it."""
    return [w for w in workers if w.healthy and (role is None or w.serves(role))]
