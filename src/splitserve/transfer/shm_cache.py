"""KV caches in POSIX shared memory: the prefill side's cache, and the decode side's maps.

The ``shm`` transport's single-copy path: a prefill worker allocates its whole paged KV cache
in a segment (``SharedKVCache``); a decode worker on the same host maps that segment
read-only (``SegmentMaps``) and copies leased blocks straight from it into its own cache::

    prefill process                          decode process
    kv_cache = SharedKVCache(...).tensor     SegmentMaps.pages(name) (PROT_READ, kept)
         |  /dev/shm/splitserve-kv-cache-*        |
         +-------------- same pages -------------+--> copy_block --> own kv_cache

Invariants: segments are created mode 0600 (same user only) and named with the transport's
prefix and the owner's pid; the owner unlinks the name at ``close()`` (its tensor stays
valid) or, if it dies first, ``multiprocessing``'s resource tracker does. If the tracker dies
with it (its whole process group SIGKILLed), the next cache created on the host unlinks
segments whose owner pid is gone. A reader maps only what it was told to and never writes;
it drops a map whose name is gone or names a new segment, so a restarted prefill worker's
old cache is not held alive.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
import threading
from collections import OrderedDict
from multiprocessing import resource_tracker

import torch

from splitserve.transfer.errors import ProtocolError
from splitserve.transfer.kv_pages import PagedBytes

SEGMENT_PREFIX = "splitserve-kv-"  # every segment the transport creates or maps
CACHE_PREFIX = f"{SEGMENT_PREFIX}cache-"


class SharedKVCache:
    """A zero-filled tensor of ``shape`` and ``dtype`` in a fresh shared-memory segment."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, prefix: str = CACHE_PREFIX):
        if not prefix.startswith(SEGMENT_PREFIX) or "/" in prefix:
            raise ValueError(f"segment prefix must start with {SEGMENT_PREFIX!r}")
        count = int(torch.Size(shape).numel())
        size = count * dtype.itemsize
        unlink_orphans(prefix)
        self.name = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        mapping = _create(self.name, size)
        resource_tracker.register("/" + self.name, "shared_memory")
        self._unlinked = False
        self.tensor = torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)

    def close(self) -> None:
        """Unlink the name (peers can no longer map it); the tensor stays usable."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
        resource_tracker.unregister("/" + self.name, "shared_memory")


def unlink_orphans(prefix: str = CACHE_PREFIX, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink caches named ``<prefix><pid>-*`` whose owner process no longer exists; returns
    their names. (A pid reused by an unrelated process keeps its orphan: the safe side.)"""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    gone = []
    for name in names:
        pid, sep, _ = name.removeprefix(prefix).partition("-")
        if name.startswith(prefix) and sep and pid.isdigit() and not _alive(int(pid)):
            try:
                _posixshmem.shm_unlink("/" + name)
                gone.append(name)
            except OSError:
                pass
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        # Reserve every page now: a full /dev/shm fails here with a clear error instead of a
        # SIGBUS in the middle of a model step. tmpfs hands out zeroed pages.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError as exc:
        _posixshmem.shm_unlink("/" + name)
        # A ValueError: the fix is in the configuration, and the CLI reports it as such.
        raise ValueError(
            f"cannot allocate a {size / 2**30:.2f} GiB KV cache in shared memory (/dev/shm): "
            f"{exc.strerror}; lower --kv-cache-gb or use --kv-transport tcp"
        ) from exc
    finally:
        os.close(fd)


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
