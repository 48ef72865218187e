"""The shm transport's staging segments reserve their pages when created."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from splitserve.transfer.shm_pool import SegmentPool


def shm_names(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_a_segment_larger_than_dev_shm_fails_at_creation_and_leaves_nothing():
    prefix = f"splitserve-test-pool-{os.getpid()}-"
    pool = SegmentPool(prefix)
    too_big = shutil.disk_usage("/dev/shm").free + 2**30
    with pytest.raises(OSError) as exc:
        pool.take(too_big)  # without the reservation this "succeeds" and SIGBUSes on use
    assert exc.value.errno == errno.ENOSPC
    assert shm_names(prefix) == []
    segment = pool.take(2**20)  # an ordinary one still works, fully backed
    assert os.stat(f"/dev/shm/{segment.name.lstrip('/')}").st_blocks * 512 >= 2**20
    pool.give_back(segment, healthy=False)
    pool.close()
    assert shm_names(prefix) == []
