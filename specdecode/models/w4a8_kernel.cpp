// int4 weights x int8 activations for small batches of rows on AVX-512 VNNI (see w4a8_linear.py for the why).
//
// Weight layout, per tile of 16 output rows and group of 32 inputs (g):
//   codes   [N/16, K/32, 256] uint8: four runs of 64 bytes; byte 4n+b of run p holds the 4-bit code of
//           (row n, input 4p+b) in its low nibble and of (row n, input 16+4p+b) in its high nibble, so one
//           64-byte load and a mask give 16 rows x 4 inputs, the operand shape of vpdpbusd;
//   scales, offsets [N/16, K/32, 16] float16: w = code * scale + offset.
// Activations are quantized per row and group of 32 to int8 with scale d; a group's contribution to an
// output is then d * (scale * sum(code * a) + offset * sum(a)), with the integer sum exact.
// Each row is quantized on its own and reduced in the same order whatever M is, so results are batch-invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

// Activations [M, K] float32 -> int8 codes per group of 32, with the group's scale d and d * sum(codes).
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* dsum) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + m * K + g * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        int c = (int)std::nearbyint(v[i] * inv);
        c = std::min(127, std::max(-127, c));
        q[m * K + g * 32 + i] = (int8_t)c;
        sum += c;
      }
      d[m * G + g] = scale;
      dsum[m * G + g] = scale * (float)sum;
    }
  }
}

// MB rows (at most 8) against one tile of 16 output rows: 2*MB accumulators plus 8 code registers fit the
// 32 vector registers.
template <int MB>
static void tile_rows(const uint8_t* w, const uint16_t* s, const uint16_t* z, const int8_t* q, const float* d,
                      const float* dsum, int64_t K, int64_t N, float* out) {
  const int64_t G = K / 32;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* block = w + g * 256;
    __m512i codes[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(block + 64 * p);
      codes[p] = _mm512_and_si512(v, low4);
      codes[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + g * 16)));
    const __m512 zv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(z + g * 16)));
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
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + i * N, acc[i]);
}

// x [M, K] float32; w [N/16, K/32, 256] uint8; s, z [N/16, K/32, 16] float16 -> [M, N] float32.
// Threads split the tiles; rows go 8 at a time so that a tile's unpacked codes stay in registers for all 8.
torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor z) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [M, K] contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), T = w.size(0), G = K / 32, N = T * 16;
  TORCH_CHECK(K % 32 == 0 && w.dim() == 3 && w.size(1) == G && w.size(2) == 256 &&
              w.scalar_type() == torch::kByte && w.is_contiguous(), "w: [N/16, K/32, 256] contiguous uint8");
  for (const auto& t : {s, z}) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == T && t.size(1) == G && t.size(2) == 16 &&
                t.scalar_type() == torch::kHalf && t.is_contiguous(), "scales: [N/16, K/32, 16] contiguous float16");
  }
  auto q = torch::empty({M, K}, torch::kInt8);
  auto d = torch::empty({M, G}, torch::kFloat);
  auto dsum = torch::empty({M, G}, torch::kFloat);
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), dsum.data_ptr<float>());
  auto out = torch::empty({M, N}, torch::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = (const uint16_t*)s.data_ptr<at::Half>();
  const uint16_t* zp = (const uint16_t*)z.data_ptr<at::Half>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const float* dsp = dsum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int rows = (int)std::min<int64_t>(8, M - m0);
        const uint8_t* wt = wp + t * G * 256;
        const uint16_t* st = sp + t * G * 16;
        const uint16_t* zt = zp + t * G * 16;
        const int8_t* qm = qp + m0 * K;
        const float* dm = dp + m0 * G;
        const float* dsm = dsp + m0 * G;
        float* om = op + m0 * N + t * 16;
        switch (rows) {
          case 1: tile_rows<1>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          case 2: tile_rows<2>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          case 3: tile_rows<3>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          case 4: tile_rows<4>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          case 5: tile_rows<5>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          case 6: tile_rows<6>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          case 7: tile_rows<7>(wt, st, zt, qm, dm, dsm, K, N, om); break;
          default: tile_rows<8>(wt, st, zt, qm, dm, dsm, K, N, om); break;
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("w4a8_mm", &w4a8_mm); }
