"""gather_blocks / scatter_blocks: exact, block-major, both dtypes."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_pages import block_nbytes, gather_blocks, scatter_blocks
from tests.transfer.helpers import BS, HD, KVH, L, assert_blocks_equal, make_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_is_exact(dtype: torch.dtype) -> None:
    src, dst = make_cache(1, dtype), torch.zeros_like(make_cache(1, dtype))
    ids = [5, 1, 30, 7]
    blocks = gather_blocks(src, ids)
    assert blocks.shape == (4, L, 2, BS, KVH, HD) and blocks.is_contiguous()
    assert torch.equal(blocks[2], src[:, :, 30])
    scatter_blocks(dst, [0, 2, 4, 6], blocks)
    assert_blocks_equal(src, ids, dst, [0, 2, 4, 6])
    untouched = [b for b in range(dst.shape[2]) if b not in (0, 2, 4, 6)]
    assert not dst[:, :, untouched].any()
    assert block_nbytes(src) == L * 2 * BS * KVH * HD * dtype.itemsize


def test_gather_into_out_and_shape_checks() -> None:
    src = make_cache()
    out = torch.empty(2, L, 2, BS, KVH, HD)
    assert gather_blocks(src, [3, 4], out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out[1], src[:, :, 4])
    with pytest.raises(ValueError, match="out must be"):
        gather_blocks(src, [3], out=out)
    with pytest.raises(ValueError, match="does not match"):
        scatter_blocks(src, [1, 2, 3], out)
