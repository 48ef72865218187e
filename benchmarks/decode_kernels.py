"""Batched decode steps and prefills with and without each CPU kernel of the engine,
alternating rounds.

Variants (same process, same weights, same sequences):

- ``plain``: weight products on the plain weights (``F.linear``), decode attention by
  gather + SDPA (the torch path), prefill attention by SDPA (float32 for a bfloat16 model);
- ``packed``: weight products on the packed weights (``models.llama.packed_weight``: a float32
  model's on the C++ panels of ``models.panel_linear`` where built, others oneDNN-blocked);
- ``packed+paged-numba``: and decode attention in place over the paged cache by the numba
  kernel (``models.paged_decode``);
- ``packed+paged-ops``: decode attention, and a bfloat16 model's prefill attention, by the C++
  kernel where it is built, with torch's elementwise ops (RMSNorm, RoPE and the K/V writes,
  SiLU * up) instead of ``models.fused_ops``;
- ``packed+paged``: and the fused elementwise ops;
- ``packed+paged+step``: and every decode-only step in one C++ call (``models.decode_step``,
  float32 where built): the engine's default.

Each round prefills ``--seqs`` random prompts of ``--context`` tokens (timed: prefill tok/s)
and times ``--steps`` decode steps of all of them together; rounds alternate between the
variants.

``--layer`` instead times the two decode attention kernels alone on one layer of the bundled
model's shape (``--seqs`` sequences of ``--context`` cached tokens, random K/V): numba against
the C++ kernel (its AVX-512 or AVX2 build, ``models/native.py``), alternating, the minimum of 15
calls per round.

``--argmax`` times the greedy pick over vocabulary-wide float32 logits at 1, 16 and 64 rows:
``torch.argmax`` against the C++ one of ``models.fused_ops.argmax``, alternating.

``--products`` times the float32 weight products alone, on the bundled model's shapes
(one layer's four, and the output projection): MKL on the plain weight (``F.linear``), oneDNN
on its blocked copy, and the C++ panels, at 1 to 1,024 rows, alternating, the minimum of a
few calls per round.

    python benchmarks/decode_kernels.py [--seqs 16] [--context 256] [--dtype bfloat16] [--threads 1]
    python benchmarks/decode_kernels.py --layer --seqs 64 --context 296 --dtype float32
    python benchmarks/decode_kernels.py --products --threads 2
    python benchmarks/decode_kernels.py --argmax --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from router_peer import cpu_description  # noqa: E402

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.models import decode_step, fused_ops, native, paged_decode  # noqa: E402
from splitserve.models.llama import Linear  # noqa: E402

VARIANTS = (
    "plain", "packed", "packed+paged-numba", "packed+paged-ops", "packed+paged", "packed+paged+step"
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layer", action="store_true", help="time the attention kernels alone")
    p.add_argument("--products", action="store_true", help="time the float32 products alone")
    p.add_argument("--argmax", action="store_true", help="time the greedy pick over the logits")
    return p.parse_args()


class Switch:
    """Turns the packed weights and the paged decode kernel of one engine on and off."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        model = self.runner.model
        self.linears = [m for m in model.modules() if isinstance(m, Linear)]
        self.packed = [m.packed for m in self.linears]
        self.lm_head = model.lm_head_packed
        self.paged = self.runner.paged_decode
        self.native_fits = paged_decode.native_fits
        self.ops_fit = fused_ops.fits
        self.step = (
            decode_step.DecodeStep(model) if decode_step.unavailable_reason(model) is None else None
        )

    def set(self, variant: str) -> None:
        packed = variant != "plain"
        for module, weight in zip(self.linears, self.packed, strict=True):
            module.packed = weight if packed else None
        self.runner.model.lm_head_packed = self.lm_head if packed else None
        self.runner.packed = packed
        self.runner.paged_decode = self.paged and variant.startswith("packed+paged")
        native = variant.startswith("packed+paged") and variant != "packed+paged-numba"
        paged_decode.native_fits = self.native_fits if native else (lambda *_: False)
        self.runner.fused = self.step if variant == "packed+paged+step" else None
        fused_ops.fits = (lambda _: False) if variant == "packed+paged-ops" else self.ops_fit


def one_round(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Prefill tokens/s of ``prompts``, and mean seconds per decode step of all together."""
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic()}-{i}", p, params)
    start = time.perf_counter()
    while (
        any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()  # the prefills, until every sequence decodes
    prefill = sum(len(p) for p in prompts) / (time.perf_counter() - start)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return prefill, statistics.mean(times[1:])


def one_layer(args: argparse.Namespace) -> None:
    """numba against the C++ kernel on one layer's decode attention, alternating rounds."""
    block, kv_heads, heads, head_dim = 16, 3, 9, 64  # SmolLM2-135M's
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    width = -(-args.context // block)
    shape = (args.seqs * width + 1, block, kv_heads, head_dim)
    kc, vc = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    rng = np.random.default_rng(args.seed)
    tables = rng.permutation(shape[0])[: args.seqs * width].reshape(args.seqs, width)
    lens = np.full(args.seqs, args.context, dtype=np.int64)
    q = torch.randn(args.seqs, heads, head_dim, generator=gen).to(dtype)
    isa = native.variant(native.cpu_flags())
    off = native.load("paged_decode")
    print(f"CPU: {cpu_description()}")
    print(f"C++ build: {isa if off is None else 'off: ' + off}")
    print(f"{args.seqs} sequences of {args.context} tokens, {args.dtype}, {args.threads} thread(s)")
    kernels = {"numba": False, "C++": True} if off is None else {"numba": False}

    def best(use_native: bool) -> float:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            paged_decode.decode_attention(
                q, kc, vc, tables, lens, head_dim**-0.5, args.threads, use_native
            )
            times.append(time.perf_counter() - start)
        return min(times)

    for use_native in kernels.values():  # warm-up: compile, fault the pages in
        best(use_native)
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(args.rounds):
        for name, use_native in kernels.items():
            times[name].append(best(use_native))
    base = statistics.median(times["numba"])
    for name in kernels:
        ms = statistics.median(times[name])
        rounds = ", ".join(f"{t * 1e3:.2f}" for t in times[name])
        print(f"{name:6s} {ms * 1e3:6.2f} ms a layer {base / ms:.2f}x numba (rounds: {rounds})")


# The bundled model's products: (name, out, in); the output projection only for few rows.
PRODUCTS = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
LM_HEAD = ("lm_head", 49152, 576)


def products(args: argparse.Namespace) -> None:
    """MKL, oneDNN-blocked and the C++ panels on each float32 product shape, alternating."""
    from splitserve.models import panel_linear

    torch.set_num_threads(args.threads)
    off = native.load("panel_linear")
    print(f"CPU: {cpu_description()}")
    print(f"float32, {args.threads} thread(s); C++ panels: {'built' if off is None else off}")
    gen = torch.Generator().manual_seed(args.seed)
    for rows in (1, 4, 16, 64, 256, 1024):
        shapes = [*PRODUCTS, LM_HEAD] if rows <= 64 else list(PRODUCTS)
        layer: dict[str, float] = {}
        for name, out, width in shapes:
            w = torch.randn(out, width, generator=gen) * 0.05
            x = torch.randn(rows, width, generator=gen)
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 16)
            pointwise = torch.ops.mkldnn._linear_pointwise
            ways = {
                "mkl": (torch.nn.functional.linear, (x, w)),
                "onednn": (pointwise, (x, onednn, None, "none", [], "")),
            }
            if off is None:
                ways["panels"] = (panel_linear.linear, (x, panel_linear.pack(w)))
            calls = max(3, int(4e8 / (2 * rows * out * width)))
            best: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(args.rounds + 1):  # the first round warms up
                for k, (f, f_args) in ways.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        f(*f_args)
                    best[k].append((time.perf_counter() - start) / calls)
            flops = 2 * rows * out * width
            cells = []
            for k in ways:
                t = min(best[k][1:])
                if name != "lm_head":
                    layer[k] = layer.get(k, 0.0) + t
                cells.append(f"{k} {t * 1e3:7.3f} ms {flops / t / 1e9:5.0f} GF/s")
            print(f"{rows:5d} rows {name:8s} " + " | ".join(cells))
        ratio = f", panels {layer['onednn'] / layer['panels']:.2f}x oneDNN" if off is None else ""
        sums = ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in layer.items())
        print(f"{rows:5d} rows, one layer's four products: {sums}{ratio}")


def greedy_picks(args: argparse.Namespace) -> None:
    """torch.argmax against the C++ argmax over vocabulary-wide logits, alternating."""
    torch.set_num_threads(args.threads)
    off = native.load("fused_ops")
    print(f"CPU: {cpu_description()}")
    print(f"float32 logits [rows, {LM_HEAD[1]}], {args.threads} thread(s); C++: {off or 'built'}")
    if off is not None:
        return
    gen = torch.Generator().manual_seed(args.seed)
    for rows in (1, 16, 64):
        logits = torch.randn(rows, LM_HEAD[1], generator=gen)
        ways = {"torch": lambda x: x.argmax(dim=-1), "C++": fused_ops.argmax}
        best: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(args.rounds + 1):  # the first round warms up
            for k, f in ways.items():
                start = time.perf_counter()
                for _ in range(20):
                    f(logits)
                best[k].append((time.perf_counter() - start) / 20)
        t = {k: min(v[1:]) for k, v in best.items()}
        cells = " | ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
        print(f"{rows:3d} rows: {cells}, {t['torch'] / t['C++']:.1f}x")


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.layer:
        one_layer(args)
        return
    if args.products:
        products(args)
        return
    if args.argmax:
        greedy_picks(args)
        return
    llm = LLM(dtype=args.dtype, threads=args.threads, fused_decode=False)
    rng = random.Random(args.seed)
    vocab = llm.engine.runner.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.context)] for _ in range(args.seqs)]
    switch = Switch(llm)
    print(f"CPU: {cpu_description()}")
    print(f"{args.seqs} sequences of {args.context} tokens, {args.dtype}, {args.threads} thread(s)")
    variants = [v for v in VARIANTS if v != "packed+paged+step" or switch.step is not None]
    for variant in variants:  # warm-up: compile, fault the pages in
        switch.set(variant)
        one_round(llm, prompts[:2], 2)
    times: dict[str, list[float]] = {v: [] for v in variants}
    prefills: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            switch.set(variant)
            prefill, step = one_round(llm, prompts, args.steps)
            prefills[variant].append(prefill)
            times[variant].append(step)
    base, base_prefill = statistics.median(times["plain"]), statistics.median(prefills["plain"])
    for variant in variants:
        ms, pre = statistics.median(times[variant]), statistics.median(prefills[variant])
        rounds = ", ".join(f"{t * 1e3:.1f}" for t in times[variant])
        print(
            f"{variant:18s} decode {ms * 1e3:6.1f} ms/step {args.seqs / ms:6.1f} tok/s "
            f"{base / ms:.2f}x plain (rounds: {rounds}) | prefill {pre:6.0f} tok/s "
            f"{pre / base_prefill:.2f}x plain"
        )


if __name__ == "__main__":
    main()
