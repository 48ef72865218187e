// The torch ops over attend.h: splitserve::paged_decode and splitserve::paged_prefill
// (models/paged_decode.py). Work items go over torch's own intra-op threads
// (at::parallel_for): the ops run on the engine thread's OpenMP team and start no threads of
// their own.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attend.h"

namespace {

using attn::attend_fn;
using attn::kMaxGroup;
using attn::Layout;

struct Caches {
  const void* k;
  const void* v;
  Layout lay;
};

Caches check_caches(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == k_cache.scalar_type()) &&
                  q.dim() == 3 && q.is_contiguous(),
              "q: contiguous [n, h, hd], float32 or the caches' type");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: two contiguous [blocks, block_size, kv_heads, head_dim] of one type");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kFloat,
              "caches: bfloat16 or float32");
  const int64_t hd = q.size(2), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == hd && attend_fn<float>(hd) != nullptr,
              "head_dim: 16, 32, 64, 96, 128 or 256");
  TORCH_CHECK(q.size(1) % kvh == 0 && q.size(1) / kvh <= kMaxGroup, "at most 8 query heads per kv head");
  return {k_cache.data_ptr(), v_cache.data_ptr(),
          Layout{k_cache.size(1), k_cache.stride(0), k_cache.stride(1), hd, q.size(1) / kvh}};
}

uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

template <typename T>
void decode_rows(const at::Tensor& q, const Caches& c, int64_t kvh, const int64_t* tables,
                 int64_t width, const int64_t* lens, float scale, at::Tensor& out) {
  const int64_t h = q.size(1), hd = q.size(2);
  attn::decode_fn<T>(hd)(q.data_ptr<float>(), h * hd, out.data_ptr<float>(), h * hd, q.size(0), lens,
                         static_cast<const T*>(c.k), static_cast<const T*>(c.v), tables, width, kvh,
                         scale, c.lay);
}

template <typename T>
void prefill_rows(const at::Tensor& q, const Caches& c, int64_t kvh, const int64_t* table,
                  int64_t start, float scale, at::Tensor& out) {
  const int64_t h = q.size(1), hd = q.size(2);
  attn::prefill_fn<T>(hd)(q.data_ptr<float>(), h * hd, q.size(0), start, static_cast<const T*>(c.k),
                          static_cast<const T*>(c.v), table, kvh, scale, c.lay, out.data_ptr<float>());
}

// Decode rows: q [n, h, hd] (float32 or the caches' type; the output in q's), row r one query
// at position lens[r] - 1 of the sequence whose blocks are tables[r] (int64 [n, w]).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, double scale) {
  const Caches c = check_caches(q, k_cache, v_cache);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  lens.scalar_type() == at::kLong && lens.is_contiguous() &&
                  tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "tables [n, w] and lens [n]: contiguous int64");
  const at::Tensor qf = q.to(at::kFloat);
  at::Tensor out = at::empty_like(qf);
  const int64_t kvh = k_cache.size(2);
  if (k_cache.scalar_type() == at::kBFloat16)
    decode_rows<uint16_t>(qf, c, kvh, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                          static_cast<float>(scale), out);
  else
    decode_rows<float>(qf, c, kvh, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                       static_cast<float>(scale), out);
  return out.to(q.scalar_type());
}

// A prefill chunk: q [n, h, hd] (float32 or the caches' type; the output in q's), row i the
// query at position start + i of the sequence whose blocks are table (int64 [w]); the chunk's
// own K/V are in the cache already.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& table, int64_t start, double scale) {
  const Caches c = check_caches(q, k_cache, v_cache);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 1 &&
                  table.size(0) * k_cache.size(1) >= start + q.size(0) && start >= 0,
              "table: contiguous int64 [w] covering the chunk");
  const int64_t kvh = k_cache.size(2), h = q.size(1), hd = q.size(2);
  if (q.scalar_type() == at::kBFloat16) {
    if (const auto fn = attn::prefill_fn<uint16_t, uint16_t>(hd)) {  // q and out as they are
      at::Tensor out = at::empty_like(q);
      fn(bits(q), h * hd, q.size(0), start, static_cast<const uint16_t*>(c.k),
         static_cast<const uint16_t*>(c.v), table.data_ptr<int64_t>(), kvh, static_cast<float>(scale),
         c.lay, bits(out));
      return out;
    }
  }
  const at::Tensor qf = q.to(at::kFloat);
  at::Tensor out = at::empty_like(qf);
  if (k_cache.scalar_type() == at::kBFloat16)
    prefill_rows<uint16_t>(qf, c, kvh, table.data_ptr<int64_t>(), start, static_cast<float>(scale), out);
  else
    prefill_rows<float>(qf, c, kvh, table.data_ptr<int64_t>(), start, static_cast<float>(scale), out);
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY(splitserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int start, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
}
