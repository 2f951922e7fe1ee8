// The w4a8 matmul on raw pointers, free of torch, so that a small driver compiled for any instruction set (an
// ARM one under qemu-user included) runs the very code the extension runs (tests/kernel_driver). The weight
// layout is described in w4a8_core.cpp; w4a8_kernel.cpp holds the torch glue around it.
#pragma once
#include <cstdint>
#include <vector>

// One w4a8 linear layer's packed tensors: codes [N/16, K/32, 256] (w3a8: 192), group_scales [N/16, K/32, 32],
// block_scales [N/16, ceil(K/256), 32] (bfloat16 bits), bias [N] or null; bits: the codes' width, 4 or 3.
struct W4A8View {
  const uint8_t* codes;
  const uint8_t* group_scales;
  const uint16_t* block_scales;
  const float* bias;
  int64_t out_features, in_features;
  int bits;
};

// Rows of activations quantized to int8 per group of 32: codes [M, K], each group's scale d [M, K/32] and
// d * sum(codes) [M, K/32].
struct QuantizedRows {
  int64_t rows, in_features;
  std::vector<int8_t> codes;
  std::vector<float> scales, scaled_sums;
};

// x [M, K] float32 -> its int8 rows; each row on its own, so a row's codes do not depend on the others.
QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in_features);

// out [M, N] columns of tiles [first_tile, end_tile) (16 outputs each) = the quantized rows times the weight,
// plus the bias. Threads take disjoint ranges of tiles; every output is summed in the same order whatever M is.
void w4a8_tiles(const QuantizedRows& x, const W4A8View& weight, int64_t first_tile, int64_t end_tile, float* out);
