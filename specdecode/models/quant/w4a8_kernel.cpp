// int4 weights x int8 activations for small batches of rows on AVX-512 VNNI, or AVX2 (see w4a8_linear.py for the
// why, and w4a8_simd.h for what differs between the two: the vector width and the integer dot product).
//
// Weight layout, per tile of 16 output rows and group of 32 inputs (g), and block of 8 groups (256 inputs):
//   codes         [N/16, K/32, 256] uint8: four runs of 64 bytes; byte 4n+b of run p holds the 4-bit code of
//                 (row n, input 4p+b) in its low nibble and of (row n, input 16+4p+b) in its high nibble, so
//                 one 64-byte load and a mask give 16 rows x 4 inputs, the operand shape of vpdpbusd (on AVX2,
//                 bytes 0-31 and 32-63 of a run give rows 0-7 and 8-15, the same shape for vpmaddubsw);
//   group_scales  [N/16, K/32, 32] uint8: the 16 rows' scale codes (uint8), then their offset codes (int8);
//   block_scales  [N/16, ceil(K/256), 32] bfloat16: the 16 rows' scale multipliers, then offset multipliers.
// w = code * (scale code * scale multiplier) + offset code * offset multiplier: 4.625 bits per weight, as
// llama.cpp's Q4_K spends 4.5 (its scales have 6 bits), where float16 scales and offsets per group cost 5.
// Activations are quantized per row and group of 32 to int8 with scale d; a group's contribution to an
// output is then d * (scale * sum(code * a) + offset * sum(a)), with the integer sum exact.
// Each row is quantized on its own and reduced in the same order whatever M is, so results are batch-invariant.
#include "w4a8_kernel.h"
#include "w4a8_simd.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Activations [M, K] float32 -> int8 codes per group of 32, with the group's scale d and d * sum(codes).
// Rounding is to nearest even (cvtps_epi32 under the default rounding mode), as torch.round does.
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* dsum) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + m * K + g * 32;
      F16 halves[2] = {load16(v), load16(v + 16)};
      const float amax = reduce_max(max16(abs16(halves[0]), abs16(halves[1])));
      const float scale = amax / 127.f;
      const V inv = vset1(scale > 0.f ? 1.f / scale : 0.f);
      int32_t sum = 0;
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < kParts; ++i) {
          const VI codes = vclamp(vround_int(vmul(halves[h].part[i], inv)), -127, 127);
          vstore_int8(q + m * K + g * 32 + 16 * h + kLanes * i, codes);
          sum += vsum_int(codes);
        }
      }
      d[m * G + g] = scale;
      dsum[m * G + g] = scale * (float)sum;
    }
  }
}

// MB rows (at most kRowsPerPass) against one tile of 16 output rows, kLanes of the tile's rows at a time. Each
// output is summed over the groups in order whatever the variant, so the variants' floats are the same.
// Groups ahead to prefetch codes and scale codes (2 KB; 4 and 16 measured slower). From about 4 rows on the
// kernel is bound by its multiplies, and the hardware prefetcher alone left the stream and those multiplies
// taking turns: verifying 8 rows cost 2.1x one token with it, 1.7x with this (docs/benchmarks/verify_rows.py).
constexpr int kPrefetchGroups = 8;
template <int MB>
static void tile_rows(const uint8_t* w, const uint8_t* gs, const uint16_t* bs, const int8_t* q, const float* d,
                      const float* dsum, int64_t K, int64_t N, const float* bias, float* out) {
  const int64_t G = K / 32;
  for (int lane0 = 0; lane0 < 16; lane0 += kLanes) {
    V acc[MB];  // unrolled loops over rows keep these in registers (GCC kept them on the stack otherwise)
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) acc[i] = vset1(0.f);
    V scale_unit = acc[0], offset_unit = acc[0];
    for (int64_t g = 0; g < G; ++g) {
      if (g % 8 == 0) {
        scale_unit = vfrom_bf16(bs + g / 8 * 32 + lane0);
        offset_unit = vfrom_bf16(bs + g / 8 * 32 + 16 + lane0);
      }
      // Rows lane0 to lane0 + kLanes - 1 of the tile are bytes 4 * lane0 onwards of each 64-byte run.
      const uint8_t* block = w + g * 256 + 4 * lane0;
      // Past the tile's last group this reaches into the next tile's, which is the next one a thread takes (past
      // the weight's end, a prefetch does not fault).
      const uint8_t* ahead = w + (g + kPrefetchGroups) * 256;
      for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)(ahead + 64 * line), _MM_HINT_T0);
      if (g % 2 == 0) _mm_prefetch((const char*)(gs + (g + kPrefetchGroups) * 32), _MM_HINT_T0);
      VI codes[8];
      for (int p = 0; p < 4; ++p) {
        const VI v = vload_codes(block + 64 * p);
        codes[p] = vlow_nibbles(v);
        codes[p + 4] = vhigh_nibbles(v);
      }
      const V sv = vmul(vfrom_u8(gs + g * 32 + lane0), scale_unit);
      const V zv = vmul(vfrom_s8(gs + g * 32 + 16 + lane0), offset_unit);
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        const V dot = vfloat(vdot32<(MB < 4 ? 2 : 1)>(codes, q + i * K + g * 32));
        acc[i] = vfmadd(dot, vmul(sv, vset1(d[i * G + g])), acc[i]);
        acc[i] = vfmadd(zv, vset1(dsum[i * G + g]), acc[i]);
      }
    }
    for (int i = 0; i < MB; ++i) vstore(out + i * N + lane0, bias ? vadd(acc[i], vload(bias + lane0)) : acc[i]);
  }
}

// tile_rows<rows> for a rows in [1, MB] known at run time.
template <int MB>
static void tile_rows_up_to(int rows, const uint8_t* w, const uint8_t* gs, const uint16_t* bs, const int8_t* q,
                            const float* d, const float* dsum, int64_t K, int64_t N, const float* bias, float* out) {
  if (rows == MB) {
    tile_rows<MB>(w, gs, bs, q, d, dsum, K, N, bias, out);
  } else if constexpr (MB > 1) {
    tile_rows_up_to<MB - 1>(rows, w, gs, bs, q, d, dsum, K, N, bias, out);
  }
}

W4A8Weight make_weight(torch::Tensor codes, torch::Tensor group_scales, torch::Tensor block_scales,
                       c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 256 && codes.scalar_type() == torch::kByte &&
              codes.is_contiguous(), "codes: [N/16, K/32, 256] contiguous uint8");
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

// Threads split the tiles; rows go kRowsPerPass at a time so that a tile's unpacked codes stay in registers.
void w4a8_rows(const float* x, int64_t M, const W4A8Weight& weight, float* out) {
  const int64_t K = weight.in_features(), N = weight.out_features(), T = N / 16, G = K / 32;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * G), dsum(M * G);
  quantize_rows(x, M, K, q.data(), d.data(), dsum.data());
  const uint8_t* wp = weight.codes.data_ptr<uint8_t>();
  const uint8_t* gp = weight.group_scales.data_ptr<uint8_t>();
  const uint16_t* bp = (const uint16_t*)weight.block_scales.data_ptr<at::BFloat16>();
  const float* bias = weight.bias.defined() ? weight.bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
        const int rows = (int)std::min<int64_t>(kRowsPerPass, M - m0);
        const uint8_t* wt = wp + t * G * 256;
        const uint8_t* gt = gp + t * G * 32;
        const uint16_t* bt16 = bp + t * ((G + 7) / 8) * 32;
        const int8_t* qm = q.data() + m0 * K;
        const float* dm = d.data() + m0 * G;
        const float* dsm = dsum.data() + m0 * G;
        const float* bt = bias ? bias + t * 16 : nullptr;
        float* om = out + m0 * N + t * 16;
        tile_rows_up_to<kRowsPerPass>(rows, wt, gt, bt16, qm, dm, dsm, K, N, bt, om);
      }
    }
  });
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
