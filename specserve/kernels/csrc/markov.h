// The DSpark drafter's Markov head for greedy requests in one call (models/dspark_native.py).
#pragma once

#include <torch/extension.h>

namespace specserve {

// Adds markov_greedy to the extension module.
void register_markov(pybind11::module& m);

}  // namespace specserve
