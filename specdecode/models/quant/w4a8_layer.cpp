// A w4a8 model's decoder layer in one call (see w4a8_decoder.py for the why): RMSNorm, the four w4a8 matmuls,
// q/k norms, rotary embeddings, the K/V cache write, attention and SiLU, with the residual stream in float32.
//
// Every row (token) is computed on its own and in the same order whatever else shares the call: the matmuls
// are batch-invariant (w4a8_kernel.cpp), norms and dot products reduce each row in a fixed order, and
// attention sums a row's visible slots in ascending slot order, skipping the rest. So a token's bits depend
// only on the slots it sees, not on how many tokens, sequences or masked slots share the forward.
// Built with -ffp-contract=off so that no a*b+c is fused differently in different places. Written on
// w4a8_simd.h's vectors, so the same algorithm (and order of every sum) is compiled for each instruction set.
#include "w4a8_kernel.h"
#include "w4a8_simd.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>

namespace {

// 16 cache elements as float32, and back (w4a8_simd.h rounds bfloat16 as torch does).
inline F16 load_cache(const float* p) { return load16(p); }
inline F16 load_cache(const c10::BFloat16* p) { return load16((const uint16_t*)p); }
inline void store_cache(float* p, F16 v) { store16(p, v); }
inline void store_cache(c10::BFloat16* p, F16 v) { store16((uint16_t*)p, v); }

// out [R, n] = x / rms(x) * weight per row of n (n a multiple of 16); out may be x.
void rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * n;
    F16 squares = set16(0.f);
    for (int64_t i = 0; i < n; i += 16) squares = fmadd16(load16(v + i), load16(v + i), squares);
    const F16 inv = set16(1.f / std::sqrt(reduce_add(squares) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) store16(out + r * n + i, load16(v + i) * inv * load16(weight + i));
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
  const F16 zero = set16(0.f), one = set16(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const F16 g = load16(gate + i);
      store16(act + r * inter + i, g / (one + exp16(zero - g)) * load16(gate + inter + i));
    }
  }
}

float dot(const float* a, const float* b, int64_t n) {
  F16 sum = set16(0.f);
  for (int64_t i = 0; i < n; i += 16) sum = fmadd16(load16(a + i), load16(b + i), sum);
  return reduce_add(sum);
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

  // x [B, T, hidden] float32; keys[b], values[b] [Hkv, capacity_b, D]: sequence b's cache for this layer
  // (float32 or bfloat16; each sequence its own tensor and capacity); starts [B]: each sequence's cached length,
  // where its T new slots go; cos, sin [B, 1, T, D/2] float32; visible [B, 1, T, S] bool (None: causal over the
  // new tokens, every cached slot visible; it never marks a slot at or past starts[b] + T) -> [B, T, hidden].
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                        std::vector<int64_t> starts, torch::Tensor cos, torch::Tensor sin,
                        c10::optional<torch::Tensor> visible) {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == hidden_ && x.scalar_type() == torch::kFloat && x.is_contiguous(),
                "x: [B, T, hidden] contiguous float32");
    const int64_t batch = x.size(0), new_tokens = x.size(1), rows = batch * new_tokens;
    TORCH_CHECK((int64_t)keys.size() == batch && (int64_t)values.size() == batch && (int64_t)starts.size() == batch,
                "one cache and one start per sequence");
    std::vector<int64_t> capacities(batch);
    for (int64_t b = 0; b < batch; ++b) {
      const torch::Tensor& k = keys[b];
      TORCH_CHECK(k.dim() == 3 && k.size(0) == kv_heads_ && k.size(2) == dim_ && k.is_contiguous() &&
                  values[b].sizes() == k.sizes() && values[b].is_contiguous() &&
                  values[b].scalar_type() == k.scalar_type() && k.scalar_type() == keys[0].scalar_type(),
                  "keys[b], values[b]: [Hkv, capacity, D] contiguous, one dtype");
      capacities[b] = k.size(1);
      TORCH_CHECK(starts[b] >= 0 && starts[b] + new_tokens <= capacities[b], "cache full");
    }
    for (const auto& t : {cos, sin}) {
      TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows * dim_ / 2,
                  "cos, sin: [B, 1, T, D/2] contiguous float32");
    }
    torch::Tensor mask;
    if (visible.has_value()) {
      mask = visible->contiguous();
      TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 4 && mask.size(0) == batch &&
                  mask.size(2) == new_tokens, "visible: [B, 1, T, S] bool");
    }

    torch::Tensor out = x.clone();  // [B, T, hidden]: the residual stream
    float* residual = out.data_ptr<float>();
    const auto buffer = [](int64_t r, int64_t n) { return torch::empty({r, n}, torch::kFloat); };
    torch::Tensor normed = buffer(rows, hidden_), qkv = buffer(rows, qkv_.out_features());
    torch::Tensor attended = buffer(rows, heads_ * dim_), projected = buffer(rows, hidden_);

    rms_norm(residual, rows, hidden_, attn_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
    w4a8_rows(normed.data_ptr<float>(), rows, qkv_, qkv.data_ptr<float>());
    position_heads(qkv.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>());
    if (keys[0].scalar_type() == torch::kFloat) {
      attend<float>(qkv.data_ptr<float>(), cache_pointers<float>(keys), cache_pointers<float>(values), capacities,
                    starts, new_tokens, mask, attended.data_ptr<float>());
    } else {
      TORCH_CHECK(keys[0].scalar_type() == torch::kBFloat16, "the cache must be float32 or bfloat16");
      attend<c10::BFloat16>(qkv.data_ptr<float>(), cache_pointers<c10::BFloat16>(keys),
                            cache_pointers<c10::BFloat16>(values), capacities, starts, new_tokens, mask,
                            attended.data_ptr<float>());
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

  template <typename C>
  static std::vector<C*> cache_pointers(const std::vector<torch::Tensor>& caches) {
    std::vector<C*> pointers;
    for (const torch::Tensor& t : caches) pointers.push_back(t.data_ptr<C>());
    return pointers;
  }

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

  // Writes the new keys and values into each sequence's cache, then each row attends its visible slots in
  // ascending order: scores, softmax, weighted values, per query head; threads split (row, kv head) pairs.
  template <typename C>
  void attend(const float* qkv, const std::vector<C*>& keys, const std::vector<C*>& values,
              const std::vector<int64_t>& capacities, const std::vector<int64_t>& starts, int64_t new_tokens,
              const torch::Tensor& mask, float* out) const {
    const int64_t width = (heads_ + 2 * kv_heads_) * dim_, rows = (int64_t)starts.size() * new_tokens;
    const int64_t group = heads_ / kv_heads_;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / new_tokens, slot = starts[b] + r % new_tokens;
      for (int64_t g = 0; g < kv_heads_; ++g) {
        const int64_t at = (g * capacities[b] + slot) * dim_;
        const float* k = qkv + r * width + (heads_ + g) * dim_;
        for (int64_t d = 0; d < dim_; d += 16) {
          store_cache(keys[b] + at + d, load16(k + d));
          store_cache(values[b] + at + d, load16(k + kv_heads_ * dim_ + d));
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
              store16(seen_rows.data() + i * dim_ + d, load_cache(base + slots[i] * dim_ + d));
            }
          }
        };
        const int64_t kv_offset = g * capacities[b] * dim_;
        const float* query = qkv + r * width + g * group * dim_;
        gather(keys[b] + kv_offset);
        for (int64_t h = 0; h < group; ++h) {
          for (int64_t i = 0; i < n; ++i) {
            probs[h * padded + i] = dot(query + h * dim_, seen_rows.data() + i * dim_, dim_) * scale;
          }
        }
        for (int64_t h = 0; h < group; ++h) {
          float* p = probs.data() + h * padded;
          float top = p[0];
          for (int64_t i = 1; i < n; ++i) top = std::max(top, p[i]);
          // Whole vectors: a row of probs is padded to 16, and what lands past n is never read.
          for (int64_t i = 0; i < n; i += 16) store16(p + i, exp16(load16(p + i) - set16(top)));
          totals[h] = 0.f;
          for (int64_t i = 0; i < n; ++i) totals[h] += p[i];
        }
        gather(values[b] + kv_offset);
        for (int64_t h = 0; h < group; ++h) {
          float* target = out + r * heads_ * dim_ + (g * group + h) * dim_;
          weighted_rows(probs.data() + h * padded, seen_rows.data(), n, dim_, 1.f / totals[h], target);
        }
      }
    });
  }

  // target [D] = inv * sum over i of p[i] * rows[i] [n, D], summed in row order, up to 8 registers of columns
  // at a time (so the sums never go through memory).
  static void weighted_rows(const float* p, const float* rows, int64_t n, int64_t dim, float inv, float* target) {
    for (int64_t column = 0; column < dim; column += 8 * kLanes) {
      weighted_columns_up_to<8>((int)std::min<int64_t>(8, (dim - column) / kLanes), p, rows + column, n, dim, inv,
                                target + column);
    }
  }

  template <int CHUNKS>  // kLanes columns each, one accumulator register per chunk; CHUNKS known at run time
  static void weighted_columns_up_to(int chunks, const float* p, const float* rows, int64_t n, int64_t dim, float inv,
                                     float* target) {
    if (chunks < CHUNKS) {
      if constexpr (CHUNKS > 1) weighted_columns_up_to<CHUNKS - 1>(chunks, p, rows, n, dim, inv, target);
      return;
    }
    V sums[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) sums[c] = vset1(0.f);
    for (int64_t i = 0; i < n; ++i) {
      const V weight = vset1(p[i]);
      for (int c = 0; c < CHUNKS; ++c) sums[c] = vfmadd(weight, vload(rows + i * dim + kLanes * c), sums[c]);
    }
    for (int c = 0; c < CHUNKS; ++c) vstore(target + kLanes * c, vmul(sums[c], vset1(inv)));
  }

  torch::Tensor attn_norm_, mlp_norm_, q_norm_, k_norm_;  // float32 weights; q/k norms undefined unless Qwen3
  W4A8Weight qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, dim_, hidden_, inter_;
  float eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // Module-local: each instruction-set variant is its own extension with its own copy of these classes.
  py::class_<W4A8Weight>(m, "Weight", py::module_local());
  m.def("weight", &make_weight, py::arg("codes"), py::arg("group_scales"), py::arg("block_scales"),
        py::arg("bias") = py::none());
  m.def("w4a8_mm", &w4a8_mm, py::call_guard<py::gil_scoped_release>());
  py::class_<W4A8DecoderLayer>(m, "DecoderLayer", py::module_local())
      .def(py::init<torch::Tensor, W4A8Weight, W4A8Weight, torch::Tensor, W4A8Weight, W4A8Weight,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, double>())
      .def("forward", &W4A8DecoderLayer::forward, py::call_guard<py::gil_scoped_release>());
}
