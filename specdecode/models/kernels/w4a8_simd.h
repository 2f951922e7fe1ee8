// The vector operations the w4a8 kernel and fused layer are written in, for each instruction set they are
// compiled for (w4a8_linear.py builds one extension per variant, with that variant's flags):
//   AVX-512 (avx512f, avx512bw, avx512_vnni): V is one 512-bit register of 16 lanes;
//   AVX2 + FMA (and AVX-VNNI where the CPU has it): V is one 256-bit register of 8 lanes;
//   ARM NEON with the dot product (ARMv8.2-A and later: Apple M1 on, Graviton 2 on, Raspberry Pi 5): V is one
//   128-bit register of 4 lanes.
// F16, 16 floats, is one V, two or four, so code written on F16 is written once for all.
//
// The variants compute the same floats: every operation here is per lane and rounded once (fused multiply-add
// included, built with -ffp-contract=off so that nothing else is fused), the integer dot products are exact,
// and horizontal sums and maxima pair lanes as GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps do.
#pragma once
#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define W4A8_AVX512 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define W4A8_NEON 1
#include <arm_neon.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#else
#error "w4a8 needs -mavx512f -mavx512bw -mavx512vnni, -mavx2 -mfma, or (on aarch64) -march=armv8.2-a+dotprod"
#endif

#ifdef W4A8_AVX512
constexpr int kLanes = 16;
using V = __m512;   // kLanes float32
using VI = __m512i;  // kLanes int32, or 4 * kLanes bytes
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline V vfnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline V vround(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vpow2_times(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n an integer
inline V vfloat(VI a) { return _mm512_cvtepi32_ps(a); }
inline VI vround_int(V a) { return _mm512_cvtps_epi32(a); }  // to nearest even, as torch.round
inline VI vclamp(VI a, int low, int high) {
  return _mm512_min_epi32(_mm512_set1_epi32(high), _mm512_max_epi32(_mm512_set1_epi32(low), a));
}
inline void vstore_int8(int8_t* p, VI a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(a)); }
inline int32_t vsum_int(VI a) { return _mm512_reduce_add_epi32(a); }
// kLanes bytes or bfloat16 values as float32.
inline V vfrom_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline V vfrom_s8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline V vfrom_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// The upper 16 bits of each lane, stored as kLanes uint16 (bfloat16 rounding happens before, in vstore_bf16).
inline void vstore_high_halves(uint16_t* p, VI bits) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
inline VI vbits(V a) { return _mm512_castps_si512(a); }
inline V vfrom_bits(VI a) { return _mm512_castsi512_ps(a); }
inline VI vadd_int(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI vand_int(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vshift_right_int(VI a, int bits) { return _mm512_srli_epi32(a, bits); }
inline VI vset1_int(int32_t x) { return _mm512_set1_epi32(x); }

// 4 * kLanes codes: kLanes output rows x 4 inputs, each byte holding two inputs' 4-bit codes.
inline VI vload_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI vlow_nibbles(VI a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0F)); }
inline VI vhigh_nibbles(VI a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F)); }
// Bits moved down within each 16-bit lane (the callers mask away what crosses from the other byte), bytes masked.
inline VI vshift_right16(VI a, int bits) { return _mm512_srli_epi16(a, bits); }
inline VI vmask_bytes(VI a, uint8_t mask) { return _mm512_and_si512(a, _mm512_set1_epi8((char)mask)); }
inline VI vor_int(VI a, VI b) { return _mm512_or_si512(a, b); }
// Per lane (output row): the sum over j of codes[j]'s 4 bytes times the 4 int8 activations a[4j .. 4j+3].
// The activations' 4 bytes are broadcast from memory inside vpdpbusd ({1to16}), which GCC does not fold on its
// own. With Chains = 2 two accumulators halve the chain of dependent vpdpbusd, for a row alone (latency-bound
// otherwise); several rows in flight give that parallelism already. The integer sum is the same either way.
template <int Chains = 2>
inline VI vdot32(const VI codes[8], const int8_t* a) {
  const int32_t* quads = (const int32_t*)a;
  VI sums[Chains];
  for (int c = 0; c < Chains; ++c) sums[c] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sums[j % Chains]) : "v"(codes[j]), "m"(quads[j]));
  }
  return Chains == 2 ? _mm512_add_epi32(sums[0], sums[Chains - 1]) : sums[0];
}
#elif defined(W4A8_NEON)
constexpr int kLanes = 4;
using V = float32x4_t;  // kLanes float32
using VI = int32x4_t;   // kLanes int32, or 4 * kLanes bytes
inline V vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, V v) { vst1q_f32(p, v); }
inline V vset1(float x) { return vdupq_n_f32(x); }
inline V vadd(V a, V b) { return vaddq_f32(a, b); }
inline V vsub(V a, V b) { return vsubq_f32(a, b); }
inline V vmul(V a, V b) { return vmulq_f32(a, b); }
inline V vdiv(V a, V b) { return vdivq_f32(a, b); }
inline V vmin(V a, V b) { return vminq_f32(a, b); }
inline V vmax(V a, V b) { return vmaxq_f32(a, b); }
inline V vfmadd(V a, V b, V c) { return vfmaq_f32(c, a, b); }   // a * b + c, rounded once
inline V vfnmadd(V a, V b, V c) { return vfmsq_f32(c, a, b); }  // c - a * b, rounded once
inline V vround(V a) { return vrndnq_f32(a); }                  // to nearest even
// p * 2^n for integers n in [-126, 127], built in the exponent bits as the AVX2 variant does.
inline V vpow2_times(V p, V n) {
  const int32x4_t exponent = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(exponent));
}
inline V vfloat(VI a) { return vcvtq_f32_s32(a); }
inline VI vround_int(V a) { return vcvtnq_s32_f32(a); }  // to nearest even, as torch.round
inline VI vclamp(VI a, int low, int high) { return vminq_s32(vdupq_n_s32(high), vmaxq_s32(vdupq_n_s32(low), a)); }
// Lanes already in [-128, 127], so narrowing keeps them.
inline void vstore_int8(int8_t* p, VI a) {
  const int16x4_t words = vmovn_s32(a);
  vst1_lane_s32((int32_t*)p, vreinterpret_s32_s8(vmovn_s16(vcombine_s16(words, words))), 0);
}
inline int32_t vsum_int(VI a) { return vaddvq_s32(a); }
inline V vfrom_u8(const uint8_t* p) {
  const uint8x8_t bytes = vreinterpret_u8_u32(vld1_dup_u32((const uint32_t*)p));
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(bytes))));
}
inline V vfrom_s8(const uint8_t* p) {
  const int8x8_t bytes = vreinterpret_s8_u32(vld1_dup_u32((const uint32_t*)p));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes))));
}
inline V vfrom_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline void vstore_high_halves(uint16_t* p, VI bits) { vst1_u16(p, vshrn_n_u32(vreinterpretq_u32_s32(bits), 16)); }
inline VI vbits(V a) { return vreinterpretq_s32_f32(a); }
inline V vfrom_bits(VI a) { return vreinterpretq_f32_s32(a); }
inline VI vadd_int(VI a, VI b) { return vaddq_s32(a, b); }
inline VI vand_int(VI a, VI b) { return vandq_s32(a, b); }
inline VI vshift_right_int(VI a, int bits) {  // logical, as srli (a negative count shifts right)
  return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-bits)));
}
inline VI vset1_int(int32_t x) { return vdupq_n_s32(x); }

inline VI vload_codes(const uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }
inline VI vlow_nibbles(VI a) { return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(a), vdupq_n_u8(0x0F))); }
inline VI vhigh_nibbles(VI a) { return vreinterpretq_s32_u8(vshrq_n_u8(vreinterpretq_u8_s32(a), 4)); }
// Bits moved down within each byte (x86 shifts 16-bit lanes; the callers mask what crosses bytes there).
inline VI vshift_right16(VI a, int bits) {
  return vreinterpretq_s32_u8(vshlq_u8(vreinterpretq_u8_s32(a), vdupq_n_s8((int8_t)-bits)));
}
inline VI vmask_bytes(VI a, uint8_t mask) {
  return vreinterpretq_s32_u8(vandq_u8(vreinterpretq_u8_s32(a), vdupq_n_u8(mask)));
}
inline VI vor_int(VI a, VI b) { return vorrq_s32(a, b); }
// sdot multiplies signed bytes; codes are at most 15, so read as signed they are the same numbers, and the int32
// sums are exactly vpdpbusd's. The activations' quad j is lane j % 4 of one of two 16-byte loads (sdot's
// by-element form broadcasts it). Two chains for a row alone, as on AVX-512.
template <int Chains = 2>
inline VI vdot32(const VI codes[8], const int8_t* a) {
  const int8x16_t low = vld1q_s8(a), high = vld1q_s8(a + 16);  // activations 0-15 and 16-31
  constexpr int odd = Chains == 2 ? 1 : 0;
  VI sums[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
  sums[0] = vdotq_laneq_s32(sums[0], vreinterpretq_s8_s32(codes[0]), low, 0);
  sums[odd] = vdotq_laneq_s32(sums[odd], vreinterpretq_s8_s32(codes[1]), low, 1);
  sums[0] = vdotq_laneq_s32(sums[0], vreinterpretq_s8_s32(codes[2]), low, 2);
  sums[odd] = vdotq_laneq_s32(sums[odd], vreinterpretq_s8_s32(codes[3]), low, 3);
  sums[0] = vdotq_laneq_s32(sums[0], vreinterpretq_s8_s32(codes[4]), high, 0);
  sums[odd] = vdotq_laneq_s32(sums[odd], vreinterpretq_s8_s32(codes[5]), high, 1);
  sums[0] = vdotq_laneq_s32(sums[0], vreinterpretq_s8_s32(codes[6]), high, 2);
  sums[odd] = vdotq_laneq_s32(sums[odd], vreinterpretq_s8_s32(codes[7]), high, 3);
  return odd ? vaddq_s32(sums[0], sums[1]) : sums[0];
}
#else
constexpr int kLanes = 8;
using V = __m256;   // kLanes float32
using VI = __m256i;  // kLanes int32, or 4 * kLanes bytes
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vfnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
inline V vround(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integers n in [-126, 127] (what exp's clamp leaves): 2^n is then a normal float, built in the
// exponent bits, so the product is rounded once, as vscalefps rounds it.
inline V vpow2_times(V p, V n) {
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
inline V vfloat(VI a) { return _mm256_cvtepi32_ps(a); }
inline VI vround_int(V a) { return _mm256_cvtps_epi32(a); }
inline VI vclamp(VI a, int low, int high) {
  return _mm256_min_epi32(_mm256_set1_epi32(high), _mm256_max_epi32(_mm256_set1_epi32(low), a));
}
// Lanes already in [-128, 127], so the saturating packs only narrow them.
inline void vstore_int8(int8_t* p, VI a) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(words, words));
}
inline int32_t vsum_int(VI a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
inline V vfrom_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline V vfrom_s8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline V vfrom_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// Lanes shifted down are in [0, 65535], so the unsigned saturating pack only narrows them.
inline void vstore_high_halves(uint16_t* p, VI bits) {
  const VI high = _mm256_srli_epi32(bits, 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}
inline VI vbits(V a) { return _mm256_castps_si256(a); }
inline V vfrom_bits(VI a) { return _mm256_castsi256_ps(a); }
inline VI vadd_int(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI vand_int(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vshift_right_int(VI a, int bits) { return _mm256_srli_epi32(a, bits); }
inline VI vset1_int(int32_t x) { return _mm256_set1_epi32(x); }

inline VI vload_codes(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline VI vlow_nibbles(VI a) { return _mm256_and_si256(a, _mm256_set1_epi8(0x0F)); }
inline VI vhigh_nibbles(VI a) { return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(0x0F)); }
inline VI vshift_right16(VI a, int bits) { return _mm256_srli_epi16(a, bits); }
inline VI vmask_bytes(VI a, uint8_t mask) { return _mm256_and_si256(a, _mm256_set1_epi8((char)mask)); }
inline VI vor_int(VI a, VI b) { return _mm256_or_si256(a, b); }
#ifdef __AVXVNNI__
// As the AVX-512 one, with the broadcast its own instruction (VEX encoding has no embedded broadcast).
template <int Chains = 2>
inline VI vdot32(const VI codes[8], const int8_t* a) {
  const int32_t* quads = (const int32_t*)a;
  VI sums[Chains];
  for (int c = 0; c < Chains; ++c) sums[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    sums[j % Chains] = _mm256_dpbusd_avx_epi32(sums[j % Chains], codes[j], _mm256_set1_epi32(quads[j]));
  }
  return Chains == 2 ? _mm256_add_epi32(sums[0], sums[Chains - 1]) : sums[0];
}
#else
// vpmaddubsw multiplies the unsigned codes by the signed activations and adds pairs into int16, which it
// would saturate past 32767; but codes are at most 15 and activations at most 127 in size, so a pair is at
// most 3810 and all 8 pairs of a lane's 16 products at most 30480. The int16 sums are then exact, and one
// vpmaddwd by ones adds each lane's two pairs into the same int32 vpdpbusd gives. VP holds such int16 sums;
// w4a8_core.cpp's paired tile (several rows against both halves of a tile) takes these steps one quad at a time.
#define W4A8_INT16_PAIRS 1
using VP = __m256i;
inline VP vpairs(VI codes, const int8_t* quad) {  // codes' 4 bytes per lane times the 4 activations, in pairs
  return _mm256_maddubs_epi16(codes, _mm256_set1_epi32(*(const int32_t*)quad));
}
inline VP vpairs_add(VP a, VP b) { return _mm256_add_epi16(a, b); }
inline VI vpairs_sum(VP a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }  // each lane's two pairs
// One chain whatever Chains: the int16 sums are cheap to add.
template <int Chains = 2>
inline VI vdot32(const VI codes[8], const int8_t* a) {
  VP pairs = vpairs(codes[0], a);
  for (int j = 1; j < 8; ++j) pairs = vpairs_add(pairs, vpairs(codes[j], a + 4 * j));
  return vpairs_sum(pairs);
}
#endif
#endif

// Quad j's 3-bit codes (w3a8, laid out in w4a8_core.cpp) from a group's three vectors, in the shape vlow_nibbles
// gives 4-bit ones: quads 0-5 are bits 0-2 or 3-5 of a vector's bytes (one or two operations), quads 6 and 7 take
// bits 6-7 of the first or second vector and bit 6 or 7 of the third (five).
inline VI vcodes3(const VI v[3], int j) {
  if (j < 6) return vmask_bytes(j % 2 ? vshift_right16(v[j / 2], 3) : v[j / 2], 0x07);
  const VI low = vmask_bytes(vshift_right16(v[j - 6], 6), 0x03);
  return vor_int(low, vmask_bytes(vshift_right16(v[2], j - 2), 0x04));
}

constexpr int kParts = 16 / kLanes;  // registers per 16 floats
// Rows of activations the matmul takes against one unpacked block of codes: its accumulators and the 8 code
// registers fit the register file (32 registers on AVX-512 and NEON, 16 on AVX2).
constexpr int kRowsPerPass = kLanes == 8 ? 4 : 8;

struct F16 {
  V part[kParts];
};

inline F16 load16(const float* p) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = vload(p + i * kLanes);
  return r;
}
inline void store16(float* p, F16 v) {
  for (int i = 0; i < kParts; ++i) vstore(p + i * kLanes, v.part[i]);
}
inline F16 set16(float x) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = vset1(x);
  return r;
}
// 16 bfloat16 as float32, and back, rounded to nearest even as torch rounds (integer ops, so that CPUs
// without AVX512_BF16 run it too).
inline F16 load16(const uint16_t* p) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = vfrom_bf16(p + i * kLanes);
  return r;
}
inline void store16(uint16_t* p, F16 v) {
  for (int i = 0; i < kParts; ++i) {
    const VI bits = vbits(v.part[i]);
    const VI odd = vand_int(vshift_right_int(bits, 16), vset1_int(1));
    vstore_high_halves(p + i * kLanes, vadd_int(bits, vadd_int(vset1_int(0x7FFF), odd)));
  }
}

template <typename Op>
inline F16 map16(F16 a, F16 b, Op op) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = op(a.part[i], b.part[i]);
  return r;
}
inline F16 operator+(F16 a, F16 b) { return map16(a, b, vadd); }
inline F16 operator-(F16 a, F16 b) { return map16(a, b, vsub); }
inline F16 operator*(F16 a, F16 b) { return map16(a, b, vmul); }
inline F16 operator/(F16 a, F16 b) { return map16(a, b, vdiv); }
inline F16 max16(F16 a, F16 b) { return map16(a, b, vmax); }
inline F16 abs16(F16 a) {  // the sign bit cleared, in integer ops (AVX-512's float and needs AVX512DQ)
  for (int i = 0; i < kParts; ++i) a.part[i] = vfrom_bits(vand_int(vbits(a.part[i]), vset1_int(0x7FFFFFFF)));
  return a;
}
inline F16 fmadd16(F16 a, F16 b, F16 c) {  // a * b + c, rounded once
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = vfmadd(a.part[i], b.part[i], c.part[i]);
  return r;
}

#ifdef W4A8_AVX512
inline float reduce_add(F16 v) { return _mm512_reduce_add_ps(v.part[0]); }
inline float reduce_max(F16 v) { return _mm512_reduce_max_ps(v.part[0]); }
#elif defined(W4A8_NEON)
// Lanes i and i + 8, then i and i + 4, then i and i + 2, then the two left, as on AVX2.
inline float reduce_add(F16 v) {
  const float32x4_t fours = vaddq_f32(vaddq_f32(v.part[3], v.part[1]), vaddq_f32(v.part[2], v.part[0]));
  const float32x4_t twos = vaddq_f32(fours, vextq_f32(fours, fours, 2));
  return vgetq_lane_f32(twos, 0) + vgetq_lane_f32(twos, 1);
}
inline float reduce_max(F16 v) {
  const float32x4_t fours = vmaxq_f32(vmaxq_f32(v.part[3], v.part[1]), vmaxq_f32(v.part[2], v.part[0]));
  const float32x4_t twos = vmaxq_f32(fours, vextq_f32(fours, fours, 2));
  return std::max(vgetq_lane_f32(twos, 0), vgetq_lane_f32(twos, 1));
}
#else
// Lanes i and i + 8, then i and i + 4, then i and i + 2, then the two left: the pairing (and operand order)
// of GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps, so the AVX-512 variant sums alike.
inline float reduce_add(F16 v) {
  const __m256 eights = _mm256_add_ps(v.part[1], v.part[0]);
  const __m128 fours = _mm_add_ps(_mm256_extractf128_ps(eights, 1), _mm256_castps256_ps128(eights));
  const __m128 twos = _mm_add_ps(fours, _mm_shuffle_ps(fours, fours, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(twos) + _mm_cvtss_f32(_mm_shuffle_ps(twos, twos, 1));
}
inline float reduce_max(F16 v) {
  const __m256 eights = _mm256_max_ps(v.part[1], v.part[0]);
  const __m128 fours = _mm_max_ps(_mm256_extractf128_ps(eights, 1), _mm256_castps256_ps128(eights));
  const __m128 twos = _mm_max_ps(fours, _mm_shuffle_ps(fours, fours, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(twos, _mm_shuffle_ps(twos, twos, _MM_SHUFFLE(0, 1, 0, 1))));
}
#endif

// e^x per lane (Cephes' single-precision polynomial, about 1 ulp); no lane depends on another.
inline V vexp(V x) {
  x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
  const V n = vround(vmul(x, vset1(1.44269504088896341f)));
  V r = vfnmadd(n, vset1(0.693359375f), x);  // x - n ln 2, in two parts
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vfmadd(vmul(p, r), r, vadd(r, vset1(1.f)));
  return vpow2_times(p, n);
}
inline F16 exp16(F16 x) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.part[i] = vexp(x.part[i]);
  return r;
}
