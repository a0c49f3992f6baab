// Weight-quantized linear layers: the generic path and the AVX512-BF16 path (see linear.h); the
// AVX2 path is in linear_avx2.cpp.
#include "linear.h"

#include "simd_avx512.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace specserve {

namespace {

constexpr uint32_t kQ4Magic = 0x43004300u;  // bf16 128.0 in both halves
constexpr uint32_t kQ4Mask = 0x000F000Fu;

int64_t groups(const PackedWeight& w) { return w.k / w.group; }
int64_t pairs(const PackedWeight& w) { return (w.k + 1) / 2; }

// The (x[2p], x[2p+1]) word of a row; past an odd K the high half is +0.
inline uint32_t x_pair(const uint16_t* row, int64_t k, int64_t pair) {
  if (2 * pair + 1 < k) {
    uint32_t word;
    std::memcpy(&word, row + 2 * pair, 4);
    return word;
  }
  return row[2 * pair];
}

// ------------------------------------------------------------------ generic path

inline uint32_t weight_word(const PackedWeight& w, const uint8_t* block, int64_t pair, int lane) {
  switch (w.format) {
    case WeightFormat::Q4: {
      const int64_t oct = pair / 4;
      const int p = int(pair % 4);
      uint32_t v;
      std::memcpy(&v, oct_codes(block, oct, w.bits) + lane * 4, 4);
      uint32_t nibbles = (v >> (4 * p)) & kQ4Mask;
      if (w.bits == kE2M1) nibbles = e2m1_code(nibbles) | (e2m1_code(nibbles >> 16) << 16);
      uint32_t word = kQ4Magic | nibbles;
      if (w.bits > 4) {
        const uint8_t* plane = oct_high(block, oct, w.bits);
        const uint32_t h = w.bits == 5 ? plane[lane] : uint32_t(plane[2 * lane]) | (uint32_t(plane[2 * lane + 1]) << 8);
        word |= high_of_pair(spread_high(h, w.bits), w.bits, p);
      }
      return word;
    }
    case WeightFormat::Q8: {
      const int8_t* c = reinterpret_cast<const int8_t*>(block + pair * 32 + lane * 2);
      return uint32_t(f32_to_bf16(float(c[0]))) | (uint32_t(f32_to_bf16(float(c[1]))) << 16);
    }
    default: {
      uint32_t v;
      std::memcpy(&v, block + pair * 64 + lane * 4, 4);
      return v;
    }
  }
}

// acc + d * part (+ m * s0) for one (row, column) and group `at` of a Q4 or Q8 weight, where part is
// the group's dot product and s0 the row's sum over the group (see linear.h for the order).
inline float apply_group(const PackedWeight& w, int64_t b, int64_t g, int lane, float part, float s0, float acc) {
  const float d = scale_at(w, b, g, lane);
  if (w.format == WeightFormat::Q4) part = std::fma(-128.0f, s0, part);
  acc = std::fma(d, part, acc);
  return has_offsets(w) ? std::fma(offset_at(w, b, g, lane), s0, acc) : acc;
}

void block_generic(const PackedWeight& w, int64_t b, const uint16_t* x, int64_t ldx, int64_t m,
                   const float* gs, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  const uint8_t* block = w.codes + b * block_bytes(w.format, w.k, w.bits);
  const int64_t G = groups(w), per = w.group / 2;  // pairs per group
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = x + r * ldx;
    float acc[kBlockCols] = {0};
    if (accumulate)  // continue the sums already in out (fp32): a chain over K split across ranks
      for (int lane = 0; lane < kBlockCols && b * kBlockCols + lane < w.n; ++lane)
        acc[lane] = static_cast<const float*>(out)[r * ldo + b * kBlockCols + lane];
    if (w.format == WeightFormat::BF16) {
      for (int64_t pair = 0; pair < pairs(w); ++pair) {
        uint32_t xw = x_pair(row, w.k, pair);
        for (int lane = 0; lane < kBlockCols; ++lane) acc[lane] = dot_pair(acc[lane], weight_word(w, block, pair, lane), xw);
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {
        float part[kBlockCols] = {0};
        for (int64_t pair = g * per; pair < g * per + per; ++pair) {
          uint32_t xw = x_pair(row, w.k, pair);
          for (int lane = 0; lane < kBlockCols; ++lane) part[lane] = dot_pair(part[lane], weight_word(w, block, pair, lane), xw);
        }
        const float s0 = has_offsets(w) ? gs[r * G + g] : 0.0f;
        for (int lane = 0; lane < kBlockCols; ++lane) acc[lane] = apply_group(w, b, g, lane, part[lane], s0, acc[lane]);
      }
    }
    for (int lane = 0; lane < kBlockCols; ++lane) {
      int64_t col = b * kBlockCols + lane;
      if (col >= w.n) break;
      if (out_bf16) static_cast<uint16_t*>(out)[r * ldo + col] = f32_to_bf16(acc[lane]);
      else static_cast<float*>(out)[r * ldo + col] = acc[lane];
    }
  }
}

// ------------------------------------------------------------------ AVX512-BF16 path
#if SPECSERVE_X86

template <WeightFormat F>
SPECSERVE_AVX512 inline __m512i q8_or_bf16_word(const uint8_t* block, int64_t pair) {
  if constexpr (F == WeightFormat::Q8) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + pair * 32))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + pair * 32 + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    return _mm512_loadu_si512(block + pair * 64);
  }
}

// spread_high (linear.h) of the 16 lanes of one oct's high-bit plane.
template <int Bits>
SPECSERVE_AVX512 inline __m512i spread_high16(const uint8_t* plane) {
  if constexpr (Bits == 5) {
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
    return _mm512_ternarylogic_epi32(_mm512_slli_epi32(h, 4), _mm512_slli_epi32(h, 16), _mm512_set1_epi32(0x00F000F0), 0xA8);
  } else {  // (a | b) & c
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)));
    return _mm512_ternarylogic_epi32(_mm512_slli_epi32(h, 4), _mm512_slli_epi32(h, 12), _mm512_set1_epi32(0x0FF00FF0), 0xA8);
  }
}

SPECSERVE_AVX512 inline __m512i x_word(const uint16_t* row, int64_t k, int64_t pair) {
  return _mm512_set1_epi32(int32_t(x_pair(row, k, pair)));
}

// part[r][j] += the pair's weight words wv[j] times row r's pair (K % 16 == 0 for quantized
// weights, so every pair is whole: a broadcast load of its word).
template <int R, int NBT>
SPECSERVE_AVX512 inline void dot_rows(const uint16_t* const* rows, int64_t pair, const __m512i* wv, __m512 (*part)[NBT]) {
  for (int r = 0; r < R; ++r) {
    int32_t word;
    std::memcpy(&word, rows[r] + 2 * pair, 4);
    const __m512i xb = _mm512_set1_epi32(word);
    for (int j = 0; j < NBT; ++j) part[r][j] = _mm512_dpbf16_ps(part[r][j], (__m512bh)wv[j], (__m512bh)xb);
  }
}

// A tile's sums before its first group: zero, or (accumulate) the fp32 sums already in out, a
// chain over K split across ranks.
template <int R, int NBT>
SPECSERVE_AVX512 SPECSERVE_INLINE void start_tile(const PackedWeight& w, int64_t b0, const void* out, int64_t ldo, bool accumulate,
                                                  __m512 (&acc)[R][NBT]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NBT; ++j) {
      const int64_t col = (b0 + j) * kBlockCols;
      const __mmask16 keep = __mmask16((1u << std::min<int64_t>(kBlockCols, w.n - col)) - 1u);
      acc[r][j] = accumulate ? _mm512_maskz_loadu_ps(keep, static_cast<const float*>(out) + r * ldo + col)
                             : _mm512_setzero_ps();
    }
}

// The end of group g: acc = fma(d, group sum, acc) per (row, column), the Q4 sum first corrected by
// -128 x the rows' group sums, then the offsets' term (linear.h).
template <WeightFormat F, ScaleType S, int R, int NBT>
SPECSERVE_AVX512 SPECSERVE_INLINE void end_group(const PackedWeight& w, int64_t b0, int64_t g, const float* gs, bool offsets,
                                                 const __m512 (&part)[R][NBT], __m512 (&acc)[R][NBT]) {
  const int64_t G = groups(w);
  for (int j = 0; j < NBT; ++j) {
    const __m512 d = scales16<S>(w, b0 + j, g);
    for (int r = 0; r < R; ++r) {
      const __m512 s0 = _mm512_set1_ps(offsets ? gs[r * G + g] : 0.0f);
      __m512 sum = part[r][j];
      if constexpr (F == WeightFormat::Q4) sum = _mm512_fmadd_ps(_mm512_set1_ps(-128.0f), s0, sum);
      acc[r][j] = _mm512_fmadd_ps(d, sum, acc[r][j]);
    }
    if (offsets) {
      const __m512 m = offsets16<S>(w, b0 + j, g, d);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(gs[r * G + g]), acc[r][j]);
    }
  }
}

// A tile's sums into out: bf16 (rounded to nearest even) or fp32, the valid columns only.
template <int R, int NBT>
SPECSERVE_AVX512 SPECSERVE_INLINE void store_tile(const PackedWeight& w, int64_t b0, const __m512 (&acc)[R][NBT], void* out,
                                                  int64_t ldo, bool out_bf16) {
  for (int j = 0; j < NBT; ++j) {
    const int64_t col = (b0 + j) * kBlockCols;
    const __mmask16 keep = __mmask16((1u << std::min<int64_t>(kBlockCols, w.n - col)) - 1u);
    for (int r = 0; r < R; ++r) {
      if (out_bf16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + r * ldo + col, keep, (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
      else _mm512_mask_storeu_ps(static_cast<float*>(out) + r * ldo + col, keep, acc[r][j]);
    }
  }
}

// The bf16 words (128 + table value) of E2M1 codes whose nibbles sit at bits 0 and 16 of each lane
// of `shifted` (above them: other codes): bytes 1 and 3 index with their top bit set, so give 0.
SPECSERVE_AVX512 inline __m512i e2m1_words(__m512i shifted) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
  const __m512i index = _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi32(int32_t(kQ4Mask)),
                                                  _mm512_set1_epi32(int32_t(0x80008000u)), 0xEA);  // (a & b) | c
  return _mm512_or_si512(_mm512_shuffle_epi8(table, index), _mm512_set1_epi32(int32_t(kQ4Magic)));
}

// R rows x NBT column blocks; every (row, column) sees the same operation sequence whatever R and NBT are.
template <WeightFormat F, int Bits, ScaleType S, int R, int NBT>
SPECSERVE_AVX512 void tile_avx512(const PackedWeight& w, int64_t b0, const uint16_t* x, int64_t ldx,
                                  const float* gs, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  const int64_t bytes = block_bytes(F, w.k, Bits), G = groups(w);
  const uint8_t* blocks[NBT];
  for (int j = 0; j < NBT; ++j) blocks[j] = w.codes + (b0 + j) * bytes;
  const uint16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + r * ldx;
  __m512 acc[R][NBT];
  start_tile<R, NBT>(w, b0, out, ldo, accumulate, acc);

  if constexpr (F == WeightFormat::BF16) {
    for (int64_t pair = 0; pair < pairs(w); ++pair) {
      __m512i wv[NBT];
      for (int j = 0; j < NBT; ++j) wv[j] = q8_or_bf16_word<F>(blocks[j], pair);
      for (int r = 0; r < R; ++r) {
        __m512i xb = x_word(rows[r], w.k, pair);
        for (int j = 0; j < NBT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], (__m512bh)xb);
      }
    }
  } else {
    const __m512i magic = _mm512_set1_epi32(int32_t(kQ4Magic)), mask = _mm512_set1_epi32(int32_t(kQ4Mask));
    const int64_t per = w.group / 2;  // pairs per group
    const bool offsets = has_offsets(w);
    for (int64_t g = 0; g < G; ++g) {
      __m512 part[R][NBT];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NBT; ++j) part[r][j] = _mm512_setzero_ps();
      if constexpr (F == WeightFormat::Q4) {
        const int64_t octs = w.group / 8;  // octs per group
        for (int64_t oct = g * octs; oct < g * octs + octs; ++oct) {
          __m512i packed[NBT], high[NBT];
          for (int j = 0; j < NBT; ++j) {
            const uint8_t* at = oct_codes(blocks[j], oct, Bits);
            prefetch_oct<NBT>(w, at, oct, Bits);
            packed[j] = _mm512_loadu_si512(at);
            if constexpr (Bits > 4) high[j] = spread_high16<Bits>(at + 64);
          }
          for (int p = 0; p < 4; ++p) {
            __m512i wv[NBT];
            for (int j = 0; j < NBT; ++j) {
              if constexpr (Bits == kE2M1) wv[j] = e2m1_words(_mm512_srli_epi32(packed[j], 4 * p));
              else wv[j] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(packed[j], 4 * p), mask, magic, 0xEA);  // (a & b) | c
              if constexpr (Bits == 5)
                wv[j] = _mm512_ternarylogic_epi32(wv[j], _mm512_srli_epi32(high[j], p), _mm512_set1_epi32(0x00100010), 0xF8);
              if constexpr (Bits == 6)  // a | (b & c)
                wv[j] = _mm512_ternarylogic_epi32(wv[j], _mm512_srli_epi32(high[j], 2 * p), _mm512_set1_epi32(0x00300030), 0xF8);
            }
            dot_rows<R, NBT>(rows, oct * 4 + p, wv, part);
          }
        }
      } else {
        for (int64_t pair = g * per; pair < g * per + per; ++pair) {
          __m512i wv[NBT];
          for (int j = 0; j < NBT; ++j) {
            if (pair % 2 == 0) prefetch_codes<NBT>(w, blocks[j] + pair * 32, pair * 32);  // one 64-byte line per two pairs
            wv[j] = q8_or_bf16_word<F>(blocks[j], pair);
          }
          dot_rows<R, NBT>(rows, pair, wv, part);
        }
      }
      end_group<F, S, R, NBT>(w, b0, g, gs, offsets, part, acc);
    }
  }
  store_tile<R, NBT>(w, b0, acc, out, ldo, out_bf16);
}

// From kPanelRows rows on, a column chunk's weights are decoded once into a panel (decode_block)
// that every row tile reads, instead of once per 6-row tile: for short rows only, where a 2-block
// tile's words (2 x K / 2 x 64 bytes) stay near L1. Measured on a 512-token prefill (AMD EPYC,
// Zen 4): gemma3's and qwen2's gate/up (K 640, 896) and QKV got 1.15-1.2x faster; their down and
// output projections (K 1024 to 4864), read from L2 at 64 bytes per pair instead of 8 to 16 bytes
// of codes, got 1.3-1.5x slower, so they decode as before.
constexpr int64_t kPanelRows = 12;
constexpr int64_t kPanelMaxK = 896;
struct alignas(64) PanelWord {
  uint8_t bytes[64];
};

// Block b's weight words (the bf16 pairs tile_avx512 decodes, pair by pair: 64 bytes each) into
// panel, for row tiles that then read them as they are instead of decoding them again.
template <WeightFormat F, int Bits>
SPECSERVE_AVX512 void decode_block(const PackedWeight& w, int64_t b, __m512i* panel) {
  const uint8_t* block = w.codes + b * block_bytes(F, w.k, Bits);
  if constexpr (F == WeightFormat::Q4) {
    const __m512i magic = _mm512_set1_epi32(int32_t(kQ4Magic)), mask = _mm512_set1_epi32(int32_t(kQ4Mask));
    for (int64_t oct = 0; oct < w.k / 8; ++oct) {
      const uint8_t* at = oct_codes(block, oct, Bits);
      prefetch_oct<1>(w, at, oct, Bits);
      const __m512i packed = _mm512_loadu_si512(at);
      __m512i high = _mm512_setzero_si512();
      if constexpr (Bits > 4) high = spread_high16<Bits>(at + 64);
      for (int p = 0; p < 4; ++p) {
        __m512i wv = Bits == kE2M1 ? e2m1_words(_mm512_srli_epi32(packed, 4 * p))
                                   : _mm512_ternarylogic_epi32(_mm512_srli_epi32(packed, 4 * p), mask, magic, 0xEA);
        if constexpr (Bits == 5)
          wv = _mm512_ternarylogic_epi32(wv, _mm512_srli_epi32(high, p), _mm512_set1_epi32(0x00100010), 0xF8);
        if constexpr (Bits == 6)
          wv = _mm512_ternarylogic_epi32(wv, _mm512_srli_epi32(high, 2 * p), _mm512_set1_epi32(0x00300030), 0xF8);
        _mm512_store_si512(panel + oct * 4 + p, wv);
      }
    }
  } else {
    for (int64_t pair = 0; pair < pairs(w); ++pair) {
      if (pair % 2 == 0) prefetch_codes<1>(w, block + pair * 32, pair * 32);
      _mm512_store_si512(panel + pair, q8_or_bf16_word<F>(block, pair));
    }
  }
}

// tile_avx512 for quantized weights whose words are in a panel (decode_block; `stride` words per
// block, the tile's first block at panel): the same dot products, group sums and epilogue.
template <WeightFormat F, ScaleType S, int R, int NBT>
SPECSERVE_AVX512 void tile_panel(const PackedWeight& w, int64_t b0, const __m512i* panel, int64_t stride,
                                 const uint16_t* x, int64_t ldx, const float* gs, void* out, int64_t ldo, bool out_bf16,
                                 bool accumulate) {
  const int64_t G = groups(w), per = w.group / 2;
  const uint16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + r * ldx;
  __m512 acc[R][NBT];
  start_tile<R, NBT>(w, b0, out, ldo, accumulate, acc);
  const bool offsets = has_offsets(w);
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[R][NBT];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NBT; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t pair = g * per; pair < g * per + per; ++pair) {
      __m512i wv[NBT];
      for (int j = 0; j < NBT; ++j) wv[j] = _mm512_load_si512(panel + j * stride + pair);
      dot_rows<R, NBT>(rows, pair, wv, part);
    }
    end_group<F, S, R, NBT>(w, b0, g, gs, offsets, part, acc);
  }
  store_tile<R, NBT>(w, b0, acc, out, ldo, out_bf16);
}

// tile_panel for the first `rows` (1..6) rows at xr, NBT blocks from block b.
template <WeightFormat F, ScaleType S, int NBT>
SPECSERVE_AVX512 void tile_panel_rows(int64_t rows, const PackedWeight& w, int64_t b, const __m512i* pb, int64_t stride,
                                      const uint16_t* xr, int64_t ldx, const float* g, void* o, int64_t ldo, bool out_bf16,
                                      bool accumulate) {
  switch (rows) {
    case 6: tile_panel<F, S, 6, NBT>(w, b, pb, stride, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
    case 5: tile_panel<F, S, 5, NBT>(w, b, pb, stride, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
    case 4: tile_panel<F, S, 4, NBT>(w, b, pb, stride, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
    case 3: tile_panel<F, S, 3, NBT>(w, b, pb, stride, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
    case 2: tile_panel<F, S, 2, NBT>(w, b, pb, stride, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
    default: tile_panel<F, S, 1, NBT>(w, b, pb, stride, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
  }
}

// Rows [0, m) of x against a decoded chunk of blocks [c, c_end): 6-row tiles, 2 blocks wide.
template <WeightFormat F, ScaleType S>
SPECSERVE_AVX512 void chunk_from_panel(const PackedWeight& w, int64_t c, int64_t c_end, const __m512i* panel, const uint16_t* x,
                                       int64_t ldx, int64_t m, const float* gs, void* out, int64_t ldo, bool out_bf16,
                                       bool accumulate) {
  const int64_t G = groups(w), stride = pairs(w);
  const size_t elem = out_bf16 ? 2 : 4;
  for (int64_t r = 0; r < m; r += 6) {
    const int64_t rows = std::min<int64_t>(6, m - r);
    const uint16_t* xr = x + r * ldx;
    void* o = static_cast<char*>(out) + r * ldo * elem;
    int64_t b = c;
    for (; b + 2 <= c_end; b += 2)
      tile_panel_rows<F, S, 2>(rows, w, b, panel + (b - c) * stride, stride, xr, ldx, gs + r * G, o, ldo, out_bf16, accumulate);
    for (; b < c_end; ++b)
      tile_panel_rows<F, S, 1>(rows, w, b, panel + (b - c) * stride, stride, xr, ldx, gs + r * G, o, ldo, out_bf16, accumulate);
  }
}

template <WeightFormat F, int Bits, ScaleType S, int R>
SPECSERVE_AVX512 void rows_avx512(const PackedWeight& w, int64_t b, int64_t b_end, const uint16_t* x, int64_t ldx,
                                  const float* gs, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  // One row: one block at a time, so each thread reads one sequential stream (several blocks at once were
  // several streams, and a decode step's weights streamed at 0.84x); more rows share the decoded words.
  constexpr int kWide = R == 1 ? 1 : R <= 2 ? 4 : 2;  // keep 2 * R * NBT accumulators within the 32 registers
  for (; b + kWide <= b_end; b += kWide) tile_avx512<F, Bits, S, R, kWide>(w, b, x, ldx, gs, out, ldo, out_bf16, accumulate);
  for (; b < b_end; ++b) tile_avx512<F, Bits, S, R, 1>(w, b, x, ldx, gs, out, ldo, out_bf16, accumulate);
}

template <WeightFormat F, int Bits, ScaleType S>
SPECSERVE_AVX512 void blocks_avx512(const PackedWeight& w, int64_t b_begin, int64_t b_end, const uint16_t* x,
                                    int64_t ldx, int64_t m, const float* gs, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  const int64_t G = w.format == WeightFormat::BF16 ? 0 : groups(w);
  const size_t elem = out_bf16 ? 2 : 4;
  // Column chunks outside, row tiles inside: a chunk's weights stay in cache across the rows. Tiles
  // of 6 rows: a weight word is decoded once per tile, and decoding (Q8: three conversions per 16
  // weights) costs as much as the dot products, so a 6-row verify window pays it once, not twice.
  constexpr int64_t kChunk = 8;
  const PackedWeight first = streaming(w, m);  // the first row tile of a chunk reads it from memory
  if constexpr (F != WeightFormat::BF16) {
    if (m >= kPanelRows && w.k <= kPanelMaxK) {  // many row tiles: decode each chunk once for them all
      const int64_t stride = pairs(w);
      thread_local std::vector<PanelWord> storage;  // per thread: the threads split the blocks
      storage.resize(size_t(kChunk * stride));
      __m512i* panel = reinterpret_cast<__m512i*>(storage.data());
      for (int64_t c = b_begin; c < b_end; c += kChunk) {
        const int64_t c_end = std::min(b_end, c + kChunk);
        for (int64_t b = c; b < c_end; ++b) decode_block<F, Bits>(first, b, panel + (b - c) * stride);
        chunk_from_panel<F, S>(w, c, c_end, panel, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
      }
      return;
    }
  }
  for (int64_t c = b_begin; c < b_end; c += kChunk) {
    int64_t c_end = std::min(b_end, c + kChunk);
    int64_t r = 0;
    for (; r + 6 <= m; r += 6)
      rows_avx512<F, Bits, S, 6>(r == 0 ? first : w, c, c_end, x + r * ldx, ldx, gs + r * G,
                                 static_cast<char*>(out) + r * ldo * elem, ldo, out_bf16, accumulate);
    void* o = static_cast<char*>(out) + r * ldo * elem;
    const PackedWeight& tail = r == 0 ? first : w;
    switch (m - r) {
      case 5: rows_avx512<F, Bits, S, 5>(tail, c, c_end, x + r * ldx, ldx, gs + r * G, o, ldo, out_bf16, accumulate); break;
      case 4: rows_avx512<F, Bits, S, 4>(tail, c, c_end, x + r * ldx, ldx, gs + r * G, o, ldo, out_bf16, accumulate); break;
      case 3: rows_avx512<F, Bits, S, 3>(tail, c, c_end, x + r * ldx, ldx, gs + r * G, o, ldo, out_bf16, accumulate); break;
      case 2: rows_avx512<F, Bits, S, 2>(tail, c, c_end, x + r * ldx, ldx, gs + r * G, o, ldo, out_bf16, accumulate); break;
      case 1: rows_avx512<F, Bits, S, 1>(tail, c, c_end, x + r * ldx, ldx, gs + r * G, o, ldo, out_bf16, accumulate); break;
      default: break;
    }
  }
}

// The blocks for w's format and code width, its tables of type S (BF16 weights have none).
template <ScaleType S>
SPECSERVE_AVX512 void blocks_avx512_format(const PackedWeight& w, int64_t b_begin, int64_t b_end, const uint16_t* x,
                                           int64_t ldx, int64_t m, const float* gs, void* out, int64_t ldo, bool out_bf16,
                                           bool accumulate) {
  switch (w.format) {
    case WeightFormat::Q4:
      if (w.bits == 5) blocks_avx512<WeightFormat::Q4, 5, S>(w, b_begin, b_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
      else if (w.bits == 6) blocks_avx512<WeightFormat::Q4, 6, S>(w, b_begin, b_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
      else if (w.bits == kE2M1) blocks_avx512<WeightFormat::Q4, kE2M1, S>(w, b_begin, b_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
      else blocks_avx512<WeightFormat::Q4, 4, S>(w, b_begin, b_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
      break;
    case WeightFormat::Q8: blocks_avx512<WeightFormat::Q8, 0, S>(w, b_begin, b_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate); break;
    default:
      if constexpr (S == ScaleType::F16)  // BF16 weights: one instance
        blocks_avx512<WeightFormat::BF16, 0, S>(w, b_begin, b_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
      break;
  }
}

#endif  // SPECSERVE_X86

}  // namespace

namespace {
int64_t prefetch_setting(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : fallback;
}
}  // namespace

extern const int64_t kPrefetchBytes = prefetch_setting("SPECSERVE_PREFETCH_BYTES", 4096);
extern const int64_t kPrefetchBytesWide = prefetch_setting("SPECSERVE_PREFETCH_BYTES_WIDE", 32768);

int64_t block_bytes(WeightFormat format, int64_t k, int bits) {
  switch (format) {
    case WeightFormat::Q4: return k / 8 * oct_bytes(bits);
    case WeightFormat::Q8: return k * kBlockCols;
    default: return (k + 1) / 2 * 4 * kBlockCols;
  }
}

void dense_rows_bf16(const PackedWeight& w, const int64_t* index, int64_t rows, uint16_t* out) {
  const int64_t bytes = block_bytes(w.format, w.k, w.bits);
  const bool offsets = has_offsets(w);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = index[r] / kBlockCols;
    const int lane = int(index[r] % kBlockCols);
    const uint8_t* block = w.codes + b * bytes;
    uint16_t* row = out + r * w.k;
    // Each bf16 word holds two columns' values (Q4: 128 + q, Q8: q, both exact; BF16: the weight's).
    if (w.format == WeightFormat::BF16) {
      for (int64_t kk = 0; kk < w.k; kk += 2) {
        const uint32_t word = weight_word(w, block, kk / 2, lane);
        row[kk] = uint16_t(word & 0xFFFFu);
        if (kk + 1 < w.k) row[kk + 1] = uint16_t(word >> 16);
      }
      continue;
    }
    const double bias = w.format == WeightFormat::Q4 ? 128.0 : 0.0;
    for (int64_t g = 0; g < w.k / w.group; ++g) {  // groups are 16 or 32 columns: whole words
      const double d = scale_at(w, b, g, lane), m = offsets ? double(offset_at(w, b, g, lane)) : 0.0;
      for (int64_t kk = g * w.group; kk < (g + 1) * w.group; kk += 2) {
        const uint32_t word = weight_word(w, block, kk / 2, lane);
        for (int h = 0; h < 2; ++h) {
          const double v = (double(bf16_to_f32(uint16_t(word >> (16 * h)))) - bias) * d;
          row[kk + h] = f32_to_bf16_torch(float(offsets ? v + m : v));
        }
      }
    }
  }
}

void group_sums(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int64_t group, float* out) {
  const int64_t G = k / group;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int i = 0; i < group; ++i) s += bf16_to_f32(x[r * ldx + g * group + i]);
      out[r * G + g] = s;
    }
}

void linear_blocks(Path path, const PackedWeight& w, const uint16_t* x, int64_t ldx, int64_t m,
                   const float* gs, const Avx2Rows* avx2, int64_t block_begin, int64_t block_end, void* out,
                   int64_t ldo, bool out_bf16, bool accumulate) {
#if SPECSERVE_X86
  if (path == Path::Avx2Fma) {
    linear_blocks_avx2(w, *avx2, m, gs, block_begin, block_end, out, ldo, out_bf16, accumulate);
    return;
  }
  if (path == Path::Avx512Bf16) {
    switch (w.scale_type) {
      case ScaleType::F32: blocks_avx512_format<ScaleType::F32>(w, block_begin, block_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate); break;
      case ScaleType::I8: blocks_avx512_format<ScaleType::I8>(w, block_begin, block_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate); break;
      default: blocks_avx512_format<ScaleType::F16>(w, block_begin, block_end, x, ldx, m, gs, out, ldo, out_bf16, accumulate); break;
    }
    return;
  }
#endif
  (void)avx2;
  for (int64_t b = block_begin; b < block_end; ++b) block_generic(w, b, x, ldx, m, gs, out, ldo, out_bf16, accumulate);
}

}  // namespace specserve
