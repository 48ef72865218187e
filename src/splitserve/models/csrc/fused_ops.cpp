// The torch ops over rows.h (models/fused_ops.py), on float32 or bfloat16 rows (argmax: float32).
// Rows go over torch's intra-op threads once their work outweighs waking a thread (rows::grain).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "rows.h"

namespace {

// float32 as float, bfloat16 as its bits (rows.h takes either).
template <typename T>
T* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Runs fn<float> or fn<uint16_t> by x's dtype: float32 or bfloat16, which `others` share.
template <typename Fn>
void by_dtype(const at::Tensor& x, std::initializer_list<const at::Tensor*> others, Fn&& fn) {
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "float32 or bfloat16 only, got ", t);
  for (const at::Tensor* o : others)
    TORCH_CHECK(o->scalar_type() == t, "every tensor in ", t, ", got one in ", o->scalar_type());
  if (t == at::kFloat)
    fn(float{});
  else
    fn(uint16_t{});
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [rows, hidden]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "weight: contiguous [hidden]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  by_dtype(x, {&w}, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = ptr<T>(x), *wp = ptr<T>(w);
    T* yp = ptr<T>(y);
    at::parallel_for(0, x.size(0), rows::grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rows::norm_row(xp + r * n, wp, n, static_cast<float>(eps), yp + r * n);
    });
  });
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(d.is_contiguous() && d.sizes() == x.sizes(), "delta: contiguous, shaped as x");
  at::Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  by_dtype(x, {&d, &w}, [&](auto tag) {
    using T = decltype(tag);
    T* xp = ptr<T>(x);
    const T *dp = ptr<T>(d), *wp = ptr<T>(w);
    T* yp = ptr<T>(y);
    at::parallel_for(0, x.size(0), rows::grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rows::add_norm_row(xp + r * n, dp + r * n, wp, n, static_cast<float>(eps), yp + r * n);
    });
  });
  return y;
}

// qkv [T, (h + 2 kvh) * hd]: RoPE on its h + kvh rotated heads in place; k and v of row t into
// slot slots[t] of caches [blocks, block_size, kvh, hd]. cos and sin [T, 1, hd].
void rope_write_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, int64_t heads,
                    int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous [tokens, width]");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == kv_heads,
              "caches: two contiguous [blocks, block_size, kv_heads, head_dim]");
  const int64_t hd = k_cache.size(3);
  TORCH_CHECK(hd % (2 * rows::kLanes) == 0 && qkv.size(1) == (heads + 2 * kv_heads) * hd,
              "qkv: (heads + 2 kv_heads) * head_dim columns, head_dim a multiple of 32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * hd && sin.numel() == T * hd,
              "cos, sin: contiguous [tokens, 1, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "slots: contiguous int64 [tokens]");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " outside the cache");
  const int64_t width = qkv.size(1);
  by_dtype(qkv, {&cos, &sin, &k_cache, &v_cache}, [&](auto tag) {
    using V = decltype(tag);
    V* qp = ptr<V>(qkv);
    const V *cp = ptr<V>(cos), *snp = ptr<V>(sin);
    V *kc = ptr<V>(k_cache), *vc = ptr<V>(v_cache);
    at::parallel_for(0, T, rows::grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rows::rope_row(qp + t * width, cp + t * hd, snp + t * hd, heads, kv_heads, hd, kc, vc, sp[t]);
    });
  });
}

// gate_up [T, 2 n] (gate, then up): y [T, n] = silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: contiguous [rows, 2 n]");
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor y = at::empty({T, n}, gate_up.options());
  by_dtype(gate_up, {}, [&](auto tag) {
    using V = decltype(tag);
    const V* gp = ptr<V>(gate_up);
    V* yp = ptr<V>(y);
    at::parallel_for(0, T, rows::grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rows::silu_mul_row(gp + t * 2 * n, gp + t * 2 * n + n, n, yp + t * n);
    });
  });
  return y;
}

// x [rows, n], n >= 1: each row's argmax as torch.argmax(x, -1) gives it, int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "x: contiguous float32 [rows, n] with n >= 1");
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, rows::grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) op[t] = rows::argmax_row(xp + t * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots, int heads, int kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_write_kv_", &rope_write_kv_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
