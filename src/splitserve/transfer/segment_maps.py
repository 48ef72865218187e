"""Read-only maps of prefill workers' shared-memory KV caches (``engine.shm_cache``), kept by a
decode worker across pulls for the ``shm`` transport's single-copy path."""

from __future__ import annotations

import _posixshmem
import mmap
import os
import threading
from collections import OrderedDict

from splitserve.engine.kv_pages import PagedBytes
from splitserve.engine.shm_cache import SEGMENT_PREFIX
from splitserve.transfer.errors import ProtocolError


class SegmentMaps:
    """Read-only maps of peers' segments, kept across pulls.

    A fresh map costs a page fault per 4 KiB on first read, as much as the copy itself, so a
    decode worker keeps its map of each prefill worker's cache (at most ``keep``, least
    recently used dropped first). Thread-safe; a dropped map is unmapped once no copy in
    flight reads it any more (the copy holds a reference).
    """

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._maps: OrderedDict[str, tuple[tuple[int, ...], PagedBytes]] = OrderedDict()
        self._lock = threading.Lock()

    def pages(self, name: str, rows: int, num_blocks: int, run: int) -> PagedBytes:
        """Segment ``name`` as a paged cache of ``num_blocks`` blocks of ``rows`` runs."""
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            # Belt and braces against an authenticated but buggy peer pointing us at some
            # other program's memory.
            raise ProtocolError(f"peer named an unexpected segment {name!r}")
        fd = _open(name)
        try:
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino, rows, num_blocks, run)
            with self._lock:
                hit = self._maps.get(name)
                if hit is not None and hit[0] == key:
                    self._maps.move_to_end(name)
                    return hit[1]
            size = rows * num_blocks * run
            if stat.st_size < size:
                raise ProtocolError(f"segment {name!r} is smaller than the {size} bytes announced")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        pages = PagedBytes(mapping, rows, num_blocks, run)
        with self._lock:
            self._maps[name] = (key, pages)
            while len(self._maps) > self.keep:
                self._maps.popitem(last=False)
        return pages

    def prune(self) -> None:
        """Drop maps whose segment was unlinked or replaced (e.g. its owner restarted)."""
        with self._lock:
            names = list(self._maps.items())
        for name, (key, _) in names:
            if _identity(name) != key[:2]:
                with self._lock:
                    if self._maps.get(name, (None,))[0] == key:
                        del self._maps[name]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._maps)


def _open(name: str) -> int:
    try:
        return _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except FileNotFoundError as exc:
        raise ProtocolError(f"shared-memory segment {name!r} does not exist") from exc


def _identity(name: str) -> tuple[int, int] | None:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError:
        return None
    try:
        stat = os.fstat(fd)
        return stat.st_dev, stat.st_ino
    finally:
        os.close(fd)
