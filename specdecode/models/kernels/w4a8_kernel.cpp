// The w4a8 matmul as the torch extension sees it: tensors checked and turned into raw views, rows quantized once,
// and the tiles split among torch's threads. The kernel itself, and the weight layout, are in w4a8_core.cpp.
#include "w4a8_kernel.h"
#include "w4a8_core.h"
#include <ATen/Parallel.h>

W4A8Weight make_weight(torch::Tensor codes, torch::Tensor group_scales, torch::Tensor block_scales,
                       c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(codes.dim() == 3 && (codes.size(2) == 256 || codes.size(2) == 192) &&
              codes.scalar_type() == torch::kByte && codes.is_contiguous(),
              "codes: [N/16, K/32, 256] (4-bit) or [N/16, K/32, 192] (3-bit) contiguous uint8");
  const int64_t T = codes.size(0), G = codes.size(1);
  TORCH_CHECK(group_scales.dim() == 3 && group_scales.size(0) == T && group_scales.size(1) == G &&
              group_scales.size(2) == 32 && group_scales.scalar_type() == torch::kByte &&
              group_scales.is_contiguous(), "group_scales: [N/16, K/32, 32] contiguous uint8");
  TORCH_CHECK(block_scales.dim() == 3 && block_scales.size(0) == T && block_scales.size(1) == (G + 7) / 8 &&
              block_scales.size(2) == 32 && block_scales.scalar_type() == torch::kBFloat16 &&
              block_scales.is_contiguous(), "block_scales: [N/16, ceil(K/256), 32] contiguous bfloat16");
  W4A8Weight weight{codes, group_scales, block_scales, torch::Tensor()};
  if (bias.has_value()) {
    weight.bias = bias->to(torch::kFloat).contiguous();
    TORCH_CHECK(weight.bias.numel() == weight.out_features(), "bias: [N]");
  }
  return weight;
}

// Threads split the tiles (w4a8_core.cpp does the work).
void w4a8_rows(const float* x, int64_t M, const W4A8Weight& weight, float* out) {
  const W4A8View view{weight.codes.data_ptr<uint8_t>(), weight.group_scales.data_ptr<uint8_t>(),
                      (const uint16_t*)weight.block_scales.data_ptr<at::BFloat16>(),
                      weight.bias.defined() ? weight.bias.data_ptr<float>() : nullptr, weight.out_features(),
                      weight.in_features(), weight.bits()};
  const QuantizedRows rows = quantize_rows(x, M, view.in_features);
  at::parallel_for(0, view.out_features / 16, 1, [&](int64_t t0, int64_t t1) { w4a8_tiles(rows, view, t0, t1, out); });
}

// x [M, K] float32 -> [M, N] float32, for the layers outside a fused decoder layer (the output head).
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor group_scales, torch::Tensor block_scales) {
  const W4A8Weight weight = make_weight(codes, group_scales, block_scales, c10::nullopt);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.in_features() && x.scalar_type() == torch::kFloat &&
              x.is_contiguous(), "x: [M, K] contiguous float32");
  auto out = torch::empty({x.size(0), weight.out_features()}, torch::kFloat);
  w4a8_rows(x.data_ptr<float>(), x.size(0), weight, out.data_ptr<float>());
  return out;
}
