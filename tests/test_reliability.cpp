// HostCache's all-or-nothing calls and allocation limit, and the CPU thread pool after fork().
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"
#if defined(__unix__) || defined(__APPLE__)
#include <sys/wait.h>
#include <unistd.h>
#define FMKV_TEST_FORK 1
#endif

namespace fmkv::test {
namespace {

// Pages free or in exactly one sequence's table; nothing else.
void expect_pages_accounted(const HostCache& c, const std::vector<int32_t>& seqs, int64_t num_pages) {
  std::vector<int> seen((size_t)num_pages, 0);
  int64_t used = 0;
  for (int32_t s : seqs)
    for (int32_t p : c.block_table(s)) {
      ASSERT_TRUE(p >= 0 && p < num_pages) << p;
      EXPECT_EQ(seen[(size_t)p]++, 0) << "page " << p << " is mapped twice";
      ++used;
    }
  EXPECT_EQ(c.free_pages() + used, num_pages) << "pages leaked";
}

// The case: 900 rows with a NaN in the last one used to take 57 of 63 pages for good.
TEST(Reliability, FailedAppendReturnsItsPages) {
  for (fmkv_backend b : {FMKV_BACKEND_REF, FMKV_BACKEND_CPU}) {
    if (!fmkv_backend_available(b)) continue;
    fmkv_config c = config(64, 3, 3, 1, 16);
    HostCache cache(c, 1, 63, 2);
    const int32_t a = cache.add_sequence(), o = cache.add_sequence();
    auto k = random_tensor(FMKV_F32, 900, 1, 64), v = random_tensor(FMKV_F32, 900, 1, 64);
    const float nan = std::nanf("");
    std::memcpy(&k[(899 * 64 + 10) * 4], &nan, 4);
    fmkv_tensor kt = make_tensor(k.data(), FMKV_F32, 900, 1, 64), vt = make_tensor(v.data(), FMKV_F32, 900, 1, 64);
    try {
      cache.append(b, 0, a, kt, vt);
      ADD_FAILURE() << "NaN accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), FMKV_ERR_NON_FINITE);
      EXPECT_NE(std::string(e.what()).find("k[899][0][10]"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.free_pages(), 63);
    EXPECT_TRUE(cache.block_table(a).empty());
    EXPECT_EQ(cache.length(0, a), 0);
    // A wrong shape detected by the C API (after the pages were reserved) is undone the same way.
    fmkv_tensor bad = make_tensor(v.data(), FMKV_F32, 450, 2, 64);
    EXPECT_THROW(cache.append(b, 0, a, kt, bad), Error);
    EXPECT_EQ(cache.free_pages(), 63);
    // The pool is whole: another sequence can take all of it.
    auto full = random_tensor(FMKV_F32, 63 * 16, 1, 64);
    fmkv_tensor k2 = make_tensor(full.data(), FMKV_F32, 63 * 16, 1, 64);
    cache.append(b, 0, o, k2, k2);
    EXPECT_EQ(cache.free_pages(), 0);
    expect_pages_accounted(cache, {a, o}, 63);
  }
}

TEST(Reliability, FailedAppendKeepsEarlierTokens) {
  fmkv_config c = config(64, 4, 2, 2, 16, 2, 5);
  HostCache cache(c, 2, 8, 1);
  const int32_t s = cache.add_sequence();
  auto k = random_tensor(FMKV_F32, 60, 2, 64), v = random_tensor(FMKV_F32, 60, 2, 64);
  cache.append(FMKV_BACKEND_REF, 1, s, make_tensor(k.data(), FMKV_F32, 30, 2, 64), make_tensor(v.data(), FMKV_F32, 30, 2, 64));
  const std::vector<int32_t> table = cache.block_table(s);
  std::vector<float> q(2 * 64, 0.25f), before(2 * 64), after(2 * 64);
  fmkv_tensor qt = make_tensor(q.data(), FMKV_F32, 1, 2, 64);
  fmkv_tensor o1 = make_tensor(before.data(), FMKV_F32, 1, 2, 64), o2 = make_tensor(after.data(), FMKV_F32, 1, 2, 64);
  cache.attention(FMKV_BACKEND_REF, 1, s, qt, o1);
  const float big = 7e4f;  // finite, beyond fp16
  std::memcpy(&v[(59 * 2 * 64 + 64) * 4], &big, 4);
  EXPECT_THROW(cache.append(FMKV_BACKEND_REF, 1, s, make_tensor(&k[30 * 2 * 64 * 4], FMKV_F32, 30, 2, 64),
                            make_tensor(&v[30 * 2 * 64 * 4], FMKV_F32, 30, 2, 64)),
               Error);
  EXPECT_EQ(cache.length(1, s), 30);
  EXPECT_EQ(cache.block_table(s), table);
  cache.attention(FMKV_BACKEND_REF, 1, s, qt, o2);
  EXPECT_EQ(before, after);
}

TEST(Reliability, AllocationCheckedUpFront) {
  fmkv_config c = config(128, 3, 3, 8, 64, 4, 64);
  // ~1e9 sequences would need tens of GB of bookkeeping: refused before allocating anything.
  try {
    HostCache huge(c, 1, 1, 1000000000);
    ADD_FAILURE() << "a cache larger than the host was allocated";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), FMKV_ERR_OUT_OF_RANGE) << e.what();
    EXPECT_NE(std::string(e.what()).find("bytes of host memory"), std::string::npos) << e.what();
  }
  EXPECT_GT(fmkv_host_memory_bytes(), 0);
  try {
    HostCache huge(c, 1, (int64_t)1 << 40, 1);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), FMKV_ERR_OVERFLOW) << e.what();
  }
  EXPECT_THROW(HostCache::host_bytes(c, 1 << 30, (int64_t)1 << 31, 1 << 30), Error);  // overflows int64
  const int64_t small = HostCache::host_bytes(c, 2, 10, 3);
  EXPECT_EQ(small, 2 * (10 * fmkv_config_page_bytes(&c) + 3 * fmkv_config_fp16_slot_bytes(&c) + 3 * 8) + 10 * 4 +
                       3 * (int64_t)sizeof(std::vector<int32_t>));
  HostCache ok(c, 2, 10, 3);
  EXPECT_EQ(ok.free_pages(), 10);
  EXPECT_THROW(ok.length(2, ok.add_sequence()), Error);  // layer outside [0, 2)
}

#ifdef FMKV_TEST_FORK
// A forked child (no threads but the forking one) runs the CPU backend's parallel kernels with a
// fresh pool; it used to wait forever for the parent's workers. The child is killed after 20 s.
TEST(Reliability, CpuThreadPoolAfterFork) {
  if (!fmkv_backend_available(FMKV_BACKEND_CPU)) GTEST_SKIP() << "cpu backend not compiled";
  fmkv_config c = config(128, 3, 3, 2, 16);
  HostCache cache(c, 1, 64, 1);
  const int32_t s = cache.add_sequence();
  auto k = random_tensor(FMKV_F32, 800, 2, 128), v = random_tensor(FMKV_F32, 800, 2, 128);
  cache.append(FMKV_BACKEND_CPU, 0, s, make_tensor(k.data(), FMKV_F32, 800, 2, 128), make_tensor(v.data(), FMKV_F32, 800, 2, 128));
  std::vector<float> q(4 * 128, 0.5f), parent(4 * 128);
  fmkv_tensor qt = make_tensor(q.data(), FMKV_F32, 1, 4, 128), ot = make_tensor(parent.data(), FMKV_F32, 1, 4, 128);
  cache.attention(FMKV_BACKEND_CPU, 0, s, qt, ot);  // the pool's workers exist now
  for (int round = 0; round < 3; ++round) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      alarm(20);
      std::vector<float> child(4 * 128);
      fmkv_tensor co = make_tensor(child.data(), FMKV_F32, 1, 4, 128);
      cache.attention(FMKV_BACKEND_CPU, 0, s, qt, co);
      _exit(child == parent ? 0 : 3);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_FALSE(WIFSIGNALED(status)) << "child killed by signal " << WTERMSIG(status) << " (hung in the thread pool?)";
    EXPECT_EQ(WEXITSTATUS(status), 0) << "child's attention differs from the parent's";
  }
}
#endif

}  // namespace
}  // namespace fmkv::test
