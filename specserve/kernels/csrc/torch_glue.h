// What the torch-facing files share (bindings.cpp, decoder_layer.cpp): CPU feature detection, the
// checked kernel path, a packed weight's tensors as the kernels' view of them, and a whole linear
// layer (threads split it by column blocks, never inside one output's sum).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "attention.h"
#include "linear.h"

namespace specserve {

bool cpu_has_avx512_bf16();
bool cpu_has_avx2_fma();

// The path `path` names, if this CPU runs it (else a TORCH_CHECK error).
Path checked_path(int64_t path);

inline const uint16_t* bf16_data(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline uint16_t* bf16_out(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// What a weight's scale and offset tables need besides themselves (linear.h).
struct GroupTables {
  int64_t code_offset;                       // c > 0: offsets not stored are -c * scale
  c10::optional<torch::Tensor> scale_super;  // int8 tables: their float16 super-values
  c10::optional<torch::Tensor> zero_super;
};

// The packed weight's tensors, checked, as the kernels' view of them. Offsets: Q4 weights have them
// stored or, with code_offset c > 0 and none stored, as -c * scale; Q8 weights where stored.
PackedWeight packed_weight(int64_t format, const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& zero,
                           int64_t n, int64_t k, int64_t group, int64_t bits, int64_t w_exp_lo, int64_t w_exp_hi,
                           const GroupTables& tables);

// out [m, w.n] (row stride w.n; bf16 or float32) = x [m, w.k] (bf16, row stride ldx) W^T; with
// accumulate (float32 only) every sum continues from out's value. int8: activations quantized per
// row (linear_int8.h; Q4 and Q8 weights with K a multiple of 32).
void run_linear(Path path, const PackedWeight& w, bool int8, const uint16_t* x, int64_t ldx, int64_t m, void* out,
                bool out_bf16, bool accumulate);

// Tasks [0, rows * kv_heads) of a paged attention, split across threads, each with its scratch
// sized for rows of up to `longest` positions (attention.h).
void run_paged_attention(Path path, const PagedAttentionArgs& a, int64_t rows, int64_t longest);

// Checks that every slot rows [0, rows) of a paged attention read (table row row_req[t], its first
// row_len[t] positions) is in a pool of `pool_slots`; returns the longest row_len.
int64_t check_table_slots(const torch::Tensor& table, const int64_t* row_req, const int64_t* row_len, int64_t rows,
                          int64_t pool_slots);

// A packed weight (kernels/linear.py PackedLinear) as the kernels see it, holding its tensors.
struct NativeLinear {
  PackedWeight w;
  bool int8;
  std::vector<torch::Tensor> keep;

  NativeLinear(int64_t format, torch::Tensor codes, torch::Tensor scale, torch::Tensor zero, int64_t n, int64_t k,
               int64_t w_exp_lo, int64_t w_exp_hi, int64_t group, int64_t bits, int64_t code_offset,
               c10::optional<torch::Tensor> scale_super, c10::optional<torch::Tensor> zero_super, bool int8_)
      : w(packed_weight(format, codes, scale, zero, n, k, group, bits, w_exp_lo, w_exp_hi,
                        GroupTables{code_offset, scale_super, zero_super})),
        int8(int8_), keep{codes, scale, zero} {
    TORCH_CHECK(!int8 || (w.format != WeightFormat::BF16 && k % 32 == 0), "specserve decoder layer: int8 activations need Q4 or Q8 weights with K a multiple of 32");
    for (const auto* t : {&scale_super, &zero_super})
      if (t->has_value()) keep.push_back(**t);
  }

  // x [T, k] bf16 (contiguous) -> [T, n] bf16.
  torch::Tensor operator()(const torch::Tensor& x, Path path) const {
    auto out = torch::empty({x.size(0), w.n}, x.options());
    run_linear(path, w, int8, bf16_data(x), w.k, x.size(0), out.data_ptr(), true, false);
    return out;
  }
};

}  // namespace specserve
