// Integer-activation linear layers (see linear_int8.h): the row quantization, the generic path and
// the AVX-512 VNNI path; the AVX2 path is in linear_int8_avx2.cpp.
#include "linear_int8.h"

#include "simd_avx512.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace specserve {

namespace {

// Where column c of an oct sits in the oct order (0, 4, 1, 5, 2, 6, 3, 7).
inline int oct_position(int c) { return (c % 4) * 2 + c / 4; }

// ------------------------------------------------------------------ generic path

// The code of input column `col` of `lane` in a packed block (see linear.h for the layouts).
int code_at(const PackedWeight& w, const uint8_t* block, int64_t col, int lane) {
  if (w.format == WeightFormat::Q8) return reinterpret_cast<const int8_t*>(block)[col / 2 * 32 + lane * 2 + col % 2];
  const int64_t oct = col / 8;
  const int p = int(col % 8) / 2, h = int(col % 2);
  uint32_t v;
  std::memcpy(&v, oct_codes(block, oct, w.bits) + lane * 4, 4);
  int code = int((v >> (4 * p + 16 * h)) & 0xF);
  if (w.bits == kE2M1) return int(e2m1_code(uint32_t(code)));
  const uint8_t* plane = oct_high(block, oct, w.bits);
  if (w.bits == 5) code |= ((plane[lane] >> (p + 4 * h)) & 1) << 4;
  if (w.bits == 6) {
    const uint32_t e = uint32_t(plane[2 * lane]) | (uint32_t(plane[2 * lane + 1]) << 8);
    code |= int((e >> (2 * p + 8 * h)) & 3) << 4;
  }
  return code;
}

void store_row(const float* acc, int64_t b, int64_t n, void* out, int64_t ldo, int64_t r, bool out_bf16) {
  for (int lane = 0; lane < kBlockCols && b * kBlockCols + lane < n; ++lane) {
    const int64_t col = b * kBlockCols + lane;
    if (out_bf16) static_cast<uint16_t*>(out)[r * ldo + col] = f32_to_bf16(acc[lane]);
    else static_cast<float*>(out)[r * ldo + col] = acc[lane];
  }
}

void block_generic(const PackedWeight& w, int64_t b, const Int8Rows& x, int64_t m, void* out, int64_t ldo,
                   bool out_bf16, bool accumulate) {
  const uint8_t* block = w.codes + b * block_bytes(w.format, w.k, w.bits);
  const int64_t G = w.k / w.group;
  const bool general = general_offsets(w);
  for (int64_t r = 0; r < m; ++r) {
    const int8_t* q = x.q + r * x.k;  // column order, unbiased (int8_layout)
    float acc[kBlockCols] = {0};
    for (int lane = 0; accumulate && lane < kBlockCols && b * kBlockCols + lane < w.n; ++lane)
      acc[lane] = static_cast<const float*>(out)[r * ldo + b * kBlockCols + lane];
    for (int64_t g = 0; g < G; ++g) {
      const int32_t sx = group_code_sum(x, r, g, w.group);
      const float dx = block_scale(x, r, g, w.group);
      for (int lane = 0; lane < kBlockCols; ++lane) {
        int32_t isum = 0;
        for (int64_t c = g * w.group; c < (g + 1) * w.group; ++c) isum += int32_t(q[c]) * code_at(w, block, c, lane);
        const float mv = general ? offset_at(w, b, g, lane) : 0.0f;
        acc[lane] = combine_group(acc[lane], isum, sx, scale_at(w, b, g, lane), mv, general, w.code_offset, dx);
      }
    }
    store_row(acc, b, w.n, out, ldo, r, out_bf16);
  }
}

// ------------------------------------------------------------------ AVX-512 VNNI path
#if SPECSERVE_X86

// Per 32-bit lane, the plane byte of that lane (5-bit codes) in all four bytes.
SPECSERVE_AVX512 inline __m512i lane_bytes_x4(const uint8_t* plane) {
  const __m512i idx = _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B, 0x0A0A0A0A,
                                       0x09090909, 0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404,
                                       0x03030303, 0x02020202, 0x01010101, 0x00000000);
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane))), idx);
}

// Adds the high bits of one oct's codes to its two nibble words: wa holds columns (0, 4, 1, 5), wb
// (2, 6, 3, 7), one byte each; a code's bits 4 and 5 come from the plane (linear.h).
template <int Bits>
SPECSERVE_AVX512 inline void add_high_bits(const uint8_t* plane, __m512i& wa, __m512i& wb) {
  if constexpr (Bits == 5) {  // plane byte: bit p = column 2p, bit 4 + p = column 2p + 1
    const __m512i h = lane_bytes_x4(plane), sixteen = _mm512_set1_epi8(16);
    wa = _mm512_mask_add_epi8(wa, _mm512_test_epi8_mask(h, _mm512_set1_epi32(0x40100401)), wa, sixteen);
    wb = _mm512_mask_add_epi8(wb, _mm512_test_epi8_mask(h, _mm512_set1_epi32(int32_t(0x80200802u))), wb, sixteen);
  } else if constexpr (Bits == 6) {  // plane uint16: bits 2p.. = column 2p, bits 8 + 2p.. = column 2p + 1
    // Qword i: the planes of lanes 2i and 2i + 1 (bits 0-15 and 16-31); VPMULTISHIFTQB takes each
    // byte's 8 bits from its qword at a bit offset of its own: the field of that byte's column,
    // starting 4 bits early so that it lands on bits 4-5 (the rest is masked off below).
    const __m512i t = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)));
    // wa's bytes are columns (0, 4, 1, 5): fields at bits 0, 4, 8, 12 of a lane; wb's (2, 6, 3, 7): 2, 6, 10, 14
    // (bytes 4-7: lane 2i + 1, 16 bits on); offsets 4 early, mod 64, lowest byte first
    const __m512i ha = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(int64_t(0x1814100C0804003Cull)), t);
    const __m512i hb = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(int64_t(0x1A16120E0A06023Eull)), t);
    const __m512i high = _mm512_set1_epi32(0x30303030);
    wa = _mm512_ternarylogic_epi32(wa, ha, high, 0xF8);  // a | (b & c)
    wb = _mm512_ternarylogic_epi32(wb, hb, high, 0xF8);
  }
}

// part[r][j] += the group's integer dot products for a Q4-layout weight (codes unsigned, x signed).
// A lone chain per (row, block) when there are enough of them to hide VPDPBUSD's latency; with
// fewer, each takes two chains (the octs' two halves), added at the end (integers: exact).
template <int Bits, int Group, int R, int NBT>
SPECSERVE_AVX512 SPECSERVE_INLINE void q4_group(const PackedWeight& w, const uint8_t* const* blocks,
                                                const int8_t* const* rows, int64_t g, __m512i (*part)[NBT]) {
  constexpr bool kTwoChains = R * NBT < 4;
  constexpr int64_t octs = Group / 8;
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  __m512i part_b[kTwoChains ? R : 1][NBT];
  if constexpr (kTwoChains)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NBT; ++j) part_b[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int64_t oct = g * octs; oct < g * octs + octs; ++oct) {
    __m512i wa[NBT], wb[NBT];
    for (int j = 0; j < NBT; ++j) {
      const uint8_t* at = oct_codes(blocks[j], oct, Bits);
      prefetch_oct<NBT>(w, at, oct, Bits);
      const __m512i packed = _mm512_loadu_si512(at);
      wa[j] = _mm512_and_si512(packed, nibbles);
      wb[j] = _mm512_and_si512(_mm512_srli_epi32(packed, 4), nibbles);
      if constexpr (Bits > 4) add_high_bits<Bits>(at + 64, wa[j], wb[j]);
      if constexpr (Bits == kE2M1) {  // every byte one code: the table's values (0..24) instead
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
        wa[j] = _mm512_shuffle_epi8(table, wa[j]);
        wb[j] = _mm512_shuffle_epi8(table, wb[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t xa, xb;
      std::memcpy(&xa, rows[r] + oct * 8, 4);
      std::memcpy(&xb, rows[r] + oct * 8 + 4, 4);
      const __m512i va = _mm512_set1_epi32(xa), vb = _mm512_set1_epi32(xb);
      for (int j = 0; j < NBT; ++j) {
        part[r][j] = _mm512_dpbusd_epi32(part[r][j], wa[j], va);
        if constexpr (kTwoChains) part_b[r][j] = _mm512_dpbusd_epi32(part_b[r][j], wb[j], vb);
        else part[r][j] = _mm512_dpbusd_epi32(part[r][j], wb[j], vb);
      }
    }
  }
  if constexpr (kTwoChains)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NBT; ++j) part[r][j] = _mm512_add_epi32(part[r][j], part_b[r][j]);
}

// The same for a Q8-layout weight (codes signed, x biased to unsigned: the bias is taken off with
// 128 times the weights' sum).
template <int Group, int R, int NBT>
SPECSERVE_AVX512 SPECSERVE_INLINE void q8_group(const PackedWeight& w, const uint8_t* const* blocks,
                                                const int8_t* const* rows, int64_t g, __m512i (*part)[NBT]) {
  // dword l of two pairs' 64 bytes: lane l's codes of pair 2t (word l) and pair 2t + 1 (word 16 + l)
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i wsum[NBT];
  for (int j = 0; j < NBT; ++j) wsum[j] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int64_t t = g * Group / 4; t < (g + 1) * Group / 4; ++t) {  // 4 columns (two pairs) at a time
    __m512i wv[NBT];
    for (int j = 0; j < NBT; ++j) {
      prefetch_codes<NBT>(w, blocks[j] + t * 64, t * 64);
      wv[j] = _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(blocks[j] + t * 64));
      wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, wv[j]);
    }
    for (int r = 0; r < R; ++r) {
      int32_t xw;
      std::memcpy(&xw, rows[r] + t * 4, 4);
      const __m512i xv = _mm512_set1_epi32(xw);
      for (int j = 0; j < NBT; ++j) part[r][j] = _mm512_dpbusd_epi32(part[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NBT; ++j) part[r][j] = _mm512_sub_epi32(part[r][j], _mm512_slli_epi32(wsum[j], 7));
}

// The scales d (and general offsets m) of NBT blocks at group g, in tables of type S. An int8
// table's float16 super-values are converted once per super-block (kSuperCols / Group groups), not
// once per group: d = super * sub, the product table16 forms, so the values are the same.
template <ScaleType S, int Group, int NBT>
struct TileTables {
  __m512 top_d[NBT], top_m[NBT];

  SPECSERVE_AVX512 SPECSERVE_INLINE void at(const PackedWeight& w, int64_t b0, int64_t g, bool general,
                                            __m512 (&d)[NBT], __m512 (&mv)[NBT]) {
    if constexpr (S == ScaleType::I8) {
      if (g % (kSuperCols / Group) == 0)
        for (int j = 0; j < NBT; ++j) {
          top_d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scale_super + super_at(w, b0 + j, g))));
          if (general) top_m[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.zero_super + super_at(w, b0 + j, g))));
        }
      for (int j = 0; j < NBT; ++j) {
        d[j] = _mm512_mul_ps(top_d[j], sub_values(w.scale, w, b0 + j, g));
        mv[j] = general ? _mm512_mul_ps(top_m[j], sub_values(w.zero, w, b0 + j, g)) : _mm512_setzero_ps();
      }
    } else {
      for (int j = 0; j < NBT; ++j) {
        d[j] = scales16<S>(w, b0 + j, g);
        mv[j] = general ? offsets16<S>(w, b0 + j, g, d[j]) : _mm512_setzero_ps();
      }
    }
  }

  // The 16 int8 sub-values of group g of block b, as float (exact).
  static SPECSERVE_AVX512 SPECSERVE_INLINE __m512 sub_values(const void* table, const PackedWeight& w, int64_t b, int64_t g) {
    const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(table) + group_at(w, b, g)));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub));
  }
};

// R rows (from r0) x NBT column blocks (from b0); every (row, column) sees the generic path's
// operations in its order whatever R and NBT are.
template <WeightFormat F, int Bits, int Group, ScaleType S, int R, int NBT>
SPECSERVE_AVX512 void tile_int8(const PackedWeight& w, int64_t b0, const Int8Rows& x, int64_t r0, void* out,
                                int64_t ldo, bool out_bf16, bool accumulate) {
  const int64_t G = w.k / Group;
  const bool general = general_offsets(w);
  const uint8_t* blocks[NBT];
  const int8_t* rows[R];
  tile_sources<R, NBT>(w, b0, x, r0, blocks, rows);
  __m512 acc[R][NBT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NBT; ++j) {
      const int64_t col = (b0 + j) * kBlockCols;
      acc[r][j] = accumulate ? _mm512_maskz_loadu_ps(tail_mask(w.n - col), static_cast<const float*>(out) + (r0 + r) * ldo + col)
                             : _mm512_setzero_ps();
    }
  TileTables<S, Group, NBT> tables;
  for (int64_t g = 0; g < G; ++g) {
    // Each integer sum starts at its code offset's term, -c * sx (exact: the same integers as
    // subtracting it after, one operation fewer per row and block).
    __m512i part[R][NBT];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(-w.code_offset * group_code_sum(x, r0 + r, g, Group));
      for (int j = 0; j < NBT; ++j) part[r][j] = start;
    }
    if constexpr (F == WeightFormat::Q4) q4_group<Bits, Group, R, NBT>(w, blocks, rows, g, part);
    else q8_group<Group, R, NBT>(w, blocks, rows, g, part);
    __m512 d[NBT], mv[NBT];
    tables.at(w, b0, g, general, d, mv);
    for (int r = 0; r < R; ++r) {  // a row's scalars once for all its blocks
      const int32_t sx = group_code_sum(x, r0 + r, g, Group);
      const __m512 dx = _mm512_set1_ps(block_scale(x, r0 + r, g, Group));
      const __m512 sxf = _mm512_set1_ps(float(sx));
      for (int j = 0; j < NBT; ++j) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(d[j], dx), _mm512_cvtepi32_ps(part[r][j]), acc[r][j]);
        if (general) acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(mv[j], dx), sxf, acc[r][j]);
      }
    }
  }
  for (int j = 0; j < NBT; ++j) {
    const int64_t col = (b0 + j) * kBlockCols;
    const __mmask16 keep = tail_mask(w.n - col);
    for (int r = 0; r < R; ++r) {
      if (out_bf16) store_bf16(static_cast<uint16_t*>(out) + (r0 + r) * ldo + col, acc[r][j], keep);
      else _mm512_mask_storeu_ps(static_cast<float*>(out) + (r0 + r) * ldo + col, keep, acc[r][j]);
    }
  }
}

template <WeightFormat F, int Bits, int Group, ScaleType S, int R>
SPECSERVE_AVX512 void rows_int8(const PackedWeight& w, int64_t b, int64_t b_end, const Int8Rows& x, int64_t r0,
                                void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  constexpr int kWide = R <= 2 ? 1 : 2;  // one block at a time streams best (one sequential stream); from 3 rows, the arithmetic bounds and two blocks share each row's broadcasts
  for (; b + kWide <= b_end; b += kWide) tile_int8<F, Bits, Group, S, R, kWide>(w, b, x, r0, out, ldo, out_bf16, accumulate);
  for (; b < b_end; ++b) tile_int8<F, Bits, Group, S, R, 1>(w, b, x, r0, out, ldo, out_bf16, accumulate);
}

template <WeightFormat F, int Bits, int Group, ScaleType S>
SPECSERVE_AVX512 void blocks_int8(const PackedWeight& w, int64_t b_begin, int64_t b_end, const Int8Rows& x, int64_t m,
                                  void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  constexpr int64_t kChunk = 8;  // column chunks outside, row tiles inside: a chunk's codes stay in cache
  const PackedWeight first = streaming(w, m);  // the first row tile of a chunk reads it from memory
  for (int64_t c = b_begin; c < b_end; c += kChunk) {
    const int64_t c_end = std::min(b_end, c + kChunk);
    int64_t r = 0;
    for (; r + 6 <= m; r += 6) rows_int8<F, Bits, Group, S, 6>(r == 0 ? first : w, c, c_end, x, r, out, ldo, out_bf16, accumulate);
    const PackedWeight& tail = r == 0 ? first : w;
    switch (m - r) {
      case 5: rows_int8<F, Bits, Group, S, 5>(tail, c, c_end, x, r, out, ldo, out_bf16, accumulate); break;
      case 4: rows_int8<F, Bits, Group, S, 4>(tail, c, c_end, x, r, out, ldo, out_bf16, accumulate); break;
      case 3: rows_int8<F, Bits, Group, S, 3>(tail, c, c_end, x, r, out, ldo, out_bf16, accumulate); break;
      case 2: rows_int8<F, Bits, Group, S, 2>(tail, c, c_end, x, r, out, ldo, out_bf16, accumulate); break;
      case 1: rows_int8<F, Bits, Group, S, 1>(tail, c, c_end, x, r, out, ldo, out_bf16, accumulate); break;
      default: break;
    }
  }
}

// The blocks for w's format, code width and group size (template arguments: the octs of a group
// unroll, with no loop-carried copies), its tables of type S (also one: a per-group switch on the
// table type cost the tiles a tenth of their speed in the bf16 kernels).
template <ScaleType S>
SPECSERVE_AVX512 void blocks_int8_format(const PackedWeight& w, int64_t block_begin, int64_t block_end, const Int8Rows& x,
                                         int64_t m, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
  using Q = WeightFormat;
  const bool g32 = w.group == 32;
  if (w.format == Q::Q8 && g32) blocks_int8<Q::Q8, 0, 32, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.format == Q::Q8) blocks_int8<Q::Q8, 0, 16, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == kE2M1) blocks_int8<Q::Q4, kE2M1, 32, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == 6 && g32) blocks_int8<Q::Q4, 6, 32, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == 6) blocks_int8<Q::Q4, 6, 16, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == 5 && g32) blocks_int8<Q::Q4, 5, 32, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (w.bits == 5) blocks_int8<Q::Q4, 5, 16, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else if (g32) blocks_int8<Q::Q4, 4, 32, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
  else blocks_int8<Q::Q4, 4, 16, S>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate);
}

#endif  // SPECSERVE_X86

}  // namespace

Int8Layout int8_layout(Path path, WeightFormat format) {
  if (path == Path::Generic) return {};
  if (format == WeightFormat::Q4) return {true, false};
  return {false, path == Path::Avx512Bf16};
}

#if SPECSERVE_X86
// quantize_block's arithmetic on 32 columns at once: the same float products, rounding (nearest,
// ties to even), clamps and integer sums, so the codes are bitwise the scalar ones. A block with
// inf, NaN or an amax so small that 127 / amax overflows takes the scalar code.
SPECSERVE_AVX512 void quantize_rows_avx512(const uint16_t* x, int64_t ldx, int64_t k, Int8Layout layout, int64_t begin,
                                           int64_t end, int8_t* q, float* d, int32_t* s16) {
  // within each 8 bytes: columns (0, 4, 1, 5, 2, 6, 3, 7), as oct_position places them
  const __m256i oct = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15, 0, 4, 1, 5, 2, 6, 3, 7, 8,
                                       12, 9, 13, 10, 14, 11, 15);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* row = x + r * ldx;
    for (int64_t blk = 0; blk < k / 32; ++blk) {
      const __m512 a = load_bf16(row + blk * 32), b = load_bf16(row + blk * 32 + 16);
      const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), exponent), exponent) |
                                _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(b), exponent), exponent);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      if (special || !(inv <= FLT_MAX)) {
        quantize_block(row, k, layout, r, blk, q, d, s16);
        continue;
      }
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, vinv), kRound), lo), hi));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(b, vinv), kRound), lo), hi));
      __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(qa)), _mm512_cvtepi32_epi8(qb), 1);
      if (layout.oct_order) bytes = _mm256_shuffle_epi8(bytes, oct);
      if (layout.biased) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(int8_t(0x80)));  // qi + 128 as uint8
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + blk * 32), bytes);
      d[r * (k / 32) + blk] = amax / 127.0f;
      s16[r * (k / 16) + 2 * blk] = _mm512_reduce_add_epi32(qa);
      s16[r * (k / 16) + 2 * blk + 1] = _mm512_reduce_add_epi32(qb);
    }
  }
}
#endif  // SPECSERVE_X86

void quantize_block(const uint16_t* x, int64_t k, Int8Layout layout, int64_t r, int64_t blk, int8_t* q, float* d,
                    int32_t* s16) {
  float v[32], amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < 32; ++i) {
    v[i] = bf16_to_f32(x[blk * 32 + i]);
    finite = finite && std::isfinite(v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  float dx = finite ? amax / 127.0f : NAN;  // a block with inf or NaN makes its outputs NaN
  float inv = amax > 0.0f && finite ? 127.0f / amax : 0.0f;
  if (!(inv <= FLT_MAX)) dx = 0.0f, inv = 0.0f;  // amax below about 2^-121: the block counts as zero
  int32_t sums[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    const int32_t qi = int32_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(v[i] * inv))));
    sums[i / 16] += qi;
    const int pos = layout.oct_order ? i / 8 * 8 + oct_position(i % 8) : i;
    q[r * k + blk * 32 + pos] = layout.biased ? int8_t(uint8_t(qi + 128)) : int8_t(qi);
  }
  d[r * (k / 32) + blk] = dx;
  s16[r * (k / 16) + 2 * blk] = sums[0];
  s16[r * (k / 16) + 2 * blk + 1] = sums[1];
}

void quantize_rows(Path path, const uint16_t* x, int64_t ldx, int64_t k, Int8Layout layout, int64_t begin,
                   int64_t end, int8_t* q, float* d, int32_t* s16) {
#if SPECSERVE_X86
  if (path == Path::Avx512Bf16) return quantize_rows_avx512(x, ldx, k, layout, begin, end, q, d, s16);
  if (path == Path::Avx2Fma) return quantize_rows_avx2(x, ldx, k, layout, begin, end, q, d, s16);
#endif
  for (int64_t r = begin; r < end; ++r)
    for (int64_t blk = 0; blk < k / 32; ++blk) quantize_block(x + r * ldx, k, layout, r, blk, q, d, s16);
}

void linear_int8_blocks(Path path, const PackedWeight& w, const Int8Rows& x, int64_t m, int64_t block_begin,
                        int64_t block_end, void* out, int64_t ldo, bool out_bf16, bool accumulate) {
#if SPECSERVE_X86
  if (path == Path::Avx2Fma) {
    linear_int8_blocks_avx2(w, x, m, block_begin, block_end, out, ldo, out_bf16, accumulate);
    return;
  }
  if (path == Path::Avx512Bf16) {
    switch (w.scale_type) {
      case ScaleType::F32: blocks_int8_format<ScaleType::F32>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate); break;
      case ScaleType::I8: blocks_int8_format<ScaleType::I8>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate); break;
      default: blocks_int8_format<ScaleType::F16>(w, block_begin, block_end, x, m, out, ldo, out_bf16, accumulate); break;
    }
    return;
  }
#endif
  for (int64_t b = block_begin; b < block_end; ++b) block_generic(w, b, x, m, out, ldo, out_bf16, accumulate);
}

}  // namespace specserve
