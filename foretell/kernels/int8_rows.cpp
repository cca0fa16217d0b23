// The int8 x int8 linear layer's work around FBGEMM's product (proxy/engine/invariant_linear.py),
// each in one call: quantizing every row to levels of small integers with its own scales, and
// scaling the integer sums back. The same arithmetic, operation for operation, as the torch code
// it replaces, so the bits are the same. As ~15 torch operations it cost ~25 us to quantize one
// row of 640 and ~10 us to scale back; one 1536 x 640 product takes 35 us with these calls against
// 64 without, ~2 ms a step over the 73 products of the embedded model.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
// Lowered to the CPU's vector width (one AVX-512 register, two AVX2 ones).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// max |r[i]| over a row, as std::max(largest, std::fabs(r[i])) from 0 gives it: a maximum is exact
// and the same in any order, so 16 lanes at a time give the same value (each lane keeps
// `largest < v ? v : largest`, std::max's rule, which skips a NaN as the scalar loop does). The
// scalar loop was the quantization's bottleneck: a chain of dependent maxima, one per element.
float largest_magnitude(const float* r, int64_t d) {
  Lanes lanes = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    Lanes v;
    std::memcpy(&v, r + i, sizeof v);
    v = v < 0.0f ? -v : v;  // |v| (-0.0 stays -0.0 here, and compares equal to 0: no effect)
    lanes = lanes < v ? v : lanes;
  }
  float largest = 0.0f;
  for (int64_t lane = 0; lane < kLanes; ++lane) largest = std::max(largest, lanes[lane]);
  for (; i < d; ++i) largest = std::max(largest, std::fabs(r[i]));
  return largest;
}

}  // namespace

// x [n, d] float32 -> (levels [L * n, d] integer-valued float32, scales [L, n, 1], residual [n, d]):
// per row and level, scale = max(max |r|, 1e-30) * (1 / 63), q = round(r / scale) (half to even),
// r = r + (-1 * q) * scale in one fused multiply-add, as torch's vector_norm(inf), clamp_, mul_,
// div, round_ and addcmul(value=-1) compute them (torch's CPU kernels for AVX2 and AVX-512 fuse
// addcmul's multiply and add: tested against them).
std::vector<at::Tensor> quantize_rows(const at::Tensor& x, int64_t levels, double activation_level) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 [n, d] CPU tensor");
  TORCH_CHECK(levels >= 1, "levels must be >= 1");
  const int64_t n = x.size(0), d = x.size(1);
  at::Tensor quantized = at::empty({levels * n, d}, x.options());
  at::Tensor scales = at::empty({levels, n, 1}, x.options());
  at::Tensor residual = x.clone();
  const float per_level = static_cast<float>(1.0 / activation_level);  // torch casts the Python float
  const float smallest = static_cast<float>(1e-30);
  float* q_data = quantized.data_ptr<float>();
  float* s_data = scales.data_ptr<float>();
  float* r_data = residual.data_ptr<float>();
  for (int64_t row = 0; row < n; ++row) {
    float* r = r_data + row * d;
    for (int64_t level = 0; level < levels; ++level) {
      const float largest = largest_magnitude(r, d);
      const float scale = std::max(largest, smallest) * per_level;
      float* q = q_data + (level * n + row) * d;
      for (int64_t i = 0; i < d; ++i) {
        q[i] = std::nearbyint(r[i] / scale);
        r[i] = std::fma(-1.0f * q[i], scale, r[i]);
      }
      s_data[level * n + row] = scale;
    }
  }
  return {quantized, scales, residual};
}

// integer [L * n, out] float32 (FBGEMM's sums), scales [L, n, 1], bias [out] or empty, into out
// [n, out] (a contiguous float32 tensor, or rows of one): out = integer_0 * s_0, then
// out = out + (1 * integer_l) * s_l per level (fused, as addcmul), then out + bias, as torch's mul,
// addcmul and add compute them. Written into a given tensor so that a product taken in several
// calls (rows_per_call in invariant_linear.py) scales each call's rows straight into its place.
void scale_rows_into(const at::Tensor& integer, const at::Tensor& scales, const at::Tensor& bias, at::Tensor out) {
  TORCH_CHECK(integer.dim() == 2 && integer.scalar_type() == at::kFloat && integer.is_contiguous(),
              "integer must be a contiguous float32 [L * n, out] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be a contiguous float32 [L, n, 1] tensor");
  const int64_t levels = scales.size(0), n = scales.size(1), width = integer.size(1);
  TORCH_CHECK(integer.size(0) == levels * n, "integer has ", integer.size(0), " rows, expected ", levels * n);
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == width && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias must be a contiguous float32 [out] tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == width && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "out must be a contiguous float32 [n, out] tensor of ", n, " x ", width);
  const float* in = integer.data_ptr<float>();
  const float* s = scales.data_ptr<float>();
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  float* o_data = out.data_ptr<float>();
  for (int64_t row = 0; row < n; ++row) {
    float* o = o_data + row * width;
    const float s0 = s[row];
    const float* first = in + row * width;
    for (int64_t j = 0; j < width; ++j) o[j] = first[j] * s0;
    for (int64_t level = 1; level < levels; ++level) {
      const float sl = s[level * n + row];
      const float* part = in + (level * n + row) * width;
      for (int64_t j = 0; j < width; ++j) o[j] = std::fma(1.0f * part[j], sl, o[j]);
    }
    if (b != nullptr)
      for (int64_t j = 0; j < width; ++j) o[j] = o[j] + b[j];
  }
}

// The same into a new [n, out] tensor.
at::Tensor scale_rows(const at::Tensor& integer, const at::Tensor& scales, const at::Tensor& bias) {
  TORCH_CHECK(scales.dim() == 3, "scales must be a contiguous float32 [L, n, 1] tensor");
  at::Tensor out = at::empty({scales.size(1), integer.dim() == 2 ? integer.size(1) : 0}, integer.options());
  scale_rows_into(integer, scales, bias, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, "Rows as levels of small integers with their own scales");
  m.def("scale_rows", &scale_rows, "FBGEMM's integer sums scaled back to float32 rows");
  m.def("scale_rows_into", &scale_rows_into, "The same, written into rows of a given tensor");
}
