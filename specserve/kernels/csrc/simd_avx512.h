// AVX-512 helpers shared by the kernels' vector paths. Each mirrors a scalar helper of simd.h
// operation for operation (tree_sum16, exp_nonpositive), so the two paths agree bit for bit.
#pragma once

#include "simd.h"

#if SPECSERVE_X86

#include <immintrin.h>

#include <cstdint>

#include "simd.h"

// Vector code is compiled for AVX512-BF16 (and VNNI, which every CPU with it has) function by
// function, so the library still loads (and runs the generic path) on CPUs without it.
#define SPECSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni")))

namespace specserve {

SPECSERVE_AVX512 inline __mmask16 tail_mask(int64_t left) { return __mmask16(left >= 16 ? 0xFFFF : (1u << left) - 1u); }

SPECSERVE_AVX512 inline __m512 load_bf16(const uint16_t* p, __mmask16 m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

SPECSERVE_AVX512 inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

SPECSERVE_AVX512 inline float tree_sum16_avx(__m512 v) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

SPECSERVE_AVX512 inline __m512 exp_nonpositive_avx(__m512 x) {
  __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_GE_OQ);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[i]));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

}  // namespace specserve

#endif  // SPECSERVE_X86
