// The DSpark drafter's Markov head for greedy requests: its left-to-right loop over the block's
// slots in one call, where the per-op loop (models/dspark.py DsparkDrafter.markov_decode) costs
// five dispatched ops per slot. Per slot k and request b, the same values that loop computes:
// e = W1[prev] (bf16 rows), t = e W2^T through the packed kernel (bf16 out), logits = base[b, k] +
// float(t) in float32, the pick the first index of the largest logit (a NaN counts as largest,
// as in torch.argmax), mapped to a target id, and prev = pick.
#include "markov.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "simd_avx512.h"
#include "torch_glue.h"

namespace specserve {
namespace {

// The first index of the largest of x[j] + y[j] (float32 sum, y bf16), a NaN first of all: the
// sums into s, their maximum over 16 interleaved partial maxima (a form the compiler vectorises;
// `v > m ? v : m` is MAXPS), then the first index holding it. Equal to the one-pass scan: the
// first maximum is the first element equal to the maximum (+0 and -0 compare equal in both).
int64_t first_argmax(const float* x, const uint16_t* y, int64_t n, float* s) {
  constexpr int L = 16;
  float part[L];
  for (int l = 0; l < L; ++l) part[l] = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t j = 0;
  for (; j + L <= n; j += L)
    for (int l = 0; l < L; ++l) {
      const float v = x[j + l] + bf16_to_f32(y[j + l]);
      s[j + l] = v;
      nan |= v != v;
      part[l] = v > part[l] ? v : part[l];
    }
  for (; j < n; ++j) {
    s[j] = x[j] + bf16_to_f32(y[j]);
    nan |= s[j] != s[j];
    part[0] = s[j] > part[0] ? s[j] : part[0];
  }
  if (nan)
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(s[i])) return i;
  float top = part[0];
  for (int l = 1; l < L; ++l) top = part[l] > top ? part[l] : top;
  int64_t i = 0;
  for (; i + L <= n; i += L) {  // 16 comparisons at a time, then the first hit inside them
    bool hit = false;
    for (int l = 0; l < L; ++l) hit |= s[i + l] == top;
    if (hit) break;
  }
  for (; i < n; ++i)
    if (s[i] == top) return i;
  return 0;  // every sum is -inf
}

#if SPECSERVE_X86
// first_argmax 16 lanes at a time: the sums' maximum (MAXPS keeps its second operand where either
// is NaN or they are equal: `v > m ? v : m`), then the first index whose sum equals it, or the
// first NaN. The same index as the scalar scan; the sums are recomputed, not stored.
SPECSERVE_AVX512 int64_t first_argmax_avx512(const float* x, const uint16_t* y, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = tail_mask(n - j);
    const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(in, x + j), load_bf16(y + j, in));
    nan |= _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q);
    top = _mm512_mask_max_ps(top, in, v, top);
  }
  const float best = _mm512_reduce_max_ps(top);  // NaN-free here unless a NaN was seen
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = tail_mask(n - j);
    const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(in, x + j), load_bf16(y + j, in));
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(in, v, v, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(in, v, _mm512_set1_ps(best), _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // every sum is -inf
}
#endif

// first_argmax on the path's vector unit where it has one.
int64_t first_argmax_on(Path p, const float* x, const uint16_t* y, int64_t n, float* s) {
#if SPECSERVE_X86
  if (p == Path::Avx512Bf16) return first_argmax_avx512(x, y, n);
#endif
  return first_argmax(x, y, n, s);
}

std::tuple<torch::Tensor, torch::Tensor> markov_greedy(torch::Tensor base, torch::Tensor w1, const NativeLinear& w2,
                                                       torch::Tensor anchors, c10::optional<torch::Tensor> to_target,
                                                       int64_t path) {
  TORCH_CHECK(base.device().is_cpu() && base.scalar_type() == torch::kFloat32 && base.is_contiguous() && base.dim() == 3 &&
                  base.size(2) == w2.w.n,
              "specserve markov_greedy: base logits must be contiguous float32 [bs, g, ", w2.w.n, "]");
  TORCH_CHECK(w1.device().is_cpu() && w1.scalar_type() == torch::kBFloat16 && w1.is_contiguous() && w1.dim() == 2 &&
                  w1.size(1) == w2.w.k,
              "specserve markov_greedy: W1 must be contiguous bf16 [vocab, ", w2.w.k, "]");
  TORCH_CHECK(anchors.device().is_cpu() && anchors.scalar_type() == torch::kInt64 && anchors.dim() == 1 &&
                  anchors.is_contiguous() && anchors.numel() == base.size(0),
              "specserve markov_greedy: one int64 anchor per request");
  const int64_t bs = base.size(0), g = base.size(1), vocab = base.size(2), rank = w1.size(1), ids = w1.size(0);
  const int64_t* map = nullptr;
  if (to_target) {
    TORCH_CHECK(to_target->device().is_cpu() && to_target->scalar_type() == torch::kInt64 && to_target->is_contiguous() &&
                    to_target->numel() == vocab,
                "specserve markov_greedy: the draft-to-target map must be contiguous int64 [", vocab, "]");
    map = to_target->data_ptr<int64_t>();
  }
  const Path p = checked_path(path);
  auto tokens = torch::empty({bs, g}, anchors.options());
  auto embedded = torch::empty({bs, g, rank}, w1.options());
  auto t = torch::empty({bs, vocab}, w1.options());
  std::vector<int64_t> prev(anchors.data_ptr<int64_t>(), anchors.data_ptr<int64_t>() + bs);
  std::vector<float> sums(p == Path::Avx512Bf16 ? 0 : bs * vocab);  // the scalar scan's sums (AVX-512 recomputes them)
  const uint16_t* table = bf16_data(w1);
  const float* logits = base.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t k = 0; k < g; ++k) {
    for (int64_t b = 0; b < bs; ++b) {
      TORCH_CHECK(prev[b] >= 0 && prev[b] < ids, "specserve markov_greedy: token ", prev[b], " is outside W1");
      std::memcpy(bf16_out(embedded) + (b * g + k) * rank, table + prev[b] * rank, rank * sizeof(uint16_t));
    }
    // The slot's W1 rows in place, one request every g * rank values: a row's sums do not depend on its stride.
    run_linear(p, w2.w, w2.int8, bf16_data(embedded) + k * rank, g * rank, bs, t.data_ptr(), true, false);
    const uint16_t* head = bf16_data(t);
    at::parallel_for(0, bs, 1, [&](int64_t begin, int64_t end) {  // requests are independent
      for (int64_t b = begin; b < end; ++b) {
        float* scratch = sums.empty() ? nullptr : sums.data() + b * vocab;
        const int64_t best = first_argmax_on(p, logits + (b * g + k) * vocab, head + b * vocab, vocab, scratch);
        out[b * g + k] = prev[b] = map ? map[best] : best;
      }
    });
  }
  return {tokens, embedded};
}

}  // namespace

void register_markov(pybind11::module& m) {
  m.def("markov_greedy", &markov_greedy, "the DSpark Markov head's greedy picks, slot by slot, in one call",
        pybind11::arg("base"), pybind11::arg("w1"), pybind11::arg("w2"), pybind11::arg("anchors"),
        pybind11::arg("to_target"), pybind11::arg("path"), pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace specserve
