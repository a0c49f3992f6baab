// Numeric building blocks shared by the generic (portable C++), AVX-512 and AVX2 paths.
//
// Every kernel in this folder computes each output row with one fixed sequence of floating-point
// operations that depends only on that row's inputs, never on how many rows, requests or threads
// share the call. The generic path spells the same sequence out in scalar code, so on a CPU with
// AVX512-BF16 the two paths agree bit for bit (tests/unit/test_cpu_kernels.py checks it).
#pragma once

// The vector paths are x86 code (AVX-512, AVX2); elsewhere (ARM) only the generic path is built.
#if defined(__x86_64__) || defined(__i386__)
#define SPECSERVE_X86 1
#else
#define SPECSERVE_X86 0
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specserve {

enum class Path : int { Generic = 0, Avx512Bf16 = 1, Avx2Fma = 2 };

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half -> float (exact).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_f32(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
  return (sign ? -1.0f : 1.0f) * float(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
}

// Round to nearest even, as VCVTNEPS2BF16 does (denormal inputs become signed zero).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7F800000u) == 0) return uint16_t((u >> 16) & 0x8000u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// float32 -> bf16 as torch rounds (.to(bfloat16), a bf16 add's sum): to nearest even, subnormals
// kept (the kernels' stores flush them), NaN as the quiet NaN; branchless, so loops of it vectorize.
inline uint16_t f32_to_bf16_torch(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// Subnormals read as signed zero (DAZ) or flushed to it (FTZ).
inline float flush_subnormal(float f) {
  const uint32_t u = f32_bits(f);
  return (u & 0x7F800000u) == 0 ? bits_f32(u & 0x80000000u) : f;
}

inline float quiet_nan(float f) { return bits_f32(f32_bits(f) | 0x00400000u); }

// acc + w * x as one step of VDPBF16PS: "FP32 FMA with DAZ in, FTZ out and RNE rounding" (Intel
// SDM). The product is exact (no overflow, no underflow: it is kept at full range), the sum is
// rounded once, and a result whose rounding with an unbounded exponent is below 2^-126 becomes
// signed zero (x86 detects tininess after rounding). NaNs: w's, then x's, then acc's, quieted;
// an invalid operation (inf * 0, inf - inf) gives the x86 default NaN. Checked bit for bit
// against VDPBF16PS and against FMA under MXCSR FTZ|DAZ on 6.4M edge cases (AMD Zen 4).
// A plain multiply then add (each product flushed, as this file once did) differs whenever a
// product is subnormal or overflows while the sum is not.
inline float fma_daz_ftz(float acc, float w, float x) {
  if (std::isnan(w)) return quiet_nan(w);
  if (std::isnan(x)) return quiet_nan(x);
  if (std::isnan(acc)) return quiet_nan(acc);
  // bf16 x bf16 is exact in double, and so is its range; rounding the sum to double and then to
  // 24 bits equals rounding it once to 24 bits, since 53 >= 2 * 24 + 2 (Figueroa).
  const double s = double(flush_subnormal(acc)) + double(flush_subnormal(w)) * double(flush_subnormal(x));
  if (std::isnan(s)) return bits_f32(0xFFC00000u);
  if (!(std::fabs(s) < 0x1p-126)) return float(s);  // normal range, or overflow to inf
  // Tiny: round to 24 bits as if the exponent were unbounded (scaled into float's normal range,
  // where conversion does exactly that), then flush unless it rounded up to 2^-126.
  const float scaled = float(s * 0x1p64);
  return std::fabs(scaled) >= 0x1p-62f ? std::copysign(0x1p-126f, scaled) : std::copysign(0.0f, scaled);
}

// One VDPBF16PS lane: acc + a_hi*b_hi, then + a_lo*b_lo, for a pair of bf16 in each 32-bit word,
// in the order the instruction defines (the odd element first).
inline float dot_pair(float acc, uint32_t a, uint32_t b) {
  acc = fma_daz_ftz(acc, bf16_to_f32(uint16_t(a >> 16)), bf16_to_f32(uint16_t(b >> 16)));
  return fma_daz_ftz(acc, bf16_to_f32(uint16_t(a)), bf16_to_f32(uint16_t(b)));
}

// Sum of 16 lanes in the tree the AVX-512 path uses: halves, quarters, pairs, last pair.
inline float tree_sum16(const float* v) {
  float t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; ++i) t8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  for (int i = 0; i < 2; ++i) t2[i] = t4[i] + t4[i + 2];
  return t2[0] + t2[1];
}

// exp(x) for x <= 0 by range reduction and a degree-6 polynomial, with explicit fused
// multiply-adds so the scalar and vector versions round identically. Relative error < 2e-7.
constexpr float kExpLow = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpC[7] = {1.0f, 1.0f, 0.5f, 0.166666671633720398f, 0.041666645556688309f,
                            0.008333360776305198f, 0.001388888922519982f};

inline float exp_nonpositive(float x) {
  if (!(x >= kExpLow)) return 0.0f;  // also maps NaN to 0, as the vector path's mask does
  float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpC[6];
  for (int i = 5; i >= 0; --i) p = std::fma(p, r, kExpC[i]);
  int32_t e = int32_t(n) + 127;
  return p * bits_f32(uint32_t(e) << 23);
}

}  // namespace specserve
