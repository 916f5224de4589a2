// Golden vectors of format v2 (tests/golden/v2.txt), v3 (tests/golden/v3.txt), v3 with scale group 64
// (tests/golden/v3_scale_group64.txt) and v3 with 5-bit codes (tests/golden/v3_code_width5.txt): inputs -> page bytes ->
// dequantized values -> attention output. Every backend must reproduce the bytes bit-exactly and the output within its stated bound
// (at least 1e-5: the file stores the output in float32).
// Cases and inputs: tests/golden_cases.h (splitmix64, not <random>: the files are platform independent).
// A backend that does not read and write a version, scale group or code width refuses its cases (FMKV_ERR_UNSUPPORTED).
// Regenerate (only with a format version change): FMKV_WRITE_GOLDEN=1 fmkv_tests --gtest_filter=Golden.*
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/backend.h"
#include "format/rotation.h"
#include "golden_cases.h"
#include "harness.h"

namespace fmkv::test {
namespace {

std::string hex(const void* p, size_t n) {
  std::string s;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, 3, "%02x", ((const uint8_t*)p)[i]);
    s += b;
  }
  return s;
}

struct Produced {
  std::string pages, fp16;
  std::vector<float> out;
};

Produced produce(fmkv_backend b, const GoldenCase& g, int idx, int32_t version) {
  const fmkv_config c = golden_config(g, idx, version);
  Scenario s;
  s.cfg = c;
  s.layer = idx;
  s.lens = {0};
  s.rows = {g.tokens};
  s.table_stride = (int64_t)kGoldenTable.size();
  s.table = kGoldenTable;
  s.slots = {0};
  s.num_pages = kGoldenPages;
  s.pages.assign((size_t)(kGoldenPages * fmkv_config_page_bytes(&c)), 0xA5);
  s.fp16_k.assign((size_t)fmkv_config_fp16_slot_bytes(&c) / 4, 0x7E00);
  s.fp16_v = s.fp16_k;
  auto k = golden_values(100 + idx, (size_t)g.tokens * g.d), v = golden_values(200 + idx, (size_t)g.tokens * g.d);
  auto q = golden_values(300 + idx, (size_t)2 * g.d);
  LayerState st = run_append(b, s, make_tensor(k.data(), FMKV_F16, g.tokens, 1, g.d), make_tensor(v.data(), FMKV_F16, g.tokens, 1, g.d));
  Scenario qs = s;
  qs.lens = {g.tokens - 1};
  qs.rows = {1};
  Produced p;
  p.pages = hex(st.pages.data(), st.pages.size());
  p.fp16 = hex(st.fp16_k.data(), st.fp16_k.size() * 2) + hex(st.fp16_v.data(), st.fp16_v.size() * 2);
  p.out = run_attention(b, qs, st, make_tensor(q.data(), FMKV_F16, 1, 2, g.d), FMKV_F32);
  return p;
}

std::string golden_path(int32_t version, const char* tag) {
  return std::string(FMKV_SOURCE_DIR) + "/tests/golden/v" + std::to_string(version) + tag + ".txt";
}

std::vector<std::string> read_golden(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);)
    if (!l.empty() && l[0] != '#') lines.push_back(l);
  return lines;
}

void golden_cases(int32_t version, const std::vector<GoldenCase>& cases, const char* tag = "") {
  const std::string path = golden_path(version, tag);
  if (std::getenv("FMKV_WRITE_GOLDEN")) {
    std::ofstream f(path);
    f << "# fmkv format v" << version << tag << " golden vectors: per case the config, page bytes (hex), fp16 sink/window\n"
         "# bytes (hex), attention output (float32 bits, hex). Inputs: tests/test_golden.cpp.\n";
    for (int i = 0; i < (int)cases.size(); ++i) {
      const GoldenCase& g = cases[i];
      Produced p = produce(FMKV_BACKEND_REF, g, i, version);
      f << "case d=" << g.d << " k" << g.kb << "v" << g.vb << " page=" << g.page << " sink=" << g.sink
        << " window=" << g.window << " rule=" << g.rule << " tokens=" << g.tokens
        << (g.scale_group ? " scale_group=" + std::to_string(g.scale_group) : std::string()) << "\n";
      f << p.pages << "\n" << (p.fp16.empty() ? "-" : p.fp16) << "\n" << hex(p.out.data(), p.out.size() * 4) << "\n";
    }
    GTEST_SKIP() << "wrote " << path;
  }
  std::vector<std::string> lines = read_golden(path);
  const int n = (int)cases.size();
  ASSERT_EQ((int)lines.size(), 4 * n) << "golden file missing or malformed: " << path;
  for (int bi = 0; bi < FMKV_BACKEND_COUNT; ++bi) {
    const fmkv_backend b = (fmkv_backend)bi;
    if (!fmkv_backend_available(b)) continue;
    for (int i = 0; i < n; ++i) {
      Produced p;
      try {
        p = produce(b, cases[i], i, version);
      } catch (const fmkv::Error& e) {
        if (version > find_backend(b)->max_format_version) {  // refused, naming the version
          EXPECT_EQ(e.code(), FMKV_ERR_UNSUPPORTED) << e.what();
          EXPECT_NE(std::string(e.what()).find("format version " + std::to_string(version)), std::string::npos) << e.what();
          continue;
        }
        if (fmkv_resolved_scale_group(cases[i].scale_group) > find_backend(b)->max_scale_group) {  // refused, naming it
          EXPECT_EQ(e.code(), FMKV_ERR_UNSUPPORTED) << e.what();
          EXPECT_NE(std::string(e.what()).find("scale_group " + std::to_string(cases[i].scale_group)), std::string::npos) << e.what();
          continue;
        }
        if (std::max(cases[i].kb == FMKV_FP16_BITS ? 0 : cases[i].kb, cases[i].vb) > find_backend(b)->max_code_bits) {
          EXPECT_EQ(e.code(), FMKV_ERR_UNSUPPORTED) << e.what();  // refused, naming the width
          EXPECT_NE(std::string(e.what()).find("code width 5"), std::string::npos) << e.what();
          continue;
        }
        if (!cuda_combination_not_compiled(b, e, cases[i].d, cases[i].kb, cases[i].vb, version >= 3)) throw;
        std::printf("[ note ] %s: not compiled in this build (FMKV_CUDA_FULL_GRID=OFF)\n", lines[4 * i].c_str());
        continue;
      }
      EXPECT_LE(version, find_backend(b)->max_format_version) << fmkv_backend_name(b) << " ran a version it does not support";
      EXPECT_LE(fmkv_resolved_scale_group(cases[i].scale_group), find_backend(b)->max_scale_group)
          << fmkv_backend_name(b) << " ran a scale group it does not support";
      EXPECT_LE(std::max(cases[i].kb == FMKV_FP16_BITS ? 0 : cases[i].kb, cases[i].vb), find_backend(b)->max_code_bits)
          << fmkv_backend_name(b) << " ran a code width it does not support";
      EXPECT_EQ(p.pages, lines[4 * i + 1]) << fmkv_backend_name(b) << ": " << lines[4 * i];
      EXPECT_EQ(p.fp16.empty() ? "-" : p.fp16, lines[4 * i + 2]) << fmkv_backend_name(b) << ": " << lines[4 * i];
      std::vector<float> want(p.out.size());
      const std::string& h = lines[4 * i + 3];
      ASSERT_EQ(h.size(), want.size() * 8);
      for (size_t j = 0; j < want.size(); ++j) {
        uint8_t bytes[4];
        for (int k = 0; k < 4; ++k) bytes[k] = (uint8_t)std::stoul(h.substr(j * 8 + k * 2, 2), nullptr, 16);
        std::memcpy(&want[j], bytes, 4);
      }
      EXPECT_LT(rel_error(p.out, want), std::max(1e-5, find_backend(b)->attention_rel_error)) << fmkv_backend_name(b) << ": " << lines[4 * i];
    }
  }
}

TEST(Golden, ReproducedByEveryBackend) { golden_cases(2, kCasesV2); }
TEST(Golden, Version3ReproducedOrRefused) { golden_cases(3, kCasesV3); }
TEST(Golden, ScaleGroup64ReproducedOrRefused) { golden_cases(3, kCasesScaleGroup64, "_scale_group64"); }
TEST(Golden, CodeWidth5ReproducedOrRefused) { golden_cases(3, kCasesCodeWidth5, "_code_width5"); }

}  // namespace
}  // namespace fmkv::test
