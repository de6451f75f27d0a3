// Token moves for relocation and eviction passes: K and V rows by slot, through the
// page addressing (so vLLM's CPU pages, K transposed inside, are read and written exactly).
#include "paging.h"

#include <ATen/Parallel.h>

namespace kvpolicy {
namespace {

template <typename scalar_t>
void copy_rows(scalar_t* dst, int64_t dst_stride, const scalar_t* src, int64_t src_stride, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d * dst_stride] = src[d * src_stride];
}

// The rows of K (value = false) or V at slots, into rows [n, dim] (contiguous).
template <typename scalar_t>
void gather_half(const scalar_t* kv, const Addressing& a, const int64_t* slots, int64_t n, int64_t dim, bool value, scalar_t* rows) {
  const int64_t dim_stride = value ? a.v_dim_stride : a.k_dim_stride;
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      copy_rows(rows + i * dim, 1, kv + (value ? a.value(slots[i]) : a.key(slots[i])), dim_stride, dim);
  });
}

template <typename scalar_t>
void scatter_half(scalar_t* kv, const Addressing& a, const int64_t* slots, int64_t n, int64_t dim, bool value, const scalar_t* rows) {
  const int64_t dim_stride = value ? a.v_dim_stride : a.k_dim_stride;
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      copy_rows(kv + (value ? a.value(slots[i]) : a.key(slots[i])), dim_stride, rows + i * dim, 1, dim);
  });
}

Addressing with_values(const std::vector<int64_t>& addressing) {
  TORCH_CHECK(addressing.size() == 10, "token moves need K and V addressing (10 ints)");
  return Addressing(addressing);
}

}  // namespace

std::vector<at::Tensor> gather_tokens(const at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim,
                                      const at::Tensor& slots) {
  check_cache(cache);
  const auto a = with_values(addressing);
  const auto at_slots = index_of(slots, "slots");
  const int64_t n = at_slots.numel();
  auto keys = at::empty({n, dim}, cache.options()), values = at::empty({n, dim}, cache.options());
  KVPOLICY_DISPATCH(cache.scalar_type(), "gather_tokens", [&] {
    const auto* kv = cache.data_ptr<scalar_t>();
    gather_half(kv, a, at_slots.data_ptr<int64_t>(), n, dim, false, keys.data_ptr<scalar_t>());
    gather_half(kv, a, at_slots.data_ptr<int64_t>(), n, dim, true, values.data_ptr<scalar_t>());
  });
  return {keys, values};
}

at::Tensor gather_values(const at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim,
                         const at::Tensor& slots) {
  check_cache(cache);
  const auto a = with_values(addressing);
  const auto at_slots = index_of(slots, "slots");
  const int64_t n = at_slots.numel();
  auto values = at::empty({n, dim}, cache.options());
  KVPOLICY_DISPATCH(cache.scalar_type(), "gather_values", [&] {
    gather_half(cache.data_ptr<scalar_t>(), a, at_slots.data_ptr<int64_t>(), n, dim, true, values.data_ptr<scalar_t>());
  });
  return values;
}

void scatter_tokens(at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim, const at::Tensor& slots,
                    const at::Tensor& keys, const at::Tensor& values) {
  check_cache(cache);
  const auto a = with_values(addressing);
  const auto at_slots = index_of(slots, "slots");
  const int64_t n = at_slots.numel();
  TORCH_CHECK(keys.numel() == n * dim && values.numel() == n * dim, "keys and values [n, head_size] expected, one row per slot");
  const auto k = keys.to(cache.scalar_type()).contiguous(), v = values.to(cache.scalar_type()).contiguous();
  KVPOLICY_DISPATCH(cache.scalar_type(), "scatter_tokens", [&] {
    auto* kv = cache.data_ptr<scalar_t>();
    scatter_half(kv, a, at_slots.data_ptr<int64_t>(), n, dim, false, k.data_ptr<scalar_t>());
    scatter_half(kv, a, at_slots.data_ptr<int64_t>(), n, dim, true, v.data_ptr<scalar_t>());
  });
}

// Every source is read before any destination is written, so sources and destinations may overlap.
void move_tokens(at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim, const at::Tensor& src,
                 const at::Tensor& dst) {
  TORCH_CHECK(src.numel() == dst.numel(), "one destination per source expected");
  const auto rows = gather_tokens(cache, addressing, dim, src);
  scatter_tokens(cache, addressing, dim, dst, rows[0], rows[1]);
}

}  // namespace kvpolicy
