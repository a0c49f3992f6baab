// A mixture-of-experts MLP in one call, for the CPU kernels (models/moe.py SparseMoeBlock). The
// per-op path calls this same object, so the native decoder layer and the per-op layer agree by
// construction; models/moe.py's torch implementation is the reference it is tested against.
//
// Routing: softmax over the router's float32 logits (max subtracted, std::exp, sum in expert order),
// the k most probable experts, ties to the lower index, weights renormalised where the model does.
// Compute: for each expert in index order, the rows routed to it gathered and run through its
// fused gate/up linear, SiLU-times-up and its down linear (float32 out): its codes are read once
// for all of them. Sums: each row's weighted expert outputs added in its own top-k order, then the
// shared expert's gated output; the float32 result rounded to bf16 once. No row's arithmetic
// depends on which other rows share the call.
#include "moe.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops.h"
#include "simd.h"

namespace specserve {

namespace {

// The k largest of values[0..experts) into chosen, largest first, ties to the lower index.
void pick_top_k(const float* values, int64_t experts, int64_t k, std::vector<bool>& taken, int64_t* chosen) {
  for (int64_t e = 0; e < experts; ++e) taken[e] = false;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e)  // strictly greater: the lower index keeps a tie
      if (!taken[e] && (best < 0 || values[e] > values[best])) best = e;
    taken[best] = true;
    chosen[j] = best;
  }
}

}  // namespace

void moe_route_rows(const float* logits, int64_t experts, int64_t k, bool normalize, bool after_topk, float* weights,
                    int64_t* chosen, int64_t begin, int64_t end) {
  std::vector<float> p(experts);
  std::vector<bool> taken(experts);
  for (int64_t r = begin; r < end; ++r) {
    const float* l = logits + r * experts;
    float* w = weights + r * k;
    int64_t* c = chosen + r * k;
    if (after_topk) {  // the k largest logits, then the softmax of those k
      pick_top_k(l, experts, k, taken, c);
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = std::exp(l[c[j]] - l[c[0]]));
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
      continue;
    }
    float top = l[0];
    for (int64_t e = 1; e < experts; ++e) top = std::max(top, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(l[e] - top));
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    pick_top_k(p.data(), experts, k, taken, c);
    float picked = 0.0f;
    for (int64_t j = 0; j < k; ++j) picked += (w[j] = p[c[j]]);
    if (normalize)
      for (int64_t j = 0; j < k; ++j) w[j] /= picked;
  }
}

MoeMlp::MoeMlp(NativeLinear router_, std::vector<NativeLinear> gate_ups_, std::vector<NativeLinear> downs_, int64_t top_k_,
               bool normalize_, c10::optional<NativeLinear> shared_gate_up_, c10::optional<NativeLinear> shared_down_,
               c10::optional<NativeLinear> shared_gate_, c10::optional<torch::Tensor> router_bias_,
               std::vector<torch::Tensor> gate_up_biases_, std::vector<torch::Tensor> down_biases_,
               bool softmax_after_topk_, bool swiglu_oai_)
    : router(std::move(router_)), gate_ups(std::move(gate_ups_)), downs(std::move(downs_)), top_k(top_k_),
      normalize(normalize_), shared_gate_up(std::move(shared_gate_up_)), shared_down(std::move(shared_down_)),
      shared_gate(std::move(shared_gate_)), router_bias(std::move(router_bias_)),
      gate_up_biases(std::move(gate_up_biases_)), down_biases(std::move(down_biases_)),
      softmax_after_topk(softmax_after_topk_), swiglu_oai(swiglu_oai_) {
  const int64_t hidden = router.w.k, experts = router.w.n;
  auto float32_vector = [](const torch::Tensor& t, int64_t n) {
    return t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n;
  };
  TORCH_CHECK(!router_bias || float32_vector(*router_bias, experts), "specserve moe: the router bias must be float32 [experts]");
  TORCH_CHECK(gate_up_biases.empty() || (int64_t(gate_up_biases.size()) == experts && down_biases.size() == gate_up_biases.size()),
              "specserve moe: expert biases come for every expert, gate/up and down");
  for (size_t e = 0; e < gate_up_biases.size(); ++e)
    TORCH_CHECK(float32_vector(gate_up_biases[e], gate_ups[e].w.n) && float32_vector(down_biases[e], hidden),
                "specserve moe: expert ", e, "'s biases must be float32 [2 * intermediate] and [hidden]");
  TORCH_CHECK(int64_t(gate_ups.size()) == experts && downs.size() == gate_ups.size() && top_k >= 1 && top_k <= experts,
              "specserve moe: one gate/up and one down linear per expert, 1 <= top_k <= experts");
  for (size_t e = 0; e < gate_ups.size(); ++e)
    TORCH_CHECK(gate_ups[e].w.k == hidden && gate_ups[e].w.n % 2 == 0 && downs[e].w.k == gate_ups[e].w.n / 2 &&
                    downs[e].w.n == hidden,
                "specserve moe: expert ", e, "'s linears do not chain");
  TORCH_CHECK(bool(shared_gate_up) == bool(shared_down) && bool(shared_down) == bool(shared_gate),
              "specserve moe: a shared expert needs its gate/up, down and gate");
  if (shared_gate)
    TORCH_CHECK(shared_gate->w.n == 1 && shared_gate->w.k == hidden && shared_gate_up->w.k == hidden &&
                    shared_down->w.k == shared_gate_up->w.n / 2 && shared_down->w.n == hidden,
                "specserve moe: the shared expert's linears do not chain");
}

namespace {

// gpt-oss's clamped SwiGLU (models/moe.py SWIGLU_OAI_*).
constexpr float kSwigluAlpha = 1.702f;
constexpr float kSwigluLimit = 7.0f;

// Up to this many rows per active expert on average, experts run side by side (MoeMlp::forward).
constexpr int64_t kExpertsPerThreadRows = 4;

torch::Tensor linear_f32(const NativeLinear& l, const torch::Tensor& x, Path path) {
  auto out = torch::empty({x.size(0), l.w.n}, x.options().dtype(torch::kFloat32));
  run_linear(path, l.w, l.int8, bf16_data(x), l.w.k, x.size(0), out.data_ptr(), false, false);
  return out;
}

}  // namespace

torch::Tensor gated_mlp_activation(const NativeLinear& gate_up, const torch::Tensor& x, Path path, bool gelu) {
  torch::Tensor gu = gate_up(x, path);
  const int64_t f = gu.size(1) / 2;
  auto act = torch::empty({x.size(0), f}, x.options());
  const uint16_t* gd = bf16_data(gu);
  uint16_t* ad = bf16_out(act);
  at::parallel_for(0, x.size(0), 8, [&](int64_t b, int64_t e) {
    if (gelu) gelu_tanh_mul_rows(path, gd, f, ad, b, e);
    else silu_mul_rows(path, gd, f, ad, b, e);
  });
  return act;
}

// gpt-oss's clamped SwiGLU of gate/up sums gu [rows, 2f] plus their bias (float32 [2f]), rounded to bf16 once.
torch::Tensor swiglu_oai_activation(const torch::Tensor& gu, const float* bias, const torch::Tensor& like, Path path) {
  const int64_t rows = gu.size(0), f = gu.size(1) / 2;
  auto act = torch::empty({rows, f}, like.options());
  const float* g = gu.data_ptr<float>();
  uint16_t* ad = bf16_out(act);
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) { swiglu_oai_rows(path, g, bias, f, kSwigluAlpha, kSwigluLimit, ad, b, e); });
  return act;
}

torch::Tensor MoeMlp::expert(size_t e, const torch::Tensor& x, Path path) const {
  if (!swiglu_oai) return linear_f32(downs[e], gated_mlp_activation(gate_ups[e], x, path), path);
  torch::Tensor gu = linear_f32(gate_ups[e], x, path);
  const torch::Tensor bias = gate_up_biases.empty() ? torch::zeros({gu.size(1)}, gu.options()) : gate_up_biases[e];
  return linear_f32(downs[e], swiglu_oai_activation(gu, bias.data_ptr<float>(), x, path), path);
}

torch::Tensor MoeMlp::forward(const torch::Tensor& h, Path path) const {
  TORCH_CHECK(h.scalar_type() == torch::kBFloat16 && h.is_contiguous() && h.dim() == 2 && h.size(1) == router.w.k,
              "specserve moe: h must be contiguous bf16 [rows, ", router.w.k, "]");
  const int64_t rows = h.size(0), hidden = h.size(1), k = top_k, experts = router.w.n;
  torch::Tensor logits = linear_f32(router, h, path);
  if (router_bias) {
    float* ld = logits.data_ptr<float>();
    const float* bd = router_bias->data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < experts; ++e) ld[r * experts + e] += bd[e];
  }
  std::vector<float> weights(rows * k);
  std::vector<int64_t> chosen(rows * k);
  moe_route_rows(logits.data_ptr<float>(), experts, k, normalize, softmax_after_topk, weights.data(), chosen.data(), 0,
                 rows);
  std::vector<std::vector<int64_t>> routed(experts);  // per expert, its (row * k + slot) in row order
  for (int64_t i = 0; i < rows * k; ++i) routed[chosen[i]].push_back(i);
  std::vector<float> by_slot(rows * k * hidden);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (!routed[e].empty()) active.push_back(e);
  auto run_expert = [&](int64_t e) {
    const auto& at = routed[e];
    auto index = torch::empty({int64_t(at.size())}, torch::kInt64);
    for (size_t i = 0; i < at.size(); ++i) index.data_ptr<int64_t>()[i] = at[i] / k;
    torch::Tensor y = expert(size_t(e), h.index_select(0, index), path);
    const float* yd = y.data_ptr<float>();
    const float* bd = down_biases.empty() ? nullptr : down_biases[e].data_ptr<float>();
    // Each slot's output (plus the down bias, gpt-oss) times its routing weight; across the threads
    // by rows where the experts run one at a time (inside the parallel loop below it runs inline).
    at::parallel_for(0, int64_t(at.size()), 8, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) {
        const float w = weights[at[i]];
        float* slot = by_slot.data() + at[i] * hidden;
        const float* yi = yd + i * hidden;
        if (bd)
          for (int64_t c = 0; c < hidden; ++c) slot[c] = (yi[c] + bd[c]) * w;
        else
          for (int64_t c = 0; c < hidden; ++c) slot[c] = yi[c] * w;
      }
    });
  };
  // Few rows per expert (decode, a verify window): the threads take whole experts, each streaming
  // its own weights with no barrier between them; many rows: one expert at a time, its columns split
  // across the threads. Either way each output is one thread's sum in one order (the kernels split
  // by column blocks only), so the partition changes no bit.
  if (rows * k <= kExpertsPerThreadRows * int64_t(active.size()))
    at::parallel_for(0, int64_t(active.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) run_expert(active[i]);
    });
  else
    for (int64_t e : active) run_expert(e);
  torch::Tensor s_gate, s_out;
  if (shared_gate) {
    s_gate = linear_f32(*shared_gate, h, path);
    s_out = linear_f32(*shared_down, gated_mlp_activation(*shared_gate_up, h, path), path);
  }
  auto out = torch::empty({rows, hidden}, h.options());
  uint16_t* od = bf16_out(out);
  const float* sg = shared_gate ? s_gate.data_ptr<float>() : nullptr;
  const float* so = shared_gate ? s_out.data_ptr<float>() : nullptr;
  const float* slots = by_slot.data();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float g = sg ? 1.0f / (1.0f + std::exp(-sg[r])) : 0.0f;
      for (int64_t c = 0; c < hidden; ++c) {
        float acc = slots[(r * k) * hidden + c];
        for (int64_t j = 1; j < k; ++j) acc += slots[(r * k + j) * hidden + c];  // the row's own top-k order
        if (so) acc += g * so[r * hidden + c];
        od[r * hidden + c] = f32_to_bf16_torch(acc);
      }
    }
  });
  return out;
}

namespace {

std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor logits, int64_t k, bool normalize, bool after_topk) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.is_contiguous() && k >= 1 && k <= logits.size(1),
              "specserve moe_route: logits must be contiguous float32 [rows, experts] on the CPU, 1 <= k <= experts");
  const int64_t rows = logits.size(0);
  auto weights = torch::empty({rows, k}, logits.options());
  auto chosen = torch::empty({rows, k}, logits.options().dtype(torch::kInt64));
  moe_route_rows(logits.data_ptr<float>(), logits.size(1), k, normalize, after_topk, weights.data_ptr<float>(),
                 chosen.data_ptr<int64_t>(), 0, rows);
  return {weights, chosen};
}

}  // namespace

void register_moe(pybind11::module& m) {
  namespace py = pybind11;
  m.def("moe_route", &moe_route, "each row's top-k experts (ties to the lower index) and softmax weights",
        py::arg("logits"), py::arg("k"), py::arg("normalize"), py::arg("after_topk") = false);
  py::class_<MoeMlp>(m, "MoeMlp", "a mixture-of-experts MLP in one call")
      .def(py::init<NativeLinear, std::vector<NativeLinear>, std::vector<NativeLinear>, int64_t, bool,
                    c10::optional<NativeLinear>, c10::optional<NativeLinear>, c10::optional<NativeLinear>,
                    c10::optional<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, bool, bool>(),
           py::arg("router"), py::arg("gate_ups"), py::arg("downs"), py::arg("top_k"), py::arg("normalize"),
           py::arg("shared_gate_up"), py::arg("shared_down"), py::arg("shared_gate"), py::arg("router_bias") = py::none(),
           py::arg("gate_up_biases") = std::vector<torch::Tensor>(), py::arg("down_biases") = std::vector<torch::Tensor>(),
           py::arg("softmax_after_topk") = false, py::arg("swiglu_oai") = false)
      .def("forward", [](const MoeMlp& moe, torch::Tensor h, int64_t path) { return moe.forward(h, checked_path(path)); },
           py::arg("h"), py::arg("path"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace specserve
