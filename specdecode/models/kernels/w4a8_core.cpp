// int4 weights x int8 activations for small batches of rows on AVX-512 VNNI, AVX2 or ARM NEON (see
// w4a8_linear.py for the why, and w4a8_simd.h for what differs between them: the vector width and the integer
// dot product). Free of torch (w4a8_core.h); w4a8_kernel.cpp calls it from the extension.
//
// Weight layout, per tile of 16 output rows and group of 32 inputs (g), and block of 8 groups (256 inputs):
//   codes         [N/16, K/32, 256] uint8: four runs of 64 bytes; byte 4n+b of run p holds the 4-bit code of
//                 (row n, input 4p+b) in its low nibble and of (row n, input 16+4p+b) in its high nibble, so
//                 one 64-byte load and a mask give 16 rows x 4 inputs, the operand shape of vpdpbusd (on AVX2,
//                 bytes 0-31 and 32-63 of a run give rows 0-7 and 8-15, the same shape for vpmaddubsw; on NEON,
//                 each 16 bytes give 4 rows x 4 inputs, the shape of sdot);
//   group_scales  [N/16, K/32, 32] uint8: the 16 rows' scale codes (uint8), then their offset codes (int8);
//   block_scales  [N/16, ceil(K/256), 32] bfloat16: the 16 rows' scale multipliers, then offset multipliers.
// w = code * (scale code * scale multiplier) + offset code * offset multiplier: 4.625 bits per weight, as
// llama.cpp's Q4_K spends 4.5 (its scales have 6 bits), where float16 scales and offsets per group cost 5.
// w3a8 (3-bit codes, 3.625 bits per weight: a draft model's cheaper form) differs only in the codes:
//   codes         [N/16, K/32, 192] uint8: three vectors of 64 bytes; with q_j the code of (row n, input 4j+b),
//                 byte 4n+b of the first holds q_0 in bits 0-2, q_1 in bits 3-5 and q_6's low two bits in bits
//                 6-7; of the second q_2, q_3 and q_7's low two bits; of the third q_4, q_5, and the third bits
//                 of q_6 and q_7 in bits 6 and 7. Each quad is then one to five byte operations away from the
//                 16 rows x 4 inputs vpdpbusd takes (vcodes3 in w4a8_simd.h): 19 a group against 4-bit's 12,
//                 where a layout of bit planes took 37 and cost more time than its bytes saved.
// Activations are quantized per row and group of 32 to int8 with scale d; a group's contribution to an
// output is then d * (scale * sum(code * a) + offset * sum(a)), with the integer sum exact.
// Each row is quantized on its own and reduced in the same order whatever M is, so results are batch-invariant.
#include "w4a8_core.h"
#include "w4a8_simd.h"
#include <algorithm>
#include <cmath>
#include <vector>

// Activations [M, K] float32 -> int8 codes per group of 32, with the group's scale d and d * sum(codes).
// Rounding is to nearest even (vround_int), as torch.round does.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  QuantizedRows rows{M, K, std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  int8_t* q = rows.codes.data();
  float* d = rows.scales.data();
  float* dsum = rows.scaled_sums.data();
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
  return rows;
}

// MB rows (at most kRowsPerPass) against one tile of 16 output rows, kLanes of the tile's rows at a time. Each
// output is summed over the groups in order whatever the variant, so the variants' floats are the same.
// Groups ahead to prefetch codes and scale codes (2 KB; 4 and 16 measured slower). From about 4 rows on the
// kernel is bound by its multiplies, and the hardware prefetcher alone left the stream and those multiplies
// taking turns: verifying 8 rows cost 2.1x one token with it, 1.7x with this (docs/benchmarks/verify_rows.py).
constexpr int kPrefetchGroups = 8;

// Bytes of codes per group of a tile: 256 at 4 bits, 192 at 3.
template <int Bits>
constexpr int kGroupBytes = Bits * 64;

// A group's codes for kLanes of a tile's rows, quad j (inputs 4j .. 4j+3) in codes[j]; `block` is the group's
// codes plus 4 * the first row.
template <int Bits>
inline void unpack_group(const uint8_t* block, VI codes[8]) {
  if constexpr (Bits == 4) {
    for (int p = 0; p < 4; ++p) {
      const VI v = vload_codes(block + 64 * p);
      codes[p] = vlow_nibbles(v);
      codes[p + 4] = vhigh_nibbles(v);
    }
  } else {
    const VI v[3] = {vload_codes(block), vload_codes(block + 64), vload_codes(block + 128)};
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) codes[j] = vcodes3(v, j);
  }
}

// Quad j's codes alone, for the paired AVX2 tile, which unpacks one quad at a time.
template <int Bits>
inline VI quad_codes(const uint8_t* block, int j) {
  if constexpr (Bits == 4) {
    const VI run = vload_codes(block + 64 * (j % 4));
    return j < 4 ? vlow_nibbles(run) : vhigh_nibbles(run);
  } else {
    const VI v[3] = {vload_codes(block), vload_codes(block + 64), vload_codes(block + 128)};
    return vcodes3(v, j);
  }
}

template <int MB, int Bits>
static void tile_rows(const uint8_t* w, const uint8_t* gs, const uint16_t* bs, const int8_t* q, const float* d,
                      const float* dsum, int64_t K, int64_t N, const float* bias, float* out) {
  const int64_t G = K / 32;
  // Registers of kLanes outputs taken per pass over the groups. A row alone is bound by latency and the stream,
  // not by the multiplies: it takes the whole tile in one pass (on AVX2 and NEON, 2 or 4 independent chains and
  // one walk over the codes). Several rows keep to one register each, so that their accumulators fit.
  constexpr int H = MB == 1 ? kParts : 1;
  for (int lane0 = 0; lane0 < 16; lane0 += kLanes * H) {
    V acc[MB][H];  // unrolled loops over rows keep these in registers (GCC kept them on the stack otherwise)
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) {
      for (int h = 0; h < H; ++h) acc[i][h] = vset1(0.f);
    }
    V scale_unit[H], offset_unit[H];
    for (int64_t g = 0; g < G; ++g) {
      if (g % 8 == 0) {
        for (int h = 0; h < H; ++h) {
          scale_unit[h] = vfrom_bf16(bs + g / 8 * 32 + lane0 + h * kLanes);
          offset_unit[h] = vfrom_bf16(bs + g / 8 * 32 + 16 + lane0 + h * kLanes);
        }
      }
      // Past the tile's last group this reaches into the next tile's, which is the next one a thread takes (past
      // the weight's end, a prefetch does not fault).
      const uint8_t* ahead = w + (g + kPrefetchGroups) * kGroupBytes<Bits>;
      for (int line = 0; line < Bits; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
      if (g % 2 == 0) __builtin_prefetch(gs + (g + kPrefetchGroups) * 32, 0, 3);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) {
        // The tile's rows first .. first + kLanes - 1 are bytes 4 * first onwards of each 64-byte run.
        const int first = lane0 + h * kLanes;
        VI codes[8];
        unpack_group<Bits>(w + g * kGroupBytes<Bits> + 4 * first, codes);
        const V sv = vmul(vfrom_u8(gs + g * 32 + first), scale_unit[h]);
        const V zv = vmul(vfrom_s8(gs + g * 32 + 16 + first), offset_unit[h]);
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) {
          const V dot = vfloat(vdot32<(MB < 4 ? 2 : 1)>(codes, q + i * K + g * 32));
          acc[i][h] = vfmadd(dot, vmul(sv, vset1(d[i * G + g])), acc[i][h]);
          acc[i][h] = vfmadd(zv, vset1(dsum[i * G + g]), acc[i][h]);
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      for (int h = 0; h < H; ++h) {
        const int first = lane0 + h * kLanes;
        vstore(out + i * N + first, bias ? vadd(acc[i][h], vload(bias + first)) : acc[i][h]);
      }
    }
  }
}

#ifdef W4A8_INT16_PAIRS
// tile_rows for 2 to kRowsPerPass rows on AVX2 without VNNI, with the same sums in the same order. There the
// multiplies bound the kernel from 2 rows on, and tile_rows spent as many again on issuing them: it walks the
// tile's two halves apart, so each activation quad is broadcast twice, and its 8 unpacked code registers with
// the rows' accumulators overflow AVX2's 16 registers. Here one walk takes both halves, a quad's codes are
// unpacked once and used by every row, and the rows' int16 pair sums stay in registers (2 per row; the float
// accumulators go to memory, touched once per group).
template <int MB, int Bits>
static void tile_rows_paired(const uint8_t* w, const uint8_t* gs, const uint16_t* bs, const int8_t* q,
                             const float* d, const float* dsum, int64_t K, int64_t N, const float* bias,
                             float* out) {
  const int64_t G = K / 32;
  V acc[MB][2];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = vset1(0.f);
  V scale_unit[2], offset_unit[2];
  for (int64_t g = 0; g < G; ++g) {
    if (g % 8 == 0) {
      for (int h = 0; h < 2; ++h) {
        scale_unit[h] = vfrom_bf16(bs + g / 8 * 32 + h * kLanes);
        offset_unit[h] = vfrom_bf16(bs + g / 8 * 32 + 16 + h * kLanes);
      }
    }
    const uint8_t* ahead = w + (g + kPrefetchGroups) * kGroupBytes<Bits>;
    for (int line = 0; line < Bits; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
    if (g % 2 == 0) __builtin_prefetch(gs + (g + kPrefetchGroups) * 32, 0, 3);
    const uint8_t* block = w + g * kGroupBytes<Bits>;
    VP pairs[MB][2];
    // Bytes 0-31 of each 64-byte run are the tile's rows 0-7, bytes 32-63 rows 8-15.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      VI codes[2];
      for (int h = 0; h < 2; ++h) codes[h] = quad_codes<Bits>(block + 32 * h, j);
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        for (int h = 0; h < 2; ++h) {
          const VP step = vpairs(codes[h], q + i * K + g * 32 + 4 * j);
          pairs[i][h] = j == 0 ? step : vpairs_add(pairs[i][h], step);
          // Held in a register here: GCC otherwise stored every step to the stack and added them all at the end.
          asm("" : "+x"(pairs[i][h]));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const V sv = vmul(vfrom_u8(gs + g * 32 + h * kLanes), scale_unit[h]);
      const V zv = vmul(vfrom_s8(gs + g * 32 + 16 + h * kLanes), offset_unit[h]);
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        const V dot = vfloat(vpairs_sum(pairs[i][h]));
        acc[i][h] = vfmadd(dot, vmul(sv, vset1(d[i * G + g])), acc[i][h]);
        acc[i][h] = vfmadd(zv, vset1(dsum[i * G + g]), acc[i][h]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int h = 0; h < 2; ++h) {
      vstore(out + i * N + h * kLanes, bias ? vadd(acc[i][h], vload(bias + h * kLanes)) : acc[i][h]);
    }
  }
}
#endif

// tile_rows<rows> for a rows in [1, MB] known at run time.
template <int MB, int Bits>
static void tile_rows_up_to(int rows, const uint8_t* w, const uint8_t* gs, const uint16_t* bs, const int8_t* q,
                            const float* d, const float* dsum, int64_t K, int64_t N, const float* bias, float* out) {
  if (rows == MB) {
#ifdef W4A8_INT16_PAIRS
    if constexpr (MB > 1) {
      tile_rows_paired<MB, Bits>(w, gs, bs, q, d, dsum, K, N, bias, out);
      return;
    }
#endif
    tile_rows<MB, Bits>(w, gs, bs, q, d, dsum, K, N, bias, out);
  } else if constexpr (MB > 1) {
    tile_rows_up_to<MB - 1, Bits>(rows, w, gs, bs, q, d, dsum, K, N, bias, out);
  }
}

// Rows go kRowsPerPass at a time so that a tile's unpacked codes stay in registers.
template <int Bits>
static void tiles_of(const QuantizedRows& x, const W4A8View& weight, int64_t first_tile, int64_t end_tile,
                     float* out) {
  const int64_t M = x.rows, K = weight.in_features, N = weight.out_features, G = K / 32;
  for (int64_t t = first_tile; t < end_tile; ++t) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int rows = (int)std::min<int64_t>(kRowsPerPass, M - m0);
      const uint8_t* wt = weight.codes + t * G * kGroupBytes<Bits>;
      const uint8_t* gt = weight.group_scales + t * G * 32;
      const uint16_t* bt16 = weight.block_scales + t * ((G + 7) / 8) * 32;
      const int8_t* qm = x.codes.data() + m0 * K;
      const float* dm = x.scales.data() + m0 * G;
      const float* dsm = x.scaled_sums.data() + m0 * G;
      const float* bt = weight.bias ? weight.bias + t * 16 : nullptr;
      tile_rows_up_to<kRowsPerPass, Bits>(rows, wt, gt, bt16, qm, dm, dsm, K, N, bt, out + m0 * N + t * 16);
    }
  }
}

void w4a8_tiles(const QuantizedRows& x, const W4A8View& weight, int64_t first_tile, int64_t end_tile, float* out) {
  if (weight.bits == 3) {
    tiles_of<3>(x, weight, first_tile, end_tile, out);
  } else {
    tiles_of<4>(x, weight, first_tile, end_tile, out);
  }
}
