"""Per-step token-mask cost of xgrammar and llguidance on the bundled SmolLM2 tokenizer.

For each of the 20 agent schemas (benchmarks/agent_schemas.py) both libraries compile the
schema (compact JSON, no free whitespace) and then walk one constrained reply: at every step
the mask is computed into a ``[1, vocab/32]`` int32 bitmask and a token allowed by it is
consumed (the same seeded pick rule for both: a uniform draw among the allowed ids, the EOS
id once the grammar accepts). Reported: compile time per schema, and the per-step mask time
(median, p90, p99, mean) over every step of every walk. One thread each (the engine computes
masks on one helper thread beside the model).

    PYTHONPATH=src .venv/bin/python benchmarks/grammar_masks.py [--steps 120] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from agent_schemas import SCHEMAS  # noqa: E402
from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: E402

from splitserve.models.loader import default_model_path  # noqa: E402


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = bitmask[0].view(torch.uint8).numpy()
    flat = np.unpackbits(bits, bitorder="little")[:vocab]
    return np.flatnonzero(flat).tolist()


class LLG:
    name = "llguidance"

    def __init__(self, hf, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        m = self.llg.LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def consume(self, m, t: int) -> None:
        assert m.consume_token(t), m.get_error()

    def done(self, m) -> bool:
        return m.is_accepting()


class XGR:
    name = "xgrammar"

    def __init__(self, hf, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema):
        g = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(g)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask)

    def consume(self, m, t: int) -> None:
        assert m.accept_token(t)

    def done(self, m) -> bool:
        return m.is_completed()


def walk(lib, schema, steps: int, rng: random.Random, eos: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    m = lib.compile(schema)
    compile_s = time.perf_counter() - start
    bitmask = torch.zeros((1, (lib.vocab + 31) // 32), dtype=torch.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        times.append(time.perf_counter() - t0)
        allowed = allowed_ids(bitmask, lib.vocab)
        if lib.done(m) or not allowed:
            break
        non_eos = [t for t in allowed if t != eos]
        lib.consume(m, rng.choice(non_eos or allowed))
    return compile_s, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120, help="mask steps per schema at most")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path, name = os.path.split(default_model_path())
    hf = TokenizersBackend.from_pretrained(path, gguf_file=name, local_files_only=True)
    vocab = 49152  # the model's logit width (SmolLM2-135M)
    eos = hf.eos_token_id
    print(f"cpu: {cpu_model()}, torch threads 1, vocab {vocab}")
    print(f"schemas: {len(SCHEMAS)}, steps <= {args.steps} each, seed {args.seed}\n")
    results = {}
    for cls in (LLG, XGR):
        t0 = time.perf_counter()
        lib = cls(hf, vocab)
        setup = time.perf_counter() - t0
        rng = random.Random(args.seed)
        walk(lib, SCHEMAS["weather_args"], 10, rng, eos)  # warm-up
        compiles, steps = [], []
        for schema in SCHEMAS.values():
            c, s = walk(lib, schema, args.steps, rng, eos)
            compiles.append(c)
            steps.extend(s)
        us = sorted(x * 1e6 for x in steps)
        results[lib.name] = (
            statistics.median(us),
            statistics.fmean(us),
            statistics.median(compiles),
        )
        print(
            f"{lib.name:11s} tokenizer setup {setup:6.2f} s | compile median "
            f"{statistics.median(compiles) * 1e3:7.2f} ms max {max(compiles) * 1e3:7.2f} ms | "
            f"mask per step (us) median {statistics.median(us):7.1f} p90 "
            f"{us[int(0.9 * len(us))]:7.1f} p99 {us[int(0.99 * len(us))]:8.1f} "
            f"mean {statistics.fmean(us):7.1f} over {len(us)} steps"
        )
    x, g = results["xgrammar"], results["llguidance"]
    print(
        f"\nxgrammar / llguidance: mask median {x[0] / g[0]:.2f}x, mask mean {x[1] / g[1]:.2f}x, "
        f"compile median {x[2] / g[2]:.0f}x"
    )


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    main()
