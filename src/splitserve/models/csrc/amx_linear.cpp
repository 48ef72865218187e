// The torch op over amx.h's product: splitserve::amx_linear (models/amx_linear.py), and
// splitserve::amx_ready, whether the OS gave this process the AMX tile state.
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

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& tiles,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(ready(), "the kernel did not get the AMX tile state from the OS");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous bfloat16 [rows, in]");
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 && tiles.is_contiguous() &&
                  tiles.size(1) * kDepth == x.size(1) && tiles.size(2) == kTileRows &&
                  tiles.size(3) == kDepth,
              "tiles: contiguous bfloat16 [out / 16, in / 32, 16, 32] for x's in");
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("amx_ready() -> bool");
  m.def("amx_linear(Tensor x, Tensor tiles, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("amx_linear", &amx_linear); }

TORCH_LIBRARY_IMPL(splitserve, CatchAll, m) { m.impl("amx_ready", &ready); }
