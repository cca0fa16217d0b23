// RMSNorm of each row on its own, in one call: out = x * (1 / sqrt(mean(x^2) + eps)) * (offset + w)
// (offset 1 for Gemma's "1 + weight", 0 for Llama's "weight"). Used by the batch-invariant int8
// precision (proxy/engine/invariant_norm.py), where a row's bits must not depend on the other rows
// of the pass: the sum of squares runs over the row in one fixed order (16 lanes, then a fixed
// tree), whatever the row count. As torch operations a norm is ~8 calls and ~30 us for one row of
// the embedded model; it runs 109 times a step.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t LANES = 16;

// The sum of x[i]^2 over one row: lane l sums i = l, l + 16, ... in order, then the lanes pair up
// (0+8, 1+9, ... then 0+4, ...), then the tail past the last whole 16 adds in order. A fixed
// order that the compiler may vectorise but not reorder (-ffp-contract=off, no -ffast-math).
float sum_of_squares(const float* x, int64_t d) {
  float lane[LANES] = {0.0f};
  const int64_t whole = d - d % LANES;
  for (int64_t i = 0; i < whole; i += LANES) {
    for (int64_t l = 0; l < LANES; ++l) lane[l] += x[i + l] * x[i + l];
  }
  for (int64_t width = LANES / 2; width >= 1; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  }
  float total = lane[0];
  for (int64_t i = whole; i < d; ++i) total += x[i] * x[i];
  return total;
}

}  // namespace

// x [n, d] float32 contiguous, weight [d] float32 -> [n, d].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 [n, d] CPU tensor");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.scalar_type() == at::kFloat
              && weight.is_contiguous(), "weight must be a contiguous float32 [", d, "] tensor");
  at::Tensor out = at::empty_like(x);
  const float* x_data = x.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps), count = static_cast<float>(d);
  const float shift = static_cast<float>(offset);
  // Rows are independent: splitting them among threads cannot change any row's bits.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* r = x_data + row * d;
      float* o = out_data + row * d;
      const float inverse = 1.0f / std::sqrt(sum_of_squares(r, d) / count + epsilon);
      for (int64_t i = 0; i < d; ++i) o[i] = (r[i] * inverse) * (shift + w_data[i]);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "row-invariant RMSNorm of float32 rows");
}
