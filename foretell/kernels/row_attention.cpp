// Attention over a paged KV pool on the CPU, one query row at a time, in an order that depends
// only on the row's own visible keys: a row computes the same bits whether it is decoded alone,
// verified beside k others or prefilled in a chunk, so speculation cannot change the text.
//
// Why native: the same work as torch operations (gather the keys, pad, two batched products,
// mask, exp, per-chunk sums) costs ~330 us a layer for one decoding row, mostly the operations'
// own overhead; this loop ~20 us over 256 keys. Why its own arithmetic rather than MKL's: a BLAS
// product rounds a row by the rows beside it; this loop does not.
//
// Each (head, row) pair: scores s_j = (q * scale) . k_j over the visible keys j in slot order
// (lanes of a fixed width summed in a fixed tree), their maximum, w_j = exp(s_j - max), the sum of
// the w_j and of the w_j v_j in slot order, then the division. Nothing depends on the row count,
// on the other rows or on how the pairs are split between threads.
//
// Products are fused multiply-adds (one rounding; the same in every row). The query heads that
// share a KV head run together, each key and value row read once for all of them. Measured on a
// Zen 4 EPYC, a 720-token prefill of the embedded model (18 layers): 731 ms in this loop with one
// head a task and separate multiplies and adds, 512 with the heads together, 440 with fused
// multiply-adds, ~455 against ~490 with its own vectorised exp (a noisy machine). Tasks of four rows
// (weights of all four, then values, so that keys come from the second-level cache) were tried and
// bought nothing (515 ms): the loop is bound by its own arithmetic (dot products of 256 finished
// by a lane tree).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
// Lowered to whatever vector width the CPU has (one AVX-512 register, two AVX2 ones); each lane's
// arithmetic is the same IEEE multiply and add whichever (built with -ffp-contract=off).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

// a * b + c rounded once, in every lane: the CPU's fused multiply-add where it has one (half the
// operations of a multiply and an add), else std::fma lane by lane (the same value, slowly).
inline Lanes fused(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  __m512 x, y, z;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  std::memcpy(&z, &c, sizeof z);
  const __m512 r = _mm512_fmadd_ps(x, y, z);
  Lanes out;
  std::memcpy(&out, &r, sizeof out);
  return out;
#elif defined(__FMA__)
  __m256 x[2], y[2], z[2], r[2];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  std::memcpy(z, &c, sizeof z);
  r[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
  r[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
  Lanes out;
  std::memcpy(&out, r, sizeof out);
  return out;
#else
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}

typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef float Quarter __attribute__((vector_size(kLanes / 4 * sizeof(float))));

typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x in every lane for x <= 0 (a score minus the row's largest): 2^n * p(r), n = x / ln 2 rounded,
// r = x - n ln 2 (ln 2 in two parts, so r is nearly exact), p the degree-7 Taylor polynomial of e^r
// (|r| <= ln 2 / 2: relative error ~5e-9, below float32's rounding). Below -87 (e^-87 ~ 1.6e-38,
// nothing beside the largest weight's 1) it gives 0, as does -inf. Lane for lane the same
// arithmetic, so a weight's bits depend on its own score alone; vectorised, unlike std::exp (a
// tenth or more of the loop's time).
inline Lanes exp_of_nonpositive(Lanes x) {
  const Lanes magnitude = x * -1.44269504088896341f + 0.5f;  // -x / ln 2 + 1/2 >= 1/2
  const Ints n = -__builtin_convertvector(magnitude, Ints);   // rounded to nearest (x <= 0)
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = (x - nf * 0.693145751953125f) - nf * 1.42860682030941723212e-6f;
  Lanes p = r * (1.0f / 5040) + (1.0f / 720);
  p = p * r + (1.0f / 120);
  p = p * r + (1.0f / 24);
  p = p * r + (1.0f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Ints safe_n = x < -87.0f ? Ints{} : n;  // keeps the exponent below in range
  Ints bits = (safe_n + 127) << 23;  // 2^n as a float's bits
  Lanes scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const Lanes zero = {};
  return x < -87.0f ? zero : p * scale;
}

// The lanes added in a fixed tree: halves, quarters, then the last four pairwise.
inline float lane_sum(Lanes v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const Half h = lo + hi;
  Quarter a, b;
  std::memcpy(&a, &h, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof a, sizeof b);
  const Quarter s = a + b;
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// Lane j of a dot product's partial sums: elements j, j + 16, ... of q * k, in four accumulators
// taken in turn (chunk c of 16 elements goes to accumulator c % 4), then added as
// (a0 + a1) + (a2 + a3). d a multiple of kLanes.
#define FORETELL_DOT_STEP(acc, q, k, i) \
  acc[0] = fused(load(q + i), load(k + i), acc[0]); \
  acc[1] = fused(load(q + i + kLanes), load(k + i + kLanes), acc[1]); \
  acc[2] = fused(load(q + i + 2 * kLanes), load(k + i + 2 * kLanes), acc[2]); \
  acc[3] = fused(load(q + i + 3 * kLanes), load(k + i + 3 * kLanes), acc[3]);
#define FORETELL_DOT_TAIL(acc, q, k, i, d) \
  for (int64_t t = 0; i + t * kLanes < d; ++t) acc[t] = fused(load(q + i + t * kLanes), load(k + i + t * kLanes), acc[t]);

inline float finish(const Lanes* acc) { return lane_sum((acc[0] + acc[1]) + (acc[2] + acc[3])); }

inline float dot(const float* q, const float* k, int64_t d) {
  Lanes a[4] = {};
  int64_t i = 0;
  for (; i + 4 * kLanes <= d; i += 4 * kLanes) { FORETELL_DOT_STEP(a, q, k, i) }
  FORETELL_DOT_TAIL(a, q, k, i, d)
  return finish(a);
}

// Four keys' dot products at once (independent chains, so the adds overlap), each computed
// exactly as dot() computes it alone.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3,
                 int64_t d, float* s) {
  Lanes a[4] = {}, b[4] = {}, c[4] = {}, e[4] = {};  // no "t": the tail macro's counter
  int64_t i = 0;
  for (; i + 4 * kLanes <= d; i += 4 * kLanes) {
    FORETELL_DOT_STEP(a, q, k0, i)
    FORETELL_DOT_STEP(b, q, k1, i)
    FORETELL_DOT_STEP(c, q, k2, i)
    FORETELL_DOT_STEP(e, q, k3, i)
  }
  FORETELL_DOT_TAIL(a, q, k0, i, d)
  FORETELL_DOT_TAIL(b, q, k1, i, d)
  FORETELL_DOT_TAIL(c, q, k2, i, d)
  FORETELL_DOT_TAIL(e, q, k3, i, d)
  s[0] = finish(a);
  s[1] = finish(b);
  s[2] = finish(c);
  s[3] = finish(e);
}

// out_h[d] = sum over j of w_h[j] * v_j[d], the j in order, for H heads at once (the heads of one
// KV head): each value row is read once for all of them. 64 outputs a head at a time (16 at the
// end) held in registers across every key; each output's additions in the same order whatever H.
template <int H>
void weighted_sums(const float* const* w, const float* const* v, int64_t m, int64_t d, float* const* out) {
  int64_t i = 0;
  for (; i + 4 * kLanes <= d; i += 4 * kLanes) {
    Lanes o[H][4] = {};
    for (int64_t j = 0; j < m; ++j) {
      const float* vj = v[j] + i;
      const Lanes v0 = load(vj), v1 = load(vj + kLanes), v2 = load(vj + 2 * kLanes), v3 = load(vj + 3 * kLanes);
      for (int h = 0; h < H; ++h) {
        Lanes wj = {};
        wj += w[h][j];
        o[h][0] = fused(wj, v0, o[h][0]);
        o[h][1] = fused(wj, v1, o[h][1]);
        o[h][2] = fused(wj, v2, o[h][2]);
        o[h][3] = fused(wj, v3, o[h][3]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < 4; ++c) store(out[h] + i + c * kLanes, o[h][c]);
  }
  for (; i < d; i += kLanes) {
    Lanes o[H] = {};
    for (int64_t j = 0; j < m; ++j) {
      const Lanes vj = load(v[j] + i);
      for (int h = 0; h < H; ++h) {
        Lanes wj = {};
        wj += w[h][j];
        o[h] = fused(wj, vj, o[h]);
      }
    }
    for (int h = 0; h < H; ++h) store(out[h] + i, o[h]);
  }
}

void weighted_sums_of(int count, const float* const* w, const float* const* v, int64_t m, int64_t d,
                      float* const* out) {
  switch (count) {
    case 1: weighted_sums<1>(w, v, m, d, out); break;
    case 2: weighted_sums<2>(w, v, m, d, out); break;
    case 3: weighted_sums<3>(w, v, m, d, out); break;
    default: weighted_sums<4>(w, v, m, d, out); break;
  }
}

constexpr int64_t kHeadsAtOnce = 4;  // query heads sharing each value row read (registers)

struct Pool {
  const float* data;
  int64_t head_stride, slot_stride;
};

// Scores, then weights, of one KV head and query row for the `group` query heads that share the
// KV head: `q` [group][d] already scaled; `keys_seen` [m] the pool slots of the keys the row
// sees, in position order. Each key block is read once for every head (while it is in the
// first-level cache); each head's arithmetic is what it would be alone, so a (head, row) result
// has the same bits whatever the grouping. Leaves w_j = exp(s_j - max) in `weights` [group][m]
// and their sums in `totals` [group].
void weigh_row(const float* q, int64_t group, const Pool& keys, int64_t kv_head, const int64_t* keys_seen,
               int64_t m, int64_t d, float* weights, float* totals) {
  const float* k_base = keys.data + kv_head * keys.head_stride;
  auto key = [&](int64_t j) { return k_base + keys_seen[j] * keys.slot_stride; };
  int64_t j = 0;
  for (; j + 4 <= m; j += 4)
    for (int64_t g = 0; g < group; ++g)
      dot4(q + g * d, key(j), key(j + 1), key(j + 2), key(j + 3), d, weights + g * m + j);
  for (; j < m; ++j)
    for (int64_t g = 0; g < group; ++g) weights[g * m + j] = dot(q + g * d, key(j), d);
  for (int64_t g = 0; g < group; ++g) {
    float* s = weights + g * m;
    float top = -std::numeric_limits<float>::infinity();
    for (j = 0; j < m; ++j) top = std::max(top, s[j]);
    for (j = 0; j < m; j += kLanes) {  // the weights, in place of the scores, 16 at a time
      Lanes x;
      for (int64_t l = 0; l < kLanes; ++l) x[l] = j + l < m ? s[j + l] - top : -std::numeric_limits<float>::infinity();
      const Lanes w = exp_of_nonpositive(x);
      for (int64_t l = 0; l < kLanes && j + l < m; ++l) s[j + l] = w[l];
    }
    float total = 0.0f;
    for (j = 0; j < m; ++j) total += s[j];
    totals[g] = total;
  }
}

// The weighted values of one KV head and query row, divided by the weights' sums: out_g [d] for
// each of the `group` heads (weigh_row's weights and totals).
void sum_row(const float* weights, const float* totals, int64_t group, const Pool& values, int64_t kv_head,
             const int64_t* keys_seen, int64_t m, int64_t d, const float** rows_of_v /* [m] scratch */,
             float* const* out) {
  const float* v_base = values.data + kv_head * values.head_stride;
  for (int64_t j = 0; j < m; ++j) rows_of_v[j] = v_base + keys_seen[j] * values.slot_stride;
  std::vector<const float*> w(group);
  for (int64_t g = 0; g < group; ++g) w[g] = weights + g * m;
  for (int64_t g = 0; g < group; g += kHeadsAtOnce)
    weighted_sums_of(static_cast<int>(std::min(kHeadsAtOnce, group - g)), w.data() + g, rows_of_v, m, d, out + g);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) out[g][i] /= totals[g];
}

}  // namespace

// query [heads, q, d]; keys, values [kv_heads, pool slots, d]; slots [n] int64 (pool slots of the
// keys in position order); visible [q, n] bool; out [q, heads, d], written in place. float32, the
// last dimension of every tensor contiguous, d a multiple of 16, every row seeing one key at least.
void row_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                   const at::Tensor& slots, const at::Tensor& visible, double scale, at::Tensor& out) {
  const int64_t heads = query.size(0), rows = query.size(1), d = query.size(2);
  const int64_t kv_heads = keys.size(0), n = slots.size(0);
  const int64_t group = heads / kv_heads;
  const float* q_data = query.data_ptr<float>();
  const int64_t q_head = query.stride(0), q_row = query.stride(1);
  float* o_data = out.data_ptr<float>();
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const Pool k{keys.data_ptr<float>(), keys.stride(0), keys.stride(1)};
  const Pool v{values.data_ptr<float>(), values.stride(0), values.stride(1)};
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const bool* vis_data = visible.data_ptr<bool>();
  const int64_t vis_row = visible.stride(0);
  const float scale_f = static_cast<float>(scale);
  // Threads only where the pass has work for them (a decoding row's few tasks stay on one).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 19) / std::max<int64_t>(1, group * n * d));
  at::parallel_for(0, kv_heads * rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * d), weights(group * n), totals(group);
    std::vector<int64_t> seen(n);
    std::vector<const float*> rows_of_v(n);
    std::vector<float*> out_rows(group);
    for (int64_t task = begin; task < end; ++task) {
      // A task is one KV head and one row. Rows taken from both ends in turn (0, last, 1,
      // last - 1, ...), so that each thread's contiguous share of a causal prefill holds as many
      // keys as the other's; which thread computes a row does not change its bits.
      const int64_t kv = task / rows, t = task % rows;
      const int64_t r = (t % 2 == 0) ? t / 2 : rows - 1 - t / 2;
      const bool* row_visible = vis_data + r * vis_row;
      int64_t m = 0;
      for (int64_t j = 0; j < n; ++j)
        if (row_visible[j]) seen[m++] = slot_data[j];
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        const float* src = q_data + h * q_head + r * q_row;
        for (int64_t i = 0; i < d; ++i) q[g * d + i] = src[i] * scale_f;
        out_rows[g] = o_data + r * o_row + h * o_head;
      }
      weigh_row(q.data(), group, k, kv, seen.data(), m, d, weights.data(), totals.data());
      sum_row(weights.data(), totals.data(), group, v, kv, seen.data(), m, d, rows_of_v.data(), out_rows.data());
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_attention", &row_attention, "Row-invariant attention over a paged KV pool (float32, CPU)");
}
