// Attention over per-sequence K/V caches in a fixed order (see attention.h): each row attends its visible slots
// in ascending slot order, so its bits depend only on the slots it sees, not on what shares the call.
// Built with the w4a8 extension (same flags: -ffp-contract=off) on w4a8_simd.h's vectors.
#include "attention.h"
#include "w4a8_simd.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>

namespace {

// 16 cache elements as float32, and back (w4a8_simd.h rounds bfloat16 as torch does).
inline F16 load_cache(const float* p) { return load16(p); }
inline F16 load_cache(const c10::BFloat16* p) { return load16((const uint16_t*)p); }
inline void store_cache(float* p, F16 v) { store16(p, v); }
inline void store_cache(c10::BFloat16* p, F16 v) { store16((uint16_t*)p, v); }

float dot(const float* a, const float* b, int64_t n) {
  F16 sum = set16(0.f);
  for (int64_t i = 0; i < n; i += 16) sum = fmadd16(load16(a + i), load16(b + i), sum);
  return reduce_add(sum);
}

template <int CHUNKS>  // kLanes columns each, one accumulator register per chunk; CHUNKS known at run time
void weighted_columns_up_to(int chunks, const float* p, const float* rows, int64_t n, int64_t dim, float inv,
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

// target [D] = inv * sum over i of p[i] * rows[i] [n, D], summed in row order, up to 8 registers of columns
// at a time (so the sums never go through memory).
void weighted_rows(const float* p, const float* rows, int64_t n, int64_t dim, float inv, float* target) {
  for (int64_t column = 0; column < dim; column += 8 * kLanes) {
    weighted_columns_up_to<8>((int)std::min<int64_t>(8, (dim - column) / kLanes), p, rows + column, n, dim, inv,
                              target + column);
  }
}

// Writes the new keys and values into each sequence's cache, then each row attends its visible slots in
// ascending order: scores, softmax, weighted values, per query head; threads split (row, kv head) pairs.
template <typename C>
void attend_typed(const float* qkv, const std::vector<C*>& keys, const std::vector<C*>& values,
                  const std::vector<int64_t>& capacities, const std::vector<int64_t>& starts, int64_t new_tokens,
                  const torch::Tensor& mask, const HeadShape& hs, float* out) {
  const int64_t width = (hs.heads + 2 * hs.kv_heads) * hs.dim, rows = (int64_t)starts.size() * new_tokens;
  const int64_t group = hs.heads / hs.kv_heads;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / new_tokens, slot = starts[b] + r % new_tokens;
    for (int64_t g = 0; g < hs.kv_heads; ++g) {
      const int64_t at = (g * capacities[b] + slot) * hs.dim;
      const float* k = qkv + r * width + (hs.heads + g) * hs.dim;
      for (int64_t d = 0; d < hs.dim; d += 16) {
        store_cache(keys[b] + at + d, load16(k + d));
        store_cache(values[b] + at + d, load16(k + hs.kv_heads * hs.dim + d));
      }
    }
  }
  const bool* visible = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t seen = mask.defined() ? mask.size(3) : 0;
  const float scale = 1.f / std::sqrt((float)hs.dim);
  // Causal rows of one sequence see prefixes of the same slots (a prefill's, a chain's), so a block of such rows
  // shares one conversion of those slots to float32 (a prefill's rows would otherwise convert O(T^2) slots);
  // other rows (a tree's, a window's) gather their own. Either way each row's sums are the same, in the same order.
  const int64_t batch = (int64_t)starts.size(), block = 32;
  const int64_t blocks = (new_tokens + block - 1) / block;
  // Whether row r of sequence b sees exactly the slots [0, n).
  const auto sees_prefix = [&](int64_t r, int64_t n) {
    if (!visible) return true;
    for (int64_t s = 0; s < seen; ++s) if (visible[r * seen + s] != (s < n)) return false;
    return true;
  };
  at::parallel_for(0, batch * hs.kv_heads * blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> slots;
    std::vector<float> probs, seen_keys, seen_values, totals(group);
    // The slots' keys and values as float32 rows [n, D]: converted once, read once per query head.
    const auto gather = [&](const C* base, std::vector<float>& rows) {
      rows.resize(slots.size() * hs.dim);
      for (size_t i = 0; i < slots.size(); ++i) {
        for (int64_t d = 0; d < hs.dim; d += 16) {
          store16(rows.data() + i * hs.dim + d, load_cache(base + slots[i] * hs.dim + d));
        }
      }
    };
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (hs.kv_heads * blocks), g = u / blocks % hs.kv_heads, first = u % blocks * block;
      const int64_t last = std::min(new_tokens, first + block);  // rows [first, last) of sequence b
      const int64_t kv_offset = g * capacities[b] * hs.dim;
      bool shared = true;
      for (int64_t t = first; t < last && shared; ++t) shared = sees_prefix(b * new_tokens + t, starts[b] + t + 1);
      if (shared) {
        slots.clear();
        for (int64_t s = 0; s < starts[b] + last; ++s) slots.push_back(s);
        gather(keys[b] + kv_offset, seen_keys);
        gather(values[b] + kv_offset, seen_values);
      }
      for (int64_t t = first; t < last; ++t) {
        const int64_t r = b * new_tokens + t;
        if (!shared) {
          slots.clear();
          for (int64_t s = 0; s < seen; ++s) if (visible[r * seen + s]) slots.push_back(s);
          gather(keys[b] + kv_offset, seen_keys);
          gather(values[b] + kv_offset, seen_values);
        }
        const int64_t n = shared ? starts[b] + t + 1 : (int64_t)slots.size(), padded = (n + 15) / 16 * 16;
        probs.assign(group * padded, 0.f);
        const float* query = qkv + r * width + g * group * hs.dim;
        for (int64_t h = 0; h < group; ++h) {
          for (int64_t i = 0; i < n; ++i) {
            probs[h * padded + i] = dot(query + h * hs.dim, seen_keys.data() + i * hs.dim, hs.dim) * scale;
          }
        }
        for (int64_t h = 0; h < group; ++h) {
          float* p = probs.data() + h * padded;  // [padded]: slots past n are padding
          for (int64_t i = n; i < padded; ++i) p[i] = -INFINITY;
          F16 top = load16(p);
          for (int64_t i = 16; i < padded; i += 16) top = max16(top, load16(p + i));
          const F16 shift = set16(reduce_max(top));
          F16 sum = set16(0.f);
          for (int64_t i = 0; i < padded; i += 16) {
            store16(p + i, exp16(load16(p + i) - shift));
            for (int64_t j = std::max(i, n); j < i + 16; ++j) p[j] = 0.f;  // the padding weighs nothing
            sum = sum + load16(p + i);
          }
          totals[h] = reduce_add(sum);
        }
        for (int64_t h = 0; h < group; ++h) {
          float* target = out + r * hs.heads * hs.dim + (g * group + h) * hs.dim;
          weighted_rows(probs.data() + h * padded, seen_values.data(), n, hs.dim, 1.f / totals[h], target);
        }
      }
    }
  });
}

template <typename C>
std::vector<C*> cache_pointers(const std::vector<torch::Tensor>& caches) {
  std::vector<C*> pointers;
  for (const torch::Tensor& t : caches) pointers.push_back(t.data_ptr<C>());
  return pointers;
}

}  // namespace

std::vector<int64_t> check_caches(const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                  const std::vector<int64_t>& starts, int64_t new_tokens, const HeadShape& hs) {
  const int64_t batch = (int64_t)starts.size();
  TORCH_CHECK((int64_t)keys.size() == batch && (int64_t)values.size() == batch && batch > 0,
              "one cache and one start per sequence");
  std::vector<int64_t> capacities(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const torch::Tensor& k = keys[b];
    TORCH_CHECK(k.dim() == 3 && k.size(0) == hs.kv_heads && k.size(2) == hs.dim && k.is_contiguous() &&
                values[b].sizes() == k.sizes() && values[b].is_contiguous() &&
                values[b].scalar_type() == k.scalar_type() && k.scalar_type() == keys[0].scalar_type(),
                "keys[b], values[b]: [Hkv, capacity, D] contiguous, one dtype");
    TORCH_CHECK(k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16,
                "the cache must be float32 or bfloat16");
    capacities[b] = k.size(1);
    TORCH_CHECK(starts[b] >= 0 && starts[b] + new_tokens <= capacities[b], "cache full");
  }
  return capacities;
}

torch::Tensor check_visible(const c10::optional<torch::Tensor>& visible, int64_t batch, int64_t new_tokens) {
  if (!visible.has_value()) return torch::Tensor();
  torch::Tensor mask = visible->contiguous();
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 4 && mask.size(0) == batch &&
              mask.size(2) == new_tokens, "visible: [B, 1, T, S] bool");
  return mask;
}

void attend_rows(const float* qkv, const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                 const std::vector<int64_t>& capacities, const std::vector<int64_t>& starts, int64_t new_tokens,
                 const torch::Tensor& visible, const HeadShape& hs, float* out) {
  if (keys[0].scalar_type() == torch::kFloat) {
    attend_typed<float>(qkv, cache_pointers<float>(keys), cache_pointers<float>(values), capacities, starts,
                        new_tokens, visible, hs, out);
  } else {
    attend_typed<c10::BFloat16>(qkv, cache_pointers<c10::BFloat16>(keys), cache_pointers<c10::BFloat16>(values),
                                capacities, starts, new_tokens, visible, hs, out);
  }
}

torch::Tensor attend(torch::Tensor qkv, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                     std::vector<int64_t> starts, c10::optional<torch::Tensor> visible, int64_t heads,
                     int64_t kv_heads, int64_t head_dim) {
  const HeadShape hs{heads, kv_heads, head_dim};
  TORCH_CHECK(head_dim % 16 == 0 && heads % kv_heads == 0, "head size must be a multiple of 16");
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) == hs.width() && qkv.scalar_type() == torch::kFloat &&
              qkv.is_contiguous(), "qkv: [B, T, (H + 2 Hkv) * D] contiguous float32");
  const int64_t batch = qkv.size(0), new_tokens = qkv.size(1);
  TORCH_CHECK((int64_t)starts.size() == batch, "one start per sequence");
  const std::vector<int64_t> capacities = check_caches(keys, values, starts, new_tokens, hs);
  const torch::Tensor mask = check_visible(visible, batch, new_tokens);
  torch::Tensor out = torch::empty({batch, new_tokens, heads * head_dim}, torch::kFloat);
  attend_rows(qkv.data_ptr<float>(), keys, values, capacities, starts, new_tokens, mask, hs, out.data_ptr<float>());
  return out;
}
