// See torch_glue.h.
#include "torch_glue.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "linear_int8.h"

namespace specserve {

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx512vbmi");
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
    TORCH_CHECK(cpu_has_avx512_bf16(), "specserve kernels: the avx512_bf16 path was asked for but this CPU lacks AVX512-BF16 with VNNI and VBMI");
    return Path::Avx512Bf16;
  }
  TORCH_CHECK(false, "specserve kernels: unknown path ", path);
}

namespace {

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

void run_linear_bf16(Path p, const PackedWeight& w, const uint16_t* x, int64_t ldx, int64_t m, void* out, bool out_bf16,
                     bool accumulate) {
  std::vector<float> sums;
  if (has_offsets(w)) {
    sums.resize(m * (w.k / w.group));
    group_sums(x, ldx, m, w.k, w.group, sums.data());
  }
  std::vector<uint8_t> exact;
  std::vector<float> xf;
  Avx2Rows avx2{nullptr, (w.k + 1) / 2 * 2, nullptr};
  if (p == Path::Avx2Fma) {  // each row converted once for every column block
    exact.resize(m);
    xf.resize(m * avx2.ldx);
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) exact[r] = prepare_avx2_row(w, x + r * ldx, xf.data() + r * avx2.ldx);
    });
    avx2.x = xf.data();
    avx2.exact = exact.data();
  }
  at::parallel_for(0, (w.n + kBlockCols - 1) / kBlockCols, 4, [&](int64_t begin, int64_t end) {
    linear_blocks(p, w, x, ldx, m, sums.data(), &avx2, begin, end, out, w.n, out_bf16, accumulate);
  });
}

void run_linear_int8(Path p, const PackedWeight& w, const uint16_t* x, int64_t ldx, int64_t m, void* out, bool out_bf16,
                     bool accumulate) {
  std::vector<int8_t> q(m * w.k);
  std::vector<float> d(m * (w.k / 32));
  std::vector<int32_t> s16(m * (w.k / 16));
  const Int8Layout layout = int8_layout(p, w.format);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    quantize_rows(p, x, ldx, w.k, layout, begin, end, q.data(), d.data(), s16.data());
  });
  const Int8Rows rows{q.data(), d.data(), s16.data(), w.k};
  at::parallel_for(0, (w.n + kBlockCols - 1) / kBlockCols, 4, [&](int64_t begin, int64_t end) {
    linear_int8_blocks(p, w, rows, m, begin, end, out, w.n, out_bf16, accumulate);
  });
}

}  // namespace

PackedWeight packed_weight(int64_t format, const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& zero,
                           int64_t n, int64_t k, int64_t group, int64_t bits, int64_t w_exp_lo, int64_t w_exp_hi,
                           const GroupTables& tables) {
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == torch::kUInt8, "specserve linear: codes must be contiguous uint8");
  const auto fmt = static_cast<WeightFormat>(format);
  TORCH_CHECK(group == 32 || (group == 16 && fmt != WeightFormat::BF16), "specserve linear: groups are 32 or 16 columns");
  TORCH_CHECK(bits == 4 || (fmt == WeightFormat::Q4 && (bits == 5 || bits == 6 || bits == kE2M1)),
              "specserve linear: codes of 4, 5 or 6 bits, or E2M1 codes");
  TORCH_CHECK(bits != kE2M1 || group == 32, "specserve linear: E2M1 codes come in groups of 32");
  TORCH_CHECK(fmt == WeightFormat::BF16 || k % group == 0, "specserve linear: quantized K must be a multiple of ", group);
  const bool power_of_two = (tables.code_offset & (tables.code_offset - 1)) == 0;
  TORCH_CHECK(tables.code_offset >= 0 && tables.code_offset <= 128 && (power_of_two || (bits == kE2M1 && tables.code_offset == kE2M1Offset)),
              "specserve linear: the code offset must be 0 or a power of two up to 128 (E2M1 codes: ", kE2M1Offset, ")");
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
  const int64_t supers = blocks * ((k + kSuperCols - 1) / kSuperCols) * kBlockCols;  // the last may be partial
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

void run_linear(Path path, const PackedWeight& w, bool int8, const uint16_t* x, int64_t ldx, int64_t m, void* out,
                bool out_bf16, bool accumulate) {
  TORCH_CHECK(!int8 || (w.format != WeightFormat::BF16 && w.k % 32 == 0),
              "specserve linear_int8: Q4 or Q8 weights with K a multiple of 32");
  if (m == 0) return;
  if (int8) run_linear_int8(path, w, x, ldx, m, out, out_bf16, accumulate);
  else run_linear_bf16(path, w, x, ldx, m, out, out_bf16, accumulate);
}

void run_paged_attention(Path path, const PagedAttentionArgs& a, int64_t rows, int64_t longest) {
  at::parallel_for(0, rows * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kMaxGroupPass * ((longest + 15) / 16 * 16 + 16));
    paged_attention_tasks(path, a, begin, end, scratch.data());
  });
}

int64_t check_table_slots(const torch::Tensor& table, const int64_t* row_req, const int64_t* row_len, int64_t rows,
                          int64_t pool_slots) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == torch::kInt64 && table.dim() == 2 && table.stride(1) == 1,
              "specserve attention: the table must be int64 [requests, positions] on CPU");
  int64_t longest = 0;
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(row_req[t] >= 0 && row_req[t] < table.size(0), "specserve attention: row ", t, " names table row ", row_req[t]);
    TORCH_CHECK(row_len[t] >= 0 && row_len[t] <= table.size(1), "specserve attention: row ", t, " sees ", row_len[t], " positions");
    longest = std::max(longest, row_len[t]);
  }
  // Checked once per request over its longest row.
  std::vector<std::pair<int64_t, int64_t>> seen;  // (table row, positions checked)
  const int64_t* slots = table.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& e) { return e.first == row_req[t]; });
    const int64_t from = it == seen.end() ? 0 : it->second;
    for (int64_t j = from; j < row_len[t]; ++j) {
      const int64_t slot = slots[row_req[t] * table.stride(0) + j];
      TORCH_CHECK(slot >= 0 && slot < pool_slots, "specserve attention: table row ", row_req[t], " position ", j,
                  " names slot ", slot, " outside the K/V pool");
    }
    if (it == seen.end()) seen.emplace_back(row_req[t], row_len[t]);
    else it->second = std::max(it->second, row_len[t]);
  }
  return longest;
}

}  // namespace specserve
