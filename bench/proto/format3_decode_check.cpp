// Correctness of the format-3 candidate in the real CUDA decode loop (bench/proto/format3_decode_loop.patch:
// with it applied, every k3v3 kernel reads the code regions of a page as format-3 tile blocks). Writes pages
// in that layout on the host (random 3-bit codes, fp16 scales in the format-2 scale rows), runs fmkv_attention
// on CUDA through the public C API over several sequences, page sizes and GQA groups, and compares each output
// (poisoned first) with a float64 attention over the same dequantized values (the rotation from the format
// core). Prints one JSON line per case; exit 1 if an error exceeds the bound.
//
//   (on the device, after tests/cuda/ab.sh built the patched tree as variant f3 in /tmp/ab_f3)
//   nvcc -O2 -std=c++17 -I /tmp/ab_src_f3/include -I /tmp/ab_src_f3/src bench/proto/format3_decode_check.cpp
//        /tmp/ab_f3/libfmkv.a -o /tmp/f3check && /tmp/f3check
// It first checks, without a GPU, the host writer against a model of the kernel's fragment decode (the
// patch's f3_k_fragment / f3_v_fragment with a host prmt, read with the mma fragment layouts of the PTX ISA);
// `--host-only` (the ctest, where the library is unpatched) stops there.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "fmkv/fmkv.h"
#include "format/pack.h"
#include "format/rotation.h"
#include "prmt_host.h"

namespace {

constexpr int kLevelsK[8] = {-88, -55, -31, -10, 10, 31, 55, 88};  // the kernel's int8 K table
constexpr int kLevelsV[8] = {-64, -40, -24, -8, 8, 24, 40, 64};    // the kernel's V table (fp16 high bytes)

// One section (K or V) of one 16-token tile of one kv head: the code block X[lane][G], Y[lane][G], written
// through the format core (format 3's tile blocks, tile_put_code); X and Y read as the kernel's fragment decode
// reads them.
struct TileWriter {
  uint8_t* block;  // the tile's code block (64 G 3 bytes)
  int G;
  uint32_t X(int lane, int g) const { return *reinterpret_cast<const uint32_t*>(block + 4 * (G * lane + g)); }
  uint16_t Y(int lane, int g) const { return *reinterpret_cast<const uint16_t*>(block + 128 * G + 2 * (G * lane + g)); }
  // code of tile token t (0..15), group g, coordinate c (0..31)
  void put_k(int t, int g, int c, int code) { fmkv::tile_put_code(block, G, 0, t, g, c, (uint32_t)code); }
  void put_v(int t, int g, int c, int code) { fmkv::tile_put_code(block, G, 1, t, g, c, (uint32_t)code); }
};

uint32_t bit3(uint32_t X, uint32_t Y) { return ((X >> 3) & 0x1111u) | ((X >> 18) & 0x2222u) | ((Y >> 1) & 0x4444u); }

// One random tile per section through the writer, decoded as the kernel does; 0 mismatches expected.
long layout_self_check(std::mt19937_64& rng) {
  constexpr int G = 4;
  const uint32_t TK0 = 0xF6E1C9A8u, TK1 = 0x58371F0Au, TV0 = 0xC8CED1D4u, TV1 = 0x54514E48u;
  long bad = 0;
  for (int it = 0; it < 64; ++it) {
    std::vector<uint8_t> blk(64 * G * 3, 0);
    TileWriter w{blk.data(), G};
    int ck[16][G][32], cv[16][G][32];
    for (int sv = 0; sv < 2; ++sv) {
      std::fill(blk.begin(), blk.end(), 0);
      for (int t = 0; t < 16; ++t)
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 32; ++c) {
            const int cd = (int)(rng() & 7u);
            if (sv) cv[t][g][c] = cd, w.put_v(t, g, c, cd);
            else ck[t][g][c] = cd, w.put_k(t, g, c, cd);
          }
      for (int lane = 0; lane < 32; ++lane)
        for (int g = 0; g < G; ++g) {
          const int gID = lane / 4, tid = lane % 4;
          const uint32_t X = w.X(lane, g), Y = w.Y(lane, g);
          if (!sv) {  // m16n8k32 s8 A: a0 (row gID, k 4 tid + e), a1 (row gID + 8), a2 / a3: k + 16
            const uint32_t a[4] = {prmt_host(TK0, TK1, X & 0x7777u), prmt_host(TK0, TK1, Y & 0x7777u),
                                   prmt_host(TK0, TK1, (X >> 16) & 0x7777u), prmt_host(TK0, TK1, bit3(X, Y))};
            for (int i = 0; i < 4; ++i)
              for (int e = 0; e < 4; ++e) {
                const int t = 2 * gID + (i & 1), c = 4 * tid + e + 16 * (i >> 1);
                bad += (int8_t)(a[i] >> (8 * e)) != kLevelsK[ck[t][g][c]];
              }
          } else {  // m16n8k16 f16 A of mma mt: a0 (row gID, k 2 tid + h), a1 (row gID + 8), a2 / a3: k + 8
            const uint32_t z = 0x0C0Cu, gg = bit3(X, Y);
            auto pair = [&](uint32_t v) { return prmt_host(TV0, TV1, (v & 0x7070u) | z); };
            const uint32_t a[8] = {pair(X << 4), pair(X), pair(X >> 12), pair(X >> 16),
                                   pair(Y << 4), pair(Y), pair(gg << 4), pair(gg)};
            for (int i = 0; i < 8; ++i)
              for (int h = 0; h < 2; ++h) {
                const int mt = i / 4, r = i % 4, c = 16 * mt + gID + 8 * (r & 1), k = 2 * tid + 8 * (r >> 1) + h;
                const int t = k < 8 ? 2 * k : 2 * (k - 8) + 1;
                const uint16_t hv = (uint16_t)(a[i] >> (16 * h));
                float f;
                fmkv_f16_to_f32(&hv, &f, 1);
                bad += f != (float)kLevelsV[cv[t][g][c]];
              }
          }
        }
    }
  }
  return bad;
}

struct Case {
  int page, kv_heads, gq;
  std::vector<int64_t> lens;
};

bool ok(fmkv_status s, const char* what) {
  if (s == FMKV_OK) return true;
  std::fprintf(stderr, "%s: %s\n", what, fmkv_last_error());
  return false;
}

// returns the relative error (||out - ref|| / ||ref||, +inf on failure)
double run_case(const Case& cs, std::mt19937_64& rng) {
  constexpr int D = 128, G = D / 32;
  const fmkv_backend be = FMKV_BACKEND_CUDA;
  fmkv_config cfg;
  fmkv_config_default(&cfg);
  cfg.head_dim = D;
  cfg.num_kv_heads = cs.kv_heads;
  cfg.k_bits = 3;
  cfg.v_bits = 3;
  cfg.page_size = cs.page;
  cfg.seed = rng();
  const int P = cs.page, H = cs.kv_heads, HQ = H * cs.gq, B = (int)cs.lens.size();
  const int64_t pb = fmkv_config_page_bytes(&cfg);
  int64_t maxp = 0, npages = 0;
  for (int64_t L : cs.lens) {
    maxp = std::max<int64_t>(maxp, (L + P - 1) / P);
    npages += (L + P - 1) / P;
  }
  // block table: a random permutation of the pages
  std::vector<int32_t> perm(npages);
  for (int64_t i = 0; i < npages; ++i) perm[i] = (int32_t)i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> bt((size_t)B * maxp, 0);
  {
    int64_t k = 0;
    for (int s = 0; s < B; ++s)
      for (int64_t j = 0; j < (cs.lens[s] + P - 1) / P; ++j) bt[s * maxp + j] = perm[k++];
  }
  std::vector<uint8_t> pages((size_t)(npages * pb), 0);
  std::uniform_int_distribution<int> code(0, 7);
  std::uniform_real_distribution<float> ks_d(0.004f, 0.02f), vs_d(0.01f, 0.04f), qd(-1.0f, 1.0f);
  // dequantized values in the rotated domain, [s][h][t][D]
  std::vector<std::vector<double>> kval(B * H), vval(B * H);
  for (int s = 0; s < B; ++s)
    for (int h = 0; h < H; ++h) {
      const int64_t L = cs.lens[s];
      kval[s * H + h].assign((size_t)L * D, 0.0);
      vval[s * H + h].assign((size_t)L * D, 0.0);
      for (int64_t t = 0; t < L; ++t) {
        uint8_t* page = pages.data() + (int64_t)bt[s * maxp + t / P] * pb;
        const int slot = (int)(t % P), tile = slot / 16, tt = slot % 16;
        for (int sv = 0; sv < 2; ++sv) {
          uint8_t* sect = page + fmkv_section_offset(D, 3, 3, P, h, sv);
          TileWriter w{sect + tile * 64 * G * 3, G};
          for (int g = 0; g < G; ++g) {
            uint16_t sc;
            const float f = sv ? vs_d(rng) : ks_d(rng);
            fmkv_f32_to_f16(&f, &sc, 1);
            *reinterpret_cast<uint16_t*>(sect + fmkv_scales_offset(D, 3, P) + ((int64_t)g * P + slot) * 2) = sc;
            float scf;
            fmkv_f16_to_f32(&sc, &scf, 1);
            for (int c = 0; c < 32; ++c) {
              const int cd = code(rng);
              if (sv) {
                w.put_v(tt, g, c, cd);
                vval[s * H + h][t * D + 32 * g + c] = (double)scf * kLevelsV[cd];
              } else {
                w.put_k(tt, g, c, cd);
                kval[s * H + h][t * D + 32 * g + c] = (double)scf * kLevelsK[cd];
              }
            }
          }
        }
      }
    }
  // queries: one row per sequence, fp32
  std::vector<float> q((size_t)B * HQ * D);
  for (auto& x : q) x = qd(rng);
  // float64 reference: q rotated (signs, FWHT, 1/sqrt(D)), softmax over the dequantized K, P V, rotated back
  uint64_t sw[FMKV_MAX_SIGN_WORDS] = {};
  fmkv::rotation_sign_words(cfg.seed, 0, D, sw);
  const double sm = 1.0 / std::sqrt((double)D), sqd = std::sqrt((double)D);
  std::vector<float> ref((size_t)B * HQ * D);
  for (int s = 0; s < B; ++s)
    for (int qh = 0; qh < HQ; ++qh) {
      const int h = qh / cs.gq;
      double qr[D];
      for (int i = 0; i < D; ++i) qr[i] = (fmkv::sign_negative(sw, i) ? -1.0 : 1.0) * q[(s * HQ + qh) * D + i];
      fmkv::fwht(qr, D);
      for (int i = 0; i < D; ++i) qr[i] /= sqd;
      const int64_t L = cs.lens[s];
      std::vector<double> sc(L);
      double mx = -1e300;
      for (int64_t t = 0; t < L; ++t) {
        double d = 0;
        for (int i = 0; i < D; ++i) d += qr[i] * kval[s * H + h][t * D + i];
        sc[t] = d * sm;
        mx = std::max(mx, sc[t]);
      }
      double l = 0, o[D] = {};
      for (int64_t t = 0; t < L; ++t) {
        const double p = std::exp(sc[t] - mx);
        l += p;
        for (int i = 0; i < D; ++i) o[i] += p * vval[s * H + h][t * D + i];
      }
      for (int i = 0; i < D; ++i) o[i] /= l;
      double x[D];
      fmkv::unrotate_exact(o, D, sw, sqd, x);
      for (int i = 0; i < D; ++i) ref[(s * HQ + qh) * D + i] = (float)x[i];
    }
  // device run
  uint8_t* d_pages = (uint8_t*)fmkv_device_alloc(be, pages.size());
  int32_t* d_bt = (int32_t*)fmkv_device_alloc(be, bt.size() * 4);
  std::vector<int64_t> ro(B + 1);
  for (int s = 0; s <= B; ++s) ro[s] = s;
  int64_t* d_lens = (int64_t*)fmkv_device_alloc(be, B * 8);
  int64_t* d_ro = (int64_t*)fmkv_device_alloc(be, (B + 1) * 8);
  int32_t* d_slots = (int32_t*)fmkv_device_alloc(be, B * 4);
  float* d_q = (float*)fmkv_device_alloc(be, q.size() * 4);
  float* d_out = (float*)fmkv_device_alloc(be, q.size() * 4);
  std::vector<int32_t> slots(B, 0);
  std::vector<float> poison(q.size(), NAN), out(q.size());
  bool good = ok(fmkv_device_copy(be, d_pages, pages.data(), pages.size(), 1), "copy") &&
              ok(fmkv_device_copy(be, d_bt, bt.data(), bt.size() * 4, 1), "copy") &&
              ok(fmkv_device_copy(be, d_lens, cs.lens.data(), B * 8, 1), "copy") &&
              ok(fmkv_device_copy(be, d_ro, ro.data(), (B + 1) * 8, 1), "copy") &&
              ok(fmkv_device_copy(be, d_slots, slots.data(), B * 4, 1), "copy") &&
              ok(fmkv_device_copy(be, d_q, q.data(), q.size() * 4, 1), "copy") &&
              ok(fmkv_device_copy(be, d_out, poison.data(), q.size() * 4, 1), "copy");
  fmkv_layer_cache layer{d_pages, npages, nullptr, nullptr, 1, 0};
  fmkv_batch batch{B, d_slots, d_lens, d_ro, d_bt, maxp};
  fmkv_tensor tq{d_q, FMKV_F32, B, HQ, D, (int64_t)HQ * D, D};
  fmkv_tensor to{d_out, FMKV_F32, B, HQ, D, (int64_t)HQ * D, D};
  fmkv_attention_opts opts{0.0f, 0.0f, 0};
  const int64_t wsb = fmkv_attention_workspace_bytes(be, &cfg, HQ, B, B, 0);
  void* ws = fmkv_device_alloc(be, (size_t)wsb);
  good = good && ok(fmkv_attention(be, &cfg, &layer, &batch, &tq, &opts, &to, ws, (size_t)wsb, nullptr), "attention") &&
         ok(fmkv_device_synchronize(be), "synchronize") && ok(fmkv_device_copy(be, out.data(), d_out, out.size() * 4, 0), "copy");
  for (void* p : {(void*)d_pages, (void*)d_bt, (void*)d_lens, (void*)d_ro, (void*)d_slots, (void*)d_q, (void*)d_out, ws})
    fmkv_device_free(be, p);
  if (!good) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += ((double)out[i] - ref[i]) * ((double)out[i] - ref[i]);
    den += (double)ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
  const bool host_only = argc > 1 && std::string(argv[1]) == "--host-only";  // ctest: no patched library
  std::mt19937_64 rng(2026);
  const long bad = layout_self_check(rng);
  std::printf("{\"suite\": \"format3_decode_check\", \"check\": \"host writer vs the kernel's fragment decode\", "
              "\"mismatches\": %ld, \"ok\": %s}\n", bad, bad == 0 ? "true" : "false");
  if (bad) return 1;
  if (host_only) return 0;
  if (!fmkv_backend_available(FMKV_BACKEND_CUDA)) {
    std::fprintf(stderr, "format3_decode_check: no CUDA backend: the host check only\n");
    return 0;
  }
  // the bound: fp16 P and V operands (2^-11 relative each) and the q16 query (2^-15 of max |q|), as format 2's
  // CUDA tests bound their fp16 operands
  const double bound = 5e-3;
  const Case cases[] = {{64, 2, 4, {1000, 5003}}, {16, 1, 8, {37, 4096}}, {256, 2, 5, {2050}}, {128, 3, 4, {16, 700, 33000}}};
  int fails = 0;
  for (const Case& cs : cases) {
    const double e = run_case(cs, rng);
    std::printf("{\"suite\": \"format3_decode_check\", \"page\": %d, \"kv_heads\": %d, \"gq\": %d, \"seqs\": %zu, "
                "\"max_len\": %lld, \"rel_error\": %.3e, \"bound\": %.0e, \"ok\": %s}\n",
                cs.page, cs.kv_heads, cs.gq, cs.lens.size(), (long long)*std::max_element(cs.lens.begin(), cs.lens.end()),
                e, bound, e <= bound ? "true" : "false");
    fails += !(e <= bound);
  }
  return fails ? 1 : 0;
}
