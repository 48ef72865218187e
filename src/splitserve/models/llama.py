"""A llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) for a flat batch over a paged KV cache.

Weights keep HF's layout and RoPE convention (rotate_half), except that q/k/v and gate/up are
fused into one matrix each at load time, so a layer runs three matmuls plus the output ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.models import amx_linear, fused_ops, hugepages, native, panel_linear
from splitserve.models.attention import AttentionContext, paged_attention, write_kv
from splitserve.models.config import ModelConfig


class SplitGemv:
    """How many cores a few-row product (a small decode step) is split over.

    MKL runs ``x @ W^T`` for a handful of rows on one core whatever torch's thread count, so a
    small decode step reads its weights at one core's bandwidth. Split in ``parts`` column
    blocks (a strided view of ``W^T``, no copy), the same product is a batched matmul that
    torch spreads over the cores, one block each; the model runner turns this on, with the
    threads, only around those products and keeps every other (tiny) op of a small step on
    one thread, where an OpenMP fork/join would cost more than the op. Each output element is
    the same dot product as unsplit; MKL may block its sum differently for some row counts
    (as it already does between a row alone and in a batch), so results agree to rounding.
    """

    parts = 1  # process-wide, like torch's thread count; set by the model runner

    @classmethod
    @contextmanager
    def over(cls, parts: int) -> Iterator[None]:
        before, cls.parts = cls.parts, parts
        try:
            yield
        finally:
            cls.parts = before


def matmul_t(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x @ w_t`` for a contiguous ``w_t`` ``[in, out]``, split across cores per
    ``SplitGemv`` when that is on and the columns divide evenly."""
    parts, (rows, out) = SplitGemv.parts, (x.shape[0], w_t.shape[1])
    if parts == 1 or out % parts:
        return torch.matmul(x, w_t)
    cols = w_t.view(w_t.shape[0], parts, out // parts).transpose(0, 1)  # [parts, in, out/p]
    with native.intra_op_threads(parts):
        y = torch.matmul(x, cols)
    return y.transpose(0, 1).reshape(rows, out)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters: the loader fills every one.

    ``weight`` has HF's shape ``[out, in]`` (the loader copies into it unchanged) but lives in
    memory as ``[in, out]``, i.e. column-major: then ``W^T`` is contiguous and MKL's small-M
    GEMM, which decode runs, streams it about 1.3x faster than the row-major layout. Large-M
    (prefill) GEMMs run at the same speed either way. Small steps may split it across cores
    (``SplitGemv``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(in_features, out_features, dtype=dtype).t(), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Keep a oneDNN-blocked copy of the weight for ``forward`` (see ``packed_weight``)."""
        self.packed = packed_weight(self.weight)

    def adds_in_place(self, out: torch.Tensor) -> bool:
        """Whether ``add_forward_`` adds inside the product (AMX tiles, no bias, ``out``
        contiguous): ``out`` is then read and written once, with no product tensor between."""
        tiles = self.packed
        return tiles is not None and tiles.dim() == 4 and self.bias is None and out.is_contiguous()

    def add_forward_(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += self(x)`` in place, with the bits of that add."""
        if self.adds_in_place(out):
            return amx_linear.linear_add_(out, x, self.packed)
        return out.add_(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if SplitGemv.parts == 1:
            return F.linear(x, self.weight, self.bias)
        y = matmul_t(x, self.weight.t())
        return y if self.bias is None else y.add_(self.bias)


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ``[out, in]`` packed once for ``packed_linear``: float32 into the panels of
    ``models.panel_linear`` where its C++ kernel is built, bfloat16 into the AMX tiles of
    ``models.amx_linear`` where the CPU has AMX, else into oneDNN's blocked layout;
    ``None`` where torch has no oneDNN, the weight is not on CPU, or oneDNN cannot compute
    bfloat16 on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; torch's own kernels do
    it elsewhere).

    A plain ``F.linear`` on CPU reorders the weight for oneDNN (bfloat16) or runs MKL on the
    plain layout (float32) on every call; a packed copy runs the same products 1.3-2x faster
    for the few-row steps of decoding, with identical results for a row alone or in a batch
    (``benchmarks/decode_kernels.py``; docs/engine.md).
    """
    for pack in (panel_linear.pack, amx_linear.pack):
        packed = pack(weight)
        if packed is not None:
            return packed
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)


# The row count oneDNN picks its blocking for; any count then runs on it (decode steps are
# the ones that gain, and the choice barely matters between 1 and 256 rows).
_PACK_ROWS_HINT = 16


# oneDNN sums a bfloat16 row of a product with more than this many rows in another order
# than alone (on AMX, its kernels for larger products block the rows differently), so a
# row's result would depend on the batch around it. Up to this many rows, every row gets the
# result it gets alone (tests/models/test_bfloat16.py holds both).
BATCH_INVARIANT_ROWS = 32


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x`` ``[rows, in]`` and a ``packed_weight``, on torch's
    threads (oneDNN spreads even one row over them). A bfloat16 product on oneDNN runs in pieces
    of at most ``BATCH_INVARIANT_ROWS`` rows, so that each row's result is the one it gets alone
    (the panels and the AMX tiles give it at any row count)."""
    if packed.dim() == 3:
        return panel_linear.linear(x, packed, bias)
    if packed.dim() == 4:
        return amx_linear.linear(x, packed, bias)
    if x.dtype == torch.bfloat16 and x.shape[0] > BATCH_INVARIANT_ROWS:
        pieces = x.split(BATCH_INVARIANT_ROWS)
        return torch.cat(
            [torch.ops.mkldnn._linear_pointwise(p, packed, bias, "none", [], "") for p in pieces]
        )
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.fits(x):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward_(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x += delta`` (in place where fused), then this norm of ``x``."""
        if fused_ops.fits(x) and x.is_contiguous():
            return fused_ops.add_rms_norm_(x, delta, self.weight, self.eps)
        x += delta
        return self(x)


class Rotary(nn.Module):
    """RoPE tables for the step's positions, computed the way HF does (float32 outer product,
    then cos/sin) so results match it bit for bit in float32.

    The sin table comes back with the sign of rotate_half folded into its first half, so that
    ``apply_rope`` needs no negation: ``-x2 * sin == x2 * (-sin)`` exactly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, hd]
        sin = emb.sin()
        sin[..., : freqs.shape[-1]].neg_()
        return emb.cos().to(dtype), sin.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3 or linear scaling applied as HF's rope utils do."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with the sign already in ``signed_sin`` (see
    ``Rotary``): swapping the halves is one flip, and the sum one addcmul."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, signed_sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, config.attention_out_bias, dtype)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """The heads' outputs ``[T, q_size]``, before the output projection (``o_proj``, which
        the decoder layer applies: inside the residual add where it can)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if fused_ops.rope_fits(qkv, self.k_cache):
            fused_ops.rope_write_kv_(
                qkv, cos, sin, self.k_cache, self.v_cache, ctx.slot_mapping,
                self.num_heads, self.num_kv_heads,
            )  # fmt: skip
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, -1)
        else:
            # RoPE on q and k together: one set of elementwise ops instead of two.
            rotated = self.num_heads + self.num_kv_heads
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, rotated, -1), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            write_kv(self.k_cache, self.v_cache, k, v, ctx.slot_mapping)
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
        return out.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype)

    def _silu_tiles(self) -> torch.Tensor | None:
        """gate_up's AMX tiles where one product can also apply silu(gate) * up, else None."""
        packed = self.gate_up_proj.packed
        fits = packed is not None and packed.dim() == 4 and self.intermediate_size % 16 == 0
        return packed if fits else None

    def add_forward_(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += self(x)``, in place (in the down product itself on AMX tiles)."""
        tiles = self._silu_tiles()
        if tiles is None:
            return out.add_(self(x))
        return self.down_proj.add_forward_(amx_linear.silu_linear(x, tiles), out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self._silu_tiles()
        if tiles is not None:
            return self.down_proj(amx_linear.silu_linear(x, tiles))
        gate_up = self.gate_up_proj(x)
        if fused_ops.fits(gate_up):
            return self.down_proj(fused_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place: both halves are views of a fresh tensor nothing else holds.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        # x is this forward's own (the embedding or the previous layer's sum): added to in place.
        heads = self.self_attn.attend(self.input_layernorm(x), cos, sin, ctx)
        o_proj = self.self_attn.o_proj
        if o_proj.adds_in_place(x):  # the residual add in the product, then the norm alone
            h = self.post_attention_layernorm(o_proj.add_forward_(heads, x))
        else:
            h = self.post_attention_layernorm.add_forward_(x, o_proj(heads))
        return self.mlp.add_forward_(h, x)


class LlamaForCausalLM(nn.Module):
    """The decoder. ``bind_kv_cache`` must be called before ``forward``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # The output projection is kept transposed, [hidden, vocab], even when tied (then it
        # is a copy of the embedding): on CPU, x @ W^T with W stored that way runs the
        # batch-1 GEMV about twice as fast as F.linear for a matrix this size.
        self.lm_head_t = nn.Parameter(
            torch.empty(config.hidden_size, config.vocab_size, dtype=dtype), requires_grad=False
        )
        self.lm_head_packed: torch.Tensor | None = None
        self.rotary = Rotary(config)
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Attach the cache ``[num_layers, 2, num_blocks, block_size, kvh, hd]``."""
        expected = (self.config.num_layers, 2)
        if tuple(kv_cache.shape[:2]) != expected or kv_cache.shape[4:] != (
            self.config.num_kv_heads,
            self.config.head_dim,
        ):
            raise ValueError(f"kv cache shape {tuple(kv_cache.shape)} does not fit this model")
        self.kv_cache = kv_cache
        for i, layer in enumerate(self.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv_cache[i, 0], kv_cache[i, 1]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` for a flat batch of ``T`` tokens."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits for ``[N, hidden]`` states."""
        if self.lm_head_packed is not None:
            return packed_linear(hidden, self.lm_head_packed).float()
        return matmul_t(hidden, self.lm_head_t).float()

    def pack_weights(self) -> None:
        """Give every weight product a oneDNN-blocked copy of its weight (``packed_weight``);
        call after ``load_weights``. The plain weights stay: the fused decode path and the
        ``SplitGemv`` split read them."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        # Tied: the embedding is the output projection's ``[vocab, hidden]`` weight, already
        # contiguous (``lm_head_t.t()`` would be copied first).
        tied = self.config.tie_word_embeddings
        self.lm_head_packed = packed_weight(self.embed_tokens if tied else self.lm_head_t.t())
        self._gather_packed()

    def _gather_packed(self) -> None:
        """Move the panels and tiles (the kernels' own layouts) into one buffer on huge pages,
        layer by layer, then the output projection (``models.hugepages``)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        owners = [m for m in linears if m.packed is not None and m.packed.dim() in (3, 4)]
        head = self.lm_head_packed
        tensors = [m.packed for m in owners]
        if head is not None and head.dim() in (3, 4):
            tensors.append(head)
        if not tensors:
            return
        views = hugepages.gather(tensors)
        for m, view in zip(owners, views[: len(owners)], strict=True):
            m.packed = view
        if len(views) > len(owners):
            self.lm_head_packed = views[-1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...) into the
        fused parameters; raise ``ValueError`` on unknown names, bad shapes or missing ones."""
        from splitserve.models.weights import WeightLoader

        WeightLoader(self).load(weights)
        if self.config.tie_word_embeddings:
            self.lm_head_t.data.copy_(self.embed_tokens.data.t())
