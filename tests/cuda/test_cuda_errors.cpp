// CUDA backend: errors that only the device can see (batch arrays are device pointers). The op
// returns FMKV_OK (it is asynchronous), the next fmkv_device_synchronize() returns the error with a
// message naming the entry, and the visible cache is untouched: the fp16 regions entirely, and every
// compressed token below a sequence's length (an append may already have written the token slots it
// was filling, at or past the compressed length: FORMAT.md section 2). Skips when no CUDA device is
// usable.
#include "harness.h"

namespace fmkv::test {
namespace {

constexpr fmkv_backend kCuda = FMKV_BACKEND_CUDA;

// The bytes of every compressed token below each sequence's compressed end E(len) equal in a and b
// (code words and scale of every group, K and V, every kv head; k16 sections: the fp16 row).
inline ::testing::AssertionResult visible_pages_equal(const Scenario& s, const std::vector<uint8_t>& a,
                                                      const std::vector<uint8_t>& b) {
  const fmkv_config& c = s.cfg;
  const int32_t P = c.page_size, d = c.head_dim, G = fmkv_groups(d);
  const int64_t pb = fmkv_config_page_bytes(&c);
  for (int32_t q = 0; q < s.seqs(); ++q) {
    const int64_t E = std::max<int64_t>(c.sink_tokens, s.lens[q] - c.window_tokens);
    for (int64_t ci = 0; ci < E - c.sink_tokens; ++ci) {
      const int64_t ti = q * s.table_stride + ci / P;
      if (ti >= (int64_t)s.table.size()) break;
      const int64_t page = s.table[ti];
      if (page < 0 || page >= s.num_pages) continue;  // the error under test: nothing lives there
      const int32_t t = (int32_t)(ci % P);
      for (int32_t h = 0; h < c.num_kv_heads; ++h)
        for (int isv = 0; isv < 2; ++isv) {
          const int32_t bits = isv ? c.v_bits : c.k_bits;
          const int64_t sec = page * pb + fmkv_section_offset(d, c.k_bits, c.v_bits, P, h, isv, c.scale_group);
          std::vector<std::pair<int64_t, int>> spans;  // (byte offset, bytes)
          if (bits == FMKV_FP16_BITS) {
            spans.push_back({sec + (int64_t)t * d * 2, d * 2});
          } else {
            for (int32_t g = 0; g < G; ++g) {
              for (int32_t w = 0; w < bits; ++w) spans.push_back({sec + 4 * fmkv_code_word_index(bits, P, g, w, t), 4});
              spans.push_back({sec + fmkv_scales_offset(d, bits, P) + 2 * ((int64_t)g * P + t), 2});
            }
          }
          for (auto [off, n] : spans)
            if (std::memcmp(a.data() + off, b.data() + off, n) != 0)
              return ::testing::AssertionFailure() << "sequence " << q << " compressed token " << ci << " head " << h
                                                   << (isv ? " V" : " K") << " changed";
        }
    }
  }
  return ::testing::AssertionSuccess();
}

// After a failed op: every visible compressed token (visible_pages_equal) and both fp16 regions
// hold the bytes of s, the state before the op.
inline void expect_visible_unchanged(const Scenario& s, const LayerState& after, const char* what) {
  EXPECT_TRUE(visible_pages_equal(s, after.pages, s.pages)) << what;
  EXPECT_TRUE(after.fp16_k == s.fp16_k) << "fp16 K region modified by " << what;
  EXPECT_TRUE(after.fp16_v == s.fp16_v) << "fp16 V region modified by " << what;
}

struct CudaCase {
  fmkv_config c;
  Scenario s;
  std::vector<uint8_t> k, v;
  fmkv_tensor kt, vt;
  CudaCase(int sink = 0, int window = 0, int64_t rows = 2, int k_bits = 3) {
    c = config(128, k_bits, 3, 2, 16, sink, window);
    s = make_scenario(c, {20}, {rows});
    k = random_tensor(FMKV_F16, rows, 2, 128);
    v = random_tensor(FMKV_F16, rows, 2, 128);
    kt = make_tensor(k.data(), FMKV_F16, rows, 2, 128);
    vt = make_tensor(v.data(), FMKV_F16, rows, 2, 128);
  }
  // Append on the device; returns (status of synchronize, message); checks the cache is unchanged
  // on failure.
  std::pair<fmkv_status, std::string> append() {
    DeviceLayer L(kCuda, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
    DeviceTensor kd(kCuda, kt), vd(kCuda, vt);
    fmkv_status st = fmkv_append(kCuda, &c, &L.lc, &L.bt, &kd.t, &vd.t, nullptr);
    EXPECT_EQ(st, FMKV_OK) << fmkv_last_error();
    st = fmkv_device_synchronize(kCuda);
    std::string msg = fmkv_last_error();
    if (st != FMKV_OK) expect_visible_unchanged(s, L.state(s), "a failed append");
    return {st, msg};
  }
};

class CudaErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fmkv_backend_available(kCuda)) GTEST_SKIP() << "no usable CUDA device";
  }
};

#define EXPECT_CUDA_ERR(expr, code, needle)                                               \
  do {                                                                                    \
    auto r_ = (expr);                                                                     \
    EXPECT_EQ(r_.first, code) << r_.second;                                               \
    EXPECT_NE(r_.second.find(needle), std::string::npos) << "message: " << r_.second;     \
  } while (0)

TEST_F(CudaErrors, BlockTableEntryOutOfRange) {
  { CudaCase f; f.s.table[1] = (int32_t)f.s.num_pages; EXPECT_CUDA_ERR(f.append(), FMKV_ERR_OUT_OF_RANGE, "block_table[1]"); }
  { CudaCase f; f.s.table[1] = -1; EXPECT_CUDA_ERR(f.append(), FMKV_ERR_OUT_OF_RANGE, "block_table[1] = -1"); }
  { CudaCase f; f.s.table_stride = 1; EXPECT_CUDA_ERR(f.append(), FMKV_ERR_OUT_OF_RANGE, "block_table_stride"); }
  { CudaCase f; f.s.lens[0] = -3; EXPECT_CUDA_ERR(f.append(), FMKV_ERR_INVALID_ARGUMENT, "negative length"); }
  // the error was consumed: a valid call succeeds again
  { CudaCase f; EXPECT_EQ(f.append().first, FMKV_OK); }
}

TEST_F(CudaErrors, SlotOutOfRange) {
  CudaCase f(4, 8);
  f.s.slots[0] = 5;
  EXPECT_CUDA_ERR(f.append(), FMKV_ERR_OUT_OF_RANGE, "slot 5");
}

TEST_F(CudaErrors, NonFiniteInput) {
  // a compressed row (found by the quantizer on the rotated values)
  CudaCase f;
  ((uint16_t*)f.v.data())[300] = 0x7E00;
  EXPECT_CUDA_ERR(f.append(), FMKV_ERR_NON_FINITE, "v[1][0][44]");
  CudaCase g;
  EXPECT_EQ(g.append().first, FMKV_OK);
  // a row going to the fp16 window (checked before the window is written)
  CudaCase w(0, 8);
  ((uint16_t*)w.k.data())[300] = 0x7C00;
  EXPECT_CUDA_ERR(w.append(), FMKV_ERR_NON_FINITE, "k[1][0][44]");
  // rows 0..3 compressed directly (with the 8 ring tokens they push out), 4..11 to the window: a bad
  // compressed row leaves the window unwritten
  CudaCase m(2, 8, 12);
  ((uint16_t*)m.k.data())[2 * 256 + 128 + 7] = 0xFC00;
  EXPECT_CUDA_ERR(m.append(), FMKV_ERR_NON_FINITE, "k[2][1][7]");
  // a bad row in the window, with compressed rows before it
  CudaCase n(2, 8, 12);
  ((uint16_t*)n.v.data())[10 * 256 + 3] = 0x7E01;
  EXPECT_CUDA_ERR(n.append(), FMKV_ERR_NON_FINITE, "v[10][0][3]");
  CudaCase ok(2, 8, 12);
  EXPECT_EQ(ok.append().first, FMKV_OK);
  // K kept in fp16 (k_bits 16): copied, not rotated, checked chunk by chunk
  CudaCase k16(0, 0, 2, 16);
  ((uint16_t*)k16.k.data())[300] = 0x7C00;
  EXPECT_CUDA_ERR(k16.append(), FMKV_ERR_NON_FINITE, "k[1][0][44]");
  CudaCase k16ok(0, 0, 2, 16);
  EXPECT_EQ(k16ok.append().first, FMKV_OK);
}

// The fused decode step (fmkv_append_attention) on the device: k, v (2 kv heads) and q (8 q heads) of
// 1..n rows appended after `cached` tokens and attended. A bad input of the sequence (any row, any
// head, any tensor, or any block-table entry up to the new end) fails the step with the element named,
// and every CTA of the sequence takes the same decision: the visible cache is unchanged, including
// the fp16 sink / window rows a good step would have rewritten (the step's compressed token slots, at
// or past the compressed length, may have been written: FORMAT.md section 2).
struct FusedCase {
  fmkv_config c;
  Scenario s;
  std::vector<uint8_t> k, v, q;
  fmkv_dtype dt;
  FusedCase(int sink, int window, int64_t rows, fmkv_dtype dtype = FMKV_F16, int64_t cached = 20) : dt(dtype) {
    c = config(128, 3, 3, 2, 16, sink, window);
    int64_t added = 0;
    s = filled_scenario(c, {cached}, {rows}, FMKV_F16, &added);
    k = random_tensor(dt, rows, 2, 128);
    v = random_tensor(dt, rows, 2, 128);
    q = random_tensor(dt, rows, 8, 128);
  }
  void set(std::vector<uint8_t>& t, size_t i, uint32_t bits) {
    if (dt == FMKV_F32) std::memcpy(t.data() + 4 * i, &bits, 4);
    else reinterpret_cast<uint16_t*>(t.data())[i] = (uint16_t)bits;
  }
  std::pair<fmkv_status, std::string> step() {
    const int64_t rows = s.rows[0];
    fmkv_tensor kt = make_tensor(k.data(), dt, rows, 2, 128), vt = make_tensor(v.data(), dt, rows, 2, 128),
                qt = make_tensor(q.data(), dt, rows, 8, 128);
    DeviceLayer L(kCuda, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
    DeviceTensor kd(kCuda, kt), vd(kCuda, vt), qd(kCuda, qt);
    DeviceOutput o(kCuda, qt, FMKV_F32);
    const int64_t ws = fmkv_attention_workspace_bytes(kCuda, &c, 8, rows, 1, s.lens[0] + rows);
    DeviceBuf work(kCuda, (size_t)ws + 16);
    fmkv_attention_opts opts{0.0f, 0.0f, 0};
    fmkv_status st = fmkv_append_attention(kCuda, &c, &L.lc, &L.bt, &kd.t, &vd.t, &qd.t, &opts, &o.t, work.p, (size_t)ws, nullptr);
    EXPECT_EQ(st, FMKV_OK) << fmkv_last_error();
    st = fmkv_device_synchronize(kCuda);
    std::string msg = fmkv_last_error();
    LayerState after = L.state(s);
    if (st != FMKV_OK) {
      expect_visible_unchanged(s, after, "a failed fused step");
    } else {
      auto out = o.as_f32();
      for (float x : out) EXPECT_TRUE(std::isfinite(x)) << "output not written";
    }
    return {st, msg};
  }
};

TEST_F(CudaErrors, FusedStepErrors) {
  { FusedCase f(0, 0, 1); EXPECT_EQ(f.step().first, FMKV_OK); }
  { FusedCase f(2, 8, 3); EXPECT_EQ(f.step().first, FMKV_OK); }
  // decode row compressed directly (no window): NaN in k of kv head 1
  { FusedCase f(0, 0, 1); f.set(f.k, 128 + 5, 0x7E00); EXPECT_CUDA_ERR(f.step(), FMKV_ERR_NON_FINITE, "k[0][1][5]"); }
  // Inf in v; a row bound for the window: the ring rows of both kv heads stay as they were
  { FusedCase f(2, 8, 3); f.set(f.v, 2 * 256 + 77, 0xFC00); EXPECT_CUDA_ERR(f.step(), FMKV_ERR_NON_FINITE, "v[2][0][77]"); }
  // NaN in q of the second kv head's group: kv head 0's CTA must not write its ring either
  { FusedCase f(2, 8, 3); f.set(f.q, 1 * 1024 + 6 * 128 + 100, 0x7E00); EXPECT_CUDA_ERR(f.step(), FMKV_ERR_NON_FINITE, "q[1][6][100]"); }
  // bf16 beyond the fp16 range (65536) in k; f32 NaN in q (q is not limited to the fp16 range)
  { FusedCase f(0, 4, 2, FMKV_BF16); f.set(f.k, 256 + 3, 0x4780); EXPECT_CUDA_ERR(f.step(), FMKV_ERR_NON_FINITE, "k[1][0][3]"); }
  { FusedCase f(0, 4, 2, FMKV_BF16); f.set(f.q, 1000, 0x4780); EXPECT_EQ(f.step().first, FMKV_OK); }
  { FusedCase f(0, 4, 2, FMKV_F32); f.set(f.q, 1024 + 9, 0x7FC00000u); EXPECT_CUDA_ERR(f.step(), FMKV_ERR_NON_FINITE, "q[1][0][9]"); }
  { FusedCase f(0, 4, 2, FMKV_F32); f.set(f.k, 17, 0x477FE000u); EXPECT_EQ(f.step().first, FMKV_OK); }  // 65504
  { FusedCase f(0, 4, 2, FMKV_F32); f.set(f.k, 17, 0x477FF000u); EXPECT_CUDA_ERR(f.step(), FMKV_ERR_NON_FINITE, "k[0][0][17]"); }  // 65520
  // a block-table entry of an earlier page (the step writes page 2), with and without a window; the
  // page the step writes
  { FusedCase f(0, 0, 1, FMKV_F16, 40); f.s.table[0] = (int32_t)f.s.num_pages; EXPECT_CUDA_ERR(f.step(), FMKV_ERR_OUT_OF_RANGE, "block_table[0]"); }
  { FusedCase f(2, 4, 1, FMKV_F16, 44); f.s.table[1] = -2; EXPECT_CUDA_ERR(f.step(), FMKV_ERR_OUT_OF_RANGE, "block_table[1] = -2"); }
  { FusedCase f(0, 0, 1, FMKV_F16, 40); f.s.table[2] = -1; EXPECT_CUDA_ERR(f.step(), FMKV_ERR_OUT_OF_RANGE, "block_table[2] = -1"); }
  // the error was consumed: a valid step succeeds again
  { FusedCase f(0, 0, 1); EXPECT_EQ(f.step().first, FMKV_OK); }
}

TEST_F(CudaErrors, AttentionErrors) {
  fmkv_config c = config(128, 3, 3, 2, 16);
  Scenario s = make_scenario(c, {20}, {2});
  auto kb = random_tensor(FMKV_F16, 22, 2, 128), vb = random_tensor(FMKV_F16, 22, 2, 128);
  Scenario fill = s;
  fill.lens = {0};
  fill.rows = {22};
  LayerState st = run_append(FMKV_BACKEND_REF, fill, make_tensor(kb.data(), FMKV_F16, 22, 2, 128),
                             make_tensor(vb.data(), FMKV_F16, 22, 2, 128));
  auto qb = random_tensor(FMKV_F32, 2, 6, 128);
  fmkv_tensor q = make_tensor(qb.data(), FMKV_F32, 2, 6, 128);
  // valid call works
  auto out = run_attention(kCuda, s, st, q, FMKV_F32);
  auto want = run_attention(FMKV_BACKEND_REF, s, st, q, FMKV_F32);
  EXPECT_LT(rel_error(out, want), 4e-3);
  // bad block table entry: detected on the device
  Scenario bad = s;
  bad.table[0] = (int32_t)s.num_pages + 7;
  EXPECT_THROW(run_attention(kCuda, bad, st, q, FMKV_F32), Error);
  EXPECT_NE(std::string(fmkv_last_error()).find("block_table[0]"), std::string::npos) << fmkv_last_error();
  // more query rows than cached tokens
  Scenario few = s;
  few.lens = {-1};  // run_attention adds the 2 query rows: 1 token cached
  EXPECT_THROW(run_attention(kCuda, few, st, q, FMKV_F32), Error);
  EXPECT_NE(std::string(fmkv_last_error()).find("append first"), std::string::npos) << fmkv_last_error();
  // NaN in q
  ((float*)qb.data())[7] = NAN;
  EXPECT_THROW(run_attention(kCuda, s, st, q, FMKV_F32), Error);
  EXPECT_NE(std::string(fmkv_last_error()).find("q[0][0][7]"), std::string::npos) << fmkv_last_error();
  ((float*)qb.data())[7] = 0.5f;
  auto again = run_attention(kCuda, s, st, q, FMKV_F32);
  EXPECT_TRUE(std::isfinite(again[0]));
  // a sequence longer than opts.max_seq_len: detected on the device; the exact bound works
  const int64_t longest = max_length_after(s);
  EXPECT_THROW(run_attention(kCuda, s, st, q, FMKV_F32, {0.0f, 0.0f, longest - 1}), Error);
  EXPECT_NE(std::string(fmkv_last_error()).find("more than opts.max_seq_len = " + std::to_string(longest - 1)),
            std::string::npos) << fmkv_last_error();
  EXPECT_LT(rel_error(run_attention(kCuda, s, st, q, FMKV_F32, {0.0f, 0.0f, longest}),
                      run_attention(FMKV_BACKEND_REF, s, st, q, FMKV_F32)), 4e-3);  // (q changed above)
}

// A device batch of one sequence of `len` tokens over a one-page pool: the page, the given block table,
// the length and the row offsets (0, q_rows), as the batch-level tests below need them.
struct OneSequenceOnDevice {
  DeviceBuf pages, tab, lens, offs;
  fmkv_layer_cache lc;
  fmkv_batch bt;
  OneSequenceOnDevice(const fmkv_config& c, const std::vector<int32_t>& table, int64_t len, int64_t q_rows)
      : pages(kCuda, (size_t)fmkv_config_page_bytes(&c)),
        tab(kCuda, table.size() * 4),
        lens(kCuda, 8),
        offs(kCuda, 16) {
    tab.upload(table);
    lens.upload(std::vector<int64_t>{len});
    offs.upload(std::vector<int64_t>{0, q_rows});
    lc = fmkv_layer_cache{(uint8_t*)pages.p, 1, nullptr, nullptr, 1, 0};
    bt = fmkv_batch{1, nullptr, (const int64_t*)lens.p, (const int64_t*)offs.p, (const int32_t*)tab.p,
                    (int64_t)table.size()};
  }
};

// A split of more than 2^30 compressed tokens (the tile loop's 32-bit token offsets): a workspace with
// room for one split and a sequence of 2^30 + 32 tokens, every block-table entry page 0 (the check comes
// before any page is read, so one page serves). Fails loudly on the device; the output stays poisoned.
TEST_F(CudaErrors, AttentionSplitSpan) {
  fmkv_config c = config(128, 3, 3, 2, 256);
  const int64_t len = (int64_t(1) << 30) + 32, pages_needed = (len + 255) / 256;
  OneSequenceOnDevice seq(c, std::vector<int32_t>((size_t)pages_needed, 0), len, 1);
  auto qb = random_tensor(FMKV_F16, 1, 8, 128);
  DeviceTensor qd(kCuda, make_tensor(qb.data(), FMKV_F16, 1, 8, 128));
  DeviceOutput o(kCuda, qd.t, FMKV_F32);
  // one split: (m, l) of 3 parts (the split + 2 raw-domain slots) x 8 q heads, 256-aligned, then their
  // 128 floats each
  const size_t ws = 256 + 3 * 8 * 128 * 4;
  DeviceBuf work(kCuda, ws);
  fmkv_attention_opts opts{0.0f, 0.0f, 0};
  ASSERT_EQ(fmkv_attention(kCuda, &c, &seq.lc, &seq.bt, &qd.t, &opts, &o.t, work.p, ws, nullptr), FMKV_OK) << fmkv_last_error();
  EXPECT_EQ(fmkv_device_synchronize(kCuda), FMKV_ERR_OVERFLOW);
  const std::string msg = fmkv_last_error();
  EXPECT_NE(msg.find("1073741856 compressed tokens over 1 splits"), std::string::npos) << msg;
  for (float x : o.as_f32()) ASSERT_TRUE(std::isnan(x)) << "output written despite the error";
  // the workspace the library asks for leaves room for more splits (64 at this batch shape)
  const int64_t wsf = fmkv_attention_workspace_bytes(kCuda, &c, 8, 1, 1, len);
  EXPECT_GT(wsf, (int64_t)ws);
}

TEST_F(CudaErrors, AppendTaskCountOverflow) {
  // more rows x kv heads than compress's 32-bit task count: rejected on the host before any launch
  // (nothing is read: a small buffer stands in for the 2^31 + 16 rows)
  fmkv_config c = config(256, 3, 3, 8, 16);
  const int64_t rows = (int64_t(1) << 31) + 16;  // (2^28 + 2) warp tasks of 8 rows x 2 x 8 heads = 2^32 + 32
  OneSequenceOnDevice seq(c, {0}, 0, rows);
  DeviceBuf data(kCuda, 4096);
  const fmkv_tensor kt{data.p, FMKV_F16, rows, 8, 256, 8 * 256, 256};
  EXPECT_EQ(fmkv_append(kCuda, &c, &seq.lc, &seq.bt, &kt, &kt, nullptr), FMKV_ERR_OVERFLOW) << fmkv_last_error();
  const std::string msg = fmkv_last_error();
  EXPECT_NE(msg.find("4294967328 quantizer tasks, more than 2^32 - 1 in one call"), std::string::npos) << msg;
  EXPECT_EQ(fmkv_device_synchronize(kCuda), FMKV_OK) << fmkv_last_error();  // nothing was launched
}

}  // namespace
}  // namespace fmkv::test
