// Paged attention, generic, AVX-512 and AVX2 paths (see attention.h).
#include "attention.h"

#include "simd_avx2.h"
#include "simd_avx512.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace specserve {

namespace {

struct Task {
  const uint16_t* q;
  const int64_t* slots;
  int64_t len;
  int64_t kv_offset;  // kv head * dim inside a slot
  int64_t slot_stride;
  uint16_t* out;
  float sink;  // the head's sink logit, -inf without one
};

// The softmax's max with the task's sink, and its sum of weights with the sink's (attention.h).
inline float max_with_sink(float best, const Task& t) { return std::max(best, t.sink); }
inline float total_with_sink(float total, float best, const Task& t) {
  return t.sink == -std::numeric_limits<float>::infinity() ? total : total + exp_nonpositive(t.sink - best);
}

Task task_of(const PagedAttentionArgs& a, int64_t task) {
  const int64_t row = task / a.heads, head = task % a.heads;
  const int64_t group = a.heads / a.kv_heads;
  const int64_t len = a.row_len[row];
  const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;  // the window's first position
  return Task{a.q + (row * a.heads + head) * a.dim, a.table + a.row_req[row] * a.table_stride + first, len - first,
              (head / group) * a.dim, a.kv_heads * a.dim, a.out + (row * a.heads + head) * a.dim,
              a.sinks ? a.sinks[head] : -std::numeric_limits<float>::infinity()};
}

// ------------------------------------------------------------------ generic path

// The bf16 word (two elements) of lane l of pair chunk c: elements 32c + 2l (low half) and 32c + 2l + 1.
inline uint32_t pair_word(const uint16_t* v, int64_t D, int64_t c, int l) {
  const int64_t e = 32 * c + 2 * l;
  const uint32_t lo = e < D ? v[e] : 0, hi = e + 1 < D ? v[e + 1] : 0;
  return hi << 16 | lo;
}

// q.k as VDPBF16PS computes it: lane l takes the pairs (2l, 2l+1) of each 32-element chunk, in
// chunk order, each step as dot_pair; then the fixed tree over the lanes.
float score_generic(const uint16_t* q, const uint16_t* k, int64_t D) {
  float acc[16] = {0};
  for (int64_t c = 0; c < (D + 31) / 32; ++c)
    for (int l = 0; l < 16; ++l) acc[l] = dot_pair(acc[l], pair_word(q, D, c, l), pair_word(k, D, c, l));
  return tree_sum16(acc);
}

void task_generic(const PagedAttentionArgs& a, const Task& t, float* p) {
  const int64_t D = a.dim;
  if (t.len <= 0) {
    for (int64_t d = 0; d < D; ++d) t.out[d] = 0;
    return;
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < t.len; ++j) {
    p[j] = score_generic(t.q, a.k_pool + t.slots[j] * t.slot_stride + t.kv_offset, D) * a.scale;
    best = std::max(best, p[j]);
  }
  best = max_with_sink(best, t);
  const int64_t padded = (t.len + 15) / 16 * 16;
  float lanes[16] = {0};
  for (int64_t j = 0; j < padded; ++j) {
    p[j] = j < t.len ? exp_nonpositive(p[j] - best) : 0.0f;
    lanes[j % 16] += p[j];
  }
  const float total = total_with_sink(tree_sum16(lanes), best, t);
  for (int64_t d = 0; d < D; ++d) {
    float o = 0.0f;
    for (int64_t j = 0; j < t.len; ++j)
      o = std::fma(p[j], bf16_to_f32(a.v_pool[t.slots[j] * t.slot_stride + t.kv_offset + d]), o);
    t.out[d] = f32_to_bf16(o / total);
  }
}

// ------------------------------------------------------------------ AVX-512 path (dim % 16 == 0)

#if SPECSERVE_X86
// HB query heads of one KV group at once (up to kMaxGroupPass, so every GQA group of the served
// models, 6 or 7 heads at Qwen2.5 1.5B and 7B, is one pass): each K/V row is read once for all of
// them, and the heads' independent chains keep the FMA units busy; every head's operations are
// those of HB = 1, so the block sizes below change speed, never a result.
template <int C, int HB>
SPECSERVE_AVX512 void heads_avx512(const PagedAttentionArgs& a, const Task* t, float* scratch) {
  const int64_t len = t[0].len, padded = (len + 15) / 16 * 16;
  if (len <= 0) {
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(t[h].out + 16 * c), _mm256_setzero_si256());
    return;
  }
  constexpr int P = C / 2;  // 32-element pair chunks of the head dimension (dim % 32 == 0)
  float* p[HB];
  float best[HB];
  for (int h = 0; h < HB; ++h) {
    p[h] = scratch + h * padded;
    best[h] = -std::numeric_limits<float>::infinity();
  }
  // Scores of JB positions at once: HB * JB independent VDPBF16PS chains over the head dimension
  // (each one the chain of a lone (head, position), as score_generic computes it), so the
  // instruction's latency is hidden; K is read as stored, two bf16 per lane, no conversion. The
  // lanes of 16 positions are then summed together (tree_sum16x16: tree_sum16's adds, vectorised).
  constexpr int JB = HB <= 4 ? 4 : 2;  // HB * JB <= 16 accumulators
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    __m512 lanes[HB][16];
    for (int64_t j = j0; j < std::min<int64_t>(j0 + 16, len); j += JB) {
      const int nj = int(std::min<int64_t>(JB, len - j));
      const uint16_t* k[JB];
      for (int jj = 0; jj < JB; ++jj)  // past the end: the last position again, its scores unused
        k[jj] = a.k_pool + t[0].slots[j + std::min(jj, nj - 1)] * t[0].slot_stride + t[0].kv_offset;
      __m512 acc[HB][JB];
      for (int h = 0; h < HB; ++h)
        for (int jj = 0; jj < JB; ++jj) acc[h][jj] = _mm512_setzero_ps();
      for (int c = 0; c < C / 2; ++c) {
        __m512i kv[JB];
        for (int jj = 0; jj < JB; ++jj) kv[jj] = _mm512_loadu_si512(k[jj] + 32 * c);
        for (int h = 0; h < HB; ++h) {
          const __m512i qw = _mm512_loadu_si512(t[h].q + 32 * c);
          for (int jj = 0; jj < JB; ++jj) acc[h][jj] = _mm512_dpbf16_ps(acc[h][jj], (__m512bh)qw, (__m512bh)kv[jj]);
        }
      }
      for (int h = 0; h < HB; ++h)
        for (int jj = 0; jj < JB; ++jj) lanes[h][j - j0 + jj] = acc[h][jj];
    }
    const __mmask16 in = tail_mask(len - j0);
    for (int h = 0; h < HB; ++h) {
      for (int64_t jj = len - j0; jj < 16; ++jj) lanes[h][jj] = _mm512_setzero_ps();  // past the end
      const __m512 scores = _mm512_mul_ps(tree_sum16x16(lanes[h]), _mm512_set1_ps(a.scale));
      _mm512_mask_storeu_ps(p[h] + j0, in, scores);
      best[h] = std::max(best[h], _mm512_mask_reduce_max_ps(in, scores));
    }
  }
  __m512 total[HB];
  for (int h = 0; h < HB; ++h) {
    best[h] = max_with_sink(best[h], t[h]);
    __m512 lanes = _mm512_setzero_ps();
    const __m512 top = _mm512_set1_ps(best[h]);
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 in = tail_mask(len - j);
      __m512 e = _mm512_maskz_mov_ps(in, exp_nonpositive_avx(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, p[h] + j), top)));
      _mm512_storeu_ps(p[h] + j, e);
      lanes = _mm512_add_ps(lanes, e);
    }
    total[h] = _mm512_set1_ps(total_with_sink(tree_sum16_avx(lanes), best[h], t[h]));
  }
  // The weighted sum of V, CB chunks of the head dimension per pass over the positions, so the
  // HB * CB sums stay in registers (each still in position order); the passes read disjoint
  // columns of V, so V is read once in all.
  constexpr int CB = std::min(C, HB <= 2 ? 8 : HB <= 4 ? 4 : 2);  // HB * CB <= 16 sums, >= 8 chains where C allows
  for (int c0 = 0; c0 < C; c0 += CB) {
    __m512 o[HB][CB];
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < CB; ++c) o[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const uint16_t* v = a.v_pool + t[0].slots[j] * t[0].slot_stride + t[0].kv_offset + 16 * c0;
      __m512 vv[CB];
      for (int c = 0; c < CB; ++c) vv[c] = load_bf16(v + 16 * c);
      for (int h = 0; h < HB; ++h) {
        const __m512 w = _mm512_set1_ps(p[h][j]);
        for (int c = 0; c < CB; ++c) o[h][c] = _mm512_fmadd_ps(w, vv[c], o[h][c]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < CB; ++c) store_bf16(t[h].out + 16 * (c0 + c), _mm512_div_ps(o[h][c], total[h]));
  }
}

template <int C>
SPECSERVE_AVX512 void group_avx512(const PagedAttentionArgs& a, const Task* t, int64_t heads, float* scratch) {
  for (int64_t h = 0; h < heads; h += kMaxGroupPass) {
    switch (std::min<int64_t>(heads - h, kMaxGroupPass)) {
      case 8: heads_avx512<C, 8>(a, t + h, scratch); break;
      case 7: heads_avx512<C, 7>(a, t + h, scratch); break;
      case 6: heads_avx512<C, 6>(a, t + h, scratch); break;
      case 5: heads_avx512<C, 5>(a, t + h, scratch); break;
      case 4: heads_avx512<C, 4>(a, t + h, scratch); break;
      case 3: heads_avx512<C, 3>(a, t + h, scratch); break;
      case 2: heads_avx512<C, 2>(a, t + h, scratch); break;
      default: heads_avx512<C, 1>(a, t + h, scratch); break;
    }
  }
}

// ------------------------------------------------------------------ AVX2 path (dim % 16 == 0)

// A row of 16 * C bf16 as C pairs of 8-lane halves.
template <int C>
SPECSERVE_AVX2 inline void load_row_avx2(const uint16_t* row, __m256 (&out)[C][2]) {
  for (int c = 0; c < C; ++c)
    for (int s = 0; s < 2; ++s) out[c][s] = load_bf16x8(row + 16 * c + 8 * s);
}

// heads_avx512 with each 16-lane vector held as two 8-lane halves (h = 0: lanes 0-7, 1: 8-15).
template <int C, int HB>
SPECSERVE_AVX2 void heads_avx2(const PagedAttentionArgs& a, const Task* t, float* scratch) {
  const int64_t len = t[0].len, padded = (len + 15) / 16 * 16;
  if (len <= 0) {
    for (int h = 0; h < HB; ++h) std::fill(t[h].out, t[h].out + 16 * C, uint16_t(0));
    return;
  }
  float* p[HB];
  float best[HB];
  for (int h = 0; h < HB; ++h) {
    p[h] = scratch + h * padded;
    best[h] = -std::numeric_limits<float>::infinity();
  }
  // Scores as score_generic: per 32-element chunk, lane l (half l / 8) takes the words 2l, 2l+1
  // as VDPBF16PS does, odd element first, each step an FMA with subnormals flushed. The flushing
  // covers the dot products of 16 positions at a time; the tree and the scale stay plain IEEE.
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int nb = int(std::min<int64_t>(16, len - j0));
    __m256 raw[16][HB][2];
    {
      FlushDenormalsScope flush(true);
      for (int jj = 0; jj < nb; ++jj) {
        const uint16_t* k = a.k_pool + t[0].slots[j0 + jj] * t[0].slot_stride + t[0].kv_offset;
        for (int h = 0; h < HB; ++h) raw[jj][h][0] = raw[jj][h][1] = _mm256_setzero_ps();
        for (int c = 0; c < C / 2; ++c)
          for (int s = 0; s < 2; ++s) {
            const __m256i kw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 32 * c + 16 * s));
            const __m256 k_hi = bits_as_f32(_mm256_and_si256(kw, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
            const __m256 k_lo = bits_as_f32(_mm256_slli_epi32(kw, 16));
            for (int h = 0; h < HB; ++h) {
              const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[h].q + 32 * c + 16 * s));
              const __m256 q_hi = bits_as_f32(_mm256_and_si256(qw, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
              raw[jj][h][s] = fmadd_nan_ordered(q_hi, k_hi, raw[jj][h][s]);
              raw[jj][h][s] = fmadd_nan_ordered(bits_as_f32(_mm256_slli_epi32(qw, 16)), k_lo, raw[jj][h][s]);
            }
          }
      }
    }
    for (int jj = 0; jj < nb; ++jj)
      for (int h = 0; h < HB; ++h) {
        p[h][j0 + jj] = tree_sum16_avx2(raw[jj][h][0], raw[jj][h][1]) * a.scale;
        best[h] = std::max(best[h], p[h][j0 + jj]);
      }
  }
  float total[HB];
  for (int h = 0; h < HB; ++h) {
    best[h] = max_with_sink(best[h], t[h]);
    // Past the end, scores of -inf give exp 0, which is what the generic path adds there.
    std::fill(p[h] + len, p[h] + padded, -std::numeric_limits<float>::infinity());
    __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 top = _mm256_set1_ps(best[h]);
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p[h] + j), top));
      _mm256_storeu_ps(p[h] + j, e);
      lanes[(j / 8) % 2] = _mm256_add_ps(lanes[(j / 8) % 2], e);
    }
    total[h] = total_with_sink(tree_sum16_avx2(lanes[0], lanes[1]), best[h], t[h]);
  }
  __m256 o[HB][C][2];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c) o[h][c][0] = o[h][c][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    __m256 vv[C][2];
    load_row_avx2<C>(a.v_pool + t[0].slots[j] * t[0].slot_stride + t[0].kv_offset, vv);
    for (int h = 0; h < HB; ++h) {
      const __m256 w = _mm256_set1_ps(p[h][j]);
      for (int c = 0; c < C; ++c)
        for (int s = 0; s < 2; ++s) o[h][c][s] = _mm256_fmadd_ps(w, vv[c][s], o[h][c][s]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    const __m256 div = _mm256_set1_ps(total[h]);
    for (int c = 0; c < C; ++c)
      for (int s = 0; s < 2; ++s) store_bf16x8(t[h].out + 16 * c + 8 * s, _mm256_div_ps(o[h][c][s], div));
  }
}

template <int C>
SPECSERVE_AVX2 void group_avx2(const PagedAttentionArgs& a, const Task* t, int64_t heads, float* scratch) {
  int64_t h = 0;
  for (; h + 2 <= heads; h += 2) heads_avx2<C, 2>(a, t + h, scratch);
  if (h < heads) heads_avx2<C, 1>(a, t + h, scratch);
}

#endif  // SPECSERVE_X86

}  // namespace

void paged_attention_tasks(Path path, const PagedAttentionArgs& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t group = a.heads / a.kv_heads;
  std::vector<Task> tasks(group);
  for (int64_t task = begin; task < end; ++task) {  // task = row * kv_heads + kv head
    const int64_t row = task / a.kv_heads, first = (task % a.kv_heads) * group;
    for (int64_t h = 0; h < group; ++h) tasks[h] = task_of(a, row * a.heads + first + h);
#if SPECSERVE_X86
    if (path == Path::Avx512Bf16 && a.dim == 64) group_avx512<4>(a, tasks.data(), group, scratch);
    else if (path == Path::Avx512Bf16 && a.dim == 128) group_avx512<8>(a, tasks.data(), group, scratch);
    else if (path == Path::Avx512Bf16 && a.dim == 32) group_avx512<2>(a, tasks.data(), group, scratch);
    else if (path == Path::Avx512Bf16 && a.dim == 256) group_avx512<16>(a, tasks.data(), group, scratch);  // gemma3
    else if (path == Path::Avx2Fma && a.dim == 64) group_avx2<4>(a, tasks.data(), group, scratch);
    else if (path == Path::Avx2Fma && a.dim == 128) group_avx2<8>(a, tasks.data(), group, scratch);
    else if (path == Path::Avx2Fma && a.dim == 32) group_avx2<2>(a, tasks.data(), group, scratch);
    else if (path == Path::Avx2Fma && a.dim == 256) group_avx2<16>(a, tasks.data(), group, scratch);
    else
#endif
      for (int64_t h = 0; h < group; ++h) task_generic(a, tasks[h], scratch);
  }
}

}  // namespace specserve
