"""How much of a KV tier load hides behind other requests' compute.

One engine in this process (the bundled model, one torch thread by default, a tiered KV
store) with four requests decoding. A session's context sits one tier down (host RAM, or
disk with the page cache dropped), evicted from the device pool by a filler prompt. The
session returns (its context + 64 new tokens) while the four keep decoding; the mover thread
reads and scatters its blocks while the engine keeps stepping. Measured in the same run:

* ``load``: the mover's time for the returning prompt's blocks (read, verify, scatter),
  while the four decode, and for a second session's context of the same length loaded on
  an idle engine (``idle load``, the peer: what the decoding costs the load);
* ``decode during load``: the four's decode rate over the steps that ran while the blocks
  were on their way, over their steady rate (1.0: the load hides behind compute entirely;
  near 0: the engine stalled for it);
* the returning turn's TTFT (load, then its 64 new tokens and last block computed) against
  recomputing a context of the same length with the same four decoding (``recompute``).

    python benchmarks/kv_tier_overlap.py [--contexts 2048,4096] [--tiers host,disk]
        [--switch-intervals 0.005,0.0005] [--repeat 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_tiers import BLOCK_BYTES, BS, drop_page_cache  # noqa: E402

from splitserve import SamplingParams  # noqa: E402
from splitserve.config import EngineConfig, KVTierConfig  # noqa: E402
from splitserve.engine.llm_engine import LLMEngine  # noqa: E402

DECODERS, DECODER_PROMPT, NEW_TOKENS = 4, 64, 64
STEADY_STEPS, WARM_STEPS = 40, 5
GREEDY = SamplingParams(max_tokens=1, temperature=0)
STALL_S = 900.0  # a request that takes longer is stuck: fail loudly


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--tiers", default="host,disk")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument(
        "--switch-intervals",
        default="0.005,0.0005",
        help="GIL switch intervals to compare, seconds (0.005 is Python's default)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds over the grid, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def make_engine(tier: str, ctx: int, tmp: Path, threads: int) -> LLMEngine:
    # Room for the returning context and the decoders, not for the filler as well.
    blocks = ctx // BS + DECODERS * 48 + 16
    kv = KVTierConfig(host_kv_gb=1.0) if tier == "host" else KVTierConfig(disk_kv_dir=str(tmp))
    cfg = EngineConfig(kv_cache_gb=blocks * BLOCK_BYTES / 1e9, threads=threads, kv_tiers=kv)
    return LLMEngine(cfg)


def run_alone(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, GREEDY)
    deadline = time.monotonic() + STALL_S
    while engine.has_unfinished_requests():
        engine.step()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{request_id} did not finish in {STALL_S:.0f} s")


def settle(engine: LLMEngine, tier: str, tmp: Path, blocks: int) -> None:
    """Wait until ``blocks`` blocks are saved one tier down (and written, for disk)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        engine.housekeeping()
        saved = engine.tiering.stats.blocks_saved
        if saved >= blocks and (tier == "host" or len(list(tmp.rglob("*.kvb"))) >= blocks):
            return
        time.sleep(0.05)
    raise RuntimeError("saves did not land in 300 s")


class Clock:
    """Per-step wall times and decode tokens, and the mover's load reports."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.loads: list[tuple[float, float, int]] = []  # (end, seconds, blocks)
        mover = engine.kv_tiers.mover
        observe = mover.on_load

        def on_load(tier: str, seconds: float, n: int) -> None:
            self.loads.append((time.perf_counter(), seconds, n))
            if observe is not None:
                observe(tier, seconds, n)

        mover.on_load = on_load

    def step(self, first_token_of: str | None = None) -> tuple[float, float, int, bool]:
        """One step: (start, seconds, decode tokens, whether ``first_token_of`` got one)."""
        start = time.perf_counter()
        outs = self.engine.step()
        decoded = sum(1 for o in outs if o.request_id.startswith("dec"))
        first = any(o.request_id == first_token_of for o in outs)
        return start, time.perf_counter() - start, decoded, first


def returning_turn(clock: Clock, request_id: str, prompt: list[int], steady_rate: float) -> dict:
    """Add ``prompt`` while the decoders run; step until its first token."""
    clock.loads.clear()
    t0 = time.perf_counter()
    clock.engine.add_request(request_id, prompt, GREEDY)
    steps = []
    deadline = time.monotonic() + STALL_S
    while time.monotonic() < deadline:
        start, seconds, decoded, first = clock.step(request_id)
        steps.append((start, seconds, decoded))
        if first:
            break
    else:
        raise RuntimeError(f"{request_id} got no token in {STALL_S:.0f} s")
    ttft = time.perf_counter() - t0
    row = {"ttft_s": ttft, "loaded_blocks": sum(n for _, _, n in clock.loads)}
    if clock.loads:
        end = clock.loads[-1][0]
        during = [(s, d) for start, s, d in steps if start < end]  # steps the load overlapped
        row |= {
            "load_s": sum(s for _, s, _ in clock.loads),
            "decode_during_load": sum(d for _, d in during) / sum(s for s, _ in during),
        }
    return row


def context_run(tier: str, ctx: int, rng: random.Random, threads: int, switch: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kv-overlap-") as tmp:
        tmp = Path(tmp)
        engine = make_engine(tier, ctx, tmp, threads)
        sys.setswitchinterval(switch)  # after the engine, which may set its own
        try:
            return {"switch_interval_s": switch} | measure(engine, tier, ctx, rng, tmp)
        finally:
            engine.close()


def measure(engine: LLMEngine, tier: str, ctx: int, rng: random.Random, tmp: Path) -> dict:
    contexts = [tokens(rng, ctx) for _ in range(2)]
    for i, context in enumerate(contexts):
        run_alone(engine, f"first{i}", context)
    pool = engine.block_manager.num_blocks
    filler = tokens(rng, pool * BS - BS)
    print(f"{tier} {ctx}: filling the pool", file=sys.stderr, flush=True)
    run_alone(engine, "filler", filler)  # the contexts are now only one tier down
    settle(engine, tier, tmp, 2 * ((ctx - 1) // BS) + (len(filler) - 1) // BS)
    if tier == "disk":
        drop_page_cache(tmp)
    clock = Clock(engine)
    run_alone(engine, "idle", contexts[1] + tokens(rng, NEW_TOKENS))
    idle_load_s = sum(s for _, s, _ in clock.loads)
    decode = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    for i in range(DECODERS):
        engine.add_request(f"dec{i}", tokens(rng, DECODER_PROMPT), decode)
    for _ in range(WARM_STEPS):
        clock.step()
    steady = [clock.step() for _ in range(STEADY_STEPS)]
    step_s = statistics.mean(s for _, s, _, _ in steady)
    rate = sum(d for _, _, d, _ in steady) / sum(s for _, s, _, _ in steady)
    tiered = returning_turn(clock, "return", contexts[0] + tokens(rng, NEW_TOKENS), rate)
    recompute = returning_turn(clock, "recompute", tokens(rng, ctx + NEW_TOKENS), rate)
    return {
        "tier": tier,
        "context": ctx,
        "steady_step_s": step_s,
        "steady_decode_tok_s": rate,
        "idle_load_s": idle_load_s,
        "tiered": tiered,
        "recompute": recompute,
    }


def print_table(rows: list[dict]) -> None:
    print(
        "| tier | context | GIL switch | blocks | idle load | load while decoding | steady "
        "decode | decode during load / steady | TTFT tiers | TTFT recompute | recompute / tiers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, c = r["tiered"], r["recompute"]
        if "load_s" not in t:
            print(f"| {r['tier']} | {r['context']} | no load: the context was still cached |")
            continue
        print(
            f"| {r['tier']} | {r['context']} | {r['switch_interval_s'] * 1e3:g} ms "
            f"| {t['loaded_blocks']} | {r['idle_load_s'] * 1e3:.0f} ms "
            f"| {t['load_s'] * 1e3:.0f} ms | {r['steady_decode_tok_s']:.1f} tok/s "
            f"| {t['decode_during_load'] / r['steady_decode_tok_s']:.2f} "
            f"| {t['ttft_s'] * 1e3:.0f} ms | {c['ttft_s'] * 1e3:.0f} ms "
            f"| {c['ttft_s'] / t['ttft_s']:.1f}x |"
        )


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    rows = []
    grid = list(
        itertools.product(
            args.tiers.split(","),
            [int(c) for c in args.contexts.split(",")],
            [float(s) for s in args.switch_intervals.split(",")],
        )
    )
    for tier, ctx, switch in grid * args.repeat:
        rows.append(context_run(tier, ctx, rng, args.threads, switch))
        print(json.dumps(rows[-1]), flush=True)
    print_table(sorted(rows, key=lambda r: (r["tier"], r["context"], -r["switch_interval_s"])))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
