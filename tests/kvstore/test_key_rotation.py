"""Key rotation end to end, in real worker processes with an encrypted host tier and disk tier.

One directory, one key file, three worker lifetimes:

1. key A (a one-key raw file): sessions s and u write their blocks; s's return is served
   from the sealed host tier.
2. ``kv rotate`` adds key B as current: s returns from disk (blocks sealed under A), t
   writes under B; ``kv reencrypt`` is refused while the worker runs.
3. ``kv reencrypt``, then ``kv drop-key`` A: s and t return from disk under B. One of u's
   files is put back as A sealed it: with A gone it is a miss, recomputed.

Every returning answer must equal the same prompt computed without cache (another
``cache_salt``: no block is shared).
"""

from __future__ import annotations

import os
import random

import httpx
import pytest
from procs import metric, start_worker, stop_group, wait_healthy

from splitserve.cli import main as cli_main
from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore import load_keyring
from splitserve.kvstore.disk import PREFIX_BYTES, _Header

BS = 16
POOL = ["--kv-cache-gb", "0.015"]  # 21 blocks of the default model
TURN, OUT, FILLER = 100, 8, 320  # a first turn; a prompt that turns the whole pool over
LOADED = (TURN + OUT - 1) // BS * BS  # the full blocks of KV a first turn computes


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def complete(url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": OUT, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True, **extra},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def key_id_of(path) -> bytes:
    return _Header.unpack(path.read_bytes()[: PREFIX_BYTES - 8]).key_id


class Deployment:
    def __init__(self, root) -> None:
        self.root = root
        self.key = root / "kv.key"
        fd = os.open(self.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))  # the one-key format
        self.disk = root / "disk"
        self.url, self.proc = "", None
        self.model = ""

    def start(self) -> str:
        args = POOL + ["--host-kv-gb", "0.05", "--host-kv-encrypt"]
        args += ["--disk-kv-dir", str(self.disk), "--disk-kv-gb", "0.05"]
        self.url, self.proc = start_worker(args + ["--kv-encryption-key-file", str(self.key)])
        wait_healthy(self.url, self.proc)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)  # SIGTERM: queued disk writes land first
            self.proc = None

    def kv(self, *argv: str) -> int:
        return cli_main(["kv", *argv])

    def file(self, seed: int):
        """The file of the first block of session ``seed``."""
        h = hash_blocks(tokens(seed, TURN), root_hash(self.model), BS)[0].hex()
        return self.disk / h[:2] / f"{h}.kvb"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("rotation"))
    try:
        yield d
    finally:
        d.stop()


def first(url: str, seed: int) -> list[int]:
    """A session's first turn; the prompt its return sends."""
    prompt = tokens(seed, TURN)
    reply = complete(url, prompt)["choices"][0]["token_ids"]
    return prompt + reply


def returning(url: str, history: list[int], seed: int) -> dict:
    return complete(url, history + tokens(seed, 20))


@pytest.mark.slow
def test_rotation_reencrypt_and_drop_keep_every_block_readable(deployment, capsys):
    d = deployment
    url = d.start()
    key_a = load_keyring(d.key).current
    s, u = first(url, 11), first(url, 12)
    complete(url, tokens(1011, FILLER))  # s and u leave the device pool
    host = metric(url, 'splitserve:kv_tier_hits_total{tier="host"}')
    s1 = returning(url, s, 2011)
    assert cached(s1) == LOADED  # from the sealed host tier
    assert metric(url, 'splitserve:kv_tier_hits_total{tier="host"}') - host == LOADED // BS
    scraped = httpx.get(f"{url}/metrics", timeout=10).text
    assert "splitserve:kv_tier_host_decrypt_failures_total 0.0" in scraped.splitlines()
    d.stop()
    assert key_id_of(d.file(11)) == key_id_of(d.file(12)) == key_a

    assert d.kv("rotate", str(d.key)) == 0
    key_b = load_keyring(d.key).current
    url = d.start()
    s2 = returning(url, s, 2111)
    assert cached(s2) == LOADED  # sealed under A, read with A as an old key
    assert metric(url, 'splitserve:kv_tier_hits_total{tier="disk"}') == LOADED // BS
    t = first(url, 13)
    capsys.readouterr()
    assert d.kv("reencrypt", str(d.disk), "--kv-encryption-key-file", str(d.key)) == 2
    assert "in use by a running worker" in capsys.readouterr().err
    d.stop()
    assert key_id_of(d.file(13)) == key_b and key_id_of(d.file(11)) == key_a

    sealed_by_a = d.file(12).read_bytes()
    assert d.kv("reencrypt", str(d.disk), "--kv-encryption-key-file", str(d.key)) == 0
    files = list(d.disk.glob("*/*.kvb"))
    assert files and {key_id_of(p) for p in files} == {key_b}
    d.file(12).write_bytes(sealed_by_a)  # as A left it: its key is about to go
    assert d.kv("drop-key", str(d.key), key_a.hex()) == 0
    assert list(load_keyring(d.key).keys) == [key_b]

    url = d.start()
    s3, t3, u3 = (returning(url, h, seed) for h, seed in ((s, 2211), (t, 2013), (u, 2012)))
    assert cached(s3) == cached(t3) == LOADED
    assert cached(u3) == 0  # block 0 is sealed under the dropped key: the prefix recomputes
    assert metric(url, 'splitserve:kv_tier_read_failures_total{reason="decrypt"}') == 1
    assert metric(url, 'splitserve:kv_tier_hits_total{tier="disk"}') == 2 * LOADED // BS

    # The same prompts computed from scratch (a salt of its own: no block is shared).
    for resp, history, seed in ((s1, s, 2011), (s2, s, 2111), (s3, s, 2211),
                                (t3, t, 2013), (u3, u, 2012)):  # fmt: skip
        ref = complete(url, history + tokens(seed, 20), cache_salt=f"ref-{seed}")
        assert cached(ref) == 0
        assert resp["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
