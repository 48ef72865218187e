"""The in-place decode attention kernels (C++ and numba) against the torch path (gather + SDPA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.models import native, paged_decode
from splitserve.models.attention import DecodeGroup, _decode_attention

NATIVE_OFF = native.load("paged_decode")
KERNELS = [
    pytest.param(False, marks=pytest.mark.skipif(paged_decode.numba is None, reason="no numba")),
    pytest.param(True, marks=pytest.mark.skipif(NATIVE_OFF is not None, reason=str(NATIVE_OFF))),
]

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
    block, hd = kc.shape[1], kc.shape[3]
    width = tables.shape[1] * block
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    group = DecodeGroup(0, torch.from_numpy(tables), mask.view(len(lens), 1, 1, width))
    return _decode_attention(q, kc, vc, group, hd**-0.5)


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_path(dtype, use_native):
    """Ragged lengths (partial last blocks, one position only), shuffled blocks, GQA."""
    lens = [1, 5, 16, 23, 40]
    kc, vc = caches(dtype, seed=1)
    tables = tables_for(lens, seed=2)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(dtype)
    got = paged_decode.decode_attention(
        q, kc, vc, tables, np.array(lens, dtype=np.int64), HEAD_DIM**-0.5, 2, use_native
    )
    expected = torch_path(q, kc, vc, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - expected.float()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("use_native", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_result_alone_in_a_batch_and_on_any_threads(dtype, use_native):
    lens = [7, 33, 12]
    kc, vc = caches(dtype, seed=4)
    tables = tables_for(lens, seed=5)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    q = q.to(dtype)
    lens_np = np.array(lens, dtype=np.int64)
    batch = paged_decode.decode_attention(q, kc, vc, tables, lens_np, 0.25, 2, use_native)
    for r in range(len(lens)):
        alone = paged_decode.decode_attention(
            q[r : r + 1], kc, vc, tables[r : r + 1], lens_np[r : r + 1], 0.25, 1, use_native
        )
        assert torch.equal(alone[0], batch[r]), r


def test_available_only_for_cpu_caches_it_can_read():
    assert paged_decode.available(torch.zeros(1, dtype=torch.bfloat16))
    assert paged_decode.available(torch.zeros(1, dtype=torch.float32))
    assert not paged_decode.available(torch.zeros(1, dtype=torch.float16))


@pytest.mark.skipif(NATIVE_OFF is not None, reason=str(NATIVE_OFF))
@pytest.mark.parametrize(
    ("block", "kv_heads", "heads", "head_dim", "lens"),
    [
        (16, 3, 9, 64, [1, 15, 16, 17, 100, 296, 700]),  # the default model's shape
        (32, 2, 16, 128, [31, 33, 64, 200, 1000]),  # two spans of 16 in a block, 8 heads a group
        (8, 4, 4, 32, [3, 8, 9, 50, 515]),  # blocks shorter than a span, no GQA
        (16, 1, 6, 16, [70]),  # one kv head for all
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_on_other_shapes(block, kv_heads, heads, head_dim, lens, dtype):
    """Against the torch path, and alone vs batched, on shapes of other architectures."""
    gen = torch.Generator().manual_seed(7)
    blocks = sum(-(-n // block) for n in lens) + 3
    shape = (blocks, block, kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    rng = np.random.default_rng(8)
    ids, width = rng.permutation(blocks), max(-(-n // block) for n in lens)
    tables, used = np.zeros((len(lens), width), dtype=np.int64), 0
    for i, n in enumerate(lens):
        tables[i, : -(-n // block)] = ids[used : used + -(-n // block)]
        used += -(-n // block)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    lens_np = np.array(lens, dtype=np.int64)
    assert paged_decode.native_fits(heads, kc)
    got = paged_decode.decode_attention(q, kc, vc, tables, lens_np, head_dim**-0.5, 2)
    expected = torch_path(q, kc, vc, tables, lens)
    assert (got.float() - expected.float()).abs().max().item() < TOL[dtype]
    # Alone, a long sequence's few kv heads are split over the threads by positions and columns.
    for r in range(len(lens)):
        for threads in (1, 2, 4):
            alone = paged_decode.decode_attention(
                q[r : r + 1], kc, vc, tables[r : r + 1], lens_np[r : r + 1], head_dim**-0.5, threads
            )
            assert torch.equal(alone[0], got[r]), (r, threads)


def test_native_kernel_turns_off_with_a_reason(monkeypatch, tmp_path):
    """SPLITSERVE_NATIVE=0, or a compiler that fails, leaves a reason and no exception."""
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert native._load("paged_decode") == f"{native.SWITCH_ENV}=0"
    monkeypatch.delenv(native.SWITCH_ENV)
    monkeypatch.setenv(native.OFF_ENV, "another, paged_decode")
    assert native._load("paged_decode") == f"{native.OFF_ENV} names it"
    monkeypatch.delenv(native.OFF_ENV)
    if native.variant(native.cpu_flags()) is None:
        pytest.skip("the CPU has neither avx512f nor avx2 and fma")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails at once
    assert native._load("paged_decode").startswith("building paged_decode.cpp failed")
    assert not list(tmp_path.iterdir())  # nothing half-built left behind


def test_every_kernel_source_is_listed_and_builds_here():
    """``make install`` builds ``native.KERNELS``: every source under csrc/ is among them,
    and on a machine with AVX-512 or AVX2 and g++ each one loads."""
    assert sorted(p.stem for p in native.CSRC.glob("*.cpp")) == sorted(native.KERNELS)
    if native.variant(native.cpu_flags()) is None:
        pytest.skip("the CPU has neither avx512f nor avx2 and fma")
    flags = native.cpu_flags()
    loaded = native.load_all()
    for name, reason in loaded.items():
        build, needs = native.NEEDS.get(name, (native.variant(flags), ()))
        if build == native.variant(flags) and all(f in flags for f in needs):
            assert reason is None, (name, reason)
        else:
            assert reason == f"it needs the {build} build and the CPU flags {', '.join(needs)}"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16", "avx512"),
        ("fpu avx2 avx512f", "avx512"),  # AVX-512 needs nothing else here
        ("fpu sse4_2 avx f16c fma avx2 bmi2", "avx2"),  # this project's AMD EPYC VMs
        ("fpu sse4_2 avx avx2", None),  # AVX2 without FMA
        ("fpu sse4_2 avx fma", None),
        ("", None),  # /proc/cpuinfo unreadable
    ],
)
def test_the_build_is_picked_by_the_cpu_flags(flags, expected):
    assert native.variant(frozenset(flags.split())) == expected


def test_each_variant_builds_apart(monkeypatch, tmp_path):
    """The variant is in the build's name (and digest): a cache shared by an AVX2 and an
    AVX-512 machine holds one build of each, and neither loads the other's."""
    name = native.variant(native.cpu_flags())
    if name is None:
        pytest.skip("the CPU has neither avx512f nor avx2 and fma")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    built = []
    monkeypatch.setattr(native, "_build", lambda *args: built.append(args) or "stopped here")
    assert native._load("paged_decode") == "stopped here"
    (_, source, target, defines) = built[0]
    assert target.name.startswith(f"paged_decode-{name}-")
    assert defines == (f"-DSPLITSERVE_{name.upper()}",)


@pytest.mark.skipif(NATIVE_OFF is not None, reason=str(NATIVE_OFF))
@pytest.mark.parametrize(
    ("block", "kv_heads", "heads", "head_dim", "cuts"),
    [
        (16, 3, 9, 64, [0, 1, 37, 64, 300]),  # the default model's shape
        (32, 2, 16, 128, [0, 90, 91, 600]),  # 8 heads a group: more than four tiles of pairs
        (8, 4, 4, 32, [0, 50, 129]),  # blocks shorter than a span, no GQA
        (16, 1, 6, 16, [0, 70]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_chunk_gives_each_query_its_decode_rows_bits(
    block, kv_heads, heads, head_dim, cuts, dtype
):
    """One sequence prefilled in chunks [cuts[i], cuts[i + 1]) (its K/V in the cache, the chunk
    reading its earlier positions there): each query's output equals, bit for bit, a decode
    row's at its position, batched or alone (a long one split over the threads)."""
    gen = torch.Generator().manual_seed(9)
    length = cuts[-1]
    blocks = -(-length // block) + 2
    shape = (blocks, block, kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    table = torch.from_numpy(np.random.default_rng(10).permutation(blocks)[: -(-length // block)])
    q = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    prefilled = torch.cat(
        [
            paged_decode.prefill_attention(q[a:b], kc, vc, table, a, scale)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
    )
    tables = np.tile(table.numpy(), (length, 1))
    lens = np.arange(1, length + 1, dtype=np.int64)
    decoded = paged_decode.decode_attention(q, kc, vc, tables, lens, scale, 2)
    assert torch.equal(prefilled, decoded)
    last = slice(length - 1, length)
    alone = paged_decode.decode_attention(q[last], kc, vc, tables[last], lens[last], scale, 2)
    assert torch.equal(prefilled[last], alone)
