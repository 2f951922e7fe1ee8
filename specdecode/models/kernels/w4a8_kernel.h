// What w4a8_layer.cpp needs from w4a8_kernel.cpp: one w4a8 linear layer's tensors and its matmul on raw rows.
#pragma once
#include <torch/extension.h>

// codes [N/16, K/32, 256] uint8 (3-bit codes: 192), group_scales [N/16, K/32, 32] uint8, block_scales
// [N/16, ceil(K/256), 32] bfloat16 (layout in w4a8_core.cpp); bias [N] float32 or undefined.
struct W4A8Weight {
  torch::Tensor codes, group_scales, block_scales, bias;
  int64_t out_features() const { return codes.size(0) * 16; }
  int64_t in_features() const { return codes.size(1) * 32; }
  int bits() const { return (int)(codes.size(2) / 64); }
};

W4A8Weight make_weight(torch::Tensor codes, torch::Tensor group_scales, torch::Tensor block_scales,
                       c10::optional<torch::Tensor> bias);

// A norm's or router's weights as the fused code reads them: a float32 contiguous copy (or t itself).
inline torch::Tensor floats(const torch::Tensor& t) { return t.detach().to(torch::kFloat).contiguous(); }

// out [M, N] = x [M, K] (float32, contiguous rows) times the weight, plus the bias; threads split the tiles.
void w4a8_rows(const float* x, int64_t M, const W4A8Weight& weight, float* out);

torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor group_scales, torch::Tensor block_scales);
