// Load-time packing in one pass per tensor, rows split across threads. Each function is the exact
// counterpart of a Python reference (models/quant.py _parse_k, _k_scales; kernels/linear.py
// pack_q4) that the tests hold it to, byte for byte; only the speed differs.
#include "pack.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <vector>

namespace specserve {
namespace {

constexpr int64_t kSuper = 256;  // elements per K-quant super-block

int64_t k_block_bytes(const std::string& type) {
  if (type == "Q4_K") return 144;
  if (type == "Q5_K") return 176;
  if (type == "Q6_K") return 210;
  TORCH_CHECK(false, "specserve gguf_k_codes: not a K-quant type with codes: ", type);
  return 0;
}

const uint8_t* checked_blocks(const torch::Tensor& raw, int64_t block_bytes, const char* what) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "specserve ", what, ": raw blocks must be contiguous uint8 [rows, bytes]");
  TORCH_CHECK(raw.size(1) % block_bytes == 0, "specserve ", what, ": a row is not whole ", block_bytes, "-byte blocks");
  return raw.data_ptr<uint8_t>();
}

// Q4_K/Q5_K: 4 low bits of 256 codes in 128 bytes; each 32 bytes give sub-block 2c's low nibbles
// then sub-block 2c + 1's high ones.
void low_nibbles(const uint8_t* qs, uint8_t* out) {
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 32; ++i) {
      out[64 * c + i] = qs[32 * c + i] & 0x0F;
      out[64 * c + 32 + i] = qs[32 * c + i] >> 4;
    }
}

// One super-block's 256 codes (llama.cpp dequantize_row_q{4,5,6}_K's element order).
void k_codes(const uint8_t* block, int64_t kind, uint8_t* out) {
  if (kind == 4) return low_nibbles(block + 16, out);
  if (kind == 5) {
    low_nibbles(block + 48, out);
    const uint8_t* qh = block + 16;  // bit j of byte i: the fifth bit of sub-block j's element i
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) out[32 * j + i] |= ((qh[i] >> j) & 1) << 4;
    return;
  }
  const uint8_t *ql = block, *qh = block + 128;
  for (int h = 0; h < 2; ++h)
    for (int e = 0; e < 64; ++e) {
      out[128 * h + e] = ql[64 * h + e] & 0x0F;
      out[128 * h + 64 + e] = ql[64 * h + e] >> 4;
    }
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 32; ++e) out[128 * h + 32 * t + e] |= ((qh[32 * h + e] >> (2 * t)) & 3) << 4;
}

torch::Tensor gguf_k_codes(torch::Tensor raw, const std::string& type) {
  const int64_t block_bytes = k_block_bytes(type), kind = type[1] - '0';
  const uint8_t* src = checked_blocks(raw, block_bytes, "gguf_k_codes");
  const int64_t rows = raw.size(0), blocks = raw.size(1) / block_bytes;
  auto codes = torch::empty({rows, blocks * kSuper}, raw.options());
  uint8_t* dst = codes.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        k_codes(src + (r * blocks + b) * block_bytes, kind, dst + (r * blocks + b) * kSuper);
  });
  return codes;
}

// MXFP4 [rows, blocks * 17]: per block of 32, a scale byte then 16 bytes of E2M1 codes (low nibbles
// are elements 0..15, high ones 16..31). Returns the codes uint8 [rows, blocks * 32] and, per block,
// whether every code reads zero (+0 or -0: no magnitude bits), uint8 [rows, blocks].
std::vector<torch::Tensor> gguf_mxfp4_codes(torch::Tensor raw) {
  constexpr int64_t block_bytes = 17, group = 32;
  const uint8_t* src = checked_blocks(raw, block_bytes, "gguf_mxfp4_codes");
  const int64_t rows = raw.size(0), blocks = raw.size(1) / block_bytes;
  auto codes = torch::empty({rows, blocks * group}, raw.options());
  auto zero = torch::empty({rows, blocks}, raw.options());
  uint8_t *dst = codes.data_ptr<uint8_t>(), *zeros = zero.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* qs = src + (r * blocks + b) * block_bytes + 1;
        uint8_t* out = dst + (r * blocks + b) * group;
        uint8_t magnitude = 0;
        for (int i = 0; i < 16; ++i) {
          out[i] = qs[i] & 0x0F;
          out[16 + i] = qs[i] >> 4;
          magnitude |= qs[i] & 0x77;
        }
        zeros[r * blocks + b] = magnitude == 0;
      }
  });
  return {codes, zero};
}

// Q4_K/Q5_K's eight 6-bit scales and mins per super-block (bytes 4..15; llama.cpp get_scale_min_k4):
// uint8 [2, rows, blocks * 8], scales then mins.
torch::Tensor gguf_k_scale_min(torch::Tensor raw, const std::string& type) {
  TORCH_CHECK(type == "Q4_K" || type == "Q5_K", "specserve gguf_k_scale_min: Q4_K or Q5_K, got ", type);
  const int64_t block_bytes = k_block_bytes(type);
  const uint8_t* src = checked_blocks(raw, block_bytes, "gguf_k_scale_min");
  const int64_t rows = raw.size(0), blocks = raw.size(1) / block_bytes, count = rows * blocks;
  auto out = torch::empty({2, rows, blocks * 8}, raw.options());
  uint8_t *sc = out.data_ptr<uint8_t>(), *mn = sc + count * 8;
  at::parallel_for(0, count, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* q = src + i * block_bytes + 4;
      for (int j = 0; j < 8; ++j) {
        sc[i * 8 + j] = j < 4 ? q[j] & 63 : (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        mn[i * 8 + j] = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      }
    }
  });
  return out;
}

// One oct (8 columns) of one lane: its nibble word (column 2p at bit 4p, 2p + 1 at 16 + 4p) and
// its high-bit plane (5 bits: a byte, 2p at bit p and 2p + 1 at 4 + p; 6 bits: a little-endian
// uint16, 2p at bits 2p..2p+1 and 2p + 1 at 8 + 2p..) as csrc/linear.h reads them.
void pack_oct(const uint8_t* c, int64_t bits, uint8_t* word, uint8_t* high) {
  uint32_t nib = 0, plane = 0;
  for (int p = 0; p < 4; ++p) {
    const uint32_t even = c[2 * p], odd = c[2 * p + 1];
    nib |= (even & 0x0F) << (4 * p) | (odd & 0x0F) << (16 + 4 * p);
    if (bits == 5) plane |= (even >> 4 & 1) << p | (odd >> 4 & 1) << (4 + p);
    if (bits == 6) plane |= (even >> 4 & 3) << (2 * p) | (odd >> 4 & 3) << (8 + 2 * p);
  }
  std::memcpy(word, &nib, 4);  // little-endian, as the kernels load it
  if (bits == 5) high[0] = uint8_t(plane);
  if (bits == 6) std::memcpy(high, &plane, 2);
}

// codes uint8 [blocks * 16, k] -> per block of 16 rows and oct of 8 columns: the 16 lanes' nibble
// words (64 bytes), then their high planes (16 or 32 bytes for 5 or 6 bits).
torch::Tensor pack_q4_codes(torch::Tensor codes, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "specserve pack_q4_codes: bits must be 4, 5 or 6");
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kUInt8 && codes.dim() == 2 &&
                  codes.is_contiguous() && codes.size(0) % 16 == 0 && codes.size(1) % 8 == 0,
              "specserve pack_q4_codes: codes must be contiguous uint8 [16 * blocks, 8 * octs]");
  const int64_t k = codes.size(1), octs = k / 8, blocks = codes.size(0) / 16;
  const int64_t high_bytes = bits == 4 ? 0 : bits - 4, oct_bytes = 16 * (4 + high_bytes);
  auto packed = torch::empty({blocks * octs * oct_bytes}, codes.options());
  const uint8_t* src = codes.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t o = 0; o < octs; ++o) {
        uint8_t* out = dst + (b * octs + o) * oct_bytes;
        for (int lane = 0; lane < 16; ++lane)
          pack_oct(src + (b * 16 + lane) * k + o * 8, bits, out + 4 * lane, out + 64 + high_bytes * lane);
      }
  });
  return packed;
}

}  // namespace

void register_pack(pybind11::module& m) {
  m.def("gguf_k_codes", &gguf_k_codes, "a K-quant tensor's codes, uint8 [rows, k], from its GGUF blocks",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_k_scale_min", &gguf_k_scale_min, "Q4_K/Q5_K's 6-bit scales and mins, uint8 [2, rows, k / 32]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gguf_mxfp4_codes", &gguf_mxfp4_codes, "MXFP4's codes uint8 [rows, k] and its all-zero blocks uint8 [rows, k / 32]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_q4_codes", &pack_q4_codes, "4/5/6-bit codes [16 * blocks, k] in the Q4 kernels' layout",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace specserve
