// Attention over per-sequence K/V caches in a fixed order (see attention.h): each row attends its visible slots
// in ascending slot order, so its bits depend only on the slots it sees, not on what shares the call.
// Built with the w4a8 extension (same flags: -ffp-contract=off) on w4a8_simd.h's vectors.
#include "attention.h"
#include "w4a8_simd.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// Cache elements as float32: 16 at a time, and kLanes at a time (w4a8_simd.h rounds bfloat16 as torch does).
inline F16 load_cache(const float* p) { return load16(p); }
inline F16 load_cache(const c10::BFloat16* p) { return load16((const uint16_t*)p); }
inline V load_lanes(const float* p) { return vload(p); }
inline V load_lanes(const c10::BFloat16* p) { return vfrom_bf16((const uint16_t*)p); }
inline void store_cache(float* p, F16 v) { store16(p, v); }
inline void store_cache(c10::BFloat16* p, F16 v) { store16((uint16_t*)p, v); }

// Query heads taken together per pass (a KV head's group is split above this): their sums and a key's 16
// floats fit the register file (32 registers on AVX-512, 16 on AVX2, where F16 takes two).
constexpr int kMaxHeads = kLanes == 16 ? 8 : 6;
// Keys (then values) are visited in tiles of this many slots, each tile by every row of a block in turn, so that
// a tile is read from memory once per block, not once per row (64-128 KiB: it stays in L2).
constexpr int64_t kSlotTile = 256;

// probs[h * padded + i] = scale * (query h . key at slots[i]) for G query heads [G, D] that share one KV head:
// each key is read (and converted) once for all G heads. Each dot sums lanes in dimension order, then its 16
// lanes with reduce_add, so a score's bits depend only on its query and key.
template <typename C, int G>
void head_scores(const float* queries, const C* base, const int64_t* slots, int64_t n, int64_t dim, float scale,
                 float* probs, int64_t padded) {
  for (int64_t i = 0; i < n; ++i) {
    const C* key = base + slots[i] * dim;  // [D]
    F16 sums[G];
    for (int h = 0; h < G; ++h) sums[h] = set16(0.f);
    for (int64_t d = 0; d < dim; d += 16) {
      const F16 k = load_cache(key + d);
      for (int h = 0; h < G; ++h) sums[h] = fmadd16(load16(queries + h * dim + d), k, sums[h]);
    }
    for (int h = 0; h < G; ++h) probs[h * padded + i] = reduce_add(sums[h]) * scale;
  }
}

// sums[h, columns] += probs[h, i] * value at slots[i] for i in [0, n), in slot order, for CHUNKS registers of
// columns (fewer when fewer are left) and G heads: each value row is read once for all G heads. The running sums
// [G, D] live in memory between calls (exactly: float32 in, float32 out), so a row's slots can come in tiles.
template <typename C, int G, int CHUNKS>
void head_sums_up_to(int chunks, const float* probs, int64_t padded, const C* base, const int64_t* slots, int64_t n,
                     int64_t dim, int64_t column, float* sums) {
  if (chunks < CHUNKS) {
    if constexpr (CHUNKS > 1) head_sums_up_to<C, G, CHUNKS - 1>(chunks, probs, padded, base, slots, n, dim, column, sums);
    return;
  }
  V running[G][CHUNKS];
  for (int h = 0; h < G; ++h) for (int c = 0; c < CHUNKS; ++c) running[h][c] = vload(sums + h * dim + column + kLanes * c);
  for (int64_t i = 0; i < n; ++i) {
    const C* value = base + slots[i] * dim + column;
    V rows[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) rows[c] = load_lanes(value + kLanes * c);
    for (int h = 0; h < G; ++h) {
      const V weight = vset1(probs[h * padded + i]);
      for (int c = 0; c < CHUNKS; ++c) running[h][c] = vfmadd(weight, rows[c], running[h][c]);
    }
  }
  for (int h = 0; h < G; ++h) for (int c = 0; c < CHUNKS; ++c) vstore(sums + h * dim + column + kLanes * c, running[h][c]);
}

template <typename C, int G>
void head_sums(const float* probs, int64_t padded, const C* base, const int64_t* slots, int64_t n, int64_t dim,
               float* sums) {
  // As many column registers as leave the G * CHUNKS sums and CHUNKS value rows in the register file.
  constexpr int kRegisters = kLanes == 16 ? 32 : 16;
  constexpr int kChunks = std::max(1, std::min(8, (kRegisters - 2) / (G + 1)));
  for (int64_t column = 0; column < dim; column += kChunks * kLanes) {
    const int chunks = (int)std::min<int64_t>(kChunks, (dim - column) / kLanes);
    head_sums_up_to<C, G, kChunks>(chunks, probs, padded, base, slots, n, dim, column, sums);
  }
}

// f(G) with G a compile-time count of heads in [1, kMaxHeads].
template <typename F>
void with_heads(int64_t count, F f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
#if W4A8_AVX512
    case 7: f(std::integral_constant<int, 7>()); break;
    case 8: f(std::integral_constant<int, 8>()); break;
#endif
    default: TORCH_CHECK(false, "heads per pass out of range");
  }
}

// One row's work for one KV head's group of query heads: its queries [heads, D], the slots it sees (n of them,
// in ascending order) and where its output [heads, D] goes.
struct GroupRow {
  const float* queries;
  const int64_t* slots;
  int64_t n;
  float* out;
};

// f(r, first, count, h0, G) for every tile [first, first + count) of slots that row r sees, tile by tile with
// every row in turn, and every pass of G heads from h0 (G a compile-time count).
template <typename F>
void each_tile(const std::vector<GroupRow>& rows, int64_t most, int64_t heads, int64_t per_pass, F f) {
  for (int64_t first = 0; first < most; first += kSlotTile) {
    for (size_t r = 0; r < rows.size(); ++r) {
      const int64_t count = std::min(rows[r].n, first + kSlotTile) - first;
      for (int64_t h0 = 0; h0 < heads && count > 0; h0 += per_pass) {
        with_heads(std::min(per_pass, heads - h0), [&](auto g) { f(r, first, count, h0, g); });
      }
    }
  }
}

// Attention for rows that list the same slots up to each one's own n (a causal block: prefixes of one list), or
// for one row: scores tile by tile, each row's softmax, then weighted values tile by tile. Every row's sums run
// in its slots' order whatever the tiling and whoever shares the block, so its bits are its own.
template <typename C>
void attend_block(const std::vector<GroupRow>& rows, int64_t heads, const C* keys, const C* values, int64_t dim,
                  float scale, std::vector<float>& probs, std::vector<float>& sums, std::vector<float>& inverse) {
  int64_t most = 0;
  for (const GroupRow& row : rows) most = std::max(most, row.n);
  const int64_t padded = (most + 15) / 16 * 16, passes = (heads + kMaxHeads - 1) / kMaxHeads;
  const int64_t per_pass = (heads + passes - 1) / passes;  // heads split evenly: 7 = 4 + 3, not 6 + 1
  probs.assign(rows.size() * heads * padded, 0.f);  // [R, heads, padded]
  sums.assign(rows.size() * heads * dim, 0.f);  // [R, heads, D]
  each_tile(rows, most, heads, per_pass, [&](size_t r, int64_t first, int64_t count, int64_t h0, auto g) {
    head_scores<C, decltype(g)::value>(rows[r].queries + h0 * dim, keys, rows[r].slots + first, count, dim, scale,
                                        probs.data() + (r * heads + h0) * padded + first, padded);
  });
  inverse.resize(rows.size() * heads);
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t n = rows[r].n, row_padded = (n + 15) / 16 * 16;
    for (int64_t h = 0; h < heads; ++h) {
      float* p = probs.data() + (r * heads + h) * padded;  // [row_padded]: slots past n are padding
      for (int64_t i = n; i < row_padded; ++i) p[i] = -INFINITY;
      F16 top = load16(p);
      for (int64_t i = 16; i < row_padded; i += 16) top = max16(top, load16(p + i));
      const F16 shift = set16(reduce_max(top));
      F16 total = set16(0.f);
      for (int64_t i = 0; i < row_padded; i += 16) {
        store16(p + i, exp16(load16(p + i) - shift));
        for (int64_t j = std::max(i, n); j < i + 16; ++j) p[j] = 0.f;  // the padding weighs nothing
        total = total + load16(p + i);
      }
      inverse[r * heads + h] = 1.f / reduce_add(total);
    }
  }
  each_tile(rows, most, heads, per_pass, [&](size_t r, int64_t first, int64_t count, int64_t h0, auto g) {
    head_sums<C, decltype(g)::value>(probs.data() + (r * heads + h0) * padded + first, padded, values,
                                     rows[r].slots + first, count, dim, sums.data() + (r * heads + h0) * dim);
  });
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const V factor = vset1(inverse[r * heads + h]);
      const float* sum = sums.data() + (r * heads + h) * dim;
      for (int64_t d = 0; d < dim; d += kLanes) vstore(rows[r].out + h * dim + d, vmul(vload(sum + d), factor));
    }
  }
}

// Writes the new keys and values into each sequence's cache, then each row attends its visible slots in
// ascending order, per KV head group; threads split (sequence, KV head, block of rows) units.
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
  const int64_t batch = (int64_t)starts.size(), block = 32;
  const int64_t blocks = (new_tokens + block - 1) / block;
  // Whether row r of sequence b sees exactly the slots [0, n): then it needs no list of its own (a causal
  // prefill's or a chain's rows; a tree's or a window's gather theirs).
  const auto sees_prefix = [&](int64_t r, int64_t n) {
    if (!visible) return true;
    for (int64_t s = 0; s < seen; ++s) if (visible[r * seen + s] != (s < n)) return false;
    return true;
  };
  at::parallel_for(0, batch * hs.kv_heads * blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> prefix, slots;  // slots: the list of a row that sees no prefix
    std::vector<GroupRow> causal, single(1);
    std::vector<float> probs, sums, inverse;  // attend_block's scratch, reused across units
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (hs.kv_heads * blocks), g = u / blocks % hs.kv_heads, first = u % blocks * block;
      const int64_t last = std::min(new_tokens, first + block);  // rows [first, last) of sequence b
      const C* k = keys[b] + g * capacities[b] * hs.dim;
      const C* v = values[b] + g * capacities[b] * hs.dim;
      for (int64_t s = (int64_t)prefix.size(); s < starts[b] + last; ++s) prefix.push_back(s);
      causal.clear();
      for (int64_t t = first; t < last; ++t) {
        const int64_t r = b * new_tokens + t;
        GroupRow row{qkv + r * width + g * group * hs.dim, prefix.data(), starts[b] + t + 1,
                     out + r * hs.heads * hs.dim + g * group * hs.dim};
        if (sees_prefix(r, row.n)) {
          causal.push_back(row);
          continue;
        }
        slots.clear();
        for (int64_t s = 0; s < seen; ++s) if (visible[r * seen + s]) slots.push_back(s);
        row.slots = slots.data(), row.n = (int64_t)slots.size();
        single[0] = row;
        attend_block(single, group, k, v, hs.dim, scale, probs, sums, inverse);
      }
      if (!causal.empty()) attend_block(causal, group, k, v, hs.dim, scale, probs, sums, inverse);
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
