"""What the router knows about one worker: its address, role, health and load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

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


class Worker:
    """One worker. ``url`` is its identity: normalized so that replicas agree on it.

    Workers compare by identity. ``load`` is kept up to date as ``in_flight``, ``report``
    and ``report_own`` change, and so is every load map the worker was asked to ``watch``
    (a policy's view of its candidates): policies never sum loads worker by worker.
    """

    __slots__ = (
        "url",
        "role",
        "healthy",
        "_report",
        "_in_flight",
        "_report_own",
        "_load",
        "_watchers",
    )

    def __init__(
        self,
        url: str,
        role: str = "both",
        healthy: bool = True,
        report: LoadReport | None = None,
        in_flight: int = 0,  # requests this router has sent there and not yet seen finish
        report_own: int = 0,  # of ``report``'s requests, how many were this router's own
    ) -> None:
        self.url = normalize_url(url)
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.healthy = healthy
        self._report = report if report is not None else LoadReport()
        self._in_flight = in_flight
        self._report_own = report_own
        self._watchers: list[dict[str, int]] = []
        self._update_load()

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, {self.role!r}, load={self._load})"

    @property
    def load(self) -> int:
        """Requests on the worker, as best this router knows.

        This router's own requests come from its in-flight count (exact and immediate); the
        report adds the others' (other replicas, direct clients), lagging by a probe
        interval. The report's own share is subtracted: counting a request that has since
        finished would make a sequential session look like load and push it off its home.
        """
        return self._load

    def watch(self, loads: dict[str, int]) -> None:
        """Keep ``loads[self.url]`` equal to this worker's load until ``unwatch``."""
        self._watchers.append(loads)
        loads[self.url] = self._load

    def unwatch(self, loads: dict[str, int]) -> None:
        self._watchers = [w for w in self._watchers if w is not loads]

    def _update_load(self) -> None:
        others = self._report.running + self._report.waiting - self._report_own
        self._load = load = self._in_flight + max(0, others)
        for loads in self._watchers:
            loads[self.url] = load

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._in_flight = value
        self._update_load()

    @property
    def report(self) -> LoadReport:
        return self._report

    @report.setter
    def report(self, value: LoadReport) -> None:
        self._report = value
        self._update_load()

    @property
    def report_own(self) -> int:
        return self._report_own

    @report_own.setter
    def report_own(self, value: int) -> None:
        self._report_own = value
        self._update_load()

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


def check_url(url: str) -> str:
    """``url`` if the router can dial it: ``http(s)://host[:port]``, printable ASCII, a port
    in range. A worker added with anything else would fail every request sent to it in ways
    no worker failure does (a ValueError, not a refused connection)."""
    if not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError(f"a worker URL must be printable ASCII without spaces, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port  # a ValueError when it is not a number in 0..65535
        host = parts.hostname or ""
        host.encode("idna")  # a UnicodeError for an empty or too long label ("a..b")
    except ValueError as e:  # UnicodeError is one
        raise ValueError(f"not a worker URL: {url!r} ({e})") from e
    if parts.scheme not in ("http", "https") or not host or port == 0:
        raise ValueError(f"a worker URL must be http(s)://host[:port], got {url!r}")
    return url


def healthy_workers(workers: Iterable[Worker], role: str | None = None) -> list[Worker]:
    """The workers a request may go to: healthy and, if ``role`` is given, serving it."""
    return [w for w in workers if w.healthy and (role is None or w.serves(role))]
