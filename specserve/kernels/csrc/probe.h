// Machine probes the benches price their figures against (bench/arithmetic.py): the core clock
// and the int8 multiply-add's peak throughput, each measured on every thread at once (the clock
// under a load on all cores is the one the kernels run at).
#pragma once

#include <cstdint>

#include "simd.h"

namespace specserve {

// The mean over the threads of each one's clock in GHz: a chain of `adds` dependent 64-bit adds
// (one a cycle on every x86-64 and AArch64 core) over the seconds it takes; 0 where neither.
double clock_ghz(int64_t adds);

// VPDPBUSD instructions per second over all threads, each running independent chains for `steps`
// rounds (enough chains to cover the latency); 0 off the AVX-512 path.
double int8_dot_per_second(Path path, int64_t steps);

}  // namespace specserve
