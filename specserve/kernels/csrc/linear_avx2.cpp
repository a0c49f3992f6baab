// The AVX2 + FMA path of the weight-quantized linear layers (see linear.h), for x86 CPUs without
// AVX512-BF16. It gives the generic path's results bit for bit.
//
// A block's 16 output columns are two 8-lane halves. VDPBF16PS (which the generic path spells out
// in fma_daz_ftz) is, per lane, an FMA of w_hi * x_hi and then one of w_lo * x_lo into the
// accumulator, reading subnormal inputs as zero and flushing results that round below 2^-126.
// Here each pair costs two FMAs per half. A plain FMA is that arithmetic whenever no input or
// partial sum is subnormal, infinite or NaN and no result rounds below 2^-126. Both hold when the
// exponents of x and of the weights are bounded (rows_exact): all products and partial sums of a
// group are then multiples of 2^(Ex_min + Ew_min - 14) >= 2^-126 (rounding keeps that), so none
// is subnormal, and no product reaches 2^128. Tiles with a row outside the bounds (in practice:
// never, for real activations) run the same FMAs with MXCSR's DAZ and FTZ set around the dot
// products (FlushDenormalsScope) and in a fixed instruction form (fmadd_nan_ordered), which makes
// them VDPBF16PS's arithmetic for every input, NaN payloads included.
#include "linear.h"

#include "simd_avx2.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace specserve {

namespace {

#if SPECSERVE_X86

constexpr int32_t kQ4Magic = 0x43004300;
constexpr int32_t kQ4Mask = 0x000F000F;
constexpr int32_t kHighHalf = int32_t(0xFFFF0000u);

// The (hi, lo) weights of 8 lanes of one pair word vector, as float.
template <WeightFormat F>
SPECSERVE_AVX2 inline void split_pair(__m256i word, __m256& hi, __m256& lo) {
  if constexpr (F == WeightFormat::Q8) {  // word = two sign-extended int16 codes
    hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(word, 16));
    lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(word, 16), 16));
  } else {  // two bf16
    hi = bits_as_f32(_mm256_and_si256(word, _mm256_set1_epi32(kHighHalf)));
    lo = bits_as_f32(_mm256_slli_epi32(word, 16));
  }
}

// Pair `pair`'s words of one block half (Q8 and BF16; Q4 words come from the oct loads).
template <WeightFormat F>
SPECSERVE_AVX2 inline __m256i pair_word(const uint8_t* block, int64_t pair, int half) {
  if constexpr (F == WeightFormat::Q8)
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + pair * 32 + half * 16)));
  else
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + pair * 64 + half * 32));
}

// acc += w_hi * x_hi, then += w_lo * x_lo, each fused, as VDPBF16PS does (see the file comment for
// the subnormal, overflow and NaN cases).
template <bool Flush>
SPECSERVE_AVX2 inline __m256 dot_pair8(__m256 acc, __m256 w_hi, __m256 w_lo, __m256 x_hi, __m256 x_lo) {
  if constexpr (Flush) return fmadd_nan_ordered(w_lo, x_lo, fmadd_nan_ordered(w_hi, x_hi, acc));
  return _mm256_fmadd_ps(w_lo, x_lo, _mm256_fmadd_ps(w_hi, x_hi, acc));
}

// Broadcast x[2p+1] and x[2p] of a prepared row (floats, subnormals flushed as the generic path
// reads them, zero-padded).
SPECSERVE_AVX2 inline void x_pair8(const float* row, int64_t pair, __m256& hi, __m256& lo) {
  hi = _mm256_broadcast_ss(row + 2 * pair + 1);
  lo = _mm256_broadcast_ss(row + 2 * pair);
}

// part[r][j][h] += one pair's weights (wh, wl per block half) times row r's pair.
template <int R, int NBT, bool Flush>
SPECSERVE_AVX2 inline void dot_rows(const float* x, int64_t ldx, int64_t pair, const __m256 (*wh)[2], const __m256 (*wl)[2],
                                    __m256 (*part)[NBT][2]) {
  for (int r = 0; r < R; ++r) {
    __m256 xh, xl;
    x_pair8(x + r * ldx, pair, xh, xl);
    for (int j = 0; j < NBT; ++j)
      for (int h = 0; h < 2; ++h) part[r][j][h] = dot_pair8<Flush>(part[r][j][h], wh[j][h], wl[j][h], xh, xl);
  }
}

// The bf16 words (128 + table value) of E2M1 codes at bits 0 and 16 of each lane of `shifted`, as
// linear.cpp's e2m1_words does for 16 lanes.
SPECSERVE_AVX2 inline __m256i e2m1_words8(__m256i shifted) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
  const __m256i index = _mm256_or_si256(_mm256_and_si256(shifted, _mm256_set1_epi32(kQ4Mask)), _mm256_set1_epi32(int32_t(0x80008000u)));
  return _mm256_or_si256(_mm256_shuffle_epi8(table, index), _mm256_set1_epi32(kQ4Magic));
}

// spread_high (linear.h) of 8 lanes (half h of the block) of one oct's high-bit plane.
SPECSERVE_AVX2 inline __m256i spread_high8(const uint8_t* plane, int half, int bits) {
  if (bits == 5) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(plane + half * 8)));
    return _mm256_and_si256(_mm256_or_si256(_mm256_slli_epi32(v, 4), _mm256_slli_epi32(v, 16)), _mm256_set1_epi32(0x00F000F0));
  }
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane + half * 16)));
  return _mm256_and_si256(_mm256_or_si256(_mm256_slli_epi32(v, 4), _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0FF00FF0));
}

template <WeightFormat F, ScaleType S, int R, int NBT, bool Flush>
SPECSERVE_AVX2 void tile_avx2(const PackedWeight& w, int64_t b0, const float* x, int64_t ldx, const float* gs,
                              void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  const int64_t bytes = block_bytes(F, w.k, w.bits), G = w.k / w.group;
  const uint8_t* blocks[NBT];
  for (int j = 0; j < NBT; ++j) blocks[j] = w.codes + (b0 + j) * bytes;
  __m256 acc[R][NBT][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NBT; ++j) {
      acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
      if (accumulate) {  // continue the fp32 sums already in out (a chain over K split across ranks)
        const int64_t col = (b0 + j) * kBlockCols, valid = std::min<int64_t>(kBlockCols, w.n - col);
        alignas(32) float lanes[kBlockCols] = {0};
        std::memcpy(lanes, static_cast<const float*>(out) + r * ldo + col, valid * 4);
        acc[r][j][0] = _mm256_load_ps(lanes);
        acc[r][j][1] = _mm256_load_ps(lanes + 8);
      }
    }

  if constexpr (F == WeightFormat::BF16) {
    FlushDenormalsScope flush(Flush);
    for (int64_t pair = 0; pair < (w.k + 1) / 2; ++pair) {
      __m256 wh[NBT][2], wl[NBT][2];
      for (int j = 0; j < NBT; ++j)
        for (int h = 0; h < 2; ++h) split_pair<F>(pair_word<F>(blocks[j], pair, h), wh[j][h], wl[j][h]);
      for (int r = 0; r < R; ++r) {
        __m256 xh, xl;
        x_pair8(x + r * ldx, pair, xh, xl);
        for (int j = 0; j < NBT; ++j)
          for (int h = 0; h < 2; ++h) acc[r][j][h] = dot_pair8<Flush>(acc[r][j][h], wh[j][h], wl[j][h], xh, xl);
      }
    }
  } else {
    const int64_t per = w.group / 2;  // pairs per group
    for (int64_t g = 0; g < G; ++g) {
      __m256 part[R][NBT][2];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NBT; ++j) part[r][j][0] = part[r][j][1] = _mm256_setzero_ps();
      {  // the dot products only: the scale FMAs below are plain IEEE ones
        FlushDenormalsScope flush(Flush);
        if constexpr (F == WeightFormat::Q4) {
          const int64_t octs = w.group / 8;  // octs per group
          for (int64_t oct = g * octs; oct < g * octs + octs; ++oct) {
            __m256i packed[NBT][2], high[NBT][2];
            for (int j = 0; j < NBT; ++j)
              for (int h = 0; h < 2; ++h) {
                const uint8_t* at = oct_codes(blocks[j], oct, w.bits);
                if (h == 0) prefetch_oct<NBT>(w, at, oct, w.bits);
                packed[j][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + h * 32));
                if (w.bits > 4) high[j][h] = spread_high8(at + 64, h, w.bits);
              }
            for (int p = 0; p < 4; ++p) {
              __m256 wh[NBT][2], wl[NBT][2];
              for (int j = 0; j < NBT; ++j)
                for (int h = 0; h < 2; ++h) {
                  __m256i word = _mm256_or_si256(
                      _mm256_and_si256(_mm256_srli_epi32(packed[j][h], 4 * p), _mm256_set1_epi32(kQ4Mask)), _mm256_set1_epi32(kQ4Magic));
                  if (w.bits == kE2M1)
                    word = e2m1_words8(_mm256_srli_epi32(packed[j][h], 4 * p));
                  else if (w.bits == 5)
                    word = _mm256_or_si256(word, _mm256_and_si256(_mm256_srli_epi32(high[j][h], p), _mm256_set1_epi32(0x00100010)));
                  else if (w.bits == 6)
                    word = _mm256_or_si256(word, _mm256_and_si256(_mm256_srli_epi32(high[j][h], 2 * p), _mm256_set1_epi32(0x00300030)));
                  split_pair<F>(word, wh[j][h], wl[j][h]);
                }
              dot_rows<R, NBT, Flush>(x, ldx, oct * 4 + p, wh, wl, part);
            }
          }
        } else {
          for (int64_t pair = g * per; pair < g * per + per; ++pair) {
            __m256 wh[NBT][2], wl[NBT][2];
            for (int j = 0; j < NBT; ++j) {
              if (pair % 2 == 0) prefetch_codes<NBT>(w, blocks[j] + pair * 32, pair * 32);  // one 64-byte line per two pairs
              for (int h = 0; h < 2; ++h) split_pair<F>(pair_word<F>(blocks[j], pair, h), wh[j][h], wl[j][h]);
            }
            dot_rows<R, NBT, Flush>(x, ldx, pair, wh, wl, part);
          }
        }
      }
      for (int j = 0; j < NBT; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m256 d = scales8<S>(w, b0 + j, g, h);
          for (int r = 0; r < R; ++r) {
            const __m256 s0 = _mm256_set1_ps(has_offsets(w) ? gs[r * G + g] : 0.0f);
            __m256 sum = part[r][j][h];
            if constexpr (F == WeightFormat::Q4) sum = _mm256_fmadd_ps(_mm256_set1_ps(-128.0f), s0, sum);
            acc[r][j][h] = _mm256_fmadd_ps(d, sum, acc[r][j][h]);
          }
          if (has_offsets(w)) {
            const __m256 m = offsets8<S>(w, b0 + j, g, h, d);
            for (int r = 0; r < R; ++r) acc[r][j][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(gs[r * G + g]), acc[r][j][h]);
          }
        }
    }
  }
  for (int j = 0; j < NBT; ++j) {
    const int64_t col = (b0 + j) * kBlockCols, valid = std::min<int64_t>(kBlockCols, w.n - col);
    for (int r = 0; r < R; ++r) store_lanes16(acc[r][j][0], acc[r][j][1], out, r * ldo + col, valid, out_bf16);
  }
}

template <WeightFormat F, ScaleType S, int R, bool Flush>
SPECSERVE_AVX2 void rows_avx2(const PackedWeight& w, int64_t b, int64_t b_end, const float* x, int64_t ldx,
                              const float* gs, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  // One row: one block at a time (one sequential stream); two rows share the decoded words. Within the
  // 16 registers: 2 * R * NBT partial sums.
  constexpr int kWide = R == 2 ? 2 : 1;
  for (; b + kWide <= b_end; b += kWide) tile_avx2<F, S, R, kWide, Flush>(w, b, x, ldx, gs, out, ldo, out_bf16, accumulate);
  for (; b < b_end; ++b) tile_avx2<F, S, R, 1, Flush>(w, b, x, ldx, gs, out, ldo, out_bf16, accumulate);
}

template <WeightFormat F, ScaleType S, int R>
SPECSERVE_AVX2 void rows_either(bool exact, const PackedWeight& w, int64_t b, int64_t b_end, const float* x,
                                int64_t ldx, const float* gs, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  if (exact) rows_avx2<F, S, R, false>(w, b, b_end, x, ldx, gs, out, ldo, out_bf16, accumulate);
  else rows_avx2<F, S, R, true>(w, b, b_end, x, ldx, gs, out, ldo, out_bf16, accumulate);
}

#endif  // SPECSERVE_X86

// Biased exponent bounds of the weights' values that make FMA exact (see the file comment):
// quantized codes act as integers below 2^8 (exponent 127 + 7 in both bounds).
ExponentRange weight_range(const PackedWeight& w) {
  return w.format == WeightFormat::BF16 ? w.exponents : ExponentRange{127 + 7, 127 + 7, true};
}

ExponentRange row_exponents(const uint16_t* row, int64_t k) {
  ExponentRange range{255, 0, true};
  for (int64_t i = 0; i < k; ++i) {
    const int e = (row[i] >> 7) & 0xFF;
    if (e == 0xFF || (e == 0 && (row[i] & 0x7F))) range.finite_normal = false;  // inf, NaN, subnormal
    if (e != 0) range.lo = std::min(range.lo, e), range.hi = std::max(range.hi, e);
  }
  return range;
}

bool rows_exact(const ExponentRange& x, const ExponentRange& w) {
  if (!x.finite_normal || !w.finite_normal) return false;
  if (x.lo > x.hi || w.lo > w.hi) return true;  // all zeros: every product is a zero
  return x.lo + w.lo >= 254 - 112 && x.hi + w.hi <= 254 + 125;
}

}  // namespace

#if SPECSERVE_X86
void linear_blocks_avx2(const PackedWeight& w, const Avx2Rows& rows_in, int64_t m, const float* gs,
                        int64_t block_begin, int64_t block_end, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  const float* x = rows_in.x;
  const int64_t ldx = rows_in.ldx;
  const uint8_t* row_exact = rows_in.exact;
  const int64_t G = w.format == WeightFormat::BF16 ? 0 : w.k / w.group;
  const size_t elem = out_bf16 ? 2 : 4;
  constexpr int64_t kChunk = 8;  // column chunks outside, row tiles inside: a chunk stays in cache
  const PackedWeight first = streaming(w, m);  // the first row tile of a chunk reads it from memory
  for (int64_t c = block_begin; c < block_end; c += kChunk) {
    const int64_t c_end = std::min(block_end, c + kChunk);
    for (int64_t r = 0; r < m;) {
      const PackedWeight& tile_w = r == 0 ? first : w;
      const int64_t rows = std::min<int64_t>(4, m - r);
      const bool exact = std::all_of(row_exact + r, row_exact + r + rows, [](uint8_t e) { return e != 0; });
      const float* xr = x + r * ldx;
      const float* g = gs + r * G;
      void* o = static_cast<char*>(out) + r * ldo * elem;
      auto run = [&](auto fmt, auto scales) {
        constexpr WeightFormat F = decltype(fmt)::value;
        constexpr ScaleType S = decltype(scales)::value;
        switch (rows) {
          case 4: rows_either<F, S, 4>(exact, tile_w, c, c_end, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
          case 3: rows_either<F, S, 3>(exact, tile_w, c, c_end, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
          case 2: rows_either<F, S, 2>(exact, tile_w, c, c_end, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
          default: rows_either<F, S, 1>(exact, tile_w, c, c_end, xr, ldx, g, o, ldo, out_bf16, accumulate); break;
        }
      };
      auto quantized = [&](auto fmt) {  // the table type as a template argument (linear.h table16)
        switch (w.scale_type) {
          case ScaleType::F32: run(fmt, std::integral_constant<ScaleType, ScaleType::F32>{}); break;
          case ScaleType::I8: run(fmt, std::integral_constant<ScaleType, ScaleType::I8>{}); break;
          default: run(fmt, std::integral_constant<ScaleType, ScaleType::F16>{}); break;
        }
      };
      switch (w.format) {
        case WeightFormat::Q4: quantized(std::integral_constant<WeightFormat, WeightFormat::Q4>{}); break;
        case WeightFormat::Q8: quantized(std::integral_constant<WeightFormat, WeightFormat::Q8>{}); break;
        default:
          run(std::integral_constant<WeightFormat, WeightFormat::BF16>{}, std::integral_constant<ScaleType, ScaleType::F16>{});
          break;
      }
      r += rows;
    }
  }
}
#endif  // SPECSERVE_X86

bool prepare_avx2_row(const PackedWeight& w, const uint16_t* row, float* out) {
  for (int64_t i = 0; i < w.k; ++i) out[i] = flush_subnormal(bf16_to_f32(row[i]));
  if (w.k % 2) out[w.k] = 0.0f;
  return rows_exact(row_exponents(row, w.k), weight_range(w));
}

}  // namespace specserve
