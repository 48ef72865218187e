"""Packed weights gathered onto huge pages (models/hugepages.py): the same values, shapes and
alignment in one buffer, backed by 2 MiB pages where the kernel offers them, and a model's
packed products all moved there with its outputs unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from splitserve.models import hugepages
from splitserve.models.llama import Linear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_offered() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def test_gather_copies_values_shapes_and_alignment():
    torch.manual_seed(0)
    tensors = [
        torch.randn(37, 5),
        torch.randn(3, 4, 16, 32).bfloat16(),
        torch.randint(0, 100, (1000,)),
        torch.randn(0, 8),
    ]
    before = [t.clone() for t in tensors]
    views = hugepages.gather(tensors)
    assert len(views) == len(tensors)
    base = views[0].untyped_storage().data_ptr()
    for t, v, b in zip(tensors, views, before, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert torch.equal(v, t) and torch.equal(t, b)
        assert v.data_ptr() % 4096 == 0
        assert v.untyped_storage().data_ptr() == base  # one buffer
    views[1].zero_()  # a view, not the original
    assert torch.equal(tensors[1], before[1])


@pytest.mark.skipif(not thp_offered(), reason="no transparent huge pages on this machine")
def test_gathered_buffer_is_on_huge_pages():
    views = hugepages.gather([torch.ones(3 << 20), torch.ones(1 << 20)])  # 16 MiB
    backed = hugepages.backed(views[0])
    assert backed >= 4 * hugepages.HUGE_PAGE, f"{backed} bytes on huge pages"


def test_backed_is_zero_for_small_ordinary_tensors():
    assert hugepages.backed(torch.ones(16)) == 0


def test_model_products_share_one_buffer(tmp_path, hf_model_factory):
    from splitserve.models.loader import load_model

    hf_model_factory("llama").save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(str(tmp_path), dtype=torch.float32, load_tokenizer=False).model
    packed = [m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    if not packed or packed[0].dim() != 3:
        pytest.skip("the panel kernel is not built here: no packed panels to gather")
    storages = {p.untyped_storage().data_ptr() for p in packed + [model.lm_head_packed]}
    assert len(storages) == 1
    for m in model.modules():
        if isinstance(m, Linear):
            x = torch.randn(5, m.weight.shape[1])
            expected = torch.nn.functional.linear(x, m.weight, m.bias)
            torch.testing.assert_close(m(x), expected, rtol=1e-4, atol=1e-4)
