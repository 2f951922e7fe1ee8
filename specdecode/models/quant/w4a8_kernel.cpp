// int4 weights x int8 activations for small batches of rows on AVX-512 VNNI (see w4a8_linear.py for the why).
//
// Weight layout, per tile of 16 output rows and group of 32 inputs (g), and block of 8 groups (256 inputs):
//   codes         [N/16, K/32, 256] uint8: four runs of 64 bytes; byte 4n+b of run p holds the 4-bit code of
//                 (row n, input 4p+b) in its low nibble and of (row n, input 16+4p+b) in its high nibble, so
//                 one 64-byte load and a mask give 16 rows x 4 inputs, the operand shape of vpdpbusd;
//   group_scales  [N/16, K/32, 32] uint8: the 16 rows' scale codes (uint8), then their offset codes (int8);
//   block_scales  [N/16, ceil(K/256), 32] bfloat16: the 16 rows' scale multipliers, then offset multipliers.
// w = code * (scale code * scale multiplier) + offset code * offset multiplier: 4.625 bits per weight, as
// llama.cpp's Q4_K spends 4.5 (its scales have 6 bits), where float16 scales and offsets per group cost 5.
// Activations are quantized per row and group of 32 to int8 with scale d; a group's contribution to an
// output is then d * (scale * sum(code * a) + offset * sum(a)), with the integer sum exact.
// Each row is quantized on its own and reduced in the same order whatever M is, so results are batch-invariant.
#include "w4a8_kernel.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Activations [M, K] float32 -> int8 codes per group of 32, with the group's scale d and d * sum(codes).
// Rounding is to nearest even (cvtps_epi32 under the default rounding mode), as torch.round does.
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* dsum) {
  const int64_t G = K / 32;
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i lowest = _mm512_set1_epi32(-127), highest = _mm512_set1_epi32(127);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + m * K + g * 32;
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, magnitude), _mm512_and_ps(b, magnitude)));
      const float scale = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      const __m512i qa = _mm512_min_epi32(highest, _mm512_max_epi32(lowest, _mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
      const __m512i qb = _mm512_min_epi32(highest, _mm512_max_epi32(lowest, _mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
      _mm_storeu_si128((__m128i*)(q + m * K + g * 32), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(q + m * K + g * 32 + 16), _mm512_cvtepi32_epi8(qb));
      d[m * G + g] = scale;
      dsum[m * G + g] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  }
}

// 16 bfloat16 values as float32.
static inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// MB rows (at most 8) against one tile of 16 output rows: 2*MB accumulators plus 8 code registers fit the
// 32 vector registers.
template <int MB>
static void tile_rows(const uint8_t* w, const uint8_t* gs, const uint16_t* bs, const int8_t* q, const float* d,
                      const float* dsum, int64_t K, int64_t N, const float* bias, float* out) {
  const int64_t G = K / 32;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  __m512 scale_unit = _mm512_setzero_ps(), offset_unit = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (g % 8 == 0) {
      scale_unit = bf16x16(bs + g / 8 * 32);
      offset_unit = bf16x16(bs + g / 8 * 32 + 16);
    }
    const uint8_t* block = w + g * 256;
    __m512i codes[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(block + 64 * p);
      codes[p] = _mm512_and_si512(v, low4);
      codes[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m128i scale_codes = _mm_loadu_si128((const __m128i*)(gs + g * 32));
    const __m128i offset_codes = _mm_loadu_si128((const __m128i*)(gs + g * 32 + 16));
    const __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scale_codes)), scale_unit);
    const __m512 zv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(offset_codes)), offset_unit);
    for (int i = 0; i < MB; ++i) {
      const int32_t* a = (const int32_t*)(q + i * K + g * 32);
      // Two accumulators halve the chain of dependent vpdpbusd (latency-bound at one row otherwise).
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        even = _mm512_dpbusd_epi32(even, codes[j], _mm512_set1_epi32(a[j]));
        odd = _mm512_dpbusd_epi32(odd, codes[j + 1], _mm512_set1_epi32(a[j + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(d[i * G + g])), acc[i]);
      acc[i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(dsum[i * G + g]), acc[i]);
    }
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + i * N, bias ? _mm512_add_ps(acc[i], b) : acc[i]);
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

// Threads split the tiles; rows go 8 at a time so that a tile's unpacked codes stay in registers for all 8.
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
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int rows = (int)std::min<int64_t>(8, M - m0);
        const uint8_t* wt = wp + t * G * 256;
        const uint8_t* gt = gp + t * G * 32;
        const uint16_t* bt16 = bp + t * ((G + 7) / 8) * 32;
        const int8_t* qm = q.data() + m0 * K;
        const float* dm = d.data() + m0 * G;
        const float* dsm = dsum.data() + m0 * G;
        const float* bt = bias ? bias + t * 16 : nullptr;
        float* om = out + m0 * N + t * 16;
        switch (rows) {
          case 1: tile_rows<1>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          case 2: tile_rows<2>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          case 3: tile_rows<3>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          case 4: tile_rows<4>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          case 5: tile_rows<5>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          case 6: tile_rows<6>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          case 7: tile_rows<7>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
          default: tile_rows<8>(wt, gt, bt16, qm, dm, dsm, K, N, bt, om); break;
        }
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
