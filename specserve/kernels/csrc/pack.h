// Load-time conversions of GGUF K-quant blocks and of 4/5/6-bit codes into the kernels' layout
// (models/quant.py parses, kernels/linear.py pack_q4 packs; both keep a Python reference).
#pragma once

#include <torch/extension.h>

namespace specserve {

// Adds gguf_k_codes, gguf_k_scale_min and pack_q4_codes to the extension module.
void register_pack(pybind11::module& m);

}  // namespace specserve
