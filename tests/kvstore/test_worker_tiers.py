"""The KV tier ladder in real worker processes: host RAM and disk below a tiny device pool.

Each session sends a turn, a filler prompt then evicts its blocks from the device pool, and
the session returns with a longer prompt. A worker without tiers recomputes the return (the
reference answer); a worker with tiers must serve the same greedy tokens from its lower
tiers, and count the loaded prefix in ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path

import httpx
import pytest
from procs import metric, start_worker, stop_group, wait_healthy
from tool_chat import WEATHER_TOOL, few_shot_tool_calls

from splitserve.bench.client import new_client
from splitserve.bench.scrape import Targets, scrape
from splitserve.cli import main as cli_main
from splitserve.common.kv_hash import hash_blocks, root_hash
from splitserve.kvstore.disk import PREFIX_BYTES

BS = 16
POOL = ["--kv-cache-gb", "0.015"]  # 21 blocks of the default model: 336 tokens
TURN = 100  # prompt tokens of a session's first turn
OUT = 8  # tokens each turn generates
FILLER = 320  # a prompt that needs the whole pool (21 blocks with its output)
# Turn 1 computes TURN + OUT - 1 tokens: its full blocks are what a return can load.
LOADED = (TURN + OUT - 1) // BS * BS
# Host RAM 72 blocks; the host worker's disk 43 (it must evict), the disk worker's 72.
HOST_GB, HOST_DISK_GB, DISK_GB = 0.05, 0.03, 0.05
QUOTA = 0.3  # of 21 blocks: 6 per session


class Workers:
    """Three workers on the same pool size: no tiers, host RAM + disk, encrypted disk only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key = self._keygen("key")
        self.args = {
            "off": POOL,
            "host": POOL
            + ["--host-kv-gb", str(HOST_GB), "--disk-kv-dir", str(root / "d1")]
            + ["--disk-kv-gb", str(HOST_DISK_GB)]
            + ["--kv-retention-quota", str(QUOTA)],
            "disk": self._disk_args(self.key),
        }
        self.procs = {name: start_worker(args) for name, args in self.args.items()}
        for url, proc in self.procs.values():
            wait_healthy(url, proc)

    def _keygen(self, name: str) -> Path:
        assert cli_main(["keygen", str(self.root / name)]) == 0
        return self.root / name

    def _disk_args(self, key: Path, directory: str = "d2") -> list[str]:
        return POOL + [
            "--disk-kv-dir",
            str(self.root / directory),
            "--disk-kv-gb",
            str(DISK_GB),
            "--kv-encryption-key-file",
            str(key),
        ]

    def url(self, name: str) -> str:
        return self.procs[name][0]

    def restart_disk(self) -> None:
        """SIGTERM the disk worker right after its last reply and start it again on the same
        directory; next to it, a worker with another key on a copy of that directory."""
        stop_group(self.procs["disk"][1])
        shutil.copytree(self.root / "d2", self.root / "d3")
        self.procs["disk"] = start_worker(self._disk_args(self.key))
        self.procs["wrong_key"] = start_worker(self._disk_args(self._keygen("other"), "d3"))
        for name in ("disk", "wrong_key"):
            wait_healthy(*self.procs[name])

    def stop(self) -> None:
        for _, proc in self.procs.values():
            stop_group(proc)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(tmp_path_factory.mktemp("tiers"))
    try:
        yield w
    finally:
        w.stop()


def complete(url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": OUT, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def session(url: str, seed: int, evict: bool = True, **extra) -> tuple[dict, dict]:
    """A first turn, a filler that evicts it from the device pool, the return turn."""
    first = tokens(seed, TURN)
    one = complete(url, first, **extra)
    if evict:
        complete(url, tokens(seed + 1000, FILLER))
    again = first + one["choices"][0]["token_ids"] + tokens(seed + 2000, 20)
    return one, complete(url, again)


def answers(pair: tuple[dict, dict]) -> list[list[int]]:
    return [r["choices"][0]["token_ids"] for r in pair]


def block_file(directory: Path, url: str, seed: int, index: int = 0) -> Path:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    h = hash_blocks(tokens(seed, TURN), root_hash(model), BS)[index].hex()
    return directory / h[:2] / f"{h}.kvb"


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_greedy_outputs_equal_with_blocks_from_host_and_disk(workers):
    for seed in (1,):
        off = session(workers.url("off"), seed)
        assert cached(off[1]) == 0  # the filler really evicted the first turn
        for name, tier in (("host", "host"), ("disk", "disk")):
            url = workers.url(name)
            hits = metric(url, f'splitserve:kv_tier_hits_total{{tier="{tier}"}}')
            on = session(url, seed)
            assert answers(on) == answers(off), name
            assert cached(on[1]) == LOADED, name
            after = metric(url, f'splitserve:kv_tier_hits_total{{tier="{tier}"}}')
            assert after - hits == LOADED // BS, name


def test_encrypted_block_files_hold_no_plaintext_kv(workers):
    plain = block_file(workers.root / "d1", workers.url("host"), 1).read_bytes()[PREFIX_BYTES:]
    sealed = block_file(workers.root / "d2", workers.url("disk"), 1).read_bytes()
    assert len(sealed) == PREFIX_BYTES + len(plain) + 16  # AES-GCM adds its tag
    windows = [plain[i : i + 32] for i in range(0, len(plain), len(plain) // 64)]
    assert not any(w in sealed for w in windows if w.strip(b"\0"))


def test_restart_serves_the_returning_session_from_disk(workers):
    url = workers.url("disk")
    first = tokens(3, TURN)
    one = complete(url, first)
    workers.restart_disk()  # SIGTERM right away: pending writes must land first
    url = workers.url("disk")
    again = first + one["choices"][0]["token_ids"] + tokens(2003, 20)
    two = complete(url, again)
    assert cached(two) == LOADED
    assert metric(url, 'splitserve:kv_tier_hits_total{tier="disk"}') == LOADED // BS
    assert answers((one, two)) == answers(session(workers.url("off"), 3, evict=False))


def test_wrong_key_gives_misses_and_correct_outputs(workers):
    url = workers.url("wrong_key")  # its directory holds session 3's blocks, under another key
    one = complete(url, tokens(3, TURN))
    assert cached(one) == 0
    assert metric(url, 'splitserve:kv_tier_read_failures_total{reason="decrypt"}') >= 1
    assert metric(url, 'splitserve:kv_tier_misses_total{tier="disk"}') >= 1
    assert answers((one,)) == answers((complete(workers.url("off"), tokens(3, TURN)),))


def test_flipped_byte_is_a_checksum_failure_and_recomputed(workers):
    url = workers.url("disk")
    path = block_file(workers.root / "d2", url, 4)
    first = tokens(4, TURN)
    one = complete(url, first)
    complete(url, tokens(1004, FILLER))
    wait_for(path.exists)
    raw = bytearray(path.read_bytes())
    raw[PREFIX_BYTES + 1000] ^= 0x01
    path.write_bytes(bytes(raw))
    before = metric(url, "splitserve:kv_tier_checksum_failures_total")
    two = complete(url, first + one["choices"][0]["token_ids"] + tokens(2004, 20))
    assert metric(url, "splitserve:kv_tier_checksum_failures_total") == before + 1
    assert cached(two) == 0  # block 0 failed: the whole prefix was recomputed
    assert answers((one, two)) == answers(session(workers.url("off"), 4, evict=False))


def test_pins_stay_within_quota_then_expire_and_demote(workers):
    url = workers.url("host")
    quota = int(QUOTA * 21)
    first = tokens(5, 150)  # 9 full blocks, more than the quota
    body = {"kv_retention": {"ttl_s": 8}}
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"X-Session-Id": "agent-5"},
        json={"prompt": first, "max_tokens": OUT, "temperature": 0, "ignore_eos": True, **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert metric(url, "splitserve:kv_tier_pinned_blocks") == quota
    # 15 blocks: every block but the pinned 6, so the unpinned rest of turn 1 is evicted.
    complete(url, tokens(1005, 225))
    host = metric(url, 'splitserve:kv_tier_hits_total{tier="host"}')
    again = complete(url, first + tokens(2005, 20))
    # The pinned 6 from the pool, the other 3 back from host RAM.
    assert metric(url, 'splitserve:kv_tier_hits_total{tier="host"}') - host == 9 - quota
    assert cached(again) == 9 * BS
    wait_for(lambda: metric(url, "splitserve:kv_tier_pinned_blocks") == 0, timeout=20)
    assert metric(url, 'splitserve:kv_tier_pins_total{event="expired"}') == 1


def test_no_tier_exceeds_its_size(workers):
    for name in ("host", "disk"):
        url = workers.url(name)
        for tier in ("device", "host", "disk"):
            held = metric(url, f'splitserve:kv_tier_bytes{{tier="{tier}"}}')
            bound = metric(url, f'splitserve:kv_tier_capacity_bytes{{tier="{tier}"}}')
            assert held <= bound, (name, tier)
    files = list((workers.root / "d2").glob("*/*.kvb"))
    assert 0 < sum(p.stat().st_size for p in files) <= DISK_GB * 2**30
    # The host worker wrote more blocks than its disk bound holds: the oldest were evicted.
    assert len(list((workers.root / "d1").glob("*/*.kvb"))) < metric(
        workers.url("host"), "splitserve:kv_tier_saved_blocks_total"
    )


def test_bench_reads_the_tier_traffic(workers):
    url = workers.url("host")

    async def read() -> dict[str, float]:
        async with new_client() as client:
            return await scrape(client, Targets((url,)))

    got = asyncio.run(read())
    assert got["kv_blocks_saved"] == metric(url, "splitserve:kv_tier_saved_blocks_total") > 0
    text = httpx.get(url + "/metrics", timeout=10).text
    loaded = [
        ln for ln in text.splitlines() if ln.startswith("splitserve:kv_tier_loaded_blocks_total")
    ]
    assert got["kv_blocks_loaded"] == sum(float(ln.split()[-1]) for ln in loaded)


def test_prefetch_hint_promotes_before_the_request(workers):
    url = workers.url("host")
    first = tokens(6, TURN)
    one = complete(url, first)
    complete(url, tokens(1006, FILLER))
    again = first + one["choices"][0]["token_ids"] + tokens(2006, 20)
    promoted = 'splitserve:kv_tier_promotions_total{to="device"}'
    before = metric(url, promoted)
    r = httpx.post(f"{url}/v1/kv/prefetch", json={"prompt_token_ids": again}, timeout=30)
    assert r.status_code == 200 and r.json()["blocks"] == LOADED // BS
    wait_for(lambda: metric(url, promoted) == before + LOADED // BS)
    two = complete(url, again)
    assert cached(two) == LOADED
    assert metric(url, promoted) == before + LOADED // BS  # found in the pool: no second load


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 2, 3], "kv_retention": {"ttl_s": -1}},
        {"prompt": [1, 2, 3], "kv_retention": {"ttl_s": "5"}},
        {"prompt": [1, 2, 3], "kv_retention": {"ttl_s": 10**6}},
        {"prompt": [1, 2, 3], "kv_retention": 5},
    ],
)
def test_bad_kv_retention_is_a_400(workers, body):
    r = httpx.post(f"{workers.url('host')}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]


@pytest.mark.parametrize("body", [{}, {"prompt_token_ids": [-1]}, {"prompt_token_ids": []}])
def test_bad_prefetch_is_a_400(workers, body):
    r = httpx.post(f"{workers.url('host')}/v1/kv/prefetch", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_a_reply_that_calls_tools_pins_its_session(workers):
    # Last in this module: the other tests count pins and expect none to be held.
    url = workers.url("host")
    pins = 'splitserve:kv_tier_pins_total{event="pinned"}'
    body = {"messages": few_shot_tool_calls("Paris"), "max_tokens": 40, "temperature": 0}
    plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert metric(url, "splitserve:kv_tier_pinned_blocks") == 0  # no tools offered: no pin
    before = metric(url, pins)
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"X-Session-Id": "agent-tools"},
        json={**body, "tools": [WEATHER_TOOL]},
        timeout=120,
    ).json()
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert metric(url, pins) == before + 1
    assert metric(url, "splitserve:kv_tier_pinned_blocks") == int(QUOTA * 21)
