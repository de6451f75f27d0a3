// The Python module kvpolicy_csrc._C; kvpolicy_csrc/__init__.py documents each op.
#include <torch/extension.h>

#include "paging.h"

namespace kvpolicy {
at::Tensor attention_column_sums(const at::Tensor& keys, const at::Tensor& queries, double scale);
std::vector<at::Tensor> prompt_attention(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& queries,
                                         double scale);
at::Tensor new_token_weights(const at::Tensor& query, const at::Tensor& cache, const std::vector<int64_t>& addressing,
                             const at::Tensor& token_of, const at::Tensor& head_of, const at::Tensor& page_table,
                             const at::Tensor& seq_lens, double scale, int64_t num_kv_heads);
at::Tensor context_page_scores(const at::Tensor& query, const at::Tensor& cache, const std::vector<int64_t>& addressing,
                               const at::Tensor& token_idx, const at::Tensor& page_ids, const at::Tensor& lengths,
                               double scale);
at::Tensor context_attention(const at::Tensor& query, at::Tensor& out, const at::Tensor& cache,
                             const std::vector<int64_t>& addressing, const at::Tensor& token_idx,
                             const at::Tensor& page_ids, const at::Tensor& lengths, double scale);
std::vector<at::Tensor> gather_tokens(const at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim,
                                      const at::Tensor& slots);
at::Tensor gather_values(const at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim,
                         const at::Tensor& slots);
void scatter_tokens(at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim, const at::Tensor& slots,
                    const at::Tensor& keys, const at::Tensor& values);
at::Tensor pod_attention(const at::Tensor& query, at::Tensor& out, const at::Tensor& cache,
                         const std::vector<int64_t>& addressing, const at::Tensor& token_of, const at::Tensor& head_of,
                         const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& value_table,
                         const at::Tensor& distant_start, const at::Tensor& distant_count, const at::Tensor& read_from,
                         const at::Tensor& write_to, at::Tensor& distant_logits, double scale, int64_t num_kv_heads,
                         double tau);
void move_tokens(at::Tensor& cache, const std::vector<int64_t>& addressing, int64_t dim, const at::Tensor& src,
                 const at::Tensor& dst);
}  // namespace kvpolicy

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_column_sums", &kvpolicy::attention_column_sums);
  m.def("prompt_attention", &kvpolicy::prompt_attention);
  m.def("new_token_weights", &kvpolicy::new_token_weights);
  m.def("context_page_scores", &kvpolicy::context_page_scores);
  m.def("context_attention", &kvpolicy::context_attention);
  m.def("gather_tokens", &kvpolicy::gather_tokens);
  m.def("gather_values", &kvpolicy::gather_values);
  m.def("scatter_tokens", &kvpolicy::scatter_tokens);
  m.def("move_tokens", &kvpolicy::move_tokens);
  m.def("pod_attention", &kvpolicy::pod_attention);
}
