// Per-head products (head_products.h). A head's weights are read once per four rows of the call (a verify
// forward's few rows share one read), and each output accumulates the inputs in ascending order.
#include "head_products.h"
#include "w4a8_simd.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

// 16 int8 codes as floats (exact); beside w4a8_simd.h's float and bfloat16 loads, so that the same overload set
// serves every weight type below.
inline F16 load16(const int8_t* p) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = vfrom_s8((const uint8_t*)p + i * kLanes);
  return r;
}

namespace {

float scalar(float w) { return w; }
float scalar(int8_t w) { return (float)w; }

float scalar(uint16_t bits) {  // bfloat16 -> float32
  const uint32_t wide = (uint32_t)bits << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// out [RB, 16 CB] (row stride out_stride) = x [RB, n] (row stride x_stride) @ w [n, 16 CB] (row stride m): the
// accumulators stay in registers, each weight vector serves RB rows. Every output sums over n in ascending order
// from zero, one rounding a step, whatever RB and CB: a row's bits do not depend on the block it falls in.
template <int RB, int CB, typename W>
void block(const float* x, int64_t x_stride, const W* w, int64_t n, int64_t m, float* out, int64_t out_stride) {
  F16 sums[RB][CB];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CB; ++c) sums[r][c] = set16(0.f);
  }
  for (int64_t i = 0; i < n; ++i) {
    F16 weights[CB];
    for (int c = 0; c < CB; ++c) weights[c] = load16(w + i * m + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const F16 input = set16(x[r * x_stride + i]);
      for (int c = 0; c < CB; ++c) sums[r][c] = fmadd16(input, weights[c], sums[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < CB; ++c) store16(out + r * out_stride + 16 * c, sums[r][c]);
  }
}

// RB rows of one head: column blocks of 64, then of 16, then the last few columns one at a time.
template <int RB, typename W>
void rows_of_head(const float* x, int64_t x_stride, const W* w, int64_t n, int64_t m, float* out,
                  int64_t out_stride) {
  int64_t j = 0;
  for (; j + 64 <= m; j += 64) block<RB, 4>(x, x_stride, w + j, n, m, out + j, out_stride);
  for (; j + 16 <= m; j += 16) block<RB, 1>(x, x_stride, w + j, n, m, out + j, out_stride);
  for (; j < m; ++j) {
    for (int r = 0; r < RB; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum = std::fma(x[r * x_stride + i], scalar(w[i * m + j]), sum);
      out[r * out_stride + j] = sum;
    }
  }
}

// out [R, m] (row stride out_stride) = x [R, n] (row stride x_stride) @ w [n, m], four rows at a time.
template <typename W>
void one_head(const float* x, int64_t x_stride, int64_t rows, const W* w, int64_t n, int64_t m, float* out,
              int64_t out_stride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) rows_of_head<4>(x + r * x_stride, x_stride, w, n, m, out + r * out_stride, out_stride);
  for (; r < rows; ++r) rows_of_head<1>(x + r * x_stride, x_stride, w, n, m, out + r * out_stride, out_stride);
}

}  // namespace

void check_head_weights(const torch::Tensor& weights, const c10::optional<torch::Tensor>& scales) {
  TORCH_CHECK(weights.dim() == 3 && weights.is_contiguous() &&
              (weights.scalar_type() == torch::kFloat || weights.scalar_type() == torch::kBFloat16 ||
               weights.scalar_type() == torch::kChar), "weights: [nh, n, m] contiguous float32, bfloat16 or int8");
  const bool codes = weights.scalar_type() == torch::kChar;
  TORCH_CHECK(codes == scales.has_value(), "int8 weights take scales [nh, m], and only they");
  if (codes) {
    TORCH_CHECK(scales->scalar_type() == torch::kFloat && scales->is_contiguous() && scales->dim() == 2 &&
                scales->size(0) == weights.size(0) && scales->size(1) == weights.size(2), "scales: [nh, m] float32");
  }
}

void head_products_rows(const float* x, int64_t x_row, int64_t x_head, int64_t rows, const torch::Tensor& weights,
                        const c10::optional<torch::Tensor>& scales, float* out, int64_t out_row, int64_t out_head) {
  const int64_t heads = weights.size(0), n = weights.size(1), m = weights.size(2);
  const bool codes = weights.scalar_type() == torch::kChar, bf16 = weights.scalar_type() == torch::kBFloat16;
  const void* ws = weights.data_ptr();
  at::parallel_for(0, heads, 1, [&](int64_t first, int64_t end) {
    for (int64_t h = first; h < end; ++h) {
      const float* xh = x + h * x_head;
      float* oh = out + h * out_head;
      if (codes) {  // each output's sum over codes, then its column's scale
        one_head(xh, x_row, rows, (const int8_t*)ws + h * n * m, n, m, oh, out_row);
        const float* scale = scales->data_ptr<float>() + h * m;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < m; ++j) oh[r * out_row + j] *= scale[j];
        }
      } else if (bf16) {
        one_head(xh, x_row, rows, (const uint16_t*)ws + h * n * m, n, m, oh, out_row);
      } else {
        one_head(xh, x_row, rows, (const float*)ws + h * n * m, n, m, oh, out_row);
      }
    }
  });
}

torch::Tensor head_products(torch::Tensor x, torch::Tensor weights, c10::optional<torch::Tensor> scales) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [R, nh, n] contiguous float32");
  check_head_weights(weights, scales);
  TORCH_CHECK(weights.size(0) == x.size(1) && weights.size(1) == x.size(2), "weights: [nh, n, m] for x [R, nh, n]");
  const int64_t rows = x.size(0), heads = x.size(1), n = x.size(2), m = weights.size(2);
  torch::Tensor out = torch::empty({rows, heads, m}, torch::kFloat);
  head_products_rows(x.data_ptr<float>(), heads * n, n, rows, weights, scales, out.data_ptr<float>(), heads * m, m);
  return out;
}
