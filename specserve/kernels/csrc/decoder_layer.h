// One decoder layer in one call (models/native_layer.py): see decoder_layer.cpp.
#pragma once

#include <torch/extension.h>

namespace specserve {

// Adds LayerStep, NativeLinear and DecoderLayer to the extension module.
void register_decoder_layer(pybind11::module& m);

}  // namespace specserve
