// H2O / D2O prompt scores: column sums of each query head's causal softmax attention, and
// optionally the attention output itself, so a prompt's QK^T is computed once for both.
//
// One task per (query head, tile of kTile queries), spread over torch's threads. A task
// multiplies its tile by the keys up to its last query (one single-threaded GEMM: inside
// at::parallel_for ATen runs it on the calling thread), turns each row into its softmax
// in place while the tile is in cache, adds the rows into its thread's column sums and,
// given values, multiplies the tile by them into the output rows. Memory: a kTile x
// length buffer per thread and one float64 row of sums per (thread, query head); never
// the length x length matrix.
#include "paging.h"

#include <ATen/Parallel.h>

#include <optional>

namespace kvpolicy {
namespace {
constexpr int64_t kTile = 32;  // queries per task

// Column sums [q_heads, length] float64; writes the attention into ``out`` [q_heads, count, dim] when given values.
at::Tensor column_sums(const at::Tensor& keys, const at::Tensor& queries, double scale,
                       const std::optional<at::Tensor>& values, at::Tensor* out) {
  TORCH_CHECK(keys.device().is_cpu() && queries.device().is_cpu(), "attention_column_sums takes CPU tensors");
  TORCH_CHECK(keys.dim() == 3 && queries.dim() == 3 && keys.size(2) == queries.size(2),
              "keys [kv_heads, length, dim] and queries [q_heads, count, dim] expected");
  const int64_t kv_heads = keys.size(0), length = keys.size(1), dim = keys.size(2);
  const int64_t q_heads = queries.size(0), count = queries.size(1);
  TORCH_CHECK(q_heads % kv_heads == 0, "query heads (", q_heads, ") must be a multiple of KV heads (", kv_heads, ")");
  TORCH_CHECK(count <= length, "more queries (", count, ") than keys (", length, ")");
  if (values) TORCH_CHECK(values->sizes() == keys.sizes(), "values must have the keys' shape [kv_heads, length, dim]");
  const int64_t group = q_heads / kv_heads, first = length - count;
  const auto kt = keys.to(at::kFloat).transpose(1, 2).contiguous();  // [kv_heads, dim, length]
  const auto q = (queries.to(at::kFloat) * scale).contiguous();     // [q_heads, count, dim]
  const auto v = values ? values->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t tiles = (count + kTile - 1) / kTile;
  auto partial = at::zeros({at::get_num_threads(), q_heads, length}, at::kDouble);
  double* partial_data = partial.data_ptr<double>();

  // Head-major tasks: each thread's contiguous range holds whole heads, so the causal
  // triangle's uneven tiles balance out.
  at::parallel_for(0, q_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    auto scores = at::empty({kTile, length}, at::kFloat);
    std::vector<float> column(length);
    double* sums_of_thread = partial_data + at::get_thread_num() * q_heads * length;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / tiles, row0 = (task % tiles) * kTile;
      const int64_t rows = std::min(kTile, count - row0);
      const int64_t span = first + row0 + rows;  // keys any query of the tile sees
      auto tile = scores.narrow(0, 0, rows).narrow(1, 0, span);
      at::mm_out(tile, q[head].narrow(0, row0, rows), kt[head / group].narrow(1, 0, span));
      std::fill(column.begin(), column.begin() + span, 0.0f);
      float* col = column.data();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t seen = first + row0 + r + 1;  // causal: keys up to the query's position
        float* row = scores.data_ptr<float>() + r * length;
        softmax_rows(row, 1, seen);
        for (int64_t j = 0; j < seen; ++j) col[j] += row[j];
        std::fill(row + seen, row + span, 0.0f);  // keys after the query get no weight
      }
      double* sums = sums_of_thread + head * length;
      for (int64_t j = 0; j < span; ++j) sums[j] += col[j];
      if (out) {
        auto rows_out = (*out)[head].narrow(0, row0, rows);
        at::mm_out(rows_out, tile, v[head / group].narrow(0, 0, span));
      }
    }
  });
  return partial.sum(0);
}
}  // namespace

at::Tensor attention_column_sums(const at::Tensor& keys, const at::Tensor& queries, double scale) {
  return column_sums(keys, queries, scale, std::nullopt, nullptr);
}

std::vector<at::Tensor> prompt_attention(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& queries,
                                         double scale) {
  auto out = at::empty({queries.size(0), queries.size(1), keys.size(2)}, at::kFloat);
  auto sums = column_sums(keys, queries, scale, values, &out);
  return {out, sums};
}

}  // namespace kvpolicy
