// A w4a8 model's decoder layer in one call (see w4a8_decoder.py for the why): RMSNorm, the four w4a8 matmuls,
// q/k norms, rotary embeddings, the K/V cache write, attention and SiLU, with the residual stream in float32.
//
// Every row (token) is computed on its own and in the same order whatever else shares the call: the matmuls
// are batch-invariant (w4a8_kernel.cpp), norms and dot products reduce each row in a fixed order, and
// attention sums a row's visible slots in ascending slot order, skipping the rest. So a token's bits depend
// only on the slots it sees, not on how many tokens, sequences or masked slots share the forward.
// Built with -ffp-contract=off so that no a*b+c is fused differently in different places.
#include "w4a8_kernel.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

// e^x per lane (Cephes' single-precision polynomial, about 1 ulp); no lane depends on another.
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16 cache elements as float32, and back (bfloat16 rounds to nearest even, as torch does, in integer ops so
// that CPUs with VNNI but without AVX512_BF16 run it too).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// out [R, n] = x / rms(x) * weight per row of n (n a multiple of 16); out may be x.
void rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * n;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) squares = _mm512_fmadd_ps(_mm512_loadu_ps(v + i), _mm512_loadu_ps(v + i), squares);
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(v + i), inv);
      _mm512_storeu_ps(out + r * n + i, _mm512_mul_ps(scaled, _mm512_loadu_ps(weight + i)));
    }
  }
}

// One head [D] rotated in the half-split (NeoX) layout; cos, sin [D/2].
void rotate(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i] + a * sin[i];
  }
}

// act [R, I] = silu(gate) * up from gate_up [R, 2I] (I a multiple of 16).
void silu_times_up(const float* gate_up, int64_t rows, int64_t inter, float* act) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_storeu_ps(act + r * inter + i, _mm512_mul_ps(silu, _mm512_loadu_ps(gate + inter + i)));
    }
  }
}

float dot(const float* a, const float* b, int64_t n) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum);
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

class W4A8DecoderLayer {
 public:
  W4A8DecoderLayer(torch::Tensor attn_norm, W4A8Weight qkv, W4A8Weight o, torch::Tensor mlp_norm,
                   W4A8Weight gate_up, W4A8Weight down, c10::optional<torch::Tensor> q_norm,
                   c10::optional<torch::Tensor> k_norm, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : attn_norm_(floats(attn_norm)), mlp_norm_(floats(mlp_norm)), qkv_(qkv), o_(o), gate_up_(gate_up),
        down_(down), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), eps_((float)eps) {
    hidden_ = attn_norm_.numel();
    inter_ = gate_up.out_features() / 2;
    TORCH_CHECK(hidden_ % 16 == 0 && dim_ % 16 == 0 && inter_ % 16 == 0 && heads_ % kv_heads_ == 0,
                "hidden size, head size and intermediate size must be multiples of 16");
    TORCH_CHECK(qkv.in_features() == hidden_ && qkv.out_features() == (heads_ + 2 * kv_heads_) * dim_ &&
                o.in_features() == heads_ * dim_ && o.out_features() == hidden_ && gate_up.in_features() == hidden_ &&
                down.in_features() == inter_ && down.out_features() == hidden_, "layer shapes do not match");
    if (q_norm.has_value()) q_norm_ = floats(*q_norm);
    if (k_norm.has_value()) k_norm_ = floats(*k_norm);
  }

  // x [B, T, hidden] float32; keys, values [B, Hkv, capacity, D] (this layer's cache, float32 or bfloat16);
  // starts [B]: each sequence's cached length, where its T new slots go; cos, sin [B, 1, T, D/2] float32;
  // visible [B, 1, T, S] bool (None: causal over the new tokens, every cached slot visible) -> [B, T, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor keys, torch::Tensor values, std::vector<int64_t> starts,
                        torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> visible) {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == hidden_ && x.scalar_type() == torch::kFloat && x.is_contiguous(),
                "x: [B, T, hidden] contiguous float32");
    const int64_t batch = x.size(0), new_tokens = x.size(1), rows = batch * new_tokens;
    TORCH_CHECK(keys.dim() == 4 && keys.size(0) == batch && keys.size(1) == kv_heads_ && keys.size(3) == dim_ &&
                keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous() &&
                values.scalar_type() == keys.scalar_type(), "keys, values: [B, Hkv, capacity, D] contiguous");
    TORCH_CHECK((int64_t)starts.size() == batch, "one start per sequence");
    for (int64_t start : starts) TORCH_CHECK(start >= 0 && start + new_tokens <= keys.size(2), "cache full");
    for (const auto& t : {cos, sin}) {
      TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows * dim_ / 2,
                  "cos, sin: [B, 1, T, D/2] contiguous float32");
    }
    torch::Tensor mask;
    if (visible.has_value()) {
      mask = visible->contiguous();
      TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 4 && mask.size(0) == batch &&
                  mask.size(2) == new_tokens && mask.size(3) <= keys.size(2), "visible: [B, 1, T, S] bool");
    }

    torch::Tensor out = x.clone();  // [B, T, hidden]: the residual stream
    float* residual = out.data_ptr<float>();
    const auto buffer = [](int64_t r, int64_t n) { return torch::empty({r, n}, torch::kFloat); };
    torch::Tensor normed = buffer(rows, hidden_), qkv = buffer(rows, qkv_.out_features());
    torch::Tensor attended = buffer(rows, heads_ * dim_), projected = buffer(rows, hidden_);

    rms_norm(residual, rows, hidden_, attn_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
    w4a8_rows(normed.data_ptr<float>(), rows, qkv_, qkv.data_ptr<float>());
    position_heads(qkv.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>());
    if (keys.scalar_type() == torch::kFloat) {
      attend<float>(qkv.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(2), starts,
                    new_tokens, mask, attended.data_ptr<float>());
    } else {
      TORCH_CHECK(keys.scalar_type() == torch::kBFloat16, "the cache must be float32 or bfloat16");
      attend<c10::BFloat16>(qkv.data_ptr<float>(), keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>(),
                            keys.size(2), starts, new_tokens, mask, attended.data_ptr<float>());
    }
    w4a8_rows(attended.data_ptr<float>(), rows, o_, projected.data_ptr<float>());
    add_into(residual, projected.data_ptr<float>(), rows * hidden_);

    torch::Tensor gate_up = buffer(rows, 2 * inter_), act = buffer(rows, inter_);
    rms_norm(residual, rows, hidden_, mlp_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
    w4a8_rows(normed.data_ptr<float>(), rows, gate_up_, gate_up.data_ptr<float>());
    silu_times_up(gate_up.data_ptr<float>(), rows, inter_, act.data_ptr<float>());
    w4a8_rows(act.data_ptr<float>(), rows, down_, projected.data_ptr<float>());
    add_into(residual, projected.data_ptr<float>(), rows * hidden_);
    return out;
  }

 private:
  static torch::Tensor floats(const torch::Tensor& t) { return t.detach().to(torch::kFloat).contiguous(); }

  static void add_into(float* target, const float* addend, int64_t n) {
    for (int64_t i = 0; i < n; ++i) target[i] += addend[i];
  }

  // q/k norms (Qwen3) and rotary embeddings, in place on qkv [R, (H + 2 Hkv) * D].
  void position_heads(float* qkv, int64_t rows, const float* cos, const float* sin) const {
    const int64_t width = (heads_ + 2 * kv_heads_) * dim_, half = dim_ / 2;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
        float* head = qkv + r * width + h * dim_;
        const torch::Tensor& norm = h < heads_ ? q_norm_ : k_norm_;
        if (norm.defined()) rms_norm(head, 1, dim_, norm.data_ptr<float>(), eps_, head);
        rotate(head, cos + r * half, sin + r * half, half);
      }
    }
  }

  // Writes the new keys and values into the cache, then each row attends its visible slots in ascending
  // order: scores, softmax, weighted values, per query head; threads split (row, kv head) pairs.
  template <typename C>
  void attend(const float* qkv, C* keys, C* values, int64_t capacity, const std::vector<int64_t>& starts,
              int64_t new_tokens, const torch::Tensor& mask, float* out) const {
    const int64_t width = (heads_ + 2 * kv_heads_) * dim_, rows = (int64_t)starts.size() * new_tokens;
    const int64_t group = heads_ / kv_heads_;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / new_tokens, slot = starts[b] + r % new_tokens;
      for (int64_t g = 0; g < kv_heads_; ++g) {
        const int64_t at = ((b * kv_heads_ + g) * capacity + slot) * dim_;
        const float* k = qkv + r * width + (heads_ + g) * dim_;
        for (int64_t d = 0; d < dim_; d += 16) {
          store16(keys + at + d, _mm512_loadu_ps(k + d));
          store16(values + at + d, _mm512_loadu_ps(k + kv_heads_ * dim_ + d));
        }
      }
    }
    const bool* visible = mask.defined() ? mask.data_ptr<bool>() : nullptr;
    const int64_t seen = mask.defined() ? mask.size(3) : 0;
    const float scale = 1.f / std::sqrt((float)dim_);
    at::parallel_for(0, rows * kv_heads_, 1, [&](int64_t u0, int64_t u1) {
      std::vector<int64_t> slots;
      std::vector<float> probs, seen_rows, totals(group);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = u / kv_heads_, g = u % kv_heads_, b = r / new_tokens, t = r % new_tokens;
        slots.clear();
        if (visible) {
          for (int64_t s = 0; s < seen; ++s) if (visible[r * seen + s]) slots.push_back(s);
        } else {
          for (int64_t s = 0; s <= starts[b] + t; ++s) slots.push_back(s);
        }
        const int64_t n = (int64_t)slots.size(), padded = (n + 15) / 16 * 16;
        probs.assign(group * padded, 0.f);
        seen_rows.resize(n * dim_);
        // The visible keys (then values) as float32 rows [n, D]: converted once, read once per query head.
        const auto gather = [&](const C* base) {
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t d = 0; d < dim_; d += 16) {
              _mm512_storeu_ps(seen_rows.data() + i * dim_ + d, load16(base + slots[i] * dim_ + d));
            }
          }
        };
        const int64_t kv_offset = (b * kv_heads_ + g) * capacity * dim_;
        const float* query = qkv + r * width + g * group * dim_;
        gather(keys + kv_offset);
        for (int64_t h = 0; h < group; ++h) {
          for (int64_t i = 0; i < n; ++i) {
            probs[h * padded + i] = dot(query + h * dim_, seen_rows.data() + i * dim_, dim_) * scale;
          }
        }
        for (int64_t h = 0; h < group; ++h) {
          float* p = probs.data() + h * padded;
          float top = p[0];
          for (int64_t i = 1; i < n; ++i) top = std::max(top, p[i]);
          for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 lanes = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, p + i), _mm512_set1_ps(top)));
            _mm512_mask_storeu_ps(p + i, lanes, e);
          }
          totals[h] = 0.f;
          for (int64_t i = 0; i < n; ++i) totals[h] += p[i];
        }
        gather(values + kv_offset);
        for (int64_t h = 0; h < group; ++h) {
          float* target = out + r * heads_ * dim_ + (g * group + h) * dim_;
          weighted_rows(probs.data() + h * padded, seen_rows.data(), n, dim_, 1.f / totals[h], target);
        }
      }
    });
  }

  // target [D] = inv * sum over i of p[i] * rows[i] [n, D], summed in row order, up to 128 columns at a time
  // in registers (so the sums never go through memory).
  static void weighted_rows(const float* p, const float* rows, int64_t n, int64_t dim, float inv, float* target) {
    for (int64_t column = 0; column < dim; column += 128) {
      switch (std::min<int64_t>(8, (dim - column) / 16)) {
        case 1: weighted_columns<1>(p, rows + column, n, dim, inv, target + column); break;
        case 2: weighted_columns<2>(p, rows + column, n, dim, inv, target + column); break;
        case 3: weighted_columns<3>(p, rows + column, n, dim, inv, target + column); break;
        case 4: weighted_columns<4>(p, rows + column, n, dim, inv, target + column); break;
        case 5: weighted_columns<5>(p, rows + column, n, dim, inv, target + column); break;
        case 6: weighted_columns<6>(p, rows + column, n, dim, inv, target + column); break;
        case 7: weighted_columns<7>(p, rows + column, n, dim, inv, target + column); break;
        default: weighted_columns<8>(p, rows + column, n, dim, inv, target + column); break;
      }
    }
  }

  template <int CHUNKS>  // 16 columns each, one accumulator register per chunk
  static void weighted_columns(const float* p, const float* rows, int64_t n, int64_t dim, float inv, float* target) {
    __m512 sums[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) sums[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m512 weight = _mm512_set1_ps(p[i]);
      for (int c = 0; c < CHUNKS; ++c) sums[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(rows + i * dim + 16 * c), sums[c]);
    }
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(target + 16 * c, _mm512_mul_ps(sums[c], _mm512_set1_ps(inv)));
  }

  torch::Tensor attn_norm_, mlp_norm_, q_norm_, k_norm_;  // float32 weights; q/k norms undefined unless Qwen3
  W4A8Weight qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, dim_, hidden_, inter_;
  float eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<W4A8Weight>(m, "Weight");
  m.def("weight", &make_weight, py::arg("codes"), py::arg("group_scales"), py::arg("block_scales"),
        py::arg("bias") = py::none());
  m.def("w4a8_mm", &w4a8_mm, py::call_guard<py::gil_scoped_release>());
  py::class_<W4A8DecoderLayer>(m, "DecoderLayer")
      .def(py::init<torch::Tensor, W4A8Weight, W4A8Weight, torch::Tensor, W4A8Weight, W4A8Weight,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, double>())
      .def("forward", &W4A8DecoderLayer::forward, py::call_guard<py::gil_scoped_release>());
}
