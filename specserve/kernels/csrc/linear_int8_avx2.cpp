// The AVX2 path of the integer-activation linear layers (see linear_int8.h), for x86 CPUs without
// AVX-512. A block's 16 columns are two 8-lane halves. VPMADDUBSW multiplies unsigned by signed
// bytes and adds adjacent pairs into int16 (saturating), so every operand is kept where no pair sum
// can saturate: Q4-layout codes are at most 63 (the two nibble words' pair sums of an oct add up to
// at most 2 * 2 * 63 * 127 < 2^15), and for signed 8-bit codes the weight's sign moves onto x
// (|w| * sign(w) x, |w| <= 128). The int32 sums are then exact, as on every path.
#include "linear_int8.h"

#include <algorithm>
#include <cfloat>
#include <cstring>

namespace specserve {

namespace {

#if SPECSERVE_X86

// Adds the high bits of one oct's codes (lanes 8h..8h+7) to its nibble words wa (columns 0, 4, 1,
// 5) and wb (2, 6, 3, 7), as add_high_bits in linear_int8.cpp does for 16 lanes.
template <int Bits>
SPECSERVE_AVX2 inline void add_high_bits8(const uint8_t* plane, int half, __m256i& wa, __m256i& wb) {
  if constexpr (Bits == 5) {  // each lane's plane byte in all four of its bytes, then one bit per byte
    const __m256i idx = _mm256_setr_epi32(0x00000000, 0x01010101, 0x02020202, 0x03030303, 0x04040404, 0x05050505,
                                          0x06060606, 0x07070707);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(plane + half * 8));
    const __m256i h = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), idx);
    const __m256i bit_a = _mm256_set1_epi32(0x40100401), bit_b = _mm256_set1_epi32(int32_t(0x80200802u));
    const __m256i sixteen = _mm256_set1_epi8(16);
    wa = _mm256_or_si256(wa, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit_a), bit_a), sixteen));
    wb = _mm256_or_si256(wb, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit_b), bit_b), sixteen));
  } else if constexpr (Bits == 6) {  // per lane the plane's (low, low, high, high) bytes
    const __m256i dup = _mm256_setr_epi32(0x01010000, 0x05050404, 0x09090808, 0x0D0D0C0C, 0x01010000, 0x05050404,
                                          0x09090808, 0x0D0D0C0C);
    const __m256i t = _mm256_shuffle_epi8(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane + half * 16))), dup);
    const __m256i even = _mm256_set1_epi32(0x00300030), odd = _mm256_set1_epi32(0x30003000);
    wa = _mm256_or_si256(wa, _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(t, 4), even), _mm256_and_si256(t, odd)));
    wb = _mm256_or_si256(wb, _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(t, 2), even),
                                             _mm256_and_si256(_mm256_srli_epi32(t, 2), odd)));
  }
}

// part[r][j][h] += the group's integer dot products, Q4 layout (codes unsigned, x signed).
template <int Bits, int R, int NBT>
SPECSERVE_AVX2 inline void q4_group8(const PackedWeight& w, const uint8_t* const* blocks, const int8_t* const* rows,
                                     int64_t g, __m256i (*part)[NBT][2]) {
  const int64_t octs = w.group / 8;
  const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
  for (int64_t oct = g * octs; oct < g * octs + octs; ++oct) {
    __m256i wa[NBT][2], wb[NBT][2];
    for (int j = 0; j < NBT; ++j)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* at = oct_codes(blocks[j], oct, Bits);
        if (h == 0) prefetch_oct<NBT>(w, at, oct, Bits);
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + h * 32));
        wa[j][h] = _mm256_and_si256(packed, nibbles);
        wb[j][h] = _mm256_and_si256(_mm256_srli_epi32(packed, 4), nibbles);
        if constexpr (Bits > 4) add_high_bits8<Bits>(at + 64, h, wa[j][h], wb[j][h]);
        if constexpr (Bits == kE2M1) {  // the table's values (0..24): pair sums stay far from saturation
          const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
          wa[j][h] = _mm256_shuffle_epi8(table, wa[j][h]);
          wb[j][h] = _mm256_shuffle_epi8(table, wb[j][h]);
        }
      }
    for (int r = 0; r < R; ++r) {
      int32_t xa, xb;
      std::memcpy(&xa, rows[r] + oct * 8, 4);
      std::memcpy(&xb, rows[r] + oct * 8 + 4, 4);
      const __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb);
      for (int j = 0; j < NBT; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(wa[j][h], va), _mm256_maddubs_epi16(wb[j][h], vb));
          part[r][j][h] = _mm256_add_epi32(part[r][j][h], _mm256_madd_epi16(pairs, ones));
        }
    }
  }
}

// The same for the Q8 layout (codes signed): |w| times x with w's sign.
template <int R, int NBT>
SPECSERVE_AVX2 inline void q8_group8(const PackedWeight& w, const uint8_t* const* blocks, const int8_t* const* rows,
                                     int64_t g, __m256i (*part)[NBT][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = g * w.group / 4; t < (g + 1) * w.group / 4; ++t) {  // 4 columns (pairs 2t, 2t + 1)
    __m256i wv[NBT][2], wabs[NBT][2];
    for (int j = 0; j < NBT; ++j)
      for (int h = 0; h < 2; ++h) {
        if (h == 0) prefetch_codes<NBT>(w, blocks[j] + 2 * t * 32, 2 * t * 32);
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[j] + 2 * t * 32 + h * 16));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[j] + (2 * t + 1) * 32 + h * 16));
        wv[j][h] = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
        wabs[j][h] = _mm256_abs_epi8(wv[j][h]);
      }
    for (int r = 0; r < R; ++r) {
      int32_t xw;
      std::memcpy(&xw, rows[r] + t * 4, 4);
      const __m256i xv = _mm256_set1_epi32(xw);
      for (int j = 0; j < NBT; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(wabs[j][h], _mm256_sign_epi8(xv, wv[j][h]));
          part[r][j][h] = _mm256_add_epi32(part[r][j][h], _mm256_madd_epi16(pairs, ones));
        }
    }
  }
}

template <WeightFormat F, int Bits, int R, int NBT>
SPECSERVE_AVX2 void tile_int8_avx2(const PackedWeight& w, int64_t b0, const Int8Rows& x, int64_t r0, void* out,
                                   int64_t ldo, bool out_bf16, bool accumulate) {
  const int64_t G = w.k / w.group;
  const bool general = general_offsets(w);
  const uint8_t* blocks[NBT];
  const int8_t* rows[R];
  tile_sources<R, NBT>(w, b0, x, r0, blocks, rows);
  __m256 acc[R][NBT][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NBT; ++j) {
      alignas(32) float lanes[kBlockCols] = {0};
      const int64_t col = (b0 + j) * kBlockCols, valid = std::min<int64_t>(kBlockCols, w.n - col);
      if (accumulate) std::memcpy(lanes, static_cast<const float*>(out) + (r0 + r) * ldo + col, valid * 4);
      acc[r][j][0] = _mm256_load_ps(lanes);
      acc[r][j][1] = _mm256_load_ps(lanes + 8);
    }
  for (int64_t g = 0; g < G; ++g) {
    // Each integer sum starts at its code offset's term, -c * sx (exact: the same integers as
    // subtracting it after, one operation fewer per row and block half).
    __m256i part[R][NBT][2];
    for (int r = 0; r < R; ++r) {
      const __m256i start = _mm256_set1_epi32(-w.code_offset * group_code_sum(x, r0 + r, g, w.group));
      for (int j = 0; j < NBT; ++j) part[r][j][0] = part[r][j][1] = start;
    }
    if constexpr (F == WeightFormat::Q4) q4_group8<Bits, R, NBT>(w, blocks, rows, g, part);
    else q8_group8<R, NBT>(w, blocks, rows, g, part);
    // linear_int8.h's arithmetic per 8 lanes: a block half's scales once for all rows, a row's
    // scalars once for all its blocks
    __m256 d[NBT][2], mv[NBT][2];
    for (int j = 0; j < NBT; ++j)
      for (int h = 0; h < 2; ++h) {
        d[j][h] = scales8(w, b0 + j, g, h);
        mv[j][h] = general ? offsets8(w, b0 + j, g, h, d[j][h]) : _mm256_setzero_ps();
      }
    for (int r = 0; r < R; ++r) {
      const int32_t sx = group_code_sum(x, r0 + r, g, w.group);
      const __m256 vdx = _mm256_set1_ps(block_scale(x, r0 + r, g, w.group)), sxf = _mm256_set1_ps(float(sx));
      for (int j = 0; j < NBT; ++j)
        for (int h = 0; h < 2; ++h) {
          acc[r][j][h] = _mm256_fmadd_ps(_mm256_mul_ps(d[j][h], vdx), _mm256_cvtepi32_ps(part[r][j][h]), acc[r][j][h]);
          if (general) acc[r][j][h] = _mm256_fmadd_ps(_mm256_mul_ps(mv[j][h], vdx), sxf, acc[r][j][h]);
        }
    }
  }
  for (int j = 0; j < NBT; ++j) {
    const int64_t col = (b0 + j) * kBlockCols, valid = std::min<int64_t>(kBlockCols, w.n - col);
    for (int r = 0; r < R; ++r) store_lanes16(acc[r][j][0], acc[r][j][1], out, (r0 + r) * ldo + col, valid, out_bf16);
  }
}

template <WeightFormat F, int Bits, int R>
SPECSERVE_AVX2 void rows_int8_avx2(const PackedWeight& w, int64_t b, int64_t b_end, const Int8Rows& x, int64_t r0,
                                   void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  constexpr int kWide = 1;  // one block at a time: one sequential weight stream (two blocks at one row streamed at 0.8x)
  for (; b + kWide <= b_end; b += kWide) tile_int8_avx2<F, Bits, R, kWide>(w, b, x, r0, out, ldo, out_bf16, accumulate);
  for (; b < b_end; ++b) tile_int8_avx2<F, Bits, R, 1>(w, b, x, r0, out, ldo, out_bf16, accumulate);
}

template <WeightFormat F, int Bits>
SPECSERVE_AVX2 void blocks_int8_avx2(const PackedWeight& w, int64_t b_begin, int64_t b_end, const Int8Rows& x,
                                     int64_t m, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  constexpr int64_t kChunk = 8;
  const PackedWeight first = streaming(w, m);  // the first row tile of a chunk reads it from memory
  for (int64_t c = b_begin; c < b_end; c += kChunk) {
    const int64_t c_end = std::min(b_end, c + kChunk);
    int64_t r = 0;
    for (; r + 2 <= m; r += 2) rows_int8_avx2<F, Bits, 2>(r == 0 ? first : w, c, c_end, x, r, out, ldo, out_bf16, accumulate);
    if (r < m) rows_int8_avx2<F, Bits, 1>(r == 0 ? first : w, c, c_end, x, r, out, ldo, out_bf16, accumulate);
  }
}

#endif  // SPECSERVE_X86

}  // namespace

#if SPECSERVE_X86
namespace {

SPECSERVE_AVX2 inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

SPECSERVE_AVX2 inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

}  // namespace

// quantize_block's arithmetic, 8 columns a vector (see the AVX-512 twin in linear_int8.cpp).
SPECSERVE_AVX2 void quantize_rows_avx2(const uint16_t* x, int64_t ldx, int64_t k, Int8Layout layout, int64_t begin,
                                       int64_t end, int8_t* q, float* d, int32_t* s16) {
  const __m256i oct = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15, 0, 4, 1, 5, 2, 6, 3, 7, 8,
                                       12, 9, 13, 10, 14, 11, 15);
  const __m256i dwords = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const __m256i exponent = _mm256_set1_epi32(0x7F800000), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* row = x + r * ldx;
    for (int64_t blk = 0; blk < k / 32; ++blk) {
      __m256 v[4];
      __m256i special = _mm256_setzero_si256();
      __m256 amax8 = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = load_bf16x8(row + blk * 32 + 8 * i);
        const __m256i bits = _mm256_castps_si256(v[i]);
        special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent));
        amax8 = _mm256_max_ps(amax8, _mm256_castsi256_ps(_mm256_and_si256(bits, magnitude)));
      }
      const float amax = hmax_ps(amax8);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      if (!_mm256_testz_si256(special, special) || !(inv <= FLT_MAX)) {
        quantize_block(row, k, layout, r, blk, q, d, s16);
        continue;
      }
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(v[i], vinv), kRound), lo), hi));
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      bytes = _mm256_permutevar8x32_epi32(bytes, dwords);
      if (layout.oct_order) bytes = _mm256_shuffle_epi8(bytes, oct);
      if (layout.biased) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(int8_t(0x80)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + blk * 32), bytes);
      d[r * (k / 32) + blk] = amax / 127.0f;
      s16[r * (k / 16) + 2 * blk] = hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
      s16[r * (k / 16) + 2 * blk + 1] = hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
    }
  }
}
#endif  // SPECSERVE_X86

void linear_int8_blocks_avx2(const PackedWeight& w, const Int8Rows& x, int64_t m, int64_t block_begin,
                             int64_t block_end, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
#if SPECSERVE_X86
  if (w.format == WeightFormat::Q8) blocks_int8_avx2<WeightFormat::Q8, 0>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == kE2M1) blocks_int8_avx2<WeightFormat::Q4, kE2M1>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == 5) blocks_int8_avx2<WeightFormat::Q4, 5>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == 6) blocks_int8_avx2<WeightFormat::Q4, 6>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else blocks_int8_avx2<WeightFormat::Q4, 4>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
#else
  (void)w, (void)x, (void)m, (void)block_begin, (void)block_end, (void)out, (void)ldo, (void)out_bf16, (void)accumulate;
#endif
}

}  // namespace specserve
