"""Would splitting the decode matmuls in two halves use both cores? (issue 2, a lead)

MKL runs ``x @ W^T`` for a few rows (decode) on one core whatever torch's thread count. This
times, for the default model's matrix shapes and several row counts, the model's layout
(``W^T`` contiguous, ``[in, out]``) against the same weights stored as two column halves
``[2, in, out/2]``: a batched matmul over the halves for few rows (torch splits the batch
across threads), two plain matmuls concatenated for many. Same process, same inputs; the
ratio is plain time over split time (above 1: the split is faster).

    python benchmarks/gemv_split.py [--threads 2] [--rows 1,4,16,32,64,256]
"""

from __future__ import annotations

import argparse
import time

import torch

# The default model (SmolLM2-135M): fused qkv, o_proj, fused gate_up, down_proj, lm_head.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
SHAPES["lm_head"] = (576, 49152)


def timed(fn, repeats: int) -> float:
    for _ in range(max(2, repeats // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def split_matmul(x: torch.Tensor, halves: torch.Tensor, few_rows: bool) -> torch.Tensor:
    rows, out = x.shape[0], 2 * halves.shape[2]
    if few_rows:
        return torch.matmul(x, halves).permute(1, 0, 2).reshape(rows, out)
    return torch.cat([x @ halves[0], x @ halves[1]], dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16,32,64,256")
    p.add_argument("--repeats", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| matrix | rows | plain | batched halves | 2 matmuls + cat | best split / plain |")
    print("|---|---|---|---|---|---|")
    for name, (inp, out) in SHAPES.items():
        w_t = torch.randn(inp, out)
        halves = w_t.view(inp, 2, out // 2).permute(1, 0, 2).contiguous()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inp)
            expected = x @ w_t
            for few in (True, False):
                got = split_matmul(x, halves, few)
                assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3), (name, rows, few)
            plain = timed(lambda: x @ w_t, args.repeats)  # noqa: B023
            batched = timed(lambda: split_matmul(x, halves, True), args.repeats)  # noqa: B023
            cat = timed(lambda: split_matmul(x, halves, False), args.repeats)  # noqa: B023
            print(
                f"| {name} {inp}x{out} | {rows} | {plain * 1e6:.0f} us | {batched * 1e6:.0f} us "
                f"| {cat * 1e6:.0f} us | {plain / min(batched, cat):.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
