// The fmkv command on bad command lines: a table of arguments with the exit status and the message
// each must give (status 2, the usage line on stderr, nothing on stdout), a few good ones, and `inspect` on a
// snapshot file the test writes (then corrupts).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <random>
#include <vector>

#include "fmkv/io.hpp"

namespace {

struct Result {
  int status = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Runs the CLI with `args` (no shell), stdout and stderr captured separately.
Result run(const std::vector<std::string>& args) {
  char dir[] = "/tmp/fmkv-cli-test.XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  const std::string out = std::string(dir) + "/out", err = std::string(dir) + "/err";
  const pid_t pid = fork();
  if (pid == 0) {
    const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(o, 1);
    dup2(e, 2);
    std::vector<char*> argv{const_cast<char*>(FMKV_CLI)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(FMKV_CLI, argv.data());
    _exit(127);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  Result r;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.out = slurp(out);
  r.err = slurp(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  rmdir(dir);
  return r;
}

std::string joined(const std::vector<std::string>& args) {
  std::string s = "fmkv";
  for (const auto& a : args) s += " '" + a + "'";
  return s;
}

struct Bad {
  std::vector<std::string> args;
  const char* message;  // a regular expression the "fmkv: error: ..." line must match
};

const std::vector<std::string> kModel = {"--layers", "32", "--kv-heads", "8", "--head-dim", "128"};

std::vector<std::string> capacity(std::vector<std::string> extra, bool model = true) {
  std::vector<std::string> a = {"capacity"};
  if (model) a.insert(a.end(), kModel.begin(), kModel.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

const std::vector<Bad>& bad_table() {
  static const std::vector<Bad> t = {
      // sizes: finite decimal numbers with a unit, in range
      {capacity({"--memory", "1e400"}), R"(--memory: 1e400 is out of range \(expected 1 to 4611686018427387904 bytes\))"},
      {capacity({"--memory", "inf"}), R"(--memory: size 'inf' not understood)"},
      {capacity({"--memory", "nan"}), R"(--memory: size 'nan' not understood)"},
      {capacity({"--memory", "-nan"}), R"(--memory: size '-nan' not understood)"},
      {capacity({"--memory", "99999999999999999999GB"}), R"(--memory: 99999999999999999999GB is out of range)"},
      {capacity({"--memory", "-5GB"}), R"(--memory: size '-5GB' not understood)"},
      {capacity({"--memory", "0x10GB"}), R"(--memory: size '0x10GB' not understood)"},
      {capacity({"--memory", "141XB"}), R"(--memory: size '141XB' not understood)"},
      {capacity({"--memory", ""}), R"(--memory: size '' not understood)"},
      {capacity({"--memory", "0"}), R"(--memory: 0 is out of range)"},
      {capacity({"--memory", "141GB", "--weights", "1e30B"}), R"(--weights: 1e30B is out of range)"},
      {capacity({"--memory", "16GB", "--weights", "20GB"}), R"(--weights 20.00 GB leave nothing of --memory 16.00 GB)"},
      // integers: decimal, in range, never truncated or wrapped
      {{"capacity", "--layers", "4294967328", "--kv-heads", "8", "--head-dim", "128", "--memory", "141GB"},
       R"(--layers: 4294967328 is out of range \(expected 1 to 65536\))"},
      {{"capacity", "--layers", "99999999999999999999", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GB"},
       R"(--layers: 99999999999999999999 is out of range)"},
      {{"capacity", "--layers", "3.5", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GB"}, R"(--layers: '3.5' is not an integer)"},
      {{"capacity", "--layers", "+3", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GB"}, R"(--layers: '\+3' is not an integer)"},
      {{"capacity", "--layers", " 3", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GB"}, R"(--layers: ' 3' is not an integer)"},
      {{"capacity", "--layers", "0x20", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GB"}, R"(--layers: '0x20' is not an integer)"},
      {capacity({"--memory", "141GB", "--window", "99999999999"}), R"(--window: 99999999999 is out of range \(expected 0 to 1048576\))"},
      {capacity({"--memory", "141GB", "--sink", "-1"}), R"(--sink: -1 is out of range)"},
      {capacity({"--memory", "141GB", "--batch", "0"}), R"(--batch: 0 is out of range)"},
      {capacity({"--memory", "141GB", "--batch", "2147483648"}), R"(--batch: 2147483648 is out of range)"},
      {capacity({"--memory", "141GB", "--page-size", "48"}), R"(page_size 48 must be a power of two)"},
      {capacity({"--memory", "141GB", "--page-size", "4294967312"}), R"(--page-size: 4294967312 is out of range)"},
      {{"capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "96", "--memory", "1GB"}, R"(--head-dim: 96 is not supported)"},
      {{"capacity", "--layers", "32", "--kv-heads", "8", "--head-dim", "2147483648", "--memory", "1GB"}, R"(--head-dim: 2147483648 is out of range)"},
      {capacity({}), R"(--memory is required)"},
      {capacity({"--memory", "1GB"}, false), R"(need --layers, --kv-heads and --head-dim \(or --preset\))"},
      {{"capacity", "--preset", "gpt-5", "--memory", "1GB"}, R"(--preset: unknown preset 'gpt-5')"},
      {{"spec", "--head-dims", "2147483648"}, R"(--head-dims: 2147483648 is out of range)"},
      {{"spec", "--head-dims", "96"}, R"(--head-dims: head_dim 96 is not supported)"},
      {{"spec", "--head-dims", "-64"}, R"(--head-dims: -64 is out of range)"},
      // lists: no empty list, no empty item
      {{"spec", "--head-dims", ""}, R"(--head-dims: empty item in list '')"},
      {{"spec", "--head-dims", "64,,128"}, R"(--head-dims: empty item in list '64,,128')"},
      {{"spec", "--head-dims", "64,"}, R"(--head-dims: empty item)"},
      {{"demo", "--formats", ""}, R"(--formats: empty item in list '')"},
      {{"demo", "--formats", ","}, R"(--formats: empty item)"},
      // formats and backends of the demo
      {{"demo", "--formats", "fp16"}, R"(--formats: 'fp16' is the uncompressed baseline)"},
      {{"demo", "--formats", "k6v3"}, R"(--formats: format 'k6v3' is not kXvY)"},
      {{"demo", "--formats", "k3v16"}, R"(--formats: format 'k3v16' is not kXvY)"},
      {{"demo", "--formats", "k3v3x"}, R"(--formats: format 'k3v3x' is not kXvY)"},
      {{"demo", "--formats", "k+3v3"}, R"(--formats: format 'k\+3v3' is not kXvY)"},
      {{"demo", "--formats", "k3"}, R"(--formats: format 'k3' is not kXvY)"},
      {{"demo", "--backend", "cuda"}, R"(--backend cuda: demo runs host caches)"},
      {{"demo", "--backend", "tpu"}, R"(--backend: unknown backend 'tpu')"},
      {{"demo", "--context", "8"}, R"(--context: 8 is out of range \(expected 16 to 4194304\))"},
      {{"demo", "--context", "1e4"}, R"(--context: '1e4' is not an integer)"},
      // the command line itself
      {{"demo", "--bogus", "1"}, R"(unknown option --bogus for 'demo')"},
      {capacity({"--memory", "141GB", "--frob", "2"}), R"(unknown option --frob for 'capacity')"},
      {{"info", "--x", "1"}, R"(unknown option --x for 'info' \(it takes no options\))"},
      {{"spec", "128"}, R"(unexpected argument '128')"},
      {{"spec", "--"}, R"(unexpected argument '--')"},
      {{"spec", "--head-dims"}, R"(option --head-dims needs a value)"},
      {capacity({"--memory", "1GB", "--memory=2GB"}), R"(option --memory given twice)"},
      {{"frobnicate"}, R"(unknown command 'frobnicate')"},
      {{"inspect"}, R"(inspect needs a snapshot FILE)"},
      {{"inspect", "--x"}, R"(inspect needs a snapshot FILE)"},
      {{"inspect", "a.fmkv", "--x", "1"}, R"(unknown option --x for 'inspect' \(it takes no options\))"},
  };
  return t;
}

TEST(Cli, BadArgumentsTable) {
  int n = 0;
  for (const Bad& b : bad_table()) {
    const Result r = run(b.args);
    const std::string what = joined(b.args) + "\nstderr: " + r.err;
    EXPECT_EQ(r.status, 2) << what;
    EXPECT_EQ(r.out, "") << what << "\nstdout: " << r.out;  // nothing printed before the options are checked
    EXPECT_TRUE(std::regex_search(r.err, std::regex(std::string("^fmkv: error: .*") + b.message))) << what;
    EXPECT_NE(r.err.find("usage: fmkv <command>"), std::string::npos) << what;
    ++n;
  }
  std::printf("[ cli table ] %d bad command lines: exit status 2, message, usage, empty stdout\n", n);
}

TEST(Cli, UsageAndGoodCommands) {
  Result r = run({});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("usage: fmkv"), std::string::npos);
  r = run({"--help"});
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("exit status: 0 success, 1 error while running, 2 bad command line"), std::string::npos) << r.out;
  r = run({"info"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("backend"), std::string::npos);
  // the decode-attention pairs of each usable backend (fmkv_backend_check_attention): the reference has them all
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\nref +format v2: every head_dim x K x V\n)"))) << r.out;
  r = run({"capacity", "--preset", "llama-3-8b", "--memory=141GB", "--window", "64"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(k3v3 +28672 +57344 )"))) << r.out;
  // The fp16 sink + window regions alone exceed the memory: no context, said so, no negative bytes.
  r = run({"capacity", "--preset", "llama-3-8b", "--memory", "141GB", "--sink", "1048576", "--window", "1048576"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(k3v3 +28672 +57344 +0 +0 +0\n)"))) << r.out;
  EXPECT_NE(r.out.find("no context fits"), std::string::npos) << r.out;
  EXPECT_FALSE(std::regex_search(r.out, std::regex(R"(-[0-9]|inf|nan)"))) << r.out;
  r = run({"capacity", "--preset", "llama-3-8b", "--memory", "1.5TiB", "--batch", "2147483647"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(std::regex_search(r.out, std::regex(R"(-[0-9]|inf|nan)"))) << r.out;
  r = run({"demo", "--context", "64", "--formats", "k3v3,k16v2", "--backend", "ref"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\nk16v2 +)"))) << r.out;
}

TEST(Cli, InspectSnapshot) {
  char dir[] = "/tmp/fmkv-cli-snap.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/p.fmkv";
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = 64;
  c.num_kv_heads = 2;
  c.page_size = 16;
  c.window_tokens = 16;
  fmkv::HostCache hc(c, 2, 16, 2);
  const int32_t s = hc.add_sequence();
  std::mt19937 g(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(70 * 2 * 64), v(k.size());
  for (int32_t layer = 0; layer < 2; ++layer) {
    for (size_t i = 0; i < k.size(); ++i) k[i] = nd(g), v[i] = nd(g);
    hc.append(FMKV_BACKEND_REF, layer, s, fmkv::make_tensor(k.data(), FMKV_F32, 70, 2, 64),
              fmkv::make_tensor(v.data(), FMKV_F32, 70, 2, 64));
  }
  fmkv::save(path, hc, s);
  Result r = run({"inspect", path});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("checksums and geometry valid"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(head_dim 64, kv heads 2, k3v3, page 16 tokens)"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(layers: 2, 4 pages each)"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\n0 +70 +4 +0\n)"))) << r.out;  // 54 compressed tokens: 4 pages
  std::string bytes = slurp(path);
  bytes[bytes.size() / 2] ^= 0x20;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  r = run({"inspect", path});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("checksum"), std::string::npos) << r.err;
  r = run({"inspect", std::string(dir) + "/missing.fmkv"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("missing.fmkv"), std::string::npos) << r.err;
  std::remove(path.c_str());
  rmdir(dir);
}

}  // namespace
