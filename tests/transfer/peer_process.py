"""A prefill-side peer in its own process, for the cross-process transfer test.

Run as ``python -m tests.transfer.peer_process PREFIX``: serves ``make_cache(0)`` over tcp and
shm, leasing blocks 4..9 as ``req-tcp`` and ``req-shm``; prints the ports as one JSON line,
serves until stdin closes, then prints which leases ended how and exits.
"""

from __future__ import annotations

import json
import sys

from splitserve.engine.kv_pages import KVCacheBlocks
from splitserve.transfer import LeaseTable, TransferConfig, get_connector
from tests.transfer.helpers import SECRET, chain, make_cache


def main(prefix: str) -> None:
    source = KVCacheBlocks(make_cache(0))
    ended: list[list[str]] = []
    leases = LeaseTable(on_end=lambda lease, why: ended.append([lease.request_id, why]))
    for name in ("tcp", "shm"):
        leases.grant(f"req-{name}", list(range(4, 10)), chain(6))
    config = TransferConfig(SECRET, encrypt=True)
    tcp = get_connector("tcp", config).make_server(source, leases)
    shm = get_connector("shm", config).make_server(source, leases, segment_prefix=prefix)
    ports = {"tcp": tcp.start()[1], "shm": shm.start()[1]}
    print(json.dumps(ports), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    tcp.stop()
    shm.stop()
    print(json.dumps(sorted(ended)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
