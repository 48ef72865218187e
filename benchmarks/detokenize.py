"""The detokenizer's cost per streamed token as an output grows: windowed updates (the
engine's ``IncrementalDetokenizer``) against decoding the whole output at every update, on the
default model's tokenizer and real text, in one process.

    .venv/bin/python benchmarks/detokenize.py [--lengths 100,1000,4000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.models.loader import default_model_path


class WholeDecode(IncrementalDetokenizer):
    """Every update decodes the whole output (what the engine did before the window)."""

    def _windowed(self, ids: list[int]) -> str | None:
        return None


def per_token_us(make, ids: list[int], start: int) -> float:
    """Mean µs of the updates for tokens [start, len(ids)) of a stream of ``ids``."""
    d, output = make(), ids[:start]
    d.update(output)
    began = time.perf_counter()
    for token in ids[start:]:
        output.append(token)  # one growing list, as the engine's sequence holds it
        d.update(output)
    return (time.perf_counter() - began) / (len(ids) - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="100,1000,4000", help="output lengths to reach")
    parser.add_argument("--window", type=int, default=100, help="tokens timed before each length")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_gguf(default_model_path())
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    lengths = [int(n) for n in args.lengths.split(",")]
    while len(ids) < max(lengths):
        ids += ids
    print("µs per streamed token, the last --window tokens before each output length")
    for n in lengths:
        part, start = ids[:n], max(0, n - args.window)
        whole = per_token_us(lambda: WholeDecode(tokenizer.decode), part, start)
        windowed = per_token_us(lambda: IncrementalDetokenizer(tokenizer.decode), part, start)
        ratio = whole / windowed
        print(f"{n:>6} tokens: whole {whole:8.1f} µs | windowed {windowed:6.1f} µs, {ratio:6.1f}x")


if __name__ == "__main__":
    main()
