// Attention over each sequence's own K/V cache, in a fixed order: a row (token) attends its visible slots in
// ascending slot order, so its bits depend only on the slots it sees, not on how many rows, sequences or masked
// slots share the call. The fused w4a8 layer (w4a8_layer.cpp) and the float layers (float_decoder.py) both
// attend through it, which is what makes their forwards batch-invariant.
#pragma once
#include <torch/extension.h>
#include <vector>

// A layer's heads: H query heads and Hkv key/value heads of D each. A row of qkv holds [(H + 2 Hkv) * D]: the
// query heads, then the keys, then the values.
struct HeadShape {
  int64_t heads, kv_heads, dim;
  int64_t width() const { return (heads + 2 * kv_heads) * dim; }
};

// Checks keys[b], values[b] [Hkv, capacity_b, D] (contiguous, float32 or bfloat16, one dtype for all) against
// starts[b] (sequence b's cached length, where its new slots go) -> each capacity.
std::vector<int64_t> check_caches(const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                  const std::vector<int64_t>& starts, int64_t new_tokens, const HeadShape& hs);

// visible [B, 1, T, S] bool, made contiguous; undefined when not given (causal over the new tokens, every
// cached slot visible). It never marks a slot at or past starts[b] + T.
torch::Tensor check_visible(const c10::optional<torch::Tensor>& visible, int64_t batch, int64_t new_tokens);

// Writes the new keys and values of qkv [B * T, width] (positions already applied) into the caches at starts,
// then out [B * T, H * D] = each row's attention over its visible slots.
void attend_rows(const float* qkv, const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                 const std::vector<int64_t>& capacities, const std::vector<int64_t>& starts, int64_t new_tokens,
                 const torch::Tensor& visible, const HeadShape& hs, float* out);

// The same from Python: qkv [B, T, width] float32 -> [B, T, H * D] float32.
torch::Tensor attend(torch::Tensor qkv, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                     std::vector<int64_t> starts, c10::optional<torch::Tensor> visible, int64_t heads,
                     int64_t kv_heads, int64_t head_dim);
