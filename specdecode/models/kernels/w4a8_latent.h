// A w4a8 latent-attention decoder layer in one call (DeepSeek-V3, GLM-4.7-Flash; decoder/mla.py computes the same
// in PyTorch, in its fixed-order absorbed form): RMSNorm, the query (low-rank with its norm, or one matmul), the
// latent and rotary key with the latent's norm, rope on the rotary parts, each head's W_UK product, attention over
// the latent cache, each head's W_UV product, the output matmul, and the MLP or experts (w4a8_moe.h), with the
// residual stream in float32. Every row on its own and in a fixed order, as the dense fused layer
// (w4a8_layer.cpp): a token's bits depend only on the slots it sees.
#pragma once
#include "w4a8_moe.h"
#include <vector>

// A layer's latent-attention sizes and constants.
struct LatentShape {
  int64_t heads, nope, rope, latent, value;  // nh, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim
  bool interleave;      // rotated pairs are neighbours, the result de-interleaved (DeepSeek's weights)
  double query_scale;   // softmax scale times sqrt(latent + rope): the attention kernel divides by that root
  double eps, latent_eps;  // the layer norms' and the latent norms' epsilon
};

class W4A8LatentLayer {
 public:
  // q (one matmul) or q_a, q_a_norm and q_b (low rank); key_weights [nh, nope, C] and value_weights [nh, C, v],
  // float32, bfloat16 or int8 with scales [nh, C] and [nh, v] (head_products.h).
  W4A8LatentLayer(torch::Tensor attn_norm, c10::optional<W4A8Weight> q, c10::optional<W4A8Weight> q_a,
                  c10::optional<torch::Tensor> q_a_norm, c10::optional<W4A8Weight> q_b, W4A8Weight kv_a,
                  torch::Tensor kv_a_norm, torch::Tensor key_weights, c10::optional<torch::Tensor> key_scales,
                  torch::Tensor value_weights, c10::optional<torch::Tensor> value_scales, W4A8Weight o,
                  torch::Tensor mlp_norm, c10::optional<W4A8Weight> gate_up, c10::optional<W4A8Weight> down,
                  std::shared_ptr<W4A8MoE> moe, int64_t heads, int64_t nope, int64_t rope, int64_t latent,
                  int64_t value, bool interleave, double query_scale, double eps, double latent_eps);

  // x [B, T, hidden] float32; caches[b] [1, capacity_b, C + R]: sequence b's latent cache for this layer
  // (float32 or bfloat16); starts [B]: each sequence's cached length; cos, sin [B, 1, T, R/2] float32; visible
  // [B, 1, T, S] bool or None (causal) -> [B, T, hidden].
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor> caches, std::vector<int64_t> starts,
                        torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> visible);

 private:
  // The rotary part `in` [R] of one row, rotated into `out` [R] (de-interleaved where the weights interleave).
  void rotate_into(const float* in, const float* cos, const float* sin, float* out) const;

  torch::Tensor attn_norm_, q_a_norm_, kv_a_norm_, mlp_norm_;  // float32; q_a_norm_ undefined without q_a
  c10::optional<W4A8Weight> q_, q_a_, q_b_;
  W4A8Weight kv_a_, o_;
  torch::Tensor key_weights_, value_weights_;
  c10::optional<torch::Tensor> key_scales_, value_scales_;
  W4A8Feedforward feedforward_;
  LatentShape shape_;
  int64_t hidden_;
};
