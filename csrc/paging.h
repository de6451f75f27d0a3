// Shared by the ops: where a token lies in a paged cache, index reading, and the
// logits of a group of query heads over one sequence of one-head pages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvpolicy {

// kvpolicy_triton's PageGeometry.addressing(), in its order (7 ints: keys only; 10: keys and values).
// Element (page p, token t, dim d) of K lies at
//   (p / heads_per_block) * block_stride + (p % heads_per_block) * head_stride + k_offset
//     + t * k_token_stride + d * k_dim_stride
// in the cache's flat storage, counted from its first element (data_ptr).
struct Addressing {
  int64_t block_size, heads_per_block, block_stride, head_stride;
  int64_t k_offset, k_token_stride, k_dim_stride;
  int64_t v_offset = 0, v_token_stride = 0, v_dim_stride = 0;

  explicit Addressing(const std::vector<int64_t>& a) {
    TORCH_CHECK(a.size() == 7 || a.size() == 10, "page addressing takes 7 or 10 ints (PageGeometry.addressing()), got ", a.size());
    block_size = a[0], heads_per_block = a[1], block_stride = a[2], head_stride = a[3];
    k_offset = a[4], k_token_stride = a[5], k_dim_stride = a[6];
    if (a.size() == 10) v_offset = a[7], v_token_stride = a[8], v_dim_stride = a[9];
  }

  int64_t page_base(int64_t page) const {
    return (page / heads_per_block) * block_stride + (page % heads_per_block) * head_stride;
  }
  int64_t key(int64_t slot) const {
    return page_base(slot / block_size) + k_offset + (slot % block_size) * k_token_stride;
  }
  int64_t value(int64_t slot) const {
    return page_base(slot / block_size) + v_offset + (slot % block_size) * v_token_stride;
  }
};

// An index tensor (int32 or int64, CPU) as contiguous int64.
inline at::Tensor index_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64");
  return t.to(at::kLong).contiguous();
}

inline void check_cache(const at::Tensor& cache) {
  TORCH_CHECK(cache.device().is_cpu(), "kvpolicy's C++ ops take CPU caches; on a GPU the Triton ops serve");
}

// Tokens per tile of sequence_logits' unit-stride path for HEADS query heads: the tile's sums stay
// in registers (AVX-512: 3 x 128 floats in 24 of its 32 registers, 4 x 64 in 16).
template <int HEADS>
constexpr int64_t token_tile() {
#ifdef __AVX512F__
  return HEADS <= 3 ? 128 : 64;
#else
  return 64;
#endif
}

// logits[g * n + t] = q[g] . K(token t) for HEADS query heads and `count` tokens whose K rows
// start at `keys` with unit token stride (dim d of token t at keys[d * dim_stride + t]). Each
// key is read once for all HEADS heads and each logit stored once; dims are added in order.
// A full tile (count == token_tile) is one vector loop per dim and head, and prefetches the same
// tile of the next page (`next`, or nullptr) dim by dim, so its keys arrive while these add up.
template <int HEADS, typename scalar_t>
inline void tile_logits(const scalar_t* keys, const scalar_t* next, int64_t dim_stride, int64_t count, const float* q,
                        int64_t dim, float* logits, int64_t n) {
  constexpr int64_t kTile = token_tile<HEADS>();
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  float acc[HEADS][kTile] = {};
  if (count == kTile) {
    for (int64_t d = 0; d < dim; ++d) {
      const scalar_t* k = keys + d * dim_stride;
      if (next != nullptr)
        for (int64_t t = 0; t < kTile; t += kLine) __builtin_prefetch(next + d * dim_stride + t);
      for (int g = 0; g < HEADS; ++g) {
        const float qd = q[g * dim + d];
#pragma omp simd
        for (int64_t t = 0; t < kTile; ++t) acc[g][t] += qd * static_cast<float>(k[t]);
      }
    }
  } else {
    for (int64_t d = 0; d < dim; ++d) {
      const scalar_t* k = keys + d * dim_stride;
      for (int g = 0; g < HEADS; ++g) {
        const float qd = q[g * dim + d];
        for (int64_t t = 0; t < count; ++t) acc[g][t] += qd * static_cast<float>(k[t]);
      }
    }
  }
  for (int g = 0; g < HEADS; ++g) std::copy(acc[g], acc[g] + count, logits + g * n);
}

// tile_logits over the first `count` tokens of one page, tile by tile (`next`: the next page's
// keys, or nullptr).
template <int HEADS, typename scalar_t>
inline void page_logits(const scalar_t* keys, const scalar_t* next, int64_t dim_stride, int64_t count, const float* q,
                        int64_t dim, float* logits, int64_t n) {
  constexpr int64_t kTile = token_tile<HEADS>();
  for (int64_t t0 = 0; t0 < count; t0 += kTile) {
    const scalar_t* next_tile = next == nullptr ? nullptr : next + t0;
    tile_logits<HEADS>(keys + t0, next_tile, dim_stride, std::min(kTile, count - t0), q, dim, logits + t0, n);
  }
}

// logits[g * n + i] = scale * q[g] . K(token i), for the first n tokens of a sequence whose
// pages are pages[0..]; q is [group, dim] float (already scaled). Dims are added in order, from
// 0, on both paths. A page whose tokens are adjacent for each dim (vLLM's CPU vec pages store K
// transposed) is read in register tiles (token_tile), up to 4 query heads at a time, while the
// next page's keys are prefetched (a sequence's pages lie anywhere in the cache); any other page
// token by token. With whole-page tiles and the prefetch, OmniKV's page scores at batch 4 and
// 7,600 tokens take 0.60 ms where 64-token tiles without it took 0.95 (two threads, an AMD EPYC).
template <typename scalar_t>
void sequence_logits(const scalar_t* cache, const Addressing& a, const int64_t* pages, int64_t n,
                     const float* q, int64_t group, int64_t dim, float* logits) {
  const int64_t bs = a.block_size;
  if (a.k_token_stride == 1) {
    for (int64_t start = 0; start < n; start += bs) {
      const int64_t in_page = std::min(bs, n - start);
      const scalar_t* page = cache + a.page_base(pages[start / bs]) + a.k_offset;
      const scalar_t* next = start + bs < n ? cache + a.page_base(pages[start / bs + 1]) + a.k_offset : nullptr;
      for (int64_t g = 0; g < group; g += 4) {
        const float* qg = q + g * dim;
        float* out = logits + g * n + start;
        switch (std::min<int64_t>(4, group - g)) {
          case 1: page_logits<1>(page, next, a.k_dim_stride, in_page, qg, dim, out, n); break;
          case 2: page_logits<2>(page, next, a.k_dim_stride, in_page, qg, dim, out, n); break;
          case 3: page_logits<3>(page, next, a.k_dim_stride, in_page, qg, dim, out, n); break;
          default: page_logits<4>(page, next, a.k_dim_stride, in_page, qg, dim, out, n); break;
        }
      }
    }
    return;
  }
  std::fill(logits, logits + group * n, 0.0f);
  for (int64_t start = 0; start < n; start += bs) {
    const int64_t count = std::min(bs, n - start);
    const scalar_t* page = cache + a.page_base(pages[start / bs]) + a.k_offset;
    for (int64_t d = 0; d < dim; ++d) {
      const scalar_t* column = page + d * a.k_dim_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float qd = q[g * dim + d];
        float* out = logits + g * n + start;
        for (int64_t t = 0; t < count; ++t) out[t] += qd * static_cast<float>(column[t * a.k_token_stride]);
      }
    }
  }
}

// acc[g * dim + d] += sum_t w[g * w_stride + t] * x(t, d) for g < group, t < count, where x(t, d) lies at
// rows[t * token_stride + d * dim_stride]: tokens innermost when they are adjacent (a K half of vLLM's CPU
// vec page), dims innermost otherwise.
template <typename scalar_t>
inline void add_weighted_rows(const scalar_t* rows, int64_t token_stride, int64_t dim_stride, int64_t count,
                              const float* w, int64_t w_stride, int64_t group, int64_t dim, float* acc) {
  if (token_stride == 1) {
    for (int64_t d = 0; d < dim; ++d) {
      const scalar_t* column = rows + d * dim_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* weights = w + g * w_stride;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < count; ++t) sum += weights[t] * static_cast<float>(column[t]);
        acc[g * dim + d] += sum;
      }
    }
    return;
  }
  for (int64_t t = 0; t < count; ++t) {
    const scalar_t* row = rows + t * token_stride;
    for (int64_t g = 0; g < group; ++g) {
      const float weight = w[g * w_stride + t];
      float* out = acc + g * dim;
      if (dim_stride == 1) {
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] += weight * static_cast<float>(row[d]);
      } else {
        for (int64_t d = 0; d < dim; ++d) out[d] += weight * static_cast<float>(row[d * dim_stride]);
      }
    }
  }
}

// acc[g * DIM + d] += sum_t w[g * w_stride + t] * V(t, d) for HEADS heads and `count` tokens whose V rows
// lie `token_stride` apart with adjacent dims (vLLM's CPU vec pages): the HEADS x DIM sums stay in
// registers over the page, each value row read once for all heads, and tokens are added in the order
// add_weighted_rows adds them; `next` (or nullptr): the next page's values, prefetched row by row.
template <int HEADS, int DIM, typename scalar_t>
inline void page_weighted_values(const scalar_t* rows, const scalar_t* next, int64_t token_stride, int64_t count,
                                 const float* w, int64_t w_stride, float* acc) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  float sums[HEADS][DIM];
  for (int g = 0; g < HEADS; ++g) std::copy(acc + g * DIM, acc + (g + 1) * DIM, sums[g]);
  for (int64_t t = 0; t < count; ++t) {
    const scalar_t* row = rows + t * token_stride;
    if (next != nullptr)
      for (int64_t d = 0; d < DIM; d += kLine) __builtin_prefetch(next + t * token_stride + d);
    for (int g = 0; g < HEADS; ++g) {
      const float weight = w[g * w_stride + t];
#pragma omp simd
      for (int64_t d = 0; d < DIM; ++d) sums[g][d] += weight * static_cast<float>(row[d]);
    }
  }
  for (int g = 0; g < HEADS; ++g) std::copy(sums[g], sums[g] + DIM, acc + g * DIM);
}

// acc[g * dim + d] += sum_i w[g * n + i] * V(token i, d) over the first n tokens of a sequence on pages
// pages[0..]: the weighted values of `group` query heads. Pages with adjacent dims and 64 or 128 of them
// go through page_weighted_values (up to 4 or 2 heads at a time), any other through add_weighted_rows.
template <typename scalar_t>
void sequence_values(const scalar_t* cache, const Addressing& a, const int64_t* pages, int64_t n, const float* w,
                     int64_t group, int64_t dim, float* acc) {
  const int64_t bs = a.block_size;
  const bool registers = a.v_dim_stride == 1 && (dim == 64 || dim == 128);
  for (int64_t start = 0; start < n; start += bs) {
    const int64_t count = std::min(bs, n - start);
    const scalar_t* page = cache + a.page_base(pages[start / bs]) + a.v_offset;
    if (!registers) {
      add_weighted_rows(page, a.v_token_stride, a.v_dim_stride, count, w + start, n, group, dim, acc);
      continue;
    }
    const scalar_t* next = start + bs < n ? cache + a.page_base(pages[start / bs + 1]) + a.v_offset : nullptr;
    const int64_t chunk = dim == 64 ? 4 : 2;
    for (int64_t g = 0; g < group; g += chunk) {
      const float* wg = w + g * n + start;
      float* out = acc + g * dim;
      const int64_t heads = std::min(chunk, group - g);
      const int64_t ts = a.v_token_stride;
      if (dim == 64) {
        switch (heads) {
          case 1: page_weighted_values<1, 64>(page, next, ts, count, wg, n, out); break;
          case 2: page_weighted_values<2, 64>(page, next, ts, count, wg, n, out); break;
          case 3: page_weighted_values<3, 64>(page, next, ts, count, wg, n, out); break;
          default: page_weighted_values<4, 64>(page, next, ts, count, wg, n, out); break;
        }
      } else if (heads == 1) {
        page_weighted_values<1, 128>(page, next, ts, count, wg, n, out);
      } else {
        page_weighted_values<2, 128>(page, next, ts, count, wg, n, out);
      }
    }
  }
}

// In place: each of `rows` rows of n logits becomes its softmax (float32, max subtracted).
inline void softmax_rows(float* x, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) top = std::max(top, row[i]);
    float total = 0.0f;  // a plain loop: with -ffast-math GCC vectorizes it and calls libmvec's expf
    for (int64_t i = 0; i < n; ++i) {
      const float e = std::exp(row[i] - top);
      row[i] = e;
      total += e;
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] *= inv;
  }
}

// Heads [first, first + group) of a query token, times scale, [group, dim]; query: float32 [T, heads, dim].
inline void scaled_query(const at::Tensor& query, int64_t token, int64_t first, int64_t group, double scale, float* out) {
  const int64_t dim = query.size(2);
  const auto* base = query.data_ptr<float>();
  const auto st = query.stride(0), sh = query.stride(1), sd = query.stride(2);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d)
      out[g * dim + d] = base[token * st + (first + g) * sh + d * sd] * static_cast<float>(scale);
}

}  // namespace kvpolicy

// The cache's element type as scalar_t: float32, bfloat16 or float16.
#define KVPOLICY_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, TYPE, NAME, __VA_ARGS__)

