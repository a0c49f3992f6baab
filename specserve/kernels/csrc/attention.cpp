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
};

Task task_of(const PagedAttentionArgs& a, int64_t task) {
  const int64_t row = task / a.heads, head = task % a.heads;
  const int64_t group = a.heads / a.kv_heads;
  const int64_t len = a.row_len[row];
  const int64_t first = a.window > 0 && len > a.window ? len - a.window : 0;  // the window's first position
  return Task{a.q + (row * a.heads + head) * a.dim, a.table + a.row_req[row] * a.table_stride + first, len - first,
              (head / group) * a.dim, a.kv_heads * a.dim, a.out + (row * a.heads + head) * a.dim};
}

// ------------------------------------------------------------------ generic path

void task_generic(const PagedAttentionArgs& a, const Task& t, float* p) {
  const int64_t D = a.dim, chunks = (D + 15) / 16;
  if (t.len <= 0) {
    for (int64_t d = 0; d < D; ++d) t.out[d] = 0;
    return;
  }
  auto lane_value = [&](const uint16_t* v, int64_t c, int l) { return 16 * c + l < D ? bf16_to_f32(v[16 * c + l]) : 0.0f; };
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < t.len; ++j) {
    const uint16_t* k = a.k_pool + t.slots[j] * t.slot_stride + t.kv_offset;
    float acc[16];
    for (int l = 0; l < 16; ++l) acc[l] = lane_value(t.q, 0, l) * lane_value(k, 0, l);
    for (int64_t c = 1; c < chunks; ++c)
      for (int l = 0; l < 16; ++l) acc[l] = std::fma(lane_value(t.q, c, l), lane_value(k, c, l), acc[l]);
    p[j] = tree_sum16(acc) * a.scale;
    best = std::max(best, p[j]);
  }
  const int64_t padded = (t.len + 15) / 16 * 16;
  float lanes[16] = {0};
  for (int64_t j = 0; j < padded; ++j) {
    p[j] = j < t.len ? exp_nonpositive(p[j] - best) : 0.0f;
    lanes[j % 16] += p[j];
  }
  const float total = tree_sum16(lanes);
  for (int64_t d = 0; d < D; ++d) {
    float o = 0.0f;
    for (int64_t j = 0; j < t.len; ++j)
      o = std::fma(p[j], bf16_to_f32(a.v_pool[t.slots[j] * t.slot_stride + t.kv_offset + d]), o);
    t.out[d] = f32_to_bf16(o / total);
  }
}

// ------------------------------------------------------------------ AVX-512 path (dim % 16 == 0)

#if SPECSERVE_X86
// HB query heads of one KV group at once: each K/V row is loaded once for all of them, and the
// heads' independent chains keep the FMA units busy; every head's operations are those of HB = 1.
template <int C, int HB>
SPECSERVE_AVX512 void heads_avx512(const PagedAttentionArgs& a, const Task* t, float* scratch) {
  const int64_t len = t[0].len, padded = (len + 15) / 16 * 16;
  if (len <= 0) {
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(t[h].out + 16 * c), _mm256_setzero_si256());
    return;
  }
  __m512 q[HB][C];
  float* p[HB];
  float best[HB];
  for (int h = 0; h < HB; ++h) {
    for (int c = 0; c < C; ++c) q[h][c] = load_bf16(t[h].q + 16 * c);
    p[h] = scratch + h * padded;
    best[h] = -std::numeric_limits<float>::infinity();
  }
  // Scores of JB positions at once: HB * JB independent chains over the head dimension (each one
  // the chain of a lone (head, position)), so the FMA latency is hidden, not waited for.
  // Only head size 256 gains (measured: 1.6x on gemma3's prefill); smaller heads run JB = 1, as
  // their q already takes the registers.
  constexpr int JB = C >= 16 ? 4 : 1;
  for (int64_t j = 0; j < len; j += JB) {
    const int nj = int(std::min<int64_t>(JB, len - j));
    const uint16_t* k[JB];
    for (int jj = 0; jj < JB; ++jj)  // past the end: the last position again, its scores unused
      k[jj] = a.k_pool + t[0].slots[j + std::min(jj, nj - 1)] * t[0].slot_stride + t[0].kv_offset;
    __m512 acc[HB][JB];
    for (int c = 0; c < C; ++c) {
      __m512 kv[JB];
      for (int jj = 0; jj < JB; ++jj) kv[jj] = load_bf16(k[jj] + 16 * c);
      for (int h = 0; h < HB; ++h)
        for (int jj = 0; jj < JB; ++jj)
          acc[h][jj] = c == 0 ? _mm512_mul_ps(q[h][0], kv[jj]) : _mm512_fmadd_ps(q[h][c], kv[jj], acc[h][jj]);
    }
    for (int h = 0; h < HB; ++h)
      for (int jj = 0; jj < nj; ++jj) {
        p[h][j + jj] = tree_sum16_avx(acc[h][jj]) * a.scale;
        best[h] = std::max(best[h], p[h][j + jj]);
      }
  }
  __m512 total[HB];
  for (int h = 0; h < HB; ++h) {
    __m512 lanes = _mm512_setzero_ps();
    const __m512 top = _mm512_set1_ps(best[h]);
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 in = tail_mask(len - j);
      __m512 e = _mm512_maskz_mov_ps(in, exp_nonpositive_avx(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, p[h] + j), top)));
      _mm512_storeu_ps(p[h] + j, e);
      lanes = _mm512_add_ps(lanes, e);
    }
    total[h] = _mm512_set1_ps(tree_sum16_avx(lanes));
  }
  // The weighted sum of V, CB chunks of the head dimension per pass over the positions, so the
  // HB * CB sums stay in registers (each still in position order); one pass up to head size 128.
  constexpr int CB = C >= 16 ? 4 : C;
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
  int64_t h = 0;
  for (; h + 4 <= heads; h += 4) heads_avx512<C, 4>(a, t + h, scratch);
  switch (heads - h) {
    case 3: heads_avx512<C, 3>(a, t + h, scratch); break;
    case 2: heads_avx512<C, 2>(a, t + h, scratch); break;
    case 1: heads_avx512<C, 1>(a, t + h, scratch); break;
    default: break;
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
  __m256 q[HB][C][2];
  float* p[HB];
  float best[HB];
  for (int h = 0; h < HB; ++h) {
    load_row_avx2<C>(t[h].q, q[h]);
    p[h] = scratch + h * padded;
    best[h] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t j = 0; j < len; ++j) {
    __m256 kv[C][2];
    load_row_avx2<C>(a.k_pool + t[0].slots[j] * t[0].slot_stride + t[0].kv_offset, kv);
    for (int h = 0; h < HB; ++h) {
      __m256 lo = _mm256_mul_ps(q[h][0][0], kv[0][0]), hi = _mm256_mul_ps(q[h][0][1], kv[0][1]);
      for (int c = 1; c < C; ++c) {
        lo = _mm256_fmadd_ps(q[h][c][0], kv[c][0], lo);
        hi = _mm256_fmadd_ps(q[h][c][1], kv[c][1], hi);
      }
      p[h][j] = tree_sum16_avx2(lo, hi) * a.scale;
      best[h] = std::max(best[h], p[h][j]);
    }
  }
  float total[HB];
  for (int h = 0; h < HB; ++h) {
    // Past the end, scores of -inf give exp 0, which is what the generic path adds there.
    std::fill(p[h] + len, p[h] + padded, -std::numeric_limits<float>::infinity());
    __m256 lanes[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 top = _mm256_set1_ps(best[h]);
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p[h] + j), top));
      _mm256_storeu_ps(p[h] + j, e);
      lanes[(j / 8) % 2] = _mm256_add_ps(lanes[(j / 8) % 2], e);
    }
    total[h] = tree_sum16_avx2(lanes[0], lanes[1]);
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
