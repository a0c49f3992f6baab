// One decoder layer in one call, for the CPU kernels at TP size 1 (models/native_layer.py). It runs
// the kernels the per-op path runs (models/llama.py on CpuKernelOps), in that path's order and on
// the same values, so its output and K/V are bitwise the per-op path's. What it saves is Python:
// about ten dispatched calls per layer, their argument checks (LayerStep checks the pass's rows once
// for every layer) and their tensor wrappers.
#include "decoder_layer.h"

#include <ATen/Parallel.h>

#include <vector>

#include "attention.h"
#include "moe.h"
#include "ops.h"
#include "torch_glue.h"

namespace specserve {
namespace {

namespace py = pybind11;

void check_index(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous(),
              "specserve decoder layer: ", what, " must be a contiguous 1-D int64 CPU tensor");
}

// One forward pass's token rows, checked once for every layer: each row's position and K/V slot,
// and the slots its attention reads through the request-to-token table.
struct LayerStep {
  torch::Tensor positions, slots, table, row_req, row_len;
  int64_t rows, pool_slots, longest = 0, max_position = -1;
  Path path;

  LayerStep(torch::Tensor positions_, torch::Tensor slots_, torch::Tensor table_, torch::Tensor row_req_,
            torch::Tensor row_len_, int64_t pool_slots_, int64_t path_)
      : positions(positions_), slots(slots_), table(table_), row_req(row_req_), row_len(row_len_),
        rows(positions_.numel()), pool_slots(pool_slots_), path(checked_path(path_)) {
    check_index(positions, "positions");
    check_index(slots, "slots");
    check_index(row_req, "row_req");
    check_index(row_len, "row_len");
    TORCH_CHECK(slots.numel() == rows && row_req.numel() == rows && row_len.numel() == rows,
                "specserve decoder layer: one position, slot, request and length per row");
    const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < rows; ++t) {
      TORCH_CHECK(pos[t] >= 0, "specserve decoder layer: position ", pos[t], " is negative");
      TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "specserve decoder layer: slot ", slot[t], " is outside the K/V pool");
      max_position = std::max(max_position, pos[t]);
    }
    longest = check_table_slots(table, row_req.data_ptr<int64_t>(), row_len.data_ptr<int64_t>(), rows, pool_slots);
  }
};

enum Norm { kInput, kPostAttention, kPreFeedforward, kPostFeedforward, kQuery, kKey, kNorms };

class DecoderLayer {
 public:
  // The MLP: gate_up and down (a dense layer), or moe (a mixture of experts).
  DecoderLayer(NativeLinear qkv, c10::optional<torch::Tensor> qkv_bias, NativeLinear o, c10::optional<NativeLinear> gate_up,
               c10::optional<NativeLinear> down, c10::optional<MoeMlp> moe, std::vector<c10::optional<torch::Tensor>> norms,
               int64_t heads, int64_t kv_heads, int64_t dim, double scale, int64_t window, bool gelu, double eps,
               c10::optional<torch::Tensor> sinks, c10::optional<torch::Tensor> o_bias)
      : qkv_(std::move(qkv)), o_(std::move(o)), gate_up_(std::move(gate_up)), down_(std::move(down)), moe_(std::move(moe)),
        bias_(qkv_bias), o_bias_(o_bias), sinks_(sinks), norms_(std::move(norms)), heads_(heads), kv_heads_(kv_heads),
        dim_(dim), scale_(float(scale)), window_(window), gelu_(gelu), eps_(float(eps)) {
    hidden_ = qkv_.w.k;
    TORCH_CHECK(norms_.size() == kNorms && norms_[kInput] && norms_[kPostAttention] &&
                    bool(norms_[kPreFeedforward]) == bool(norms_[kPostFeedforward]) && bool(norms_[kQuery]) == bool(norms_[kKey]),
                "specserve decoder layer: norms are input, post-attention, [pre- and post-feedforward], [query and key]");
    TORCH_CHECK(qkv_.w.n == (heads + 2 * kv_heads) * dim && o_.w.k == heads * dim && o_.w.n == hidden_,
                "specserve decoder layer: the attention's shapes do not chain");
    TORCH_CHECK(moe_ ? !gate_up_ && !down_ && moe_->router.w.k == hidden_
                     : gate_up_ && down_ && gate_up_->w.k == hidden_ && gate_up_->w.n % 2 == 0 &&
                           down_->w.k == gate_up_->w.n / 2 && down_->w.n == hidden_,
                "specserve decoder layer: the MLP is gate_up and down, or a mixture of experts, chaining with the attention");
    TORCH_CHECK(heads % kv_heads == 0 && dim % 2 == 0 && window >= 0, "specserve decoder layer: bad head shape or window");
    check_vector(bias_, qkv_.w.n, "qkv bias");
    check_vector(o_bias_, hidden_, "output bias");
    TORCH_CHECK(!sinks_ || (sinks_->scalar_type() == torch::kFloat32 && sinks_->is_contiguous() && sinks_->numel() == heads),
                "specserve decoder layer: sinks must be contiguous float32 [heads]");
    for (int i = 0; i < kNorms; ++i) check_vector(norms_[i], i >= kQuery ? dim : hidden_, "norm weight");
  }

  torch::Tensor forward(c10::optional<torch::Tensor> out, torch::Tensor residual, const LayerStep& step, torch::Tensor k_pool,
                        torch::Tensor v_pool, torch::Tensor cos, torch::Tensor sin) const {
    check_inputs(out, residual, step, k_pool, v_pool, cos, sin);
    const Path p = step.path;
    torch::Tensor h = add_norm(out ? &*out : nullptr, residual, kInput, p);
    torch::Tensor attn = attention(h, step, k_pool, v_pool, cos, sin);
    if (!norms_[kPreFeedforward]) return mlp(add_norm(&attn, residual, kPostAttention, p), p);
    attn = add_norm(nullptr, attn, kPostAttention, p);  // sandwich norms (gemma3)
    torch::Tensor mlp_out = mlp(add_norm(&attn, residual, kPreFeedforward, p), p);
    return add_norm(nullptr, mlp_out, kPostFeedforward, p);
  }

  // Whether the layer attends over a sliding window (it then reads the local RoPE table, as
  // models/llama.py picks it).
  bool local() const { return window_ > 0; }

 private:
  static void check_vector(const c10::optional<torch::Tensor>& t, int64_t n, const char* what) {
    TORCH_CHECK(!t || (t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->numel() == n),
                "specserve decoder layer: ", what, " must be contiguous bf16 [", n, "]");
  }

  void check_inputs(const c10::optional<torch::Tensor>& out, const torch::Tensor& residual, const LayerStep& step,
                    const torch::Tensor& k_pool, const torch::Tensor& v_pool, const torch::Tensor& cos,
                    const torch::Tensor& sin) const {
    for (const torch::Tensor* t : {&residual, out ? &*out : &residual})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == step.rows && t->size(1) == hidden_,
                  "specserve decoder layer: out and residual must be contiguous bf16 [", step.rows, ", ", hidden_, "]");
    for (const torch::Tensor* t : {&k_pool, &v_pool})
      TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->dim() == 3 && t->size(0) == step.pool_slots &&
                      t->size(1) == kv_heads_ && t->size(2) == dim_,
                  "specserve decoder layer: K/V pools must be contiguous bf16 [", step.pool_slots, ", ", kv_heads_, ", ", dim_, "]");
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == dim_ / 2 && sin.sizes() == cos.sizes(),
                "specserve decoder layer: cos/sin must be contiguous float32 [positions, ", dim_ / 2, "]");
    TORCH_CHECK(step.max_position < cos.size(0), "specserve decoder layer: position ", step.max_position,
                " is outside the RoPE table");
  }

  // residual += x (x given: rounded to bf16 as a plain add), then RMSNorm of it: ops.add_rms_norm.
  // With x null, RMSNorm of `residual` alone, which stays as it is.
  torch::Tensor add_norm(const torch::Tensor* x, torch::Tensor& residual, Norm which, Path p) const {
    auto out = torch::empty_like(residual);
    const uint16_t* xd = bf16_data(x ? *x : residual);
    uint16_t* res = x ? bf16_out(residual) : nullptr;
    const uint16_t* w = bf16_data(*norms_[which]);
    uint16_t* od = bf16_out(out);
    const int64_t h = residual.size(1);
    const float eps = eps_;
    at::parallel_for(0, residual.size(0), 16, [&](int64_t b, int64_t e) { add_rms_norm_rows(p, xd, res, w, h, eps, od, b, e); });
    return out;
  }

  // Each head of q and of k RMS-normalised over its dim, in place (LlamaAttention._norm_heads).
  void norm_heads(torch::Tensor& qkv, Path p) const {
    uint16_t* d = bf16_out(qkv);
    const int64_t width = qkv.size(1), q_width = heads_ * dim_, dim = dim_, heads = heads_, kv_heads = kv_heads_;
    const uint16_t *qw = bf16_data(*norms_[kQuery]), *kw = bf16_data(*norms_[kKey]);
    const float eps = eps_;
    at::parallel_for(0, qkv.size(0), 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        uint16_t* row = d + t * width;
        add_rms_norm_rows(p, row, nullptr, qw, dim, eps, row, 0, heads);
        add_rms_norm_rows(p, row + q_width, nullptr, kw, dim, eps, row + q_width, 0, kv_heads);
      }
    });
  }

  // QKV, [q/k norms], RoPE with the K/V store, paged attention, output projection.
  torch::Tensor attention(const torch::Tensor& h, const LayerStep& step, torch::Tensor& k_pool, torch::Tensor& v_pool,
                          const torch::Tensor& cos, const torch::Tensor& sin) const {
    const Path p = step.path;
    const int64_t rows = step.rows;
    torch::Tensor qkv = qkv_(h, p);
    if (bias_) qkv.add_(*bias_);  // as the per-op path's `y + bias` (torch's bf16 add)
    if (norms_[kQuery]) norm_heads(qkv, p);
    auto q = torch::empty({rows, heads_, dim_}, h.options());
    RopeStoreArgs r{bf16_data(qkv), cos.data_ptr<float>(), sin.data_ptr<float>(), step.positions.data_ptr<int64_t>(),
                    step.slots.data_ptr<int64_t>(), heads_, kv_heads_, dim_, bf16_out(q), bf16_out(k_pool), bf16_out(v_pool)};
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) { rope_store_rows(r, b, e); });
    auto att = torch::empty_like(q);
    PagedAttentionArgs a{bf16_data(q), bf16_data(k_pool), bf16_data(v_pool), step.table.data_ptr<int64_t>(), step.table.stride(0),
                         step.row_req.data_ptr<int64_t>(), step.row_len.data_ptr<int64_t>(), heads_, kv_heads_, dim_, scale_,
                         bf16_out(att), window_, sinks_ ? sinks_->data_ptr<float>() : nullptr};
    run_paged_attention(p, a, rows, step.longest);
    torch::Tensor o = o_(att.view({rows, heads_ * dim_}), p);
    if (o_bias_) o.add_(*o_bias_);  // as the per-op path's `y + bias`
    return o;
  }

  torch::Tensor mlp(const torch::Tensor& h, Path p) const {
    if (moe_) return moe_->forward(h, p);
    return (*down_)(gated_mlp_activation(*gate_up_, h, p, gelu_), p);
  }

  NativeLinear qkv_, o_;
  c10::optional<NativeLinear> gate_up_, down_;
  c10::optional<MoeMlp> moe_;
  c10::optional<torch::Tensor> bias_, o_bias_, sinks_;
  std::vector<c10::optional<torch::Tensor>> norms_;
  int64_t heads_, kv_heads_, dim_;
  float scale_;
  int64_t window_;
  bool gelu_;
  float eps_;
  int64_t hidden_ = 0;
};

// `out + residual` of one layer (both [rows, H] bf16) into columns [col, col + H) of `captured`,
// each element rounded as torch's bf16 add rounds it, so the drafter's context is bitwise what
// the per-op path's `out + residual` gives.
void capture_sum(const torch::Tensor& out, const torch::Tensor& residual, torch::Tensor& captured, int64_t col) {
  const int64_t rows = out.size(0), h = out.size(1), ld = captured.size(1);
  const uint16_t* x = bf16_data(out);
  const uint16_t* r = bf16_data(residual);
  uint16_t* d = bf16_out(captured) + col;
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t c = 0; c < h; ++c)
        d[i * ld + c] = f32_to_bf16_torch(bf16_to_f32(x[i * h + c]) + bf16_to_f32(r[i * h + c]));
  });
}

void check_capture(const std::vector<int64_t>& capture, const c10::optional<torch::Tensor>& captured, size_t layers,
                   const torch::Tensor& residual) {
  if (capture.empty()) return;
  TORCH_CHECK(captured.has_value(), "specserve decoder layers: captured layers need an output tensor");
  const torch::Tensor& c = *captured;
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == torch::kBFloat16,
              "specserve decoder layers: the residual must be a contiguous [rows, hidden] bf16 tensor");
  TORCH_CHECK(c.dim() == 2 && c.is_contiguous() && c.scalar_type() == torch::kBFloat16 && c.size(0) == residual.size(0) &&
                  c.size(1) == int64_t(capture.size()) * residual.size(1),
              "specserve decoder layers: captured must be a contiguous bf16 [rows, captured layers x hidden] tensor");
  for (size_t i = 0; i < capture.size(); ++i)
    TORCH_CHECK(capture[i] >= 0 && capture[i] < int64_t(layers) && (i == 0 || capture[i] > capture[i - 1]),
                "specserve decoder layers: captured layers must be increasing indices of the given layers");
}

// Layers in order in one call: layer j with K/V pools k_pools[j] and v_pools[j] and the local RoPE
// table where it has a sliding window, each exactly as its own forward call would run it; returns the
// last layer's MLP output (residual updated in place). One pybind call for a run of layers, not one
// per layer: at batch 1 the per-layer calls' argument conversion and Python loop were a measurable
// share of a step. After each layer in `capture` (increasing), `out + residual` goes into the next
// column block of `captured` (the DSpark drafter's context), inside the call: splitting the call at
// each captured layer and adding in Python cost about 1% of a decode step.
torch::Tensor forward_layers(const std::vector<const DecoderLayer*>& layers, c10::optional<torch::Tensor> out,
                             torch::Tensor residual, const LayerStep& step, const std::vector<torch::Tensor>& k_pools,
                             const std::vector<torch::Tensor>& v_pools, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor cos_local, torch::Tensor sin_local, const std::vector<int64_t>& capture,
                             c10::optional<torch::Tensor> captured) {
  TORCH_CHECK(!layers.empty() && k_pools.size() == layers.size() && v_pools.size() == layers.size(),
              "specserve decoder layers: one K and one V pool per layer, at least one layer");
  check_capture(capture, captured, layers.size(), residual);
  size_t next = 0;
  for (size_t j = 0; j < layers.size(); ++j) {
    const bool local = layers[j]->local();
    out = layers[j]->forward(out, residual, step, k_pools[j], v_pools[j], local ? cos_local : cos, local ? sin_local : sin);
    if (next < capture.size() && capture[next] == int64_t(j)) {
      TORCH_CHECK(out->sizes() == residual.sizes() && out->is_contiguous(), "specserve decoder layers: out matches the residual");
      capture_sum(*out, residual, *captured, int64_t(next) * residual.size(1));
      ++next;
    }
  }
  return *out;
}

}  // namespace

void register_decoder_layer(py::module& m) {
  py::class_<LayerStep>(m, "LayerStep", "one forward pass's rows, checked once for every layer")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t>(),
           py::arg("positions"), py::arg("slots"), py::arg("table"), py::arg("row_req"), py::arg("row_len"),
           py::arg("pool_slots"), py::arg("path"));
  py::class_<NativeLinear>(m, "NativeLinear", "a packed weight as the kernels see it")
      .def(py::init<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, bool>(),
           py::arg("format"), py::arg("codes"), py::arg("scale"), py::arg("zero"), py::arg("n"), py::arg("k"),
           py::arg("w_exp_lo"), py::arg("w_exp_hi"), py::arg("group"), py::arg("bits"), py::arg("code_offset"),
           py::arg("scale_super"), py::arg("zero_super"), py::arg("int8"));
  py::class_<DecoderLayer>(m, "DecoderLayer", "one decoder layer in one call (TP size 1)")
      .def(py::init<NativeLinear, c10::optional<torch::Tensor>, NativeLinear, c10::optional<NativeLinear>,
                    c10::optional<NativeLinear>, c10::optional<MoeMlp>, std::vector<c10::optional<torch::Tensor>>, int64_t,
                    int64_t, int64_t, double, int64_t, bool, double, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>>(),
           py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("moe"), py::arg("norms"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("dim"), py::arg("scale"), py::arg("window"), py::arg("gelu"),
           py::arg("eps"), py::arg("sinks") = py::none(), py::arg("o_bias") = py::none())
      .def("forward", &DecoderLayer::forward, py::arg("out"), py::arg("residual"), py::arg("step"), py::arg("k_pool"),
           py::arg("v_pool"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("forward_layers", &forward_layers, "decoder layers in order in one call", py::arg("layers"), py::arg("out"),
        py::arg("residual"), py::arg("step"), py::arg("k_pools"), py::arg("v_pools"), py::arg("cos"), py::arg("sin"),
        py::arg("cos_local"), py::arg("sin_local"), py::arg("capture"), py::arg("captured"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace specserve
