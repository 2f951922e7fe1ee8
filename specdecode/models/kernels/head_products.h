// Each head's own small matmul, for every row, in one call and in a fixed order: latent attention's absorbed form
// (decoder/mla.py) folds kv_b's key half into each head's query and applies its value half to each head's sum.
// One oneDNN matmul per head cost about 31 us each at one row (40 a layer on GLM-4.7-Flash, more than the layer's
// experts); here a row's outputs sum over the inputs in ascending order whatever the number of rows, so a row's bits
// never depend on the rows beside it.
#pragma once
#include <torch/extension.h>

// x [R, nh, n] float32, weights [nh, n, m] float32, bfloat16 or int8 codes with scales [nh, m] float32 (one a
// column: w = code * scale) -> [R, nh, m] float32: out[r, h] = x[r, h] @ weights[h].
torch::Tensor head_products(torch::Tensor x, torch::Tensor weights, c10::optional<torch::Tensor> scales);

// The same on raw rows, for the fused latent layer (w4a8_latent.cpp): head h of row r reads n inputs at
// x + r * x_row + h * x_head and writes m outputs at out + r * out_row + h * out_head.
void check_head_weights(const torch::Tensor& weights, const c10::optional<torch::Tensor>& scales);
void head_products_rows(const float* x, int64_t x_row, int64_t x_head, int64_t rows, const torch::Tensor& weights,
                        const c10::optional<torch::Tensor>& scales, float* out, int64_t out_row, int64_t out_head);
