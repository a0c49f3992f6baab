// Integer-activation linear layers for the quantized weight layouts of linear.h (Q4 and Q8), as
// llama.cpp computes its quantized matmuls: each activation row is quantized on its own, in blocks
// of 32 columns, to int8 codes qx with one float scale dx per block: with amax the block's largest
// |x| (float32), dx = amax / 127 and qx = x * (127 / amax) rounded to the nearest integer (ties to
// even) and clamped to [-127, 127]. A block whose 127 / amax overflows (amax below about 2^-121) is
// all zero (dx = 0); a block holding inf or NaN has dx = NaN, so its row's outputs are NaN. A weight
// group's dot product with the row is then an exact integer sum, so every path (AVX-512 VNNI, AVX2
// maddubs, portable C++) gets the same integers whatever instructions form them, and one fixed
// float sequence turns them into outputs.
//
// Per output (row, column), over the weight's groups in order (a group of 16 or 32 columns lies in
// one activation block; dx is that block's scale):
//   isum = sum over the group of qx * code        (Q4 layout: the unsigned 4/5/6-bit code;
//   sx   = sum over the group of qx                Q8 layout: the signed 8-bit code)
//   t    = float(isum - c * sx)                    c: the weight's code offset (see below), else 0
//   acc  = fma(d * dx, t, acc)                     d: the group's weight scale
//   acc  = fma(m * dx, float(sx), acc)             only for weights with general offsets m
// A weight whose offsets are all -c * d (GGUF Q4_0: c = 8, Q5_0: 16, Q6_K: 32) is w = d * (q - c),
// so its offset term is part of the exact integer sum. Each row's result depends on that row only.
#pragma once

#include <cstdint>

#include "linear.h"

namespace specserve {

// How a path wants a row's codes laid out: in column order, or, for the Q4 layout, per oct of 8
// columns in the order its nibbles come out of a 32-bit word (0, 4, 1, 5, 2, 6, 3, 7); biased codes
// hold qx + 128 as uint8 (the AVX-512 Q8 kernel's unsigned operand).
struct Int8Layout {
  bool oct_order = false;
  bool biased = false;
};

// Rows quantized for the integer kernels.
struct Int8Rows {
  const int8_t* q;      // [m][k] codes in the layout
  const float* d;       // [m][k/32] block scales dx
  const int32_t* s16;   // [m][k/16] sums of the (unbiased) codes per 16 columns
  int64_t k;
};

// The layout `path` reads for a weight of `format`.
Int8Layout int8_layout(Path path, WeightFormat format);

// Quantize rows [begin, end) of x (bf16, row stride ldx; k a multiple of 32) into q, d and s16
// (laid out as Int8Rows, rows at their own index). Every path gives the same bytes: the vector
// paths do quantize_block's arithmetic lane by lane and hand it the blocks with inf, NaN or a
// vanishing amax.
void quantize_rows(Path path, const uint16_t* x, int64_t ldx, int64_t k, Int8Layout layout, int64_t begin,
                   int64_t end, int8_t* q, float* d, int32_t* s16);

// One block of 32 columns of row r (x points at the row), the scalar reference.
void quantize_block(const uint16_t* x, int64_t k, Int8Layout layout, int64_t r, int64_t blk, int8_t* q, float* d,
                    int32_t* s16);

// The vector paths of quantize_rows (linear_int8.cpp, linear_int8_avx2.cpp; x86 only).
void quantize_rows_avx512(const uint16_t* x, int64_t ldx, int64_t k, Int8Layout layout, int64_t begin, int64_t end,
                          int8_t* q, float* d, int32_t* s16);
void quantize_rows_avx2(const uint16_t* x, int64_t ldx, int64_t k, Int8Layout layout, int64_t begin, int64_t end,
                        int8_t* q, float* d, int32_t* s16);

// Rows [0, m) of the quantized x times the columns of blocks [block_begin, block_end) of w (format
// Q4 or Q8; w.code_offset as above); out and accumulate as for linear_blocks.
void linear_int8_blocks(Path path, const PackedWeight& w, const Int8Rows& x, int64_t m, int64_t block_begin,
                        int64_t block_end, void* out, int64_t ldo, bool out_bf16, bool accumulate);

// The AVX2 path (linear_int8_avx2.cpp), reached through linear_int8_blocks.
void linear_int8_blocks_avx2(const PackedWeight& w, const Int8Rows& x, int64_t m, int64_t block_begin,
                             int64_t block_end, void* out, int64_t ldo, bool out_bf16, bool accumulate);

// The sum of a row's codes over weight group g (of 16 or 32 columns), and the scale of the
// activation block holding that group.
inline int32_t group_code_sum(const Int8Rows& x, int64_t r, int64_t g, int64_t group) {
  const int32_t* s = x.s16 + r * (x.k / 16) + g * group / 16;
  return group == 32 ? s[0] + s[1] : s[0];
}

inline float block_scale(const Int8Rows& x, int64_t r, int64_t g, int64_t group) {
  return x.d[r * (x.k / 32) + g * group / 32];
}

// Whether w's offsets need their own float term (general offsets, not folded into the integer sums).
inline bool general_offsets(const PackedWeight& w) { return w.zero != nullptr && w.code_offset == 0; }

// The code blocks (from b0) and quantized rows (from r0) a tile of NBT blocks x R rows reads.
template <int R, int NBT>
inline void tile_sources(const PackedWeight& w, int64_t b0, const Int8Rows& x, int64_t r0, const uint8_t* (&blocks)[NBT],
                         const int8_t* (&rows)[R]) {
  const int64_t bytes = block_bytes(w.format, w.k, w.bits);
  for (int j = 0; j < NBT; ++j) blocks[j] = w.codes + (b0 + j) * bytes;
  for (int r = 0; r < R; ++r) rows[r] = x.q + (r0 + r) * x.k;
}

// The group-end arithmetic of the header comment for one (row, column), as the generic path spells it.
inline float combine_group(float acc, int32_t isum, int32_t sx, float d, float m, bool general_offsets, int c, float dx) {
  const float dd = d * dx;
  acc = std::fma(dd, float(isum - c * sx), acc);
  if (general_offsets) {
    const float mm = m * dx;
    acc = std::fma(mm, float(sx), acc);
  }
  return acc;
}

}  // namespace specserve
