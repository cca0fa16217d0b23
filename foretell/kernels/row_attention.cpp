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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
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

typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef float Quarter __attribute__((vector_size(kLanes / 4 * sizeof(float))));

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
  acc[0] += load(q + i) * load(k + i); \
  acc[1] += load(q + i + kLanes) * load(k + i + kLanes); \
  acc[2] += load(q + i + 2 * kLanes) * load(k + i + 2 * kLanes); \
  acc[3] += load(q + i + 3 * kLanes) * load(k + i + 3 * kLanes);
#define FORETELL_DOT_TAIL(acc, q, k, i, d) \
  for (int64_t t = 0; i + t * kLanes < d; ++t) acc[t] += load(q + i + t * kLanes) * load(k + i + t * kLanes);

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

// out[d] = sum over j of w[j] * v_j[d], the j in order: 64 outputs at a time (16 at the end)
// held in registers across every key (each output's additions in the same order whatever).
inline void weighted_sum(const float* w, const float* const* v, int64_t m, int64_t d, float* out) {
  int64_t i = 0;
  for (; i + 4 * kLanes <= d; i += 4 * kLanes) {
    Lanes o0 = {}, o1 = {}, o2 = {}, o3 = {};
    for (int64_t j = 0; j < m; ++j) {
      const float* vj = v[j] + i;
      Lanes wj = {};
      wj += w[j];
      o0 += wj * load(vj);
      o1 += wj * load(vj + kLanes);
      o2 += wj * load(vj + 2 * kLanes);
      o3 += wj * load(vj + 3 * kLanes);
    }
    store(out + i, o0);
    store(out + i + kLanes, o1);
    store(out + i + 2 * kLanes, o2);
    store(out + i + 3 * kLanes, o3);
  }
  for (; i < d; i += kLanes) {
    Lanes o = {};
    for (int64_t j = 0; j < m; ++j) {
      Lanes wj = {};
      wj += w[j];
      o += wj * load(v[j] + i);
    }
    store(out + i, o);
  }
}

struct Pool {
  const float* data;
  int64_t head_stride, slot_stride;
};

// One (head, query row): `q` [d] already scaled; `keys_seen` [m] the pool slots of the keys
// the row sees, in position order.
void attend_row(const float* q, const Pool& keys, const Pool& values, int64_t kv_head,
                const int64_t* keys_seen, int64_t m, int64_t d,
                float* scores /* [m] scratch */, const float** rows_of_v /* [m] scratch */,
                float* out /* [d] */) {
  const float* k_base = keys.data + kv_head * keys.head_stride;
  const float* v_base = values.data + kv_head * values.head_stride;
  auto key = [&](int64_t j) { return k_base + keys_seen[j] * keys.slot_stride; };
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) dot4(q, key(j), key(j + 1), key(j + 2), key(j + 3), d, scores + j);
  for (; j < m; ++j) scores[j] = dot(q, key(j), d);
  float top = -std::numeric_limits<float>::infinity();
  for (j = 0; j < m; ++j) top = std::max(top, scores[j]);
  float total = 0.0f;
  for (j = 0; j < m; ++j) {
    scores[j] = std::exp(scores[j] - top);  // the weight, in place of the score
    total += scores[j];
    rows_of_v[j] = v_base + keys_seen[j] * values.slot_stride;
  }
  weighted_sum(scores, rows_of_v, m, d, out);
  for (int64_t i = 0; i < d; ++i) out[i] /= total;
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
  // Threads only where the pass has work for them (a decoding row's few pairs stay on one).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 19) / std::max<int64_t>(1, n * d));
  at::parallel_for(0, heads * rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(d), scores(n);
    std::vector<int64_t> seen(n);
    std::vector<const float*> rows_of_v(n);
    for (int64_t pair = begin; pair < end; ++pair) {
      // Head-major: threads split by heads, each with every row, so a causal prefill's work is even
      // between them (a row's keys are found again for each head: a scan of n flags, cheap).
      const int64_t h = pair / rows, r = pair % rows;
      const bool* row_visible = vis_data + r * vis_row;
      int64_t m = 0;
      for (int64_t j = 0; j < n; ++j)
        if (row_visible[j]) seen[m++] = slot_data[j];
      const float* src = q_data + h * q_head + r * q_row;
      for (int64_t i = 0; i < d; ++i) q[i] = src[i] * scale_f;
      attend_row(q.data(), k, v, h / group, seen.data(), m, d, scores.data(), rows_of_v.data(),
                 o_data + r * o_row + h * o_head);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_attention", &row_attention, "Row-invariant attention over a paged KV pool (float32, CPU)");
}
