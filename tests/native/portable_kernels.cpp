// The kernels' generic (portable C++) path without torch, for the cross-architecture test
// (tests/unit/test_portable_build.py): built natively and for aarch64 from the same sources, it
// runs every generic kernel on inputs drawn from a fixed generator and writes the outputs' raw
// bytes to stdout. Both builds must print the same bytes: the portable path gives the same bits
// on every CPU, not only on the x86 machines that also have the vector paths.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "linear_int8.h"
#include "ops.h"

namespace {

using namespace specserve;

struct Draw {  // xorshift64: the same stream on every machine
  uint64_t s = 0x9E3779B97F4A7C15ull;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  // Raw bf16 bits around 2^(e - 127): subnormals, huge values, inf and NaN when e reaches the ends.
  uint16_t bf16_near(int e, int spread) {
    int exp = e + int(next() % (2 * spread + 1)) - spread;
    exp = exp < 0 ? 0 : exp > 255 ? 255 : exp;
    return uint16_t((next() & 0x807F) | (uint64_t(exp) << 7));
  }
  uint16_t f16_scale() { return uint16_t(((next() % 8) + 6) << 10 | (next() & 0x3FF)); }  // 2^-9..2^-2
};

void emit(const void* data, size_t bytes) { fwrite(data, 1, bytes, stdout); }

// The same weight with integer activations (linear_int8.h); Q4 also as w = d (q - 8).
void linears_int8(PackedWeight w, const std::vector<uint16_t>& x, int64_t m, std::vector<float>& out) {
  const int64_t k = w.k, blocks = (w.n + kBlockCols - 1) / kBlockCols;
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * (k / 32));
  std::vector<int32_t> s16(m * (k / 16));
  quantize_rows(Path::Generic, x.data(), k, k, int8_layout(Path::Generic, w.format), 0, m, q.data(), d.data(), s16.data());
  for (int c : {0, 8}) {
    if (c && w.format != WeightFormat::Q4) break;
    w.code_offset = c;
    linear_int8_blocks(Path::Generic, w, Int8Rows{q.data(), d.data(), s16.data(), k}, m, 0, blocks, out.data(), w.n,
                       false, false);
    emit(out.data(), out.size() * sizeof(float));
  }
}

void linears(Draw& d) {
  const int64_t n = 40, k = 96, m = 9;
  for (WeightFormat fmt : {WeightFormat::Q4, WeightFormat::Q8, WeightFormat::BF16}) {
    const int64_t blocks = (n + kBlockCols - 1) / kBlockCols, groups = k / kGroup;
    std::vector<uint8_t> codes(blocks * block_bytes(fmt, k));
    for (auto& c : codes) c = uint8_t(d.next());
    if (fmt == WeightFormat::BF16)  // weights and rows over the whole exponent range
      for (size_t i = 0; i + 1 < codes.size(); i += 2) {
        const uint16_t v = d.bf16_near(int(d.next() % 256), 6);
        codes[i] = uint8_t(v), codes[i + 1] = uint8_t(v >> 8);
      }
    std::vector<uint16_t> scale(blocks * groups * kBlockCols), zero(scale.size()), x(m * k);
    for (auto& v : scale) v = d.f16_scale();
    for (auto& v : zero) v = uint16_t(d.f16_scale() | 0x8000);
    for (int64_t r = 0; r < m; ++r) {
      const int centre = fmt == WeightFormat::BF16 ? int(d.next() % 256) : 120 + int(d.next() % 14);
      for (int64_t i = 0; i < k; ++i) x[r * k + i] = d.bf16_near(centre, 6);
    }
    std::vector<float> sums(m * groups);
    group_sums(x.data(), k, m, k, 32, sums.data());
    const PackedWeight w{fmt, codes.data(), scale.data(), zero.data(), n, k, ExponentRange{-1, -1, false}};
    std::vector<float> out(m * n);
    linear_blocks(Path::Generic, w, x.data(), k, m, sums.data(), nullptr, 0, blocks, out.data(), n, false, false);
    emit(out.data(), out.size() * sizeof(float));
    if (fmt != WeightFormat::BF16) linears_int8(w, x, m, out);
  }
}

// A Q4 weight with K-quant tables (int8 sub-values times float16 super-values per 256 columns):
// offsets stored so, then none stored (-8 * scale), then the stored ones with integer activations.
void linears_k_quant(Draw& d) {
  const int64_t n = 40, k = 512, m = 9, blocks = (n + kBlockCols - 1) / kBlockCols, groups = k / kGroup;
  std::vector<uint8_t> codes(blocks * block_bytes(WeightFormat::Q4, k));
  for (auto& c : codes) c = uint8_t(d.next());
  std::vector<int8_t> scale(blocks * groups * kBlockCols), zero(scale.size());
  for (auto& v : scale) v = int8_t(d.next() % 64);
  for (auto& v : zero) v = int8_t(d.next() % 64);
  std::vector<uint16_t> supers(2 * blocks * (k / kSuperCols) * kBlockCols), x(m * k);
  for (size_t i = 0; i < supers.size(); ++i) supers[i] = uint16_t((d.f16_scale() - (6 << 10)) | (i % 2 ? 0x8000 : 0));
  for (auto& v : x) v = d.bf16_near(124, 6);
  std::vector<float> sums(m * groups), out(m * n);
  group_sums(x.data(), k, m, k, 32, sums.data());
  PackedWeight w{WeightFormat::Q4, codes.data(), scale.data(), zero.data(), n, k, ExponentRange{-1, -1, false}};
  w.scale_type = ScaleType::I8;
  w.scale_super = supers.data();
  w.zero_super = supers.data() + supers.size() / 2;
  for (int stored : {1, 0}) {
    w.zero = stored ? zero.data() : nullptr;
    w.code_offset = stored ? 0 : 8;
    linear_blocks(Path::Generic, w, x.data(), k, m, sums.data(), nullptr, 0, blocks, out.data(), n, false, false);
    emit(out.data(), out.size() * sizeof(float));
  }
  w.zero = zero.data();
  linears_int8(w, x, m, out);
}

void attention(Draw& d) {
  const int64_t heads = 6, kv_heads = 2, dim = 32, slots = 64, rows = 5, stride = 48;
  std::vector<uint16_t> q(rows * heads * dim), k(slots * kv_heads * dim), v(k.size()), out(q.size());
  for (auto* t : {&q, &k, &v})
    for (auto& e : *t) e = d.bf16_near(125 + int(d.next() % 4), 3);
  std::vector<int64_t> table(2 * stride), row_req(rows), row_len(rows);
  for (auto& s : table) s = int64_t(d.next() % slots);
  for (int64_t r = 0; r < rows; ++r) row_req[r] = r % 2, row_len[r] = int64_t(d.next() % stride);
  const PagedAttentionArgs a{q.data(), k.data(), v.data(), table.data(), stride, row_req.data(), row_len.data(),
                             heads, kv_heads, dim, 0.17677669f, out.data()};
  std::vector<float> scratch(4 * (stride + 16 + 16));
  paged_attention_tasks(Path::Generic, a, 0, rows * kv_heads, scratch.data());
  emit(out.data(), out.size() * 2);
}

void small_ops(Draw& d) {
  const int64_t rows = 4, h = 200;
  std::vector<uint16_t> x(rows * h), residual(rows * h), weight(h), out(rows * h), gate_up(rows * 2 * h), act(rows * h);
  for (auto* t : {&x, &residual, &weight, &gate_up})
    for (auto& e : *t) e = d.bf16_near(126, 4);
  add_rms_norm_rows(Path::Generic, x.data(), residual.data(), weight.data(), h, 1e-5f, out.data(), 0, rows);
  silu_mul_rows(Path::Generic, gate_up.data(), h, act.data(), 0, rows);
  emit(out.data(), out.size() * 2);
  emit(residual.data(), residual.size() * 2);
  emit(act.data(), act.size() * 2);
}

}  // namespace

int main() {
  Draw d;
  linears(d);
  linears_k_quant(d);
  attention(d);
  small_ops(d);
  return 0;
}
