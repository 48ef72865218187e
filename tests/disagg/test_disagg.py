"""Prefill/decode disaggregation with real worker processes over loopback.

The test plays the front: the prefill leg (``max_tokens=1``, ``do_remote_decode``), then
the decode leg with the ``kv_transfer_params`` the prefill worker returned.
"""

from __future__ import annotations

import os
import random
import subprocess

import httpx
import pytest
from procs import as_router, metric, start_worker, stop_group, wait_healthy_or_restart

pytestmark = pytest.mark.slow

SECRET = "disagg-test-secret"
MAX_TOKENS = 8
BLOCK_BYTES = 2 * 30 * 3 * 64 * 4 * 16  # the default model's KV block, float32


class Cluster(dict):
    """Worker name -> URL; ``procs`` maps the names to their processes."""

    procs: dict[str, subprocess.Popen]


def kv_cache_segments(pid: int) -> list[str]:
    """The shared-memory KV cache of worker ``pid``, if it has one."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"splitserve-kv-cache-{pid}-")]


POOL = ["--kv-cache-gb", "0.25"]  # 1,456 blocks: room for every test's prompts
SPECS = {
    "p_tcp": ["--role", "prefill", "--kv-transport", "tcp", *POOL],
    "p_shm": ["--role", "prefill", "--kv-transport", "shm", *POOL],
    # A short lease, and the first block it serves arrives corrupted.
    "p_fault": ["--role", "prefill", "--kv-transport", "tcp", "--kv-lease-ttl", "2", *POOL]
    + ["--kv-test-fault", "corrupt_block=0"],
    "d": ["--role", "decode", "--host-kv-gb", "0.2", *POOL],
    # 21 device blocks (336 tokens) over 72 in host RAM: a session's blocks get evicted.
    "d_small": ["--role", "decode", "--kv-cache-gb", "0.015", "--host-kv-gb", "0.05"],
    # One test each: a prefill worker that is stopped before its blocks are pulled, one
    # that cuts the connection mid-transfer, a decode worker with another cluster secret.
    "p_gone": ["--role", "prefill", "--kv-transport", "shm", *POOL],
    "p_cut": ["--role", "prefill", "--kv-test-fault", f"drop_after_bytes={3 * BLOCK_BYTES}"] + POOL,
    "d_wrong": ["--role", "decode", *POOL],
}
SECRETS = {"d_wrong": "not-the-secret"}


@pytest.fixture(scope="module")
def cluster():
    """Every worker of this module, started together: they load in parallel."""

    def start(name: str) -> tuple[str, subprocess.Popen]:
        return start_worker(SPECS[name], secret=SECRETS.get(name, SECRET))

    procs = {name: start(name) for name in SPECS}
    try:
        for name, (url, proc) in procs.items():
            procs[name] = wait_healthy_or_restart(url, proc, lambda name=name: start(name))
        urls = Cluster({name: url for name, (url, _) in procs.items()})
        urls.procs = {name: proc for name, (_, proc) in procs.items()}
        yield urls
    finally:
        for _, proc in procs.values():
            stop_group(proc)


@pytest.fixture(scope="module")
def offline():
    from splitserve import LLM

    return LLM()


def prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` token-id prompts with lengths spread from 10 (no full block) to 1,100 (over
    one step's 1,024-token budget: a chunked prefill)."""
    rng = random.Random(seed)
    lengths = [round(10 * 110 ** (i / (n - 1))) for i in range(n)]
    return [[rng.randrange(100, 49000) for _ in range(length)] for length in lengths]


def body(prompt: list[int], **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def prefill_leg(url: str, prompt: list[int]) -> dict:
    leg = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    r = as_router(url, "/v1/completions", leg, SECRET, timeout=120)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    return params


def decode_leg(url: str, prompt: list[int], params: dict, secret: str = SECRET) -> str:
    r = as_router(
        url, "/v1/completions", body(prompt, kv_transfer_params=params), secret, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def two_legs(p_url: str, d_url: str, prompt: list[int]) -> str:
    return decode_leg(d_url, prompt, prefill_leg(p_url, prompt))


def reference(offline, batch: list[list[int]]) -> list[str]:
    from splitserve import SamplingParams

    outs = offline.generate(batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize(("transport", "seed"), [("tcp", 1), ("shm", 2)])
def test_greedy_outputs_equal_collocated(cluster, offline, transport, seed):
    batch = prompts(seed, 8)  # 16 prompts over the two transports
    received = metric(cluster["d"], "splitserve:kv_blocks_received_total")
    got = [two_legs(cluster[f"p_{transport}"], cluster["d"], p) for p in batch]
    assert got == reference(offline, batch)
    # Every full block but one holding the prompt's last token (the engine recomputes that).
    usable = sum((len(p) - 1) // 16 for p in batch)
    assert metric(cluster["d"], "splitserve:kv_blocks_received_total") - received == usable


def test_shm_prefill_worker_keeps_its_kv_cache_in_shared_memory(cluster):
    # So the shm greedy test above ran the single-copy path: the decode worker copied each
    # block straight out of this segment. A tcp prefill worker keeps a private cache.
    assert len(kv_cache_segments(cluster.procs["p_shm"].pid)) == 1
    assert kv_cache_segments(cluster.procs["p_tcp"].pid) == []


def test_second_turn_pulls_only_the_missing_blocks(cluster):
    d, p = cluster["d"], cluster["p_tcp"]
    turn1 = prompts(3, 2)[1][:600]
    before = metric(d, "splitserve:kv_bytes_received_total")
    two_legs(p, d, turn1)
    assert metric(d, "splitserve:kv_bytes_received_total") - before == (600 // 16) * BLOCK_BYTES
    # Turn 2 extends turn 1. The decode worker holds turn 1's 37 full blocks; its own
    # decoding (< 16 tokens) completed no further block. Only blocks 37.. cross the wire.
    turn2 = turn1 + [1000 + i for i in range(300)]
    before = metric(d, "splitserve:kv_bytes_received_total")
    two_legs(p, d, turn2)
    expected = (len(turn2) - 1) // 16 - 600 // 16
    assert metric(d, "splitserve:kv_bytes_received_total") - before == expected * BLOCK_BYTES


def test_pulled_blocks_are_saved_down_the_decode_workers_tier_ladder(cluster):
    d, p = cluster["d"], cluster["p_tcp"]
    saved = "splitserve:kv_tier_saved_blocks_total"
    before, received = metric(d, saved), metric(d, "splitserve:kv_blocks_received_total")
    two_legs(p, d, prompts(11, 2)[1][:400])
    pulled = metric(d, "splitserve:kv_blocks_received_total") - received
    assert pulled == (400 - 1) // 16
    # Saves run in the background: the pulled blocks, and the few the decode worker
    # completes itself, land in host RAM shortly after.
    poll(lambda: metric(d, saved) - before >= pulled, timeout=30)


def test_decode_worker_loads_its_own_lower_tiers_instead_of_pulling(cluster, offline):
    d, p = cluster["d_small"], cluster["p_tcp"]
    turn1 = prompts(12, 2)[1][:200]
    two_legs(p, d, turn1)  # pulls 12 blocks, saved to host RAM in the background
    poll(lambda: metric(d, "splitserve:kv_tier_saved_blocks_total") >= 200 // 16, timeout=30)
    # A local prompt that needs the whole device pool evicts turn 1's blocks from it.
    r = httpx.post(f"{d}/v1/completions", json=body(prompts(13, 2)[1][:320]), timeout=120)
    assert r.status_code == 200, r.text
    turn2 = turn1 + [2000 + i for i in range(100)]
    received = metric(d, "splitserve:kv_blocks_received_total")
    local = metric(d, "splitserve:kv_blocks_from_local_tiers_total")
    assert two_legs(p, d, turn2) == reference(offline, [turn2])[0]
    # Turn 1's 12 blocks come up from host RAM; only the 6 new ones cross the wire.
    assert metric(d, "splitserve:kv_blocks_from_local_tiers_total") - local == 200 // 16
    pulled = metric(d, "splitserve:kv_blocks_received_total") - received
    assert pulled == (len(turn2) - 1) // 16 - 200 // 16


def test_corrupted_block_falls_back_to_recompute(cluster, offline):
    prompt = prompts(4, 2)[1][:300]
    before = metric(cluster["d"], 'splitserve:kv_load_fallbacks_total{reason="checksum"}')
    assert two_legs(cluster["p_fault"], cluster["d"], prompt) == reference(offline, [prompt])[0]
    after = metric(cluster["d"], 'splitserve:kv_load_fallbacks_total{reason="checksum"}')
    assert after == before + 1


def test_lease_expiry_frees_prefill_blocks(cluster):
    p = cluster["p_fault"]
    prompt = prompts(5, 2)[1][:200]
    leased = lambda: httpx.get(f"{p}/load").json()["kv_blocks_leased"]  # noqa: E731
    poll(lambda: leased() == 0, timeout=15)  # earlier tests' leases run out first
    used = httpx.get(f"{p}/load").json()["kv_blocks_used"]
    prefill_leg(p, prompt)  # nobody pulls
    assert leased() == -(-200 // 16)
    poll(lambda: leased() == 0, timeout=15)
    assert httpx.get(f"{p}/load").json()["kv_blocks_used"] == used
    assert metric(p, 'splitserve:kv_leases_ended_total{reason="expired"}') >= 1


def test_prefill_worker_gone_before_pull(cluster, offline):
    url, proc = cluster["p_gone"], cluster.procs["p_gone"]
    assert len(kv_cache_segments(proc.pid)) == 1
    prompt = prompts(6, 2)[1][:400]
    params = prefill_leg(url, prompt)
    stop_group(proc)
    assert kv_cache_segments(proc.pid) == []  # its shared KV cache went with it
    assert decode_leg(cluster["d"], prompt, params) == reference(offline, [prompt])[0]


def test_connection_cut_mid_transfer(cluster, offline):
    prompt = prompts(7, 2)[1][:500]
    before = metric(cluster["d"], "splitserve:kv_load_fallbacks_total")
    assert two_legs(cluster["p_cut"], cluster["d"], prompt) == reference(offline, [prompt])[0]
    assert metric(cluster["d"], "splitserve:kv_load_fallbacks_total") == before + 1


def test_wrong_cluster_secret_is_refused(cluster, offline):
    url = cluster["d_wrong"]
    prompt = prompts(8, 2)[1][:300]
    reason = 'splitserve:kv_load_fallbacks_total{reason="auth"}'
    # The router and this decode worker agree; the prefill worker holds another secret.
    params = prefill_leg(cluster["p_tcp"], prompt)
    assert decode_leg(url, prompt, params, SECRETS["d_wrong"]) == reference(offline, [prompt])[0]
    assert metric(url, reason) == 1
    assert metric(url, "splitserve:kv_blocks_received_total") == 0
    # The right secret is what lets a peer in: the shared decode worker pulls fine.
    before = metric(cluster["d"], "splitserve:kv_blocks_received_total")
    two_legs(cluster["p_tcp"], cluster["d"], prompt)
    assert metric(cluster["d"], "splitserve:kv_blocks_received_total") > before


def test_malformed_kv_transfer_params_is_a_400(cluster):
    bad = {"do_remote_prefill": True, "remote_block_ids": "nope"}
    r = as_router(cluster["d"], "/v1/completions", body([1, 2, 3], kv_transfer_params=bad), SECRET)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"


def poll(cond, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_a_decode_leg_of_n_choices_pulls_the_prompt_once(cluster, offline):
    d, p = cluster["d"], cluster["p_tcp"]
    prompt = prompts(31, 2)[1][:200]
    received = metric(d, "splitserve:kv_blocks_received_total")
    params = prefill_leg(p, prompt)
    r = as_router(d, "/v1/completions", body(prompt, n=3, kv_transfer_params=params), SECRET)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == reference(offline, [prompt]) * 3
    usable = (len(prompt) - 1) // 16
    assert metric(d, "splitserve:kv_blocks_received_total") - received == usable


def test_a_prefill_leg_of_n_choices_is_a_400(cluster):
    leg = body([5, 6, 7], max_tokens=1, n=2, kv_transfer_params={"do_remote_decode": True})
    r = as_router(cluster["p_tcp"], "/v1/completions", leg, SECRET, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"


def test_n_choices_wait_for_a_chunked_prefill_and_share_it(cluster, offline):
    # 1,100 tokens: choice 0's prefill takes two steps (1,024-token budget). Choices added
    # after the first chunk would compute the second one again; they wait for all of it.
    d = cluster["d"]
    prompt = prompts(32, 2)[1]
    assert len(prompt) > 1024
    hits = metric(d, 'splitserve:kv_tier_hits_total{tier="device"}')
    misses = metric(d, 'splitserve:kv_tier_misses_total{tier="device"}')
    r = as_router(d, "/v1/completions", body(prompt, n=3, max_tokens=2), SECRET, timeout=120)
    assert r.status_code == 200, r.text
    usable = (len(prompt) - 1) // 16
    assert metric(d, 'splitserve:kv_tier_misses_total{tier="device"}') - misses == usable
    assert metric(d, 'splitserve:kv_tier_hits_total{tier="device"}') - hits == 2 * usable
