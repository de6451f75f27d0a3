// H2O / D2O in decode: each new token's softmax weights over its KV head's pages, read in place.
//
// One task per sequence (one KV head of one request): the logits of its G query heads over
// its pages (paging.h), a softmax per head, then their mean. No copy of the keys is made.
#include "paging.h"

#include <ATen/Parallel.h>

namespace kvpolicy {

at::Tensor new_token_weights(const at::Tensor& query, const at::Tensor& cache, const std::vector<int64_t>& addressing,
                             const at::Tensor& token_of, const at::Tensor& head_of, const at::Tensor& page_table,
                             const at::Tensor& seq_lens, double scale, int64_t num_kv_heads) {
  check_cache(cache);
  const Addressing a(addressing);
  const auto tokens = index_of(token_of, "token_of"), heads = index_of(head_of, "head_of");
  const auto table = index_of(page_table, "page_table"), lengths = index_of(seq_lens, "seq_lens");
  const int64_t seqs = tokens.numel(), pages = table.size(1), dim = query.size(2);
  const int64_t group = query.size(1) / num_kv_heads;
  TORCH_CHECK(lengths.numel() == seqs && heads.numel() == seqs && table.size(0) == seqs, "one row per sequence expected");
  TORCH_CHECK(lengths.numel() == 0 || lengths.max().item<int64_t>() <= pages * a.block_size, "a sequence is longer than its pages");
  auto out = at::zeros({seqs, pages * a.block_size}, at::kFloat);
  const auto q_float = query.to(at::kFloat);
  KVPOLICY_DISPATCH(cache.scalar_type(), "new_token_weights", [&] {
    const auto* kv = cache.data_ptr<scalar_t>();
    at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(group * dim), logits;
      for (int64_t s = begin; s < end; ++s) {
        const int64_t n = lengths.data_ptr<int64_t>()[s];
        scaled_query(q_float, tokens.data_ptr<int64_t>()[s], heads.data_ptr<int64_t>()[s] * group, group, scale, q.data());
        logits.resize(group * n);
        sequence_logits(kv, a, table.data_ptr<int64_t>() + s * pages, n, q.data(), group, dim, logits.data());
        softmax_rows(logits.data(), group, n);
        float* row = out.data_ptr<float>() + s * pages * a.block_size;
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < n; ++i) row[i] += logits[g * n + i];
        for (int64_t i = 0; i < n; ++i) row[i] /= static_cast<float>(group);
      }
    });
  });
  return out;
}

}  // namespace kvpolicy
