// The fused w4a8 layer's per-row float operations (w4a8_layer.cpp), free of torch so that the kernel driver
// (tests/kernel_driver) checks them on every instruction set too: each reduces a row in a fixed order, so a
// row's bits do not depend on the other rows, and w4a8_simd.h makes the order the same on every variant.
#pragma once
#include "w4a8_simd.h"
#include <cmath>
#include <cstdint>

// out [R, n] = x / rms(x) * weight per row of n (n a multiple of 16); out may be x.
inline void rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = x + r * n;
    F16 squares = set16(0.f);
    for (int64_t i = 0; i < n; i += 16) squares = fmadd16(load16(v + i), load16(v + i), squares);
    const F16 inv = set16(1.f / std::sqrt(reduce_add(squares) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) store16(out + r * n + i, load16(v + i) * inv * load16(weight + i));
  }
}

// One head [D] rotated in the half-split (NeoX) layout; cos, sin [D/2].
inline void rotate(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i] + a * sin[i];
  }
}

// act [R, I] = silu(gate) * up from gate_up [R, 2I] (I a multiple of 16).
inline void silu_times_up(const float* gate_up, int64_t rows, int64_t inter, float* act) {
  const F16 zero = set16(0.f), one = set16(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const F16 g = load16(gate + i);
      store16(act + r * inter + i, g / (one + exp16(zero - g)) * load16(gate + inter + i));
    }
  }
}
