// The output head's rescoring (proxy/engine/precision.py rescore_in_fp32) first finds, per row of
// approximate logits, the largest value and then every token at or above a line below it (the
// tokens that could hold the row's largest float32 logit). As torch operations that is a topk of 64
// and, for a row with more candidates than that (the median row of the embedded model has ~300),
// a copy of the row, a comparison and a nonzero: ~0.8 ms for one row of 262144, ~6 ms for 16.
// Here each is one pass over the row, the rows shared among the threads; both are comparisons
// only, so their results are exact whatever the order.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Mask __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline bool any(Mask m) {
  int32_t bits = 0;
  for (int64_t l = 0; l < kLanes; ++l) bits |= m[l];
  return bits != 0;
}

// The row's largest value and the first index holding it; a NaN counts as the largest (as torch's
// topk and max take it), the first NaN then.
void row_top(const float* row, int64_t width, float* top, int64_t* leader) {
  Lanes best;  // lane-wise maxima (a NaN never replaces one: it is noted apart)
  for (int64_t l = 0; l < kLanes; ++l) best[l] = -INFINITY;
  int64_t i = 0;
  bool nan = false;
  for (; i + kLanes <= width; i += kLanes) {
    const Lanes v = load(row + i);
    nan |= any(v != v);
    best = best < v ? v : best;
  }
  float largest = -INFINITY;
  for (int64_t l = 0; l < kLanes; ++l) largest = best[l] > largest ? best[l] : largest;
  for (; i < width; ++i) {
    nan |= std::isnan(row[i]);
    largest = row[i] > largest ? row[i] : largest;
  }
  for (int64_t j = 0; j < width; ++j) {
    if (nan ? std::isnan(row[j]) : row[j] == largest) {
      *top = row[j];
      *leader = j;
      return;
    }
  }
  *top = largest;  // a row of -inf (or an empty one)
  *leader = 0;
}

// Appends every j with row[j] >= line (none for a NaN line).
void at_or_above_row(const float* row, int64_t width, float line, std::vector<int64_t>& cols) {
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const Lanes v = load(row + i);
    if (!any(v >= line)) continue;  // most chunks: nothing
    for (int64_t l = 0; l < kLanes; ++l)
      if (row[i + l] >= line) cols.push_back(i + l);
  }
  for (; i < width; ++i)
    if (row[i] >= line) cols.push_back(i);
}

void check_scores(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous() &&
                  scores.device().is_cpu() && scores.size(1) > 0,
              "scores must be a contiguous float32 [n, V] CPU tensor with V >= 1");
}

}  // namespace

// scores [n, V] -> (top [n, 1] float32, leader [n, 1] int64): each row's largest value, its first index.
std::vector<at::Tensor> row_tops(const at::Tensor& scores) {
  check_scores(scores);
  const int64_t n = scores.size(0), width = scores.size(1);
  at::Tensor top = at::empty({n, 1}, scores.options());
  at::Tensor leader = at::empty({n, 1}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  float* t = top.data_ptr<float>();
  int64_t* l = leader.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) row_top(s + row * width, width, t + row, l + row);
  });
  return {top, leader};
}

// scores [n, V], line [n] -> (rows [c], cols [c]) int64: every (row, token) with scores >= line[row],
// in row order and within a row in token order.
std::vector<at::Tensor> at_or_above(const at::Tensor& scores, const at::Tensor& line) {
  check_scores(scores);
  const int64_t n = scores.size(0), width = scores.size(1);
  TORCH_CHECK(line.dim() == 1 && line.size(0) == n && line.scalar_type() == at::kFloat && line.is_contiguous(),
              "line must be a contiguous float32 [n] tensor, one value per row of scores");
  const float* s = scores.data_ptr<float>();
  const float* lines = line.data_ptr<float>();
  std::vector<std::vector<int64_t>> found(n);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) at_or_above_row(s + row * width, width, lines[row], found[row]);
  });
  int64_t total = 0;
  for (const auto& cols : found) total += static_cast<int64_t>(cols.size());
  at::Tensor rows = at::empty({total}, scores.options().dtype(at::kLong));
  at::Tensor cols = at::empty({total}, scores.options().dtype(at::kLong));
  int64_t* r = rows.data_ptr<int64_t>();
  int64_t* c = cols.data_ptr<int64_t>();
  for (int64_t row = 0, k = 0; row < n; ++row) {
    for (const int64_t col : found[row]) {
      r[k] = row;
      c[k] = col;
      ++k;
    }
  }
  return {rows, cols};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_tops", &row_tops, "Each row's largest value and the first index holding it");
  m.def("at_or_above", &at_or_above, "Every (row, index) at or above its row's line");
}
