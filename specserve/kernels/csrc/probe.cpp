// The clock and int8 multiply-add probes (see probe.h).
#include "probe.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <vector>

#include "simd_avx512.h"

namespace specserve {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Eight dependent adds per round, in assembly so that the compiler cannot fold the chain, of a
// register the compiler cannot see the value of (a core may fold adds of small immediates at rename).
double add_chain_seconds(int64_t adds) {
  volatile uint64_t one_source = 1;
  const uint64_t one = one_source;
  uint64_t x = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < adds / 8; ++i) {
#if defined(__x86_64__)
    asm volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                 "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0" : "+r"(x) : "r"(one));
#elif defined(__aarch64__)
    asm volatile("add %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1\n\t"
                 "add %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1\n\tadd %0, %0, %1" : "+r"(x) : "r"(one));
#else
    (void)one;
    return 0.0;
#endif
  }
  return seconds_since(start);
}

#if SPECSERVE_X86
// Twelve independent chains: VPDPBUSD's latency (4-5 cycles) times its throughput (up to 2 a cycle)
// with room to spare. Returns the chains' sum, which the caller adds into an atomic (a side effect
// the compiler must keep), so that no chain is dropped.
SPECSERVE_AVX512 int64_t dot_chains(int64_t steps) {
  constexpr int kChains = 12;
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01FF01FF);
  for (int64_t s = 0; s < steps; ++s)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, acc[c]);
  return _mm512_reduce_add_epi32(total);
}
#endif

}  // namespace

double clock_ghz(int64_t adds) {
  std::vector<double> ghz(at::get_num_threads(), 0.0);
  at::parallel_for(0, int64_t(ghz.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const double s = add_chain_seconds(adds);
      ghz[t] = s > 0 ? double(adds) / s / 1e9 : 0.0;
    }
  });
  double total = 0.0;
  for (double g : ghz) total += g;
  return total / double(ghz.size());
}

double int8_dot_per_second(Path path, int64_t steps) {
#if SPECSERVE_X86
  if (path != Path::Avx512Bf16) return 0.0;
  const int threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink += dot_chains(steps);
  });
  return 12.0 * double(steps) * threads / seconds_since(start);
#else
  (void)path;
  (void)steps;
  return 0.0;
#endif
}

}  // namespace specserve
