// Fused small ops of a decoder layer on bf16 rows, each row computed alone in a fixed order:
//   add_rms_norm: residual = bf16(x + residual); out = bf16((residual * inv_rms) * weight), with
//                 inv_rms = 1 / sqrt(sum(residual^2) / H + eps), the sum in 16 lanes then a tree;
//   silu_mul:     out = bf16(silu(gate) * up), silu(g) = g * sigmoid(g) from exp of -|g|;
//   gelu_tanh_mul: out = bf16(gelu_tanh(gate) * up), gelu_tanh(g) = g * sigmoid(2u) (which is
//                 g / 2 * (1 + tanh(u))), 2u = fma(B, g * g, A) * g with A = 2 sqrt(2 / pi),
//                 B = 0.044715 A; the sigmoid as silu's;
//   swiglu_oai:   gpt-oss's clamped SwiGLU of float32 gate/up sums plus their float32 biases,
//                 g = min(gate, L), u = clamp(up, -L, L), out = bf16((u + 1) * (g * sigmoid(alpha g))),
//                 the sigmoid as silu's, a NaN sum passed through the clamps (as torch.clamp's);
//   rope_store:   rotate-half RoPE of q and k (fp32 tables), rotated k and v stored to their slots.
#pragma once

#include <cstdint>

#include "simd.h"

namespace specserve {

// Rows [begin, end) of x [rows, h]; residual (may be null: then it is x alone) is updated in place.
void add_rms_norm_rows(Path path, const uint16_t* x, uint16_t* residual, const uint16_t* weight, int64_t h,
                       float eps, uint16_t* out, int64_t begin, int64_t end);

// Rows [begin, end) of gate_up [rows, 2f] -> out [rows, f].
void silu_mul_rows(Path path, const uint16_t* gate_up, int64_t f, uint16_t* out, int64_t begin, int64_t end);
void gelu_tanh_mul_rows(Path path, const uint16_t* gate_up, int64_t f, uint16_t* out, int64_t begin, int64_t end);

// Rows [begin, end) of gate_up [rows, 2f] float32 (gate first) with bias [2f] -> out [rows, f].
void swiglu_oai_rows(Path path, const float* gate_up, const float* bias, int64_t f, float alpha, float limit,
                     uint16_t* out, int64_t begin, int64_t end);

struct RopeStoreArgs {
  const uint16_t* qkv;   // [T, (heads + 2 kv_heads) * dim]
  const float* cos;      // [positions, dim / 2]
  const float* sin;
  const int64_t* positions;  // [T]
  const int64_t* slots;      // [T]
  int64_t heads, kv_heads, dim;
  uint16_t* q_out;       // [T, heads, dim]
  uint16_t* k_pool;      // [slots, kv_heads, dim]
  uint16_t* v_pool;
};

void rope_store_rows(const RopeStoreArgs& a, int64_t begin, int64_t end);

}  // namespace specserve
