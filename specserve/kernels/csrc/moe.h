// A mixture-of-experts MLP in one call (models/moe.py): routing, the rows grouped by expert, each
// row's sums in its own order; see moe.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "torch_glue.h"

namespace specserve {

// Rows [begin, end) of router logits [rows, experts] (float32) -> each row's k experts, most
// probable first with ties to the lower index, and their softmax weights (renormalised to sum to 1
// with `normalize`); with `after_topk` (gpt-oss) the k largest logits and the softmax of those k.
// Scalar float32 in a fixed order: the same bits on every path and machine.
void moe_route_rows(const float* logits, int64_t experts, int64_t k, bool normalize, bool after_topk, float* weights,
                    int64_t* chosen, int64_t begin, int64_t end);

// act(gate) * up of a gated MLP's fused gate/up linear on x (bf16 [rows, hidden] -> [rows, f]):
// SiLU, or GELU-tanh with `gelu`. The dense decoder layer's MLP and every expert run it.
torch::Tensor gated_mlp_activation(const NativeLinear& gate_up, const torch::Tensor& x, Path path, bool gelu = false);

// The MLP of a mixture-of-experts layer: a router, gated experts, an optional shared expert behind
// a sigmoid gate (qwen2moe); or gpt-oss's: float32 biases on the router and every expert's gate/up
// and down, routing by the softmax of the k largest logits, the clamped SwiGLU (swiglu_oai:
// gate <= 7, -7 <= up <= 7, (up + 1) * gate * sigmoid(1.702 gate), in float32).
struct MoeMlp {
  NativeLinear router;
  std::vector<NativeLinear> gate_ups, downs;
  int64_t top_k;
  bool normalize;
  c10::optional<NativeLinear> shared_gate_up, shared_down, shared_gate;
  c10::optional<torch::Tensor> router_bias;            // float32 [experts]
  std::vector<torch::Tensor> gate_up_biases, down_biases;  // float32 per expert, or none
  bool softmax_after_topk = false;
  bool swiglu_oai = false;

  MoeMlp(NativeLinear router_, std::vector<NativeLinear> gate_ups_, std::vector<NativeLinear> downs_, int64_t top_k_,
         bool normalize_, c10::optional<NativeLinear> shared_gate_up_, c10::optional<NativeLinear> shared_down_,
         c10::optional<NativeLinear> shared_gate_, c10::optional<torch::Tensor> router_bias_,
         std::vector<torch::Tensor> gate_up_biases_, std::vector<torch::Tensor> down_biases_, bool softmax_after_topk_,
         bool swiglu_oai_);

  // h [rows, hidden] bf16 -> [rows, hidden] bf16.
  torch::Tensor forward(const torch::Tensor& h, Path path) const;

 private:
  torch::Tensor expert(size_t e, const torch::Tensor& x, Path path) const;
};

// Adds moe_route and MoeMlp to the extension module.
void register_moe(pybind11::module& m);

}  // namespace specserve
