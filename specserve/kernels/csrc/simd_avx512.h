// AVX-512 helpers shared by the kernels' vector paths. Each mirrors a scalar helper of simd.h
// operation for operation (tree_sum16, exp_nonpositive), so the two paths agree bit for bit.
#pragma once

#include "simd.h"

#if SPECSERVE_X86

#include <immintrin.h>

#include <cstdint>

#include "simd.h"

// Vector code is compiled for AVX512-BF16 with VNNI and VBMI (every CPU with BF16 but Cooper Lake,
// which takes the AVX2 path) function by function, so the library still loads (and runs the
// generic path) on CPUs without them. VBMI's byte shifts place the 6-bit codes' high bits.
#define SPECSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni,avx512vbmi")))

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

// tree_sum16 of each of 16 vectors, as one vector (lane i: v[i]'s sum): the same adds on the same
// pairs in the same order, four lanes' worth of vectors at a time by shuffles.
SPECSERVE_AVX512 inline __m512 tree_sum16x16(const __m512* v) {
  __m512 t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; ++i)  // [v_a lanes 0-7 + 8-15 | v_b's]
    t8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane q: t8[q] + t8[q + 4] of vector 4i + q
    t4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t8[2 * i], t8[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t8[2 * i], t8[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane q: t2 of vector 8i + q, then of 8i + 4 + q
    t2[i] = _mm512_add_ps(_mm512_shuffle_ps(t4[2 * i], t4[2 * i + 1], 0x44), _mm512_shuffle_ps(t4[2 * i], t4[2 * i + 1], 0xEE));
  // lane 4q + m holds the sum of vector q + 4m; put it in lane q + 4m
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(t2[0], t2[1], 0x88), _mm512_shuffle_ps(t2[0], t2[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
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
