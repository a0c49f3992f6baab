// Torch bindings of the CPU kernels: argument checks, threading (at::parallel_for splits work by
// output column blocks or attention tasks, never inside one output's sum) and CPU feature detection.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "linear_int8.h"
#include "ops.h"

namespace specserve {
namespace {

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_has_avx2_fma() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

Path checked_path(int64_t path) {
  if (path == int64_t(Path::Generic)) return Path::Generic;
  if (path == int64_t(Path::Avx2Fma)) {
    TORCH_CHECK(cpu_has_avx2_fma(), "specserve kernels: the avx2_fma path was asked for but this CPU lacks AVX2 and FMA");
    return Path::Avx2Fma;
  }
  if (path == int64_t(Path::Avx512Bf16)) {
    TORCH_CHECK(cpu_has_avx512_bf16(), "specserve kernels: the avx512_bf16 path was asked for but this CPU lacks AVX512-BF16");
    return Path::Avx512Bf16;
  }
  TORCH_CHECK(false, "specserve kernels: unknown path ", path);
}

const uint16_t* bf16_data(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// What a weight's scale and offset tables need besides themselves (linear.h).
struct GroupTables {
  int64_t code_offset;                       // c > 0: offsets not stored are -c * scale
  c10::optional<torch::Tensor> scale_super;  // int8 tables: their float16 super-values
  c10::optional<torch::Tensor> zero_super;
};

// A float16 super-value table [blocks, K/256, 16] of an I8 scale or offset table (else null).
const uint16_t* super_values(const c10::optional<torch::Tensor>& super, bool needed, int64_t count, const char* what) {
  if (!needed) return nullptr;
  TORCH_CHECK(super.has_value() && super->scalar_type() == torch::kFloat16 && super->is_contiguous() && super->numel() == count,
              "specserve linear: int8 ", what, " need contiguous float16 super-values [blocks, K/256, 16]");
  return reinterpret_cast<const uint16_t*>(super->data_ptr<at::Half>());
}

ScaleType scale_type_of(const torch::Tensor& scale) {
  switch (scale.scalar_type()) {
    case torch::kFloat16: return ScaleType::F16;
    case torch::kFloat32: return ScaleType::F32;
    case torch::kInt8: return ScaleType::I8;
    default: TORCH_CHECK(false, "specserve linear: scales must be float16, float32 or int8 (times float16 super-values)");
  }
}

// The packed weight's tensors, checked, as the kernels' view of them. Offsets: Q4 weights have them
// stored or, with code_offset c > 0 and none stored, as -c * scale; Q8 weights where stored.
PackedWeight packed_weight(int64_t format, const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& zero,
                           int64_t n, int64_t k, int64_t group, int64_t bits, int64_t w_exp_lo, int64_t w_exp_hi,
                           const GroupTables& tables) {
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8, "specserve linear: codes must be contiguous uint8");
  const auto fmt = static_cast<WeightFormat>(format);
  TORCH_CHECK(group == 32 || (group == 16 && fmt != WeightFormat::BF16), "specserve linear: groups are 32 or 16 columns");
  TORCH_CHECK(bits == 4 || (fmt == WeightFormat::Q4 && (bits == 5 || bits == 6)), "specserve linear: codes of 4, 5 or 6 bits");
  TORCH_CHECK(fmt == WeightFormat::BF16 || k % group == 0, "specserve linear: quantized K must be a multiple of ", group);
  TORCH_CHECK(tables.code_offset >= 0 && tables.code_offset <= 128 && (tables.code_offset & (tables.code_offset - 1)) == 0,
              "specserve linear: the code offset must be 0 or a power of two up to 128");
  const int64_t blocks = (n + kBlockCols - 1) / kBlockCols;
  TORCH_CHECK(codes.numel() == blocks * block_bytes(fmt, k, int(bits)), "specserve linear: packed codes have the wrong size");
  const bool quantized = fmt != WeightFormat::BF16;
  const bool offsets = quantized && zero.numel() > 0;
  TORCH_CHECK(!(fmt == WeightFormat::Q4 && !offsets && tables.code_offset == 0),
              "specserve linear: Q4 weights need offsets, stored or as a code offset");
  const int64_t scales = blocks * (k / group) * kBlockCols;
  PackedWeight w{fmt, codes.data_ptr<uint8_t>(), nullptr, nullptr, n, k, ExponentRange{int(w_exp_lo), int(w_exp_hi), w_exp_lo >= 0}};
  w.group = group;
  w.bits = int(bits);
  w.code_offset = int(tables.code_offset);
  if (!quantized) return w;  // BF16 weights' exponent bounds come from packing (w_exp_lo < 0: not all finite and normal)
  w.scale_type = scale_type_of(scale);
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == scales, "specserve linear: scales must be contiguous [blocks, K/group, 16]");
  const bool i8 = w.scale_type == ScaleType::I8;
  TORCH_CHECK(!i8 || k % kSuperCols == 0, "specserve linear: int8 scales need K a multiple of ", kSuperCols);
  const int64_t supers = blocks * (k / kSuperCols) * kBlockCols;
  w.scale = scale.data_ptr();
  w.scale_super = super_values(tables.scale_super, i8, supers, "scales");
  if (offsets) {
    TORCH_CHECK(zero.scalar_type() == scale.scalar_type() && zero.is_contiguous() && zero.numel() == scales,
                "specserve linear: offsets must be contiguous [blocks, K/group, 16] in the scales' dtype");
    w.zero = zero.data_ptr();
    w.zero_super = super_values(tables.zero_super, i8, supers, "offsets");
  }
  return w;
}

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
  const int64_t m = x.size(0);
  if (m == 0) return out;
  const Path p = checked_path(path);
  std::vector<float> sums;
  if (has_offsets(w)) {
    sums.resize(m * (k / group));
    group_sums(bf16_data(x), x.stride(0), m, k, group, sums.data());
  }
  const uint16_t* xd = bf16_data(x);
  std::vector<uint8_t> exact;
  std::vector<float> xf;
  Avx2Rows avx2{nullptr, (k + 1) / 2 * 2, nullptr};
  if (p == Path::Avx2Fma) {  // each row converted once for every column block
    exact.resize(m);
    xf.resize(m * avx2.ldx);
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) exact[r] = prepare_avx2_row(w, xd + r * x.stride(0), xf.data() + r * avx2.ldx);
    });
    avx2.x = xf.data();
    avx2.exact = exact.data();
  }
  void* od = out.data_ptr();
  const int64_t blocks = (n + kBlockCols - 1) / kBlockCols;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    linear_blocks(p, w, xd, x.stride(0), m, sums.data(), &avx2, begin, end, od, n, out_bf16, init.has_value());
  });
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
  TORCH_CHECK(w.format != WeightFormat::BF16 && k % 32 == 0, "specserve linear_int8: Q4 or Q8 weights with K a multiple of 32");
  const int64_t m = x.size(0);
  if (m == 0) return out;
  const Path p = checked_path(path);
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * (k / 32));
  std::vector<int32_t> s16(m * (k / 16));
  const Int8Layout layout = int8_layout(p, w.format);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    quantize_rows(bf16_data(x), x.stride(0), k, layout, begin, end, q.data(), d.data(), s16.data());
  });
  const Int8Rows rows{q.data(), d.data(), s16.data(), k};
  void* od = out.data_ptr();
  at::parallel_for(0, (n + kBlockCols - 1) / kBlockCols, 4, [&](int64_t begin, int64_t end) {
    linear_int8_blocks(p, w, rows, m, begin, end, od, n, out_bf16, init.has_value());
  });
  return out;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor table,
                              torch::Tensor row_req, torch::Tensor row_len, double scale, int64_t window,
                              int64_t path) {
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
  auto out = torch::empty_like(q);
  if (rows == 0) return out;
  const int64_t *req = row_req.data_ptr<int64_t>(), *len = row_len.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(req[t] >= 0 && req[t] < table.size(0), "specserve attention: row ", t, " names table row ", req[t]);
    TORCH_CHECK(len[t] >= 0 && len[t] <= table.size(1), "specserve attention: row ", t, " sees ", len[t], " positions");
    longest = std::max(longest, len[t]);
  }
  // Every slot a row reads must be in the pool: checked once per request over its longest row.
  std::vector<std::pair<int64_t, int64_t>> seen;  // (table row, positions checked)
  const int64_t* slots = table.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& e) { return e.first == req[t]; });
    const int64_t from = it == seen.end() ? 0 : it->second;
    for (int64_t j = from; j < len[t]; ++j) {
      const int64_t slot = slots[req[t] * table.stride(0) + j];
      TORCH_CHECK(slot >= 0 && slot < k_pool.size(0), "specserve attention: table row ", req[t], " position ", j,
                  " names slot ", slot, " outside the K/V pool");
    }
    if (it == seen.end()) seen.emplace_back(req[t], len[t]);
    else it->second = std::max(it->second, len[t]);
  }
  const Path p = checked_path(path);
  PagedAttentionArgs a{bf16_data(q), bf16_data(k_pool), bf16_data(v_pool), table.data_ptr<int64_t>(), table.stride(0),
                       row_req.data_ptr<int64_t>(), row_len.data_ptr<int64_t>(), heads, kv_heads, dim, float(scale),
                       reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), window};
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(4 * ((longest + 15) / 16 * 16 + 16));
    paged_attention_tasks(p, a, begin, end, scratch.data());
  });
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

torch::Tensor silu_mul(torch::Tensor gate_up, int64_t path) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "specserve silu_mul: gate_up width must be even");
  const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
  auto out = torch::empty({rows, f}, gate_up.options());
  const Path p = checked_path(path);
  const uint16_t* gd = bf16_data(gate_up);
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) { silu_mul_rows(p, gd, f, od, b, e); });
  return out;
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
  m.def("paged_attention", &specserve::paged_attention, "attention over the paged K/V pool in place");
  m.def("add_rms_norm", &specserve::add_rms_norm, "residual += x (if given), then RMSNorm of it");
  m.def("silu_mul", &specserve::silu_mul, "silu(gate) * up of [rows, 2f] gate_up");
  m.def("rope_store", &specserve::rope_store, "RoPE of q and k; k and v stored to their slots; returns q");
}
