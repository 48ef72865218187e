from __future__ import annotations

import subprocess
import sys

from splitserve.common.kv_hash import (
    BlockChain,
    ChainSalts,
    block_hash,
    chain_salts,
    hash_blocks,
    root_hash,
    split_salt,
)

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


# A split salt: the full blocks of the first ``tokens`` tokens under a shared salt, the rest
# under each key's own (``split_salt``).
def test_a_split_chain_shares_exactly_the_blocks_within_its_shared_tokens():
    alice = hash_blocks(TOKENS, root_hash("m", split_salt("public", 40, "alice")))
    bob = hash_blocks(TOKENS, root_hash("m", split_salt("public", 40, "bob")))
    shared = hash_blocks(TOKENS[:32], root_hash("m", "public"))
    assert alice[:2] == bob[:2] == shared  # 40 tokens hold two full blocks of 16
    assert alice[2] != bob[2]
    assert alice[2] not in hash_blocks(TOKENS, root_hash("m", "alice"))
    assert alice[2] == block_hash(alice[1], TOKENS[32:48], root_hash("m", "alice"))


def test_a_split_with_no_full_shared_block_is_the_own_chain():
    own = hash_blocks(TOKENS, root_hash("m", "alice"))
    assert hash_blocks(TOKENS, root_hash("m", split_salt("public", 15, "alice"))) == own
    assert split_salt("public", 0, "alice") == "alice"
    assert chain_salts(split_salt("public", 15, "alice"), 16) == ChainSalts("alice")
    assert chain_salts(split_salt("public", 40, "alice"), 16) == ChainSalts("public", 2, "alice")
    assert chain_salts("plain", 16) == ChainSalts("plain")


def test_block_chain_follows_a_split_root_as_hash_blocks_does():
    for tokens in (40, 48, 15):
        root = root_hash("m", split_salt("public", tokens, "alice"))
        chain = BlockChain(root, 16)
        chain.extend(TOKENS, 1)
        chain.extend(TOKENS, 3)
        assert chain.hashes == hash_blocks(TOKENS, root, 16)
        assert chain.root == root


def test_split_salts_are_unambiguous_and_malformed_ones_are_plain_names():
    a = root_hash("m", split_salt("ab", 32, "c"))
    assert (
        a != root_hash("m", split_salt("a", 32, "bc")) != root_hash("m", split_salt("ab", 33, "c"))
    )
    for odd in ("\0", "\0x:1:ab", "\0" + "16:9:ab", "\x0016:2:ab"):
        assert root_hash("m", odd) == root_hash("m", odd) and len(root_hash("m", odd)) == 16
