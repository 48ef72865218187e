"""A keys file (``--api-keys``) changed on disk takes effect without a restart.

Each process that holds one (router, worker) looks at the file's size, modification time and
inode every ``KEYS_POLL_S`` seconds. A changed file is read and checked whole, as at start;
if it is good, the keys, tenants, limits and public prefixes switch at once for every new
request, and a request already accepted finishes as it started. A bad file (unreadable, not
valid JSON, a bad entry) is logged and the keys in use stay.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from splitserve.common.kv_salts import KVSalts
from splitserve.common.tenants import Tenants

log = logging.getLogger(__name__)

KEYS_POLL_S = 1.0


class KeysReload:
    """Watches ``salts.tenants.path`` and adopts the file's keys when it changes; ``check``
    may refuse new tenants (a ValueError) as the process would at start."""

    def __init__(
        self,
        salts: KVSalts,
        check: Callable[[Tenants], None] | None = None,
        interval: float = KEYS_POLL_S,
    ) -> None:
        self.salts = salts
        self.path = salts.tenants.path
        self.check = check
        self.interval = interval
        self.reloads = 0
        self.failures = 0
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path) if self.path else None
        except OSError:
            return None
        return None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self) -> bool:
        """Adopt the file if it changed and is good; True when keys switched."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return False
        self._seen = stamp
        try:
            tenants = Tenants.load(self.path)
            if self.check is not None:
                self.check(tenants)
            self.salts.adopt(tenants)
        except ValueError as e:
            self.failures += 1
            log.error("API keys file not reloaded, the keys in use stay: %s", e)
            return False
        self.reloads += 1
        log.info("API keys reloaded from %s: %d tenants", self.path, len(tenants.by_id))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.poll()


def start(salts: KVSalts, check: Callable[[Tenants], None] | None = None) -> asyncio.Task | None:
    """A task reloading ``salts``' keys file on the running loop; None without a file."""
    if salts.tenants.path is None:
        return None
    return asyncio.create_task(KeysReload(salts, check).run(), name="keys-reload")


async def stop(task: asyncio.Task | None) -> None:
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
