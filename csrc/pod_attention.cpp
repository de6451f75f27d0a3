// PoD's decode attention (eq. 3-4), read in place: kvpolicy_triton's pod_attention on CPU.
//
// One task per sequence (one KV head of one decode row in one layer): the logits of its G
// query heads over its own pages (paging.h), their exponentials and the weighted sum of its
// own values; a lowest layer stores its distant logits for the layers above. A sharing layer
// then takes the shared distant logits, decides per head whether the gate skips them, and adds
// its own distant values, packed two per slot, weighted by them: one softmax over both groups.
#include "paging.h"

#include <ATen/Parallel.h>

namespace kvpolicy {
namespace {

// In place: each of `rows` rows of n logits becomes exp(x - max); returns through top/total the row's
// max and the sum of its exponentials (max -inf and sum 0 for an empty row).
inline void exp_rows(float* x, int64_t rows, int64_t n, float* top, float* total) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    float best = -INFINITY;
    for (int64_t i = 0; i < n; ++i) best = std::max(best, row[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float e = std::exp(row[i] - best);
      row[i] = e;
      sum += e;
    }
    top[r] = best, total[r] = sum;
  }
}

// What one sequence reads: its index rows and the shared logits' buffer.
struct Sequences {
  const int64_t *token_of, *head_of, *page_table, *seq_lens, *value_table;
  const int64_t *distant_start, *distant_count, *read_from, *write_to;
  int64_t pages, value_pages;
  float* logits;
  int64_t logits_row, logits_head;
};

template <typename scalar_t>
void attend_sequence(const scalar_t* kv, const Addressing& a, const Sequences& in, int64_t s, const float* q,
                     int64_t group, int64_t dim, float tau, std::vector<float>& own, std::vector<float>& far,
                     std::vector<float>& stats, float* result, bool* skipped) {
  const int64_t n = in.seq_lens[s], bs = a.block_size;
  const int64_t start = in.distant_start[s], count = in.distant_count[s];
  const int64_t* pages = in.page_table + s * in.pages;
  own.resize(group * n);
  sequence_logits(kv, a, pages, n, q, group, dim, own.data());
  if (in.write_to[s] >= 0)
    for (int64_t g = 0; g < group; ++g)
      std::copy_n(own.data() + g * n + start, count, in.logits + in.write_to[s] * in.logits_row + g * in.logits_head);
  stats.assign(4 * group, 0.0f);
  float *near_top = stats.data(), *near_total = near_top + group, *far_top = near_total + group,
        *far_total = far_top + group;
  exp_rows(own.data(), group, n, near_top, near_total);
  std::fill(result, result + group * dim, 0.0f);
  sequence_values(kv, a, pages, n, own.data(), group, dim, result);
  const int64_t source = in.read_from[s];
  bool any = false;
  if (source >= 0 && count > 0) {
    far.resize(group * count);
    for (int64_t g = 0; g < group; ++g)
      std::copy_n(in.logits + source * in.logits_row + g * in.logits_head, count, far.data() + g * count);
    exp_rows(far.data(), group, count, far_top, far_total);
    for (int64_t g = 0; g < group; ++g) {
      const float top = std::max(near_top[g], far_top[g]);
      const float near = near_total[g] * std::exp(near_top[g] - top), distant = far_total[g] * std::exp(far_top[g] - top);
      skipped[g] = near / (near + distant) >= tau;
      any = any || !skipped[g];
    }
  }
  if (!any) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) result[g * dim + d] /= near_total[g];
    return;
  }
  // The distant values: pair j's slot holds value 2j in its K half and 2j + 1 in its V half, so each half
  // takes every other weight; de-interleave them once.
  const int64_t pairs = (count + 1) / 2;
  std::vector<float> even(group * pairs), odd(group * pairs, 0.0f), far_acc(group * dim, 0.0f);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < count; ++i) (i % 2 ? odd : even)[g * pairs + i / 2] = far[g * count + i];
  const int64_t* value_pages = in.value_table + s * in.value_pages;
  for (int64_t first = 0; first < pairs; first += bs) {
    const int64_t base = a.page_base(value_pages[first / bs]), rows = std::min(bs, pairs - first);
    add_weighted_rows(kv + base + a.k_offset, a.k_token_stride, a.k_dim_stride, rows, even.data() + first, pairs,
                      group, dim, far_acc.data());
    add_weighted_rows(kv + base + a.v_offset, a.v_token_stride, a.v_dim_stride, rows, odd.data() + first, pairs,
                      group, dim, far_acc.data());
  }
  for (int64_t g = 0; g < group; ++g) {
    float* out = result + g * dim;
    if (skipped[g]) {
      for (int64_t d = 0; d < dim; ++d) out[d] /= near_total[g];
      continue;
    }
    const float top = std::max(near_top[g], far_top[g]);
    const float near = std::exp(near_top[g] - top), distant = std::exp(far_top[g] - top);
    const float inv = 1.0f / (near_total[g] * near + far_total[g] * distant);
    for (int64_t d = 0; d < dim; ++d) out[d] = (out[d] * near + far_acc[g * dim + d] * distant) * inv;
  }
}

}  // namespace

at::Tensor pod_attention(const at::Tensor& query, at::Tensor& out, const at::Tensor& cache,
                         const std::vector<int64_t>& addressing, const at::Tensor& token_of, const at::Tensor& head_of,
                         const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& value_table,
                         const at::Tensor& distant_start, const at::Tensor& distant_count, const at::Tensor& read_from,
                         const at::Tensor& write_to, at::Tensor& distant_logits, double scale, int64_t num_kv_heads,
                         double tau) {
  check_cache(cache);
  TORCH_CHECK(addressing.size() == 10, "pod_attention reads K and V (10 addressing ints)");
  const Addressing a(addressing);
  const auto tokens = index_of(token_of, "token_of"), heads = index_of(head_of, "head_of");
  const auto table = index_of(page_table, "page_table"), lengths = index_of(seq_lens, "seq_lens");
  const auto values = index_of(value_table, "value_table");
  const auto starts = index_of(distant_start, "distant_start"), counts = index_of(distant_count, "distant_count");
  const auto reads = index_of(read_from, "read_from"), writes = index_of(write_to, "write_to");
  const int64_t seqs = tokens.numel(), dim = query.size(2), group = query.size(1) / num_kv_heads;
  TORCH_CHECK(heads.numel() == seqs && table.size(0) == seqs && lengths.numel() == seqs && values.size(0) == seqs &&
                  starts.numel() == seqs && counts.numel() == seqs && reads.numel() == seqs && writes.numel() == seqs,
              "one row per sequence expected");
  TORCH_CHECK(distant_logits.scalar_type() == at::kFloat && distant_logits.dim() == 3 && distant_logits.stride(2) == 1 &&
                  distant_logits.size(1) == group,
              "distant_logits [rows, G, N] float32 expected, contiguous in its last dim");
  TORCH_CHECK(seqs == 0 || lengths.max().item<int64_t>() <= table.size(1) * a.block_size, "a sequence is longer than its pages");
  TORCH_CHECK(seqs == 0 || counts.max().item<int64_t>() <= distant_logits.size(2), "more distant tokens than distant_logits holds");
  auto skipped = at::zeros({seqs, group}, at::kBool);
  auto result = at::empty({seqs, group, dim}, at::kFloat);
  const auto q_float = query.to(at::kFloat);
  const Sequences in{tokens.data_ptr<int64_t>(), heads.data_ptr<int64_t>(), table.data_ptr<int64_t>(),
                     lengths.data_ptr<int64_t>(), values.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                     counts.data_ptr<int64_t>(), reads.data_ptr<int64_t>(), writes.data_ptr<int64_t>(),
                     table.size(1), values.size(1), distant_logits.data_ptr<float>(),
                     distant_logits.stride(0), distant_logits.stride(1)};
  const float gate = static_cast<float>(tau);
  KVPOLICY_DISPATCH(cache.scalar_type(), "pod_attention", [&] {
    const auto* kv = cache.data_ptr<scalar_t>();
    at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(group * dim), own, far, stats;
      for (int64_t s = begin; s < end; ++s) {
        scaled_query(q_float, in.token_of[s], in.head_of[s] * group, group, scale, q.data());
        attend_sequence(kv, a, in, s, q.data(), group, dim, gate, own, far, stats,
                        result.data_ptr<float>() + s * group * dim, skipped.data_ptr<bool>() + s * group);
      }
    });
  });
  out.unflatten(1, {num_kv_heads, group}).index_put_({tokens, heads}, result.to(out.scalar_type()));
  return skipped;
}

}  // namespace kvpolicy
