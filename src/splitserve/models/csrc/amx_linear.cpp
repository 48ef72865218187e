// The torch ops over amx.h's product: splitserve::amx_linear, amx_silu_linear and
// amx_linear_add_ (models/amx_linear.py), and splitserve::amx_ready, whether the OS gave this
// process the AMX tile state.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "amx.h"

namespace {

using amx::kCols;
using amx::kDepth;
using amx::kTileRows;
using amx::ready;

void check(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(ready(), "the kernel did not get the AMX tile state from the OS");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous bfloat16 [rows, in]");
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 && tiles.is_contiguous() &&
                  tiles.size(1) * kDepth == x.size(1) && tiles.size(2) == kTileRows &&
                  tiles.size(3) == kDepth,
              "tiles: contiguous bfloat16 [out / 16, in / 32, 16, 32] for x's in");
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles,
                      const std::optional<at::Tensor>& bias) {
  check(x, tiles);
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * kCols;
  at::Tensor widened;  // the bias in float32, which the sums take it in
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N, "bias: [out]");
    widened = bias->to(at::kFloat).contiguous();
  }
  const float* b = widened.defined() ? widened.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0)
    amx::product(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
            reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), N, b,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

// gate_up's tiles (gate's panels, then up's: [2 I / 16, in / 32, 16, 32], I a multiple of 16):
// y [rows, I] = silu(x gate^T) * (x up^T), each product rounded to bfloat16 first, as
// splitserve::silu_mul computes it over amx_linear's output.
at::Tensor amx_silu_linear(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(0) % 2 == 0, "tiles: gate's panels then up's, as many each");
  check(x, tiles);
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * kCols;
  at::Tensor y = at::empty({M, N / 2}, x.options());
  if (M > 0)
    amx::product<true>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
                       reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), N, nullptr,
                       reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

// out [rows, out] += x W^T for tiles = pack(W): each product element rounded to bfloat16, then
// added as torch adds two bfloat16 tensors.
at::Tensor& amx_linear_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles) {
  check(x, tiles);
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * kCols;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N,
              "out: contiguous bfloat16 [rows, out]");
  if (M > 0)
    amx::product(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
                 reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), N, nullptr,
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), true);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("amx_ready() -> bool");
  m.def("amx_linear(Tensor x, Tensor tiles, Tensor? bias) -> Tensor");
  m.def("amx_silu_linear(Tensor x, Tensor tiles) -> Tensor");
  m.def("amx_linear_add_(Tensor(a!) out, Tensor x, Tensor tiles) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_silu_linear", &amx_silu_linear);
  m.impl("amx_linear_add_", &amx_linear_add_);
}

TORCH_LIBRARY_IMPL(splitserve, CatchAll, m) { m.impl("amx_ready", &ready); }
