// Paged attention over the K/V pool in place: each query row reads its request's token slots
// through the request-to-token table, no gathered copies. Each (row, head) is computed alone (a
// task runs the heads of one KV group side by side, sharing K/V loads), in one order: scores q.k
// as VDPBF16PS chains (16 fp32 lanes, lane l taking elements 2l and 2l+1 of each 32-element chunk
// of the head dimension, chunk by chunk; bf16 products exact), then a fixed tree; the max, exp by a fixed polynomial, the sum of weights in 16 lanes over
// positions then the same tree, and the weighted sum of V in position order. A row's output thus
// depends only on its query and the K/V of the positions it sees: prefill, extend, decode and
// verify rows compute a token identically. With sinks (gpt-oss), head h's learned logit s_h joins
// the softmax with no value: the max is taken over the scores and s_h, and after the tree of the
// weights' sum, exp(s_h - max) is added to it (scalar, the same on every path).
#pragma once

#include <cstdint>

#include "simd.h"

namespace specserve {

struct PagedAttentionArgs {
  const uint16_t* q;        // [T, heads, dim] bf16
  const uint16_t* k_pool;   // [slots, kv_heads, dim] bf16
  const uint16_t* v_pool;
  const int64_t* table;     // [requests, table_stride] token slots
  int64_t table_stride;
  const int64_t* row_req;   // [T] request row of the table
  const int64_t* row_len;   // [T] positions the row sees (0: output zeros)
  int64_t heads, kv_heads, dim;
  float scale;
  uint16_t* out;            // [T, heads, dim] bf16
  int64_t window;           // > 0: a row sees only the last `window` of its positions (a sliding-window layer)
  const float* sinks = nullptr;  // [heads] float32 logits that join each softmax (gpt-oss), or none
};

// Query heads one pass of a KV group's task computes side by side (a larger group takes more passes).
constexpr int kMaxGroupPass = 8;

// Tasks [begin, end) of T * kv_heads (task = row * kv_heads + kv head: the query heads of one
// KV group); scratch holds >= kMaxGroupPass * (max(row_len) + 16) floats.
void paged_attention_tasks(Path path, const PagedAttentionArgs& a, int64_t begin, int64_t end, float* scratch);

}  // namespace specserve
