// Torch bindings of the CPU kernels: argument checks, threading (at::parallel_for splits work by
// output column blocks or attention tasks, never inside one output's sum) and CPU feature detection.
#include <atomic>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "attention.h"
#include "linear.h"
#include "ops.h"
#include "probe.h"
#include "decoder_layer.h"
#include "markov.h"
#include "moe.h"
#include "pack.h"
#include "torch_glue.h"

namespace specserve {
namespace {

// The output of an [M, k] x [n, k] linear: a fresh tensor, or a copy of init to continue its sums.
torch::Tensor linear_output(const torch::Tensor& x, int64_t n, int64_t k, bool out_bf16,
                            const c10::optional<torch::Tensor>& init) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16, "specserve linear: x must be bf16 on CPU");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.stride(1) == 1, "specserve linear: x must be [M, ", k, "] with contiguous rows");
  if (!init.has_value()) return torch::empty({x.size(0), n}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
  TORCH_CHECK(!out_bf16 && init->scalar_type() == torch::kFloat32 && init->dim() == 2 && init->size(0) == x.size(0) &&
                  init->size(1) == n,
              "specserve linear: init must be float32 [M, ", n, "] and the output float32");
  return init->contiguous().clone();
}

torch::Tensor linear(torch::Tensor x, int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor zero,
                     int64_t n, int64_t k, bool out_bf16, int64_t path, int64_t w_exp_lo, int64_t w_exp_hi,
                     c10::optional<torch::Tensor> init, int64_t group, int64_t bits, int64_t code_offset,
                     c10::optional<torch::Tensor> scale_super, c10::optional<torch::Tensor> zero_super) {
  auto out = linear_output(x, n, k, out_bf16, init);
  const PackedWeight w = packed_weight(format, codes, scale, zero, n, k, group, bits, w_exp_lo, w_exp_hi,
                                       GroupTables{code_offset, scale_super, zero_super});
  run_linear(checked_path(path), w, false, bf16_data(x), x.stride(0), x.size(0), out.data_ptr(), out_bf16, init.has_value());
  return out;
}

// y = x W^T with x quantized to int8 per row (linear_int8.h); Q4 and Q8 weights only.
torch::Tensor linear_int8(torch::Tensor x, int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor zero,
                          int64_t n, int64_t k, bool out_bf16, int64_t path, c10::optional<torch::Tensor> init,
                          int64_t group, int64_t bits, int64_t code_offset, c10::optional<torch::Tensor> scale_super,
                          c10::optional<torch::Tensor> zero_super) {
  auto out = linear_output(x, n, k, out_bf16, init);
  const PackedWeight w = packed_weight(format, codes, scale, zero, n, k, group, bits, -1, -1,
                                       GroupTables{code_offset, scale_super, zero_super});
  run_linear(checked_path(path), w, true, bf16_data(x), x.stride(0), x.size(0), out.data_ptr(), out_bf16, init.has_value());
  return out;
}

// Rows `index` of a packed weight as bf16 (linear.h dense_rows_bf16).
torch::Tensor packed_rows_bf16(int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor zero, int64_t n,
                               int64_t k, int64_t group, int64_t bits, int64_t code_offset,
                               c10::optional<torch::Tensor> scale_super, c10::optional<torch::Tensor> zero_super,
                               torch::Tensor index) {
  const PackedWeight w = packed_weight(format, codes, scale, zero, n, k, group, bits, -1, -1,
                                       GroupTables{code_offset, scale_super, zero_super});
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == torch::kInt64 && index.dim() == 1 && index.is_contiguous(),
              "specserve dense_rows: index must be a contiguous 1-D int64 CPU tensor");
  const int64_t* at = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < index.numel(); ++r)
    TORCH_CHECK(at[r] >= 0 && at[r] < n, "specserve dense_rows: row ", at[r], " is outside the weight's ", n, " rows");
  auto out = torch::empty({index.numel(), k}, codes.options().dtype(torch::kBFloat16));
  uint16_t* rows = bf16_out(out);
  at::parallel_for(0, index.numel(), 16, [&](int64_t b, int64_t e) { dense_rows_bf16(w, at + b, e - b, rows + b * k); });
  return out;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor table,
                              torch::Tensor row_req, torch::Tensor row_len, double scale, int64_t window,
                              int64_t path, c10::optional<torch::Tensor> sinks) {
  for (const auto* t : {&q, &k_pool, &v_pool})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kBFloat16 && t->is_contiguous(),
                "specserve attention: q and the K/V pools must be contiguous bf16 on CPU");
  for (const auto* t : {&table, &row_req, &row_len})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->stride(-1) == 1,
                "specserve attention: index tensors must be int64 on CPU");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes(), "specserve attention: q [T,H,D], pools [S,KVH,D]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == dim && heads % kv_heads == 0, "specserve attention: head shapes do not match");
  TORCH_CHECK(row_req.numel() == rows && row_len.numel() == rows, "specserve attention: one request and length per row");
  TORCH_CHECK(window >= 0, "specserve attention: window must be >= 0 (0: none)");
  TORCH_CHECK(!sinks || (sinks->device().is_cpu() && sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() &&
                         sinks->numel() == heads),
              "specserve attention: sinks must be contiguous float32 [heads]");
  auto out = torch::empty_like(q);
  if (rows == 0) return out;
  const int64_t longest = check_table_slots(table, row_req.data_ptr<int64_t>(), row_len.data_ptr<int64_t>(), rows, k_pool.size(0));
  const Path p = checked_path(path);
  PagedAttentionArgs a{bf16_data(q), bf16_data(k_pool), bf16_data(v_pool), table.data_ptr<int64_t>(), table.stride(0),
                       row_req.data_ptr<int64_t>(), row_len.data_ptr<int64_t>(), heads, kv_heads, dim, float(scale),
                       reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), window,
                       sinks ? sinks->data_ptr<float>() : nullptr};
  run_paged_attention(p, a, rows, longest);
  return out;
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.dim() == 2,
              "specserve ", what, ": expected a contiguous 2-D bf16 CPU tensor");
}

torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                           int64_t path) {
  check_rows(x, "add_rms_norm x");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous() && weight.numel() == h,
              "specserve add_rms_norm: weight must be bf16 [", h, "]");
  uint16_t* res = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "add_rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "specserve add_rms_norm: residual and x differ in shape");
    res = reinterpret_cast<uint16_t*>(residual->data_ptr<at::BFloat16>());
  }
  auto out = torch::empty_like(x);
  const Path p = checked_path(path);
  const uint16_t *xd = bf16_data(x), *wd = bf16_data(weight);
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) { add_rms_norm_rows(p, xd, res, wd, h, float(eps), od, b, e); });
  return out;
}

// act(gate) * up of [rows, 2f] gate_up = [gate | up] through `rows_fn` (silu_mul_rows or gelu_tanh_mul_rows).
template <void (*rows_fn)(Path, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t)>
torch::Tensor gated_mul(torch::Tensor gate_up, int64_t path) {
  check_rows(gate_up, "gated activation");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "specserve gated activation: gate_up width must be even");
  const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
  auto out = torch::empty({rows, f}, gate_up.options());
  const Path p = checked_path(path);
  const uint16_t* gd = bf16_data(gate_up);
  uint16_t* od = bf16_out(out);
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) { rows_fn(p, gd, f, od, b, e); });
  return out;
}

// gpt-oss's clamped SwiGLU of float32 gate/up sums [rows, 2f] plus their float32 bias [2f] -> bf16
// [rows, f] (the experts' activation in moe.cpp, exposed for its tests).
torch::Tensor swiglu_oai(torch::Tensor gate_up, torch::Tensor bias, double alpha, double limit, int64_t path) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0 && bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() &&
                  bias.numel() == gate_up.size(1),
              "specserve swiglu_oai: contiguous float32 gate_up [rows, 2f] and bias [2f]");
  const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
  auto out = torch::empty({rows, f}, gate_up.options().dtype(torch::kBFloat16));
  const Path p = checked_path(path);
  const float *gd = gate_up.data_ptr<float>(), *bd = bias.data_ptr<float>();
  uint16_t* od = bf16_out(out);
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) { swiglu_oai_rows(p, gd, bd, f, float(alpha), float(limit), od, b, e); });
  return out;
}

// Reads every byte of `buffer` once, both threads streaming disjoint halves, and returns a sum of
// its 64-bit words (so the reads cannot be optimised away): the machine's read bandwidth as the
// weight stream sees it, the bound of a batch-1 decode step (bench offline, benchmarks weight-stream).
int64_t stream_read(torch::Tensor buffer) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.scalar_type() == torch::kUInt8 && buffer.numel() % 64 == 0,
              "specserve stream_read: a contiguous uint8 buffer of whole 64-byte lines");
  const uint64_t* words = reinterpret_cast<const uint64_t*>(buffer.data_ptr<uint8_t>());
  const int64_t lines = buffer.numel() / 64;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
    uint64_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t line = begin; line < end; ++line)
      for (int i = 0; i < 8; ++i) lanes[i] += words[line * 8 + i];
    uint64_t sum = 0;
    for (uint64_t v : lanes) sum += v;
    total += sum;
  });
  return int64_t(total.load());
}

torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                         torch::Tensor slots, int64_t heads, int64_t kv_heads, torch::Tensor k_pool, torch::Tensor v_pool) {
  check_rows(qkv, "rope_store qkv");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == torch::kBFloat16 &&
              v_pool.scalar_type() == torch::kBFloat16 && k_pool.dim() == 3 && k_pool.size(1) == kv_heads,
              "specserve rope_store: K/V pools must be contiguous bf16 [slots, ", kv_heads, ", dim]");
  const int64_t rows = qkv.size(0), dim = k_pool.size(2);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "specserve rope_store: qkv width does not match the heads");
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes(), "specserve rope_store: the K and V pools differ in shape");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes(),
              "specserve rope_store: cos/sin must be contiguous float32 [positions, dim/2]");
  TORCH_CHECK(positions.device().is_cpu() && slots.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "specserve rope_store: positions, slots and tables must be on CPU");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 &&
              positions.numel() == rows && slots.numel() == rows && positions.is_contiguous() && slots.is_contiguous(),
              "specserve rope_store: one int64 position and slot per row");
  const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "specserve rope_store: position ", pos[t], " is outside the RoPE table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_pool.size(0), "specserve rope_store: slot ", slot[t], " is outside the K/V pool");
  }
  auto q = torch::empty({rows, heads, dim}, qkv.options());
  RopeStoreArgs a{bf16_data(qkv), cos.data_ptr<float>(), sin.data_ptr<float>(), positions.data_ptr<int64_t>(),
                  slots.data_ptr<int64_t>(), heads, kv_heads, dim, reinterpret_cast<uint16_t*>(q.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(k_pool.data_ptr<at::BFloat16>()), reinterpret_cast<uint16_t*>(v_pool.data_ptr<at::BFloat16>())};
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) { rope_store_rows(a, b, e); });
  return q;
}

}  // namespace
}  // namespace specserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512_bf16", &specserve::cpu_has_avx512_bf16, "CPU (and OS) support AVX512-BF16");
  m.def("has_avx2_fma", &specserve::cpu_has_avx2_fma, "CPU supports AVX2 and FMA");
  m.def("linear", &specserve::linear, "y = x W^T through a packed Q4 / Q8 / BF16 weight", py::arg("x"), py::arg("format"),
        py::arg("codes"), py::arg("scale"), py::arg("zero"), py::arg("n"), py::arg("k"), py::arg("out_bf16"),
        py::arg("path"), py::arg("w_exp_lo") = -1, py::arg("w_exp_hi") = -1, py::arg("init") = py::none(),
        py::arg("group") = 32, py::arg("bits") = 4, py::arg("code_offset") = 0, py::arg("scale_super") = py::none(),
        py::arg("zero_super") = py::none());
  m.def("linear_int8", &specserve::linear_int8, "y = x W^T with x quantized to int8 per row (Q4 / Q8 weights)",
        py::arg("x"), py::arg("format"), py::arg("codes"), py::arg("scale"), py::arg("zero"), py::arg("n"), py::arg("k"),
        py::arg("out_bf16"), py::arg("path"), py::arg("init") = py::none(), py::arg("group") = 32, py::arg("bits") = 4,
        py::arg("code_offset") = 0, py::arg("scale_super") = py::none(), py::arg("zero_super") = py::none());
  m.def("dense_rows_bf16", &specserve::packed_rows_bf16, "rows of a packed weight as bf16 (an embedding lookup)");
  m.def("paged_attention", &specserve::paged_attention, "attention over the paged K/V pool in place");
  m.def("add_rms_norm", &specserve::add_rms_norm, "residual += x (if given), then RMSNorm of it");
  m.def("swiglu_oai", &specserve::swiglu_oai, "gpt-oss's clamped SwiGLU of float32 [rows, 2f] gate/up sums plus bias");
  m.def("silu_mul", &specserve::gated_mul<specserve::silu_mul_rows>, "silu(gate) * up of [rows, 2f] gate_up");
  m.def("gelu_tanh_mul", &specserve::gated_mul<specserve::gelu_tanh_mul_rows>, "gelu_tanh(gate) * up of [rows, 2f] gate_up");
  specserve::register_decoder_layer(m);
  specserve::register_moe(m);
  specserve::register_markov(m);
  specserve::register_pack(m);
  m.def("stream_read", &specserve::stream_read, "read a uint8 buffer once with every thread (the read-bandwidth probe)");
  m.def("clock_ghz", &specserve::clock_ghz, "the mean core clock over every thread, from a dependent add chain");
  m.def("int8_dot_per_second", [](int64_t path, int64_t steps) { return specserve::int8_dot_per_second(specserve::checked_path(path), steps); },
        "VPDPBUSD instructions per second over every thread (0 off the AVX-512 path)");
  m.def("rope_store", &specserve::rope_store, "RoPE of q and k; k and v stored to their slots; returns q");
}
