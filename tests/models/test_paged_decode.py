"""The in-place decode attention kernel against the torch path (gather + SDPA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.models import paged_decode
from splitserve.models.attention import DecodeGroup, _decode_attention

pytestmark = pytest.mark.skipif(paged_decode.numba is None, reason="numba is not importable")

BLOCK, KV_HEADS, HEADS, HEAD_DIM, BLOCKS = 4, 2, 6, 16, 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def caches(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def tables_for(lens: list[int], seed: int) -> np.ndarray:
    """Each sequence's blocks, distinct and shuffled; rows padded with block 0."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(BLOCKS)
    width = max(-(-n // BLOCK) for n in lens)
    tables, used = np.zeros((len(lens), width), dtype=np.int64), 0
    for i, n in enumerate(lens):
        k = -(-n // BLOCK)
        tables[i, :k] = ids[used : used + k]
        used += k
    return tables


def torch_path(q, kc, vc, tables: np.ndarray, lens: list[int]) -> torch.Tensor:
    width = tables.shape[1] * BLOCK
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    group = DecodeGroup(0, torch.from_numpy(tables), mask.view(len(lens), 1, 1, width))
    return _decode_attention(q, kc, vc, group, HEAD_DIM**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_path(dtype):
    """Ragged lengths (partial last blocks, one position only), shuffled blocks, GQA."""
    lens = [1, 5, 16, 23, 40]
    kc, vc = caches(dtype, seed=1)
    tables = tables_for(lens, seed=2)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(dtype)
    got = paged_decode.decode_attention(
        q, kc, vc, tables, np.array(lens, dtype=np.int64), HEAD_DIM**-0.5, threads=2
    )
    expected = torch_path(q, kc, vc, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - expected.float()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_result_alone_in_a_batch_and_on_any_threads(dtype):
    lens = [7, 33, 12]
    kc, vc = caches(dtype, seed=4)
    tables = tables_for(lens, seed=5)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    q = q.to(dtype)
    lens_np = np.array(lens, dtype=np.int64)
    batch = paged_decode.decode_attention(q, kc, vc, tables, lens_np, 0.25, threads=2)
    for r in range(len(lens)):
        alone = paged_decode.decode_attention(
            q[r : r + 1], kc, vc, tables[r : r + 1], lens_np[r : r + 1], 0.25, threads=1
        )
        assert torch.equal(alone[0], batch[r]), r


def test_available_only_for_cpu_caches_it_can_read():
    assert paged_decode.available(torch.zeros(1, dtype=torch.bfloat16))
    assert paged_decode.available(torch.zeros(1, dtype=torch.float32))
    assert not paged_decode.available(torch.zeros(1, dtype=torch.float16))
