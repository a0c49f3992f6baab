// Weight-quantized linear layers y = x W^T for bf16 activations: one kernel family for every row
// count. Weights are packed in blocks of 16 output columns; within a block, input columns come in
// pairs so one 32-bit lane holds the two weights VDPBF16PS multiplies with an (x[k], x[k+1]) pair.
//
// Formats (per block of 16 columns, K input columns):
//   Q4: codes q of 4, 5 or 6 bits (`bits`) as "octs" of 8 input columns, K/8 octs in order, each
//       64 bytes of nibbles (16 lanes x 8 nibbles: bits 4p..4p+3 = column 2p, bits 16+4p.. =
//       column 2p+1) followed, for 5- and 6-bit codes, by the oct's high bits: per lane one byte
//       (5 bits: bit p = column 2p, bit 4+p = column 2p+1) or one uint16 (6 bits: bits 2p..2p+1 =
//       column 2p, bits 8+2p.. = column 2p+1). Interleaved so, a block is one sequential stream
//       (a plane after all the octs was a second one, and 6-bit weights streamed at 0.8x 4-bit's). Per group (32 columns, or 16) and column
//       a scale d and offset m, w = d * q + m (Q4_0: m = -8 d; Q5_0: m = -16 d; Q6_K: m = -32 d).
//       The kernel multiplies x by 128 + q, which is exact in bf16 (bits 0x4300 | q, q < 128), so
//       codes become bf16 with an OR or two.
//   Q8: codes as K/2 pairs x 16 lanes x 2 int8 (32 bytes), per group and column the scale d and,
//       if the weight has offsets, the offset m: w = d * q (+ m). Groups are 32 or 16 columns (the
//       K-quants Q6_K, Q3_K and Q2_K scale every 16). GGUF Q8_0 and Q5_0 (codes q - 16) have no
//       offset; Q5_1 and Q5_K do (and Q4 weights whose fused neighbours are Q8, see quant.py).
//   BF16: K/2 pairs x 16 lanes x 2 bf16 (64 bytes), no scales (K is padded to even with zeros).
// Scales and offsets (ScaleType) are float16 where every value of the weight is one (the GGUF's
// own block scales); for K-quants, an int8 sub-value per group times a float16 super-value per 256
// input columns and column, as the file stores them (the product is exact in float32), so the
// tables take 1 byte per group and column, not 4; float32 otherwise. A weight whose offsets are all
// -c * scale (code_offset c > 0, a power of two: GGUF Q4_0, Q5_0, Q6_K) stores none: the kernels
// compute them so, exactly.
// Per output (row, column) the sum runs over groups in order; within a group over pairs in order,
// then acc = fma(d, group_sum, acc); for Q4 the group sum is of x * (128 + q), so it first becomes
// fma(-128, sum_x(group), group_sum); with offsets acc = fma(m, sum_x(group), acc) follows.
#pragma once

#include <cstdint>

#include "simd.h"
#include "simd_avx2.h"
#include "simd_avx512.h"

namespace specserve {

enum class WeightFormat : int { Q4 = 0, Q8 = 1, BF16 = 2 };

constexpr int kBlockCols = 16;
constexpr int kGroup = 32;

// How a weight's per-group scales and offsets are stored (see above).
enum class ScaleType : int { F16 = 0, F32 = 1, I8 = 2 };
constexpr int64_t kSuperCols = 256;  // input columns per super-value of an I8 table

// Biased exponent bounds of the nonzero values of a row or weight (lo > hi: all zero), and whether
// every value is zero or normal (no subnormal, infinity or NaN).
struct ExponentRange {
  int lo = 255, hi = 0;
  bool finite_normal = true;
};

// How far ahead of its reads a streaming tile asks for codes (see `streaming` below): `distance`
// bytes along its own stream, its block's `stride` bytes apart from the next (distance = whole
// strides plus part bytes).
struct Lookahead {
  int64_t distance = 0, stride = 1, whole = 0, part = 0;
};

struct PackedWeight {
  WeightFormat format;
  const uint8_t* codes;  // [blocks][...] as above
  const void* scale;     // [blocks][K/group][16] of scale_type (Q4, Q8)
  const void* zero;      // offsets, shaped as scale; null where there are none or they are -c * scale
  int64_t n;             // output columns
  int64_t k;             // input columns
  ExponentRange exponents;  // of the values (BF16 only; quantized codes have fixed bounds)
  ScaleType scale_type = ScaleType::F16;  // of scale and zero
  int64_t group = 32;       // input columns per scale: 32 or 16
  int bits = 4;             // Q4: bits per code (4, 5 or 6), or kE2M1
  int code_offset = 0;      // c > 0: every offset is -c * scale, w = scale * (q - c) (linear_int8.h)
  const uint16_t* scale_super = nullptr;  // I8: float16 [blocks][K/256][16]
  const uint16_t* zero_super = nullptr;   // I8 with stored offsets: likewise
  Lookahead ahead;  // distance > 0: tiles prefetch the codes ahead of their reads (streaming)
};

// Whether the weight has offsets (stored, or -c * scale).
inline bool has_offsets(const PackedWeight& w) { return w.zero != nullptr || w.code_offset > 0; }

// Element index of group g's 16 values for column block b in a [blocks][K/group][16] table, and of
// their super-values in an I8 table's [blocks][ceil(K/256)][16] (groups are 32 or 16 columns:
// shifts; a K that is not a multiple of 256, such as gpt-oss's 2880, ends on a partial super-block).
inline int64_t group_at(const PackedWeight& w, int64_t b, int64_t g) {
  return (b * (w.k >> (w.group == 32 ? 5 : 4)) + g) * kBlockCols;
}
inline int64_t super_at(const PackedWeight& w, int64_t b, int64_t g) {
  return (b * ((w.k + kSuperCols - 1) >> 8) + (g >> (w.group == 32 ? 3 : 4))) * kBlockCols;
}

// One scale or offset (lane of group g of block b) from a table, as float (exact).
inline float table_value(const PackedWeight& w, const void* values, const uint16_t* super, int64_t b, int64_t g, int lane) {
  const int64_t at = group_at(w, b, g) + lane;
  switch (w.scale_type) {
    case ScaleType::F32: return static_cast<const float*>(values)[at];
    case ScaleType::I8: return f16_to_f32(super[super_at(w, b, g) + lane]) * float(static_cast<const int8_t*>(values)[at]);
    default: return f16_to_f32(static_cast<const uint16_t*>(values)[at]);
  }
}

inline float scale_at(const PackedWeight& w, int64_t b, int64_t g, int lane) {
  return table_value(w, w.scale, w.scale_super, b, g, lane);
}

// The offset; -c * scale where none are stored (exact: c is a power of two).
inline float offset_at(const PackedWeight& w, int64_t b, int64_t g, int lane) {
  return w.zero ? table_value(w, w.zero, w.zero_super, b, g, lane) : float(-w.code_offset) * scale_at(w, b, g, lane);
}

// A Q4 weight's `bits` where its 4-bit codes index the E2M1 table (GGUF MXFP4) instead of being
// values: code c reads as kE2M1Codes[c], the doubled E2M1 value plus 12 (0..24), with code offset
// 12, so w = d * (kE2M1Codes[c] - 12) for the block's power-of-two d. A sentinel, not a width: the
// codes take 4 bits, with no high bits.
constexpr int kE2M1 = -4;
constexpr int kE2M1Offset = 12;
alignas(16) constexpr uint8_t kE2M1Codes[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
inline uint32_t e2m1_code(uint32_t c) { return kE2M1Codes[c & 15u]; }

// Bytes of the high bits per oct of a Q4 weight with `bits`-bit codes (16 lanes).
constexpr int64_t high_plane_bytes(int bits) { return bits <= 4 ? 0 : (bits == 5 ? 16 : 32); }

// Bytes of one oct of a Q4 block (nibbles, then high bits); where oct `oct` of a block starts and
// where its high bits are.
constexpr int64_t oct_bytes(int bits) { return 64 + high_plane_bytes(bits); }
inline const uint8_t* oct_codes(const uint8_t* block, int64_t oct, int bits) { return block + oct * oct_bytes(bits); }
inline const uint8_t* oct_high(const uint8_t* block, int64_t oct, int bits) { return oct_codes(block, oct, bits) + 64; }

// A plane entry h (one lane of one oct) spread so that the high bits of pair p's two columns sit
// at bit 4 (+1) and bit 20 (+1) after a right shift by p (5 bits) or 2p (6 bits).
inline uint32_t spread_high(uint32_t h, int bits) {
  return bits == 5 ? ((h << 4) | (h << 16)) & 0x00F000F0u : ((h << 4) | (h << 12)) & 0x0FF00FF0u;
}

// Pair p's high bits of a spread plane entry, in place above the nibbles.
inline uint32_t high_of_pair(uint32_t spread, int bits, int p) {
  return bits == 5 ? (spread >> p) & 0x00100010u : (spread >> (2 * p)) & 0x00300030u;
}

#if SPECSERVE_X86
// Forced: each runs once per group and column block, between a few dozen vector instructions.
#define SPECSERVE_INLINE inline __attribute__((always_inline))

// The 16 values of group g of block b in a table of type S, as float (exact). The vector paths'
// tiles take S as a template argument: a per-group switch costs them a tenth of their speed.
template <ScaleType S>
SPECSERVE_AVX512 SPECSERVE_INLINE __m512 table16(const PackedWeight& w, const void* values, const uint16_t* super, int64_t b,
                                                 int64_t g) {
  const int64_t at = group_at(w, b, g);
  if constexpr (S == ScaleType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(values) + at);
  } else if constexpr (S == ScaleType::I8) {
    const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(values) + at));
    const __m512 top = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + super_at(w, b, g))));
    return _mm512_mul_ps(top, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(values) + at)));
  }
}

template <ScaleType S>
SPECSERVE_AVX512 SPECSERVE_INLINE __m512 scales16(const PackedWeight& w, int64_t b, int64_t g) {
  return table16<S>(w, w.scale, w.scale_super, b, g);
}

// The offsets of the same lanes, given their scales d.
template <ScaleType S>
SPECSERVE_AVX512 SPECSERVE_INLINE __m512 offsets16(const PackedWeight& w, int64_t b, int64_t g, __m512 d) {
  return w.zero ? table16<S>(w, w.zero, w.zero_super, b, g) : _mm512_mul_ps(d, _mm512_set1_ps(float(-w.code_offset)));
}

// Runtime-typed versions, for kernels that do not take S as a template argument.
SPECSERVE_AVX512 SPECSERVE_INLINE __m512 scales16(const PackedWeight& w, int64_t b, int64_t g) {
  switch (w.scale_type) {
    case ScaleType::F32: return scales16<ScaleType::F32>(w, b, g);
    case ScaleType::I8: return scales16<ScaleType::I8>(w, b, g);
    default: return scales16<ScaleType::F16>(w, b, g);
  }
}

SPECSERVE_AVX512 SPECSERVE_INLINE __m512 offsets16(const PackedWeight& w, int64_t b, int64_t g, __m512 d) {
  switch (w.scale_type) {
    case ScaleType::F32: return offsets16<ScaleType::F32>(w, b, g, d);
    case ScaleType::I8: return offsets16<ScaleType::I8>(w, b, g, d);
    default: return offsets16<ScaleType::F16>(w, b, g, d);
  }
}

// Lanes 8h..8h+7 of group g of block b in a table of type S, as float (exact).
template <ScaleType S>
SPECSERVE_AVX2 SPECSERVE_INLINE __m256 table8(const PackedWeight& w, const void* values, const uint16_t* super, int64_t b,
                                              int64_t g, int h) {
  const int64_t at = group_at(w, b, g) + 8 * h;
  if constexpr (S == ScaleType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(values) + at);
  } else if constexpr (S == ScaleType::I8) {
    const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(values) + at));
    const __m256 top = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super + super_at(w, b, g) + 8 * h)));
    return _mm256_mul_ps(top, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + at)));
  }
}

template <ScaleType S>
SPECSERVE_AVX2 SPECSERVE_INLINE __m256 scales8(const PackedWeight& w, int64_t b, int64_t g, int h) {
  return table8<S>(w, w.scale, w.scale_super, b, g, h);
}

template <ScaleType S>
SPECSERVE_AVX2 SPECSERVE_INLINE __m256 offsets8(const PackedWeight& w, int64_t b, int64_t g, int h, __m256 d) {
  return w.zero ? table8<S>(w, w.zero, w.zero_super, b, g, h) : _mm256_mul_ps(d, _mm256_set1_ps(float(-w.code_offset)));
}

SPECSERVE_AVX2 SPECSERVE_INLINE __m256 scales8(const PackedWeight& w, int64_t b, int64_t g, int h) {
  switch (w.scale_type) {
    case ScaleType::F32: return scales8<ScaleType::F32>(w, b, g, h);
    case ScaleType::I8: return scales8<ScaleType::I8>(w, b, g, h);
    default: return scales8<ScaleType::F16>(w, b, g, h);
  }
}

SPECSERVE_AVX2 SPECSERVE_INLINE __m256 offsets8(const PackedWeight& w, int64_t b, int64_t g, int h, __m256 d) {
  switch (w.scale_type) {
    case ScaleType::F32: return offsets8<ScaleType::F32>(w, b, g, h, d);
    case ScaleType::I8: return offsets8<ScaleType::I8>(w, b, g, h, d);
    default: return offsets8<ScaleType::F16>(w, b, g, h, d);
  }
}

// The first `valid` of 16 lanes (lo: 0-7, hi: 8-15) at element `at` of out (float32 or bf16).
SPECSERVE_AVX2 inline void store_lanes16(__m256 lo, __m256 hi, void* out, int64_t at, int64_t valid, bool out_bf16) {
  if (out_bf16) {
    alignas(16) uint16_t h[16];
    store_bf16x8(h, lo);
    store_bf16x8(h + 8, hi);
    std::memcpy(static_cast<uint16_t*>(out) + at, h, valid * 2);
  } else {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, lo);
    _mm256_store_ps(lanes + 8, hi);
    std::memcpy(static_cast<float*>(out) + at, lanes, valid * 4);
  }
}
#endif


// Bytes of one 16-column block.
int64_t block_bytes(WeightFormat format, int64_t k, int bits = 4);

// Rows [0, m) of x (bf16, row stride ldx) times columns of blocks [block_begin, block_end).
// out is float32 or bf16 (row stride ldo); with accumulate (float32 out only) every sum starts from
// the value already in out instead of zero, so a K split across ranks can run as one chain whose
// operations are exactly those of the unsplit layer. group_sums[m][K/group] = sum of x per group
// (weights with offsets only).
// avx2 (AVX2 path only): the rows prepared by prepare_avx2_row.
struct Avx2Rows {
  const float* x;        // [m][ldx] x as float, subnormals flushed, zero-padded to an even length
  int64_t ldx;
  const uint8_t* exact;  // [m] linear_row_exact of each row
};
void linear_blocks(Path path, const PackedWeight& w, const uint16_t* x, int64_t ldx, int64_t m,
                   const float* group_sums, const Avx2Rows* avx2, int64_t block_begin, int64_t block_end,
                   void* out, int64_t ldo, bool out_bf16, bool accumulate);

// The AVX2 path (linear_avx2.cpp), reached through linear_blocks.
void linear_blocks_avx2(const PackedWeight& w, const Avx2Rows& x, int64_t m, const float* group_sums,
                        int64_t block_begin, int64_t block_end, void* out, int64_t ldo, bool out_bf16, bool accumulate);

// One row of x for the AVX2 path: its floats (out[(k + 1) / 2 * 2]) and whether FMAs give it
// exactly the flushing dot products of the generic path with w (the returned flag).
bool prepare_avx2_row(const PackedWeight& w, const uint16_t* row, float* out);

// Rows `index` (output columns) of a packed weight as bf16 [rows][k]: each value d * q (+ m) in
// double, rounded to float32 and then to bf16 as torch rounds (PackedLinear.dense_rows(...).to(bf16),
// the embedding lookup in a quantized table; a NaN of a bf16 table reads as itself, one computed as
// 0x7FC0).
void dense_rows_bf16(const PackedWeight& w, const int64_t* index, int64_t rows, uint16_t* out);

// Per-row sums of x over each group of `group` columns (sequential order), for the offset term.
void group_sums(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int64_t group, float* out);

// How far ahead of its reads a tile asks for weight codes (bytes; SPECSERVE_PREFETCH_BYTES at
// load, 0 for none). A decode step streams every weight from memory once, and a verify window
// adds enough arithmetic per byte that the hardware prefetchers fall behind: asking ahead lets the
// reads and the arithmetic overlap (16 KiB on the AMD EPYC this was first tuned on). Only the first row tile of a column chunk streams (`streaming`); the later ones
// find the chunk in cache, and prefetching there only cost time (a batch-8 verify step got
// slower). A prefetch never faults, so reading past the last block is harmless; results do not
// depend on it.
// A tile of three or more rows spends longer on each block, so it asks further ahead
// (kPrefetchBytesWide, SPECSERVE_PREFETCH_BYTES_WIDE): on the Zen 5 EPYC of the models_vs_ik
// record, 4 KiB gave the 1-row sweep of the 1.5B file's linears its best time and 32 KiB the
// 4-row sweep (`python -m benchmarks weight-stream`, 4 alternations of 2-32 KiB).
extern const int64_t kPrefetchBytes;
extern const int64_t kPrefetchBytesWide;

// w for the first row tile of a linear over m rows.
inline PackedWeight streaming(const PackedWeight& w, int64_t m) {
  PackedWeight s = w;
  const int64_t distance = m >= 3 ? kPrefetchBytesWide : kPrefetchBytes, stride = block_bytes(w.format, w.k, w.bits);
  s.ahead = {distance, stride, distance / stride, distance % stride};
  return s;
}

// Asks for the codes w.ahead.distance bytes on along the stream that reads `at`, `offset` bytes into
// its block, in a tile of NBT neighbouring blocks. The tile reads its blocks side by side, so past
// its block's end a stream's next bytes are the next tile's, NBT - 1 blocks further on (the blocks
// between are this tile's own, being read now). Looking ahead in plain addresses instead asked a
// 2-block tile over blocks shorter than the distance for lines it was already reading: the 7B
// file's LM head (3584 columns of 6-bit codes, 42 KiB a block) took 1.75x its 1-row time at 4 rows.
template <int NBT>
inline void prefetch_codes(const PackedWeight& w, const uint8_t* at, int64_t offset) {
  const Lookahead& a = w.ahead;
  if (a.distance <= 0) return;
  const int64_t skipped = NBT == 1 ? 0 : (a.whole + (offset + a.part >= a.stride)) * (NBT - 1) * a.stride;
  __builtin_prefetch(at + a.distance + skipped, 0, 3);
}

// The same for oct `oct` of a Q4 block (at: its codes), which spans two cache lines when it has
// high bits (80 or 96 bytes).
template <int NBT>
inline void prefetch_oct(const PackedWeight& w, const uint8_t* at, int64_t oct, int bits) {
  const int64_t offset = oct * oct_bytes(bits);
  prefetch_codes<NBT>(w, at, offset);
  if (bits > 4) prefetch_codes<NBT>(w, at + oct_bytes(bits) - 1, offset + oct_bytes(bits) - 1);
}

}  // namespace specserve
