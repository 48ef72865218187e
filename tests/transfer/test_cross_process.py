"""Server and client in separate processes: both transports, real sockets, real /dev/shm."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import torch

from splitserve.engine.kv_pages import KVCacheBlocks
from splitserve.transfer import (
    RemoteKV,
    TransferConfig,
    build_transfer_params,
    get_connector,
)
from tests.transfer.helpers import BS, SECRET, assert_blocks_equal, chain, make_cache, plan_all

ROOT = Path(__file__).resolve().parents[2]


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"peer process said nothing within {timeout_s}s"
    return proc.stdout.readline()


def test_pull_from_another_process(shm_prefix: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.peer_process", shm_prefix],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        ports = json.loads(read_line(proc, timeout_s=60))
        expected = make_cache(0)
        for transport, port in ports.items():
            remote = RemoteKV.from_params(
                build_transfer_params(
                    engine_id="p",
                    request_id=f"req-{transport}",
                    block_ids=list(range(4, 10)),
                    block_hashes=chain(6),
                    host="127.0.0.1",
                    port=port,
                    transport=transport,
                    block_size=BS,
                )  # fmt: skip
            )
            plan = plan_all(remote, held=set(chain(6)[:2]))
            dst = torch.zeros_like(expected)
            client = get_connector(transport, TransferConfig(SECRET)).make_client()
            client.pull(plan, KVCacheBlocks(dst), [0, 1, 2, 3])
            assert_blocks_equal(expected, [6, 7, 8, 9], dst, [0, 1, 2, 3])
        proc.stdin.close()
        ended = json.loads(read_line(proc, timeout_s=30))
        assert ended == [["req-shm", "released"], ["req-tcp", "released"]]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
