from __future__ import annotations

import subprocess
import sys

from splitserve.common.kv_hash import BlockChain, block_hash, hash_blocks, root_hash

TOKENS = list(range(100, 150))  # 3 full blocks of 16 and a partial one


def test_full_blocks_only():
    hashes = hash_blocks(TOKENS, root_hash("m"), block_size=16)
    assert len(hashes) == 3
    assert all(isinstance(h, bytes) and len(h) == 16 for h in hashes)


def test_chain_depends_on_every_earlier_block():
    a = hash_blocks(TOKENS, root_hash("m"))
    changed = [7] + TOKENS[1:]
    b = hash_blocks(changed, root_hash("m"))
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_shared_prefix_shares_hashes():
    a = hash_blocks(TOKENS, root_hash("m"))
    b = hash_blocks(TOKENS[:32] + [1] * 16, root_hash("m"))
    assert a[:2] == b[:2] and a[2] != b[2]


def test_incremental_extension_matches_full_hash():
    root = root_hash("m")
    full = hash_blocks(TOKENS, root)
    head = hash_blocks(TOKENS[:16], root)
    tail = hash_blocks(TOKENS, head[-1], start_block=1)
    assert head + tail == full


def test_different_salts_share_nothing():
    a = hash_blocks(TOKENS, root_hash("m", salt="tenant-a"))
    b = hash_blocks(TOKENS, root_hash("m", salt="tenant-b"))
    assert not set(a) & set(b)


def test_different_models_share_nothing():
    assert not set(hash_blocks(TOKENS, root_hash("m1"))) & set(hash_blocks(TOKENS, root_hash("m2")))


def test_root_is_unambiguous():
    # ("ab", "c") and ("a", "bc") must not collide: parts are length-prefixed.
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_stable_across_processes():
    code = (
        "from splitserve.common.kv_hash import hash_blocks, root_hash;"
        "print(','.join(h.hex() for h in hash_blocks(list(range(100, 150)), root_hash('m', 's'))))"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    ]
    here = ",".join(h.hex() for h in hash_blocks(TOKENS, root_hash("m", "s")))
    assert runs[0] == runs[1] == here


def test_block_hash_value_is_pinned():
    # Changing the hash function silently would orphan every block on disk and in flight.
    h = block_hash(root_hash("m"), list(range(16)))
    assert h == block_hash(root_hash("m"), tuple(range(16)))
    assert h.hex() == PINNED


PINNED = "f1c306ffd26aa4d218bdb75a3bb12a0c"


def test_block_chain_hashes_each_block_once_and_extends_in_steps():
    chain = BlockChain(root_hash("m"), 16)
    chain.extend(TOKENS, 1)
    first = chain.hashes[0]
    chain.extend(TOKENS, 3)  # continues from block 1: block 0 is not hashed again
    assert chain.hashes[0] is first
    assert chain.hashes == hash_blocks(TOKENS, root_hash("m"), 16)
    assert chain.tokens == [tuple(TOKENS[i * 16 : (i + 1) * 16]) for i in range(3)]
    chain.extend(TOKENS, 2)  # already covered: nothing changes
    assert len(chain) == 3
