// OmniKV's filter layer: each context page's score, the sum over its tokens of the max over
// all query heads of the row's last query's softmax weights, read from the row's pages in place;
// with context_attention, also the attention output those weights make with the values, so a
// filter layer reads its keys once for both (vLLM's kernel returns no weights).
//
// One task per (row, KV head) computes each token's max over that KV head's G query heads (and
// its G output rows); one task per row then takes each token's max over its KV heads and sums
// them page by page (in double, as the torch reference sums). The page choice stays on the host
// (kvpolicy.policies.omnikv.PageChoice): it works on rows x pages, not on keys.
#include "paging.h"

#include <ATen/Parallel.h>

namespace kvpolicy {
namespace {

// The page scores [rows, pages] float64; with `result` ([rows, kv_heads * G, dim] float32), the
// attention output of each row's query heads too.
at::Tensor score_pages(const at::Tensor& query, const at::Tensor& cache, const Addressing& a, const at::Tensor& token_idx,
                       const at::Tensor& page_ids, const at::Tensor& lengths, double scale, float* result) {
  check_cache(cache);
  const auto tokens = index_of(token_idx, "token_idx"), ids = index_of(page_ids, "page_ids");
  const auto counts = index_of(lengths, "lengths");
  TORCH_CHECK(ids.dim() == 3, "page_ids [rows, kv_heads, pages] expected");
  const int64_t rows = ids.size(0), kv_heads = ids.size(1), pages = ids.size(2), dim = query.size(2);
  const int64_t group = query.size(1) / kv_heads, bs = a.block_size, width = pages * bs;
  TORCH_CHECK(counts.numel() == rows && tokens.numel() == rows, "one query token and one length per row expected");
  TORCH_CHECK(rows == 0 || counts.max().item<int64_t>() <= width, "a row is longer than its pages");
  auto per_head = at::zeros({rows, kv_heads, width}, at::kFloat);
  const auto q_float = query.to(at::kFloat);
  KVPOLICY_DISPATCH(cache.scalar_type(), "context_page_scores", [&] {
    const auto* kv = cache.data_ptr<scalar_t>();
    at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(group * dim), logits;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, h = task % kv_heads, n = counts.data_ptr<int64_t>()[b];
        const int64_t* row_pages = ids.data_ptr<int64_t>() + task * pages;
        scaled_query(q_float, tokens.data_ptr<int64_t>()[b], h * group, group, scale, q.data());
        logits.resize(group * n);
        sequence_logits(kv, a, row_pages, n, q.data(), group, dim, logits.data());
        softmax_rows(logits.data(), group, n);
        if (result != nullptr) {
          float* acc = result + task * group * dim;
          std::fill(acc, acc + group * dim, 0.0f);
          sequence_values(kv, a, row_pages, n, logits.data(), group, dim, acc);
        }
        float* best = per_head.data_ptr<float>() + task * width;
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < n; ++i) best[i] = std::max(best[i], logits[g * n + i]);
      }
    });
  });
  auto out = at::empty({rows, pages}, at::kDouble);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* heads = per_head.data_ptr<float>() + b * kv_heads * width;
      double* page_scores = out.data_ptr<double>() + b * pages;
      for (int64_t p = 0; p < pages; ++p) {
        double sum = 0.0;
        for (int64_t i = p * bs; i < (p + 1) * bs; ++i) {
          float top = heads[i];
          for (int64_t h = 1; h < kv_heads; ++h) top = std::max(top, heads[h * width + i]);
          sum += top;
        }
        page_scores[p] = sum;
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor context_page_scores(const at::Tensor& query, const at::Tensor& cache, const std::vector<int64_t>& addressing,
                               const at::Tensor& token_idx, const at::Tensor& page_ids, const at::Tensor& lengths,
                               double scale) {
  return score_pages(query, cache, Addressing(addressing), token_idx, page_ids, lengths, scale, nullptr);
}

at::Tensor context_attention(const at::Tensor& query, at::Tensor& out, const at::Tensor& cache,
                             const std::vector<int64_t>& addressing, const at::Tensor& token_idx,
                             const at::Tensor& page_ids, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(addressing.size() == 10, "context_attention reads K and V (10 addressing ints)");
  auto result = at::empty({token_idx.numel(), query.size(1), query.size(2)}, at::kFloat);
  auto scores = score_pages(query, cache, Addressing(addressing), token_idx, page_ids, lengths, scale,
                            result.data_ptr<float>());
  out.index_put_({index_of(token_idx, "token_idx")}, result.to(out.scalar_type()));
  return scores;
}

}  // namespace kvpolicy
