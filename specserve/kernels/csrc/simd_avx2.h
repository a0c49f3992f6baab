// AVX2 + FMA helpers for the kernels' second vector path, for x86 CPUs without AVX-512 (AMD Zen 2
// and 3, older Intel). A 16-lane AVX-512 vector is held as two 8-lane halves (lanes 0-7, 8-15), so
// every helper mirrors its scalar twin in simd.h operation for operation and the three paths agree
// bit for bit.
#pragma once

#include "simd.h"

#if SPECSERVE_X86

#include <immintrin.h>

#include <cstdint>

#include "simd.h"

// Compiled function by function, so the library still loads on CPUs without AVX2.
#define SPECSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace specserve {

// Two halves of one 16-lane vector.
struct F16x2 {
  __m256 lo, hi;
};

SPECSERVE_AVX2 inline __m256 bits_as_f32(__m256i v) { return _mm256_castsi256_ps(v); }

// 8 bf16 -> 8 float (exact).
SPECSERVE_AVX2 inline __m256 load_bf16x8(const uint16_t* p) {
  return bits_as_f32(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 8 float -> 8 bf16, rounded as f32_to_bf16 (and VCVTNEPS2BF16) round: nearest even, denormal
// inputs to signed zero, NaN kept quiet.
SPECSERVE_AVX2 inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i exp_bits = _mm256_and_si256(u, _mm256_set1_epi32(0x7F800000));
  const __m256i denormal = _mm256_cmpeq_epi32(exp_bits, _mm256_setzero_si256());
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040)), nan);
  r = _mm256_blendv_epi8(r, _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)), denormal);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit half: 4 words, then the same 4 again
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // halves' first 64 bits together
}

SPECSERVE_AVX2 inline void store_bf16x8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16x8(v));
}

// While alive, FMAs flush subnormal inputs and results to signed zero (MXCSR DAZ and FTZ; x86
// detects tininess after rounding). FMA then computes VDPBF16PS's step exactly (fma_daz_ftz in
// simd.h); scoped, because the kernels' other FMAs are plain IEEE ones, and restored on exit so the
// caller's thread state is untouched.
class FlushDenormalsScope {
 public:
  explicit FlushDenormalsScope(bool active) : saved_(_mm_getcsr()), active_(active) {
    if (active_) _mm_setcsr(saved_ | kFtzDaz);
  }
  ~FlushDenormalsScope() {
    if (active_) _mm_setcsr(saved_);
  }
  FlushDenormalsScope(const FlushDenormalsScope&) = delete;
  FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;

 private:
  static constexpr unsigned kFtzDaz = 0x8040u;  // bit 15 FTZ, bit 6 DAZ
  unsigned saved_;
  bool active_;
};

// acc + w * x by VFMADD231PS spelled out. Given NaNs, it returns w's, then x's, then acc's (quieted),
// as VDPBF16PS and fma_daz_ftz do; through the intrinsic the compiler picks the instruction form,
// and with it which NaN wins. (The linears' exact-rows tiles, which see no NaNs, use the plain intrinsic.)
SPECSERVE_AVX2 inline __m256 fmadd_nan_ordered(__m256 w, __m256 x, __m256 acc) {
  asm("vfmadd231ps %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
  return acc;
}

// tree_sum16 of (lo, hi): the first step of the tree adds lane i and lane i + 8, which is lo + hi.
SPECSERVE_AVX2 inline float tree_sum16_avx2(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

SPECSERVE_AVX2 inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC[6]);
  for (int i = 5; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, bits_as_f32(e)));
}

}  // namespace specserve

#endif  // SPECSERVE_X86
