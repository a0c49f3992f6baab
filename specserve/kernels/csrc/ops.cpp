// Fused small ops (see ops.h). RoPE has no reduction and no transcendental, so one scalar
// version serves every path; the others have AVX-512 and AVX2 versions with the same order.
#include "ops.h"

#include "simd_avx2.h"
#include "simd_avx512.h"

#include <algorithm>
#include <type_traits>

namespace specserve {

namespace {

inline float sigmoid(float z) {
  const float e = exp_nonpositive(z >= 0.0f ? -z : z);  // exp(-|z|) <= 1
  return z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// gelu_tanh(g) = g / 2 * (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) * (g + 0.044715 g^3).
constexpr float kGeluA = 1.5957691216057308f;             // 2 sqrt(2 / pi)
constexpr float kGeluB = float(1.5957691216057308 * 0.044715);

inline float gelu_arg(float g) { return std::fma(kGeluB, g * g, kGeluA) * g; }  // 2u

// swiglu_oai's value from a gate and an up sum (their biases added). The clamps as the vector
// paths take them: min/max return their second operand where either is NaN, and the sum is the
// second, so a NaN passes through (as torch.clamp's does in models/moe.py), never a clamped value.
inline uint16_t swiglu_oai_value(float gate, float up, float alpha, float limit) {
  const float g = limit < gate ? limit : gate;
  const float t = -limit > up ? -limit : up;
  const float u = limit < t ? limit : t;
  return f32_to_bf16((u + 1.0f) * (g * sigmoid(alpha * g)));
}

struct Silu {
  static float apply(float g) { return g * sigmoid(g); }
};
struct GeluTanh {
  static float apply(float g) { return g * sigmoid(gelu_arg(g)); }
};

void add_rms_norm_generic(const uint16_t* x, uint16_t* residual, const uint16_t* w, int64_t h, float eps, uint16_t* out) {
  float lanes[16] = {0};
  for (int64_t i = 0; i < h; ++i) {
    float v = bf16_to_f32(x[i]);
    if (residual) {
      residual[i] = f32_to_bf16(v + bf16_to_f32(residual[i]));
      v = bf16_to_f32(residual[i]);
    }
    lanes[i % 16] = std::fma(v, v, lanes[i % 16]);
  }
  const float inv = 1.0f / std::sqrt(tree_sum16(lanes) / float(h) + eps);
  const uint16_t* src = residual ? residual : x;
  for (int64_t i = 0; i < h; ++i) out[i] = f32_to_bf16((bf16_to_f32(src[i]) * inv) * bf16_to_f32(w[i]));
}

#if SPECSERVE_X86
SPECSERVE_AVX512 inline __m512 bf16_round(__m512 v) {  // the value after a round trip through bf16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

SPECSERVE_AVX512 void add_rms_norm_avx(const uint16_t* x, uint16_t* residual, const uint16_t* w, int64_t h, float eps,
                                       uint16_t* out) {
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail_mask(h - i);
    __m512 v = load_bf16(x + i, m);
    if (residual) {
      v = bf16_round(_mm512_add_ps(v, load_bf16(residual + i, m)));
      store_bf16(residual + i, v, m);
    }
    lanes = _mm512_fmadd_ps(v, v, lanes);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(tree_sum16_avx(lanes) / float(h) + eps));
  const uint16_t* src = residual ? residual : x;
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail_mask(h - i);
    store_bf16(out + i, _mm512_mul_ps(_mm512_mul_ps(load_bf16(src + i, m), inv), load_bf16(w + i, m)), m);
  }
}

SPECSERVE_AVX512 inline __m512 sigmoid_avx(__m512 z) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __mmask16 pos = _mm512_cmp_ps_mask(z, zero, _CMP_GE_OQ);
  const __m512 e = exp_nonpositive_avx(_mm512_mask_sub_ps(z, pos, zero, z));  // z >= 0 ? -z : z
  return _mm512_div_ps(_mm512_mask_mov_ps(e, pos, one), _mm512_add_ps(one, e));
}

template <class Act>
SPECSERVE_AVX512 void gated_avx(const uint16_t* gate, const uint16_t* up, int64_t f, uint16_t* out) {
  for (int64_t i = 0; i < f; i += 16) {
    const __mmask16 m = tail_mask(f - i);
    const __m512 g = load_bf16(gate + i, m);
    __m512 z = g;
    if constexpr (std::is_same_v<Act, GeluTanh>)
      z = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(kGeluB), _mm512_mul_ps(g, g), _mm512_set1_ps(kGeluA)), g);
    store_bf16(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid_avx(z)), load_bf16(up + i, m)), m);
  }
}

// swiglu_oai (ops.h) on 16 columns at a time: the generic path's operations lane by lane.
SPECSERVE_AVX512 void swiglu_oai_avx(const float* gate, const float* up, const float* bias, int64_t f, float alpha,
                                     float limit, uint16_t* out) {
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < f; i += 16) {
    const __mmask16 m = tail_mask(f - i);
    const __m512 g = _mm512_min_ps(hi, _mm512_add_ps(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, bias + i)));
    const __m512 u = _mm512_add_ps(_mm512_maskz_loadu_ps(m, up + i), _mm512_maskz_loadu_ps(m, bias + f + i));
    const __m512 a = _mm512_mul_ps(g, sigmoid_avx(_mm512_mul_ps(_mm512_set1_ps(alpha), g)));
    store_bf16(out + i, _mm512_mul_ps(_mm512_add_ps(_mm512_min_ps(hi, _mm512_max_ps(lo, u)), one), a), m);
  }
}

// 16 bf16 from p, of which `valid` are read; the rest are +0 (as the AVX-512 masked loads give).
SPECSERVE_AVX2 inline F16x2 load16_avx2(const uint16_t* p, int64_t valid) {
  if (valid >= 16) return {load_bf16x8(p), load_bf16x8(p + 8)};
  alignas(32) uint16_t tmp[16] = {0};
  std::copy(p, p + valid, tmp);
  return {load_bf16x8(tmp), load_bf16x8(tmp + 8)};
}

SPECSERVE_AVX2 inline void store16_avx2(uint16_t* p, const F16x2& v, int64_t valid) {
  alignas(32) uint16_t tmp[16];
  store_bf16x8(tmp, v.lo);
  store_bf16x8(tmp + 8, v.hi);
  std::copy(tmp, tmp + std::min<int64_t>(valid, 16), p);
}

SPECSERVE_AVX2 inline __m256 bf16_round_avx2(__m256 v) {
  return bits_as_f32(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}

SPECSERVE_AVX2 void add_rms_norm_avx2(const uint16_t* x, uint16_t* residual, const uint16_t* w, int64_t h, float eps,
                                      uint16_t* out) {
  __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < h; i += 16) {
    F16x2 v = load16_avx2(x + i, h - i);
    if (residual) {
      const F16x2 r = load16_avx2(residual + i, h - i);
      v = {bf16_round_avx2(_mm256_add_ps(v.lo, r.lo)), bf16_round_avx2(_mm256_add_ps(v.hi, r.hi))};
      store16_avx2(residual + i, v, h - i);
    }
    lanes[0] = _mm256_fmadd_ps(v.lo, v.lo, lanes[0]);
    lanes[1] = _mm256_fmadd_ps(v.hi, v.hi, lanes[1]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(tree_sum16_avx2(lanes[0], lanes[1]) / float(h) + eps));
  const uint16_t* src = residual ? residual : x;
  for (int64_t i = 0; i < h; i += 16) {
    const F16x2 v = load16_avx2(src + i, h - i), g = load16_avx2(w + i, h - i);
    store16_avx2(out + i, {_mm256_mul_ps(_mm256_mul_ps(v.lo, inv), g.lo), _mm256_mul_ps(_mm256_mul_ps(v.hi, inv), g.hi)}, h - i);
  }
}

SPECSERVE_AVX2 inline __m256 sigmoid_avx2(__m256 z) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 pos = _mm256_cmp_ps(z, zero, _CMP_GE_OQ);
  const __m256 e = exp_nonpositive_avx2(_mm256_blendv_ps(z, _mm256_sub_ps(zero, z), pos));  // z >= 0 ? -z : z
  return _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
}

template <class Act>
SPECSERVE_AVX2 void gated_avx2(const uint16_t* gate, const uint16_t* up, int64_t f, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= f; i += 8) {
    const __m256 g = load_bf16x8(gate + i);
    __m256 z = g;
    if constexpr (std::is_same_v<Act, GeluTanh>)
      z = _mm256_mul_ps(_mm256_fmadd_ps(_mm256_set1_ps(kGeluB), _mm256_mul_ps(g, g), _mm256_set1_ps(kGeluA)), g);
    store_bf16x8(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid_avx2(z)), load_bf16x8(up + i)));
  }
  for (; i < f; ++i) out[i] = f32_to_bf16(Act::apply(bf16_to_f32(gate[i])) * bf16_to_f32(up[i]));
}

// The same, 8 columns at a time, the last f % 8 by the generic path.
SPECSERVE_AVX2 void swiglu_oai_avx2(const float* gate, const float* up, const float* bias, int64_t f, float alpha,
                                    float limit, uint16_t* out) {
  const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= f; i += 8) {
    const __m256 g = _mm256_min_ps(hi, _mm256_add_ps(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(bias + i)));
    const __m256 u = _mm256_add_ps(_mm256_loadu_ps(up + i), _mm256_loadu_ps(bias + f + i));
    const __m256 a = _mm256_mul_ps(g, sigmoid_avx2(_mm256_mul_ps(_mm256_set1_ps(alpha), g)));
    store_bf16x8(out + i, _mm256_mul_ps(_mm256_add_ps(_mm256_min_ps(hi, _mm256_max_ps(lo, u)), one), a));
  }
  for (; i < f; ++i) out[i] = swiglu_oai_value(gate[i] + bias[i], up[i] + bias[f + i], alpha, limit);
}

#endif  // SPECSERVE_X86

}  // namespace

void add_rms_norm_rows(Path path, const uint16_t* x, uint16_t* residual, const uint16_t* weight, int64_t h, float eps,
                       uint16_t* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    uint16_t* res = residual ? residual + r * h : nullptr;
#if SPECSERVE_X86
    if (path == Path::Avx512Bf16) add_rms_norm_avx(x + r * h, res, weight, h, eps, out + r * h);
    else if (path == Path::Avx2Fma) add_rms_norm_avx2(x + r * h, res, weight, h, eps, out + r * h);
    else
#endif
      add_rms_norm_generic(x + r * h, res, weight, h, eps, out + r * h);
  }
}

namespace {

template <class Act>
void gated_rows(Path path, const uint16_t* gate_up, int64_t f, uint16_t* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* gate = gate_up + r * 2 * f;
#if SPECSERVE_X86
    if (path == Path::Avx512Bf16) {
      gated_avx<Act>(gate, gate + f, f, out + r * f);
      continue;
    }
    if (path == Path::Avx2Fma) {
      gated_avx2<Act>(gate, gate + f, f, out + r * f);
      continue;
    }
#endif
    for (int64_t i = 0; i < f; ++i) out[r * f + i] = f32_to_bf16(Act::apply(bf16_to_f32(gate[i])) * bf16_to_f32(gate[f + i]));
  }
}

}  // namespace

void silu_mul_rows(Path path, const uint16_t* gate_up, int64_t f, uint16_t* out, int64_t begin, int64_t end) {
  gated_rows<Silu>(path, gate_up, f, out, begin, end);
}

void gelu_tanh_mul_rows(Path path, const uint16_t* gate_up, int64_t f, uint16_t* out, int64_t begin, int64_t end) {
  gated_rows<GeluTanh>(path, gate_up, f, out, begin, end);
}

void swiglu_oai_rows(Path path, const float* gate_up, const float* bias, int64_t f, float alpha, float limit,
                     uint16_t* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* gate = gate_up + r * 2 * f;
#if SPECSERVE_X86
    if (path == Path::Avx512Bf16) {
      swiglu_oai_avx(gate, gate + f, bias, f, alpha, limit, out + r * f);
      continue;
    }
    if (path == Path::Avx2Fma) {
      swiglu_oai_avx2(gate, gate + f, bias, f, alpha, limit, out + r * f);
      continue;
    }
#endif
    for (int64_t i = 0; i < f; ++i) out[r * f + i] = swiglu_oai_value(gate[i] + bias[i], gate[f + i] + bias[f + i], alpha, limit);
  }
}

void rope_store_rows(const RopeStoreArgs& a, int64_t begin, int64_t end) {
  const int64_t half = a.dim / 2, width = (a.heads + 2 * a.kv_heads) * a.dim;
  for (int64_t t = begin; t < end; ++t) {
    const uint16_t* row = a.qkv + t * width;
    const float* c = a.cos + a.positions[t] * half;
    const float* s = a.sin + a.positions[t] * half;
    for (int64_t head = 0; head < a.heads + a.kv_heads; ++head) {
      const uint16_t* x = row + head * a.dim;
      uint16_t* dst = head < a.heads ? a.q_out + (t * a.heads + head) * a.dim
                                     : a.k_pool + (a.slots[t] * a.kv_heads + head - a.heads) * a.dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        const float a1 = x1 * c[i], b1 = x2 * s[i], a2 = x2 * c[i], b2 = x1 * s[i];
        dst[i] = f32_to_bf16(a1 - b1);
        dst[i + half] = f32_to_bf16(a2 + b2);
      }
    }
    const uint16_t* v = row + (a.heads + a.kv_heads) * a.dim;
    uint16_t* vdst = a.v_pool + a.slots[t] * a.kv_heads * a.dim;
    for (int64_t i = 0; i < a.kv_heads * a.dim; ++i) vdst[i] = v[i];
  }
}

}  // namespace specserve
