"""The KV cache in POSIX shared memory, for the ``shm`` transport's single-copy path.

A prefill worker allocates its whole paged KV cache in a segment (``SharedKVCache``); a
decode worker on the same host maps that segment read-only (``transfer.segment_maps``) and
copies leased blocks straight from it into its own cache::

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
from multiprocessing import resource_tracker

import torch

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
