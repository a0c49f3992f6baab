// Numeric building blocks shared by the generic (portable C++), AVX-512 and AVX2 paths.
//
// Every kernel in this folder computes each output row with one fixed sequence of floating-point
// operations that depends only on that row's inputs, never on how many rows, requests or threads
// share the call. The generic path spells the same sequence out in scalar code, so on a CPU with
// AVX512-BF16 the two paths agree bit for bit (tests/unit/test_cpu_kernels.py checks it).
#pragma once

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

// Subnormals as VDPBF16PS treats them: inputs read as zero (DAZ), results flushed to zero (FTZ).
inline float flush_subnormal(float f) {
  const uint32_t u = f32_bits(f);
  return (u & 0x7F800000u) == 0 ? bits_f32(u & 0x80000000u) : f;
}

// One VDPBF16PS lane: acc + a_hi*b_hi + a_lo*b_lo for a pair of bf16 in each 32-bit word, in the
// order the instruction defines (the odd element first), with its DAZ/FTZ. Products of two bf16
// are exact in fp32 unless they fall below its normal range, where they flush.
inline float dot_pair(float acc, uint32_t a, uint32_t b) {
  auto value = [](uint32_t word, int shift) { return flush_subnormal(bf16_to_f32(uint16_t(word >> shift))); };
  acc = flush_subnormal(acc + flush_subnormal(value(a, 16) * value(b, 16)));
  return flush_subnormal(acc + flush_subnormal(value(a, 0) * value(b, 0)));
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
