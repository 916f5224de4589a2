// CPU emulator for the fmkv Metal kernels: fibers + rendezvous scheduler (see emulator.h).
#include "emulator.h"

#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#endif
#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace emu {
namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kMaxThreadgroupBytes = 32 * 1024;

// Context switch. On x86-64 a 10-instruction stack switch (callee-saved registers only): no
// system call and no noreturn function for the sanitizer to intercept (glibc swapcontext changes
// the signal mask; ASan unpoisons the whole stack on every longjmp), so ASan-built tests stay fast.
// Elsewhere ucontext's swapcontext. Stack switches are announced to ASan either way.
#if defined(__x86_64__)
#define EMU_ASM_SWITCH 1
extern "C" void fmkv_emu_switch(void** save_sp, void* next_sp);
asm(".text\n"
    ".globl fmkv_emu_switch\n"
    ".type fmkv_emu_switch,@function\n"
    "fmkv_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size fmkv_emu_switch, .-fmkv_emu_switch\n");
#endif

enum class State { kReady, kWaiting, kDone };

struct Fiber {
#ifdef EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  char* stack = nullptr;  // from the stack pool (reused across threadgroups)
  State state = State::kReady;
  ThreadIds ids{};
  Op op{};
  uint64_t value = 0, result = 0;
  uint32_t arg = 0;
};

struct Group {
  std::vector<Fiber> fibers;
#ifdef EMU_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched;
#endif
  Fiber* current = nullptr;
  const std::function<void(const ThreadIds&)>* body = nullptr;
  std::map<const void*, std::vector<unsigned char>> tg_mem;
  size_t tg_bytes = 0;
#ifdef EMU_ASAN
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
};

Group* g_group = nullptr;
Stats g_stats;
std::vector<std::unique_ptr<char[]>> g_stacks;  // pool: fiber stacks are reused, never freed

char* pooled_stack(uint32_t i) {
  while (g_stacks.size() <= i) g_stacks.emplace_back(new char[kStackBytes]);
  char* s = g_stacks[i].get();
#ifdef EMU_ASAN
  // Frames of a finished fiber that never returned (its final switch) may have left poisoned
  // redzones near the top of the stack.
  __asan_unpoison_memory_region(s + kStackBytes - 32 * 1024, 32 * 1024);
#endif
  return s;
}

void switch_to_fiber(Group& g, Fiber& f) {
  g.current = &f;
  ++g_stats.switches;
#ifdef EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
#ifdef EMU_ASM_SWITCH
  fmkv_emu_switch(&g.sched_sp, f.sp);
#else
  swapcontext(&g.sched, &f.ctx);
#endif
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  g.current = nullptr;
}

// From a fiber back to the scheduler (the fiber stays resumable unless done).
void yield_to_scheduler(Group& g, Fiber& f, bool done) {
  (void)done;
#ifdef EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(done ? nullptr : &fake, g.sched_bottom, g.sched_size);
#endif
#ifdef EMU_ASM_SWITCH
  fmkv_emu_switch(&f.sp, g.sched_sp);
#else
  swapcontext(&f.ctx, &g.sched);
#endif
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, &g.sched_bottom, &g.sched_size);
#endif
}

void fiber_entry() {
  Group& g = *g_group;
  Fiber* f = g.current;
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g.sched_bottom, &g.sched_size);
#endif
  (*g.body)(f->ids);
  f->state = State::kDone;
  yield_to_scheduler(g, *f, true);
  fail("finished fiber resumed");
}

void init_fiber(Fiber& f, const ThreadIds& ids) {
  f.ids = ids;
  f.stack = pooled_stack(ids.thread_in_group);
#ifdef EMU_ASM_SWITCH
  // Initial frame popped by fmkv_emu_switch: 6 registers, then `ret` into fiber_entry with
  // rsp = 8 mod 16 as at any function entry.
  uintptr_t top = ((uintptr_t)f.stack + kStackBytes) & ~(uintptr_t)15;
  void** sp = (void**)top;
  *--sp = nullptr;                  // fake return address of fiber_entry
  *--sp = (void*)&fiber_entry;      // ret target
  for (int i = 0; i < 6; ++i) *--sp = nullptr;
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, (void (*)())fiber_entry, 0);
#endif
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kShuffleXor: return "simd_shuffle_xor";
    case Op::kBallot: return "simd_ballot";
    case Op::kBarrier: return "threadgroup_barrier";
  }
  return "?";
}

// Completes the SIMD-group operation of simdgroup sg if all its live lanes wait on it.
bool try_simd(Group& g, uint32_t sg, uint32_t threads) {
  uint32_t first = sg * 32, last = std::min(threads, first + 32);
  Fiber* lanes[32] = {};
  uint32_t waiting = 0, done = 0, other = 0;
  for (uint32_t t = first; t < last; ++t) {
    Fiber& f = g.fibers[t];
    lanes[t - first] = &f;
    if (f.state == State::kDone) ++done;
    else if (f.state == State::kWaiting && f.op != Op::kBarrier) ++waiting;
    else ++other;
  }
  if (waiting == 0 || other > 0) return false;
  if (done > 0) {
    char msg[160];
    snprintf(msg, sizeof msg, "SIMD group %u of threadgroup %u: %s while %u lane(s) have exited", sg,
             g.fibers[first].ids.group, "a SIMD operation", done);
    fail(msg);
  }
  Fiber& f0 = *lanes[0];
  for (uint32_t i = 0; i < last - first; ++i)
    if (lanes[i]->op != f0.op || lanes[i]->arg != f0.arg) {
      char msg[200];
      snprintf(msg, sizeof msg, "divergent SIMD operations in SIMD group %u: lane 0 %s(%u), lane %u %s(%u)", sg,
               op_name(f0.op), f0.arg, i, op_name(lanes[i]->op), lanes[i]->arg);
      fail(msg);
    }
  uint32_t n = last - first;
  if (f0.op == Op::kBallot) {
    uint64_t mask = 0;
    for (uint32_t i = 0; i < n; ++i) mask |= (lanes[i]->value ? 1ull : 0ull) << i;
    for (uint32_t i = 0; i < n; ++i) lanes[i]->result = mask;
  } else {
    for (uint32_t i = 0; i < n; ++i) {
      uint32_t src = i ^ f0.arg;
      if (src >= n) {
        char msg[160];
        snprintf(msg, sizeof msg, "simd_shuffle_xor(%u) in a SIMD group of %u lanes reads missing lane %u", f0.arg, n,
                 src);
        fail(msg);
      }
      lanes[i]->result = lanes[src]->value;
    }
  }
  for (uint32_t i = 0; i < n; ++i) lanes[i]->state = State::kReady;
  ++g_stats.simd_ops;
  return true;
}

}  // namespace

Stats& stats() { return g_stats; }

void fail(const char* what) {
  fprintf(stderr, "metal emulator: %s\n", what);
  fflush(stderr);
  abort();
}

uint64_t sync_op(Op op, uint64_t value, uint32_t arg) {
  Group* g = g_group;
  if (!g || !g->current) fail("SIMD/barrier operation outside a dispatched kernel");
  Fiber& f = *g->current;
  f.op = op;
  f.value = value;
  f.arg = arg;
  f.state = State::kWaiting;
  yield_to_scheduler(*g, f, false);
  return f.result;
}

void* threadgroup_alloc(const void* key, size_t bytes) {
  Group* g = g_group;
  if (!g) fail("threadgroup memory outside a dispatched kernel");
  auto it = g->tg_mem.find(key);
  if (it == g->tg_mem.end()) {
    g->tg_bytes += bytes;
    if (g->tg_bytes > kMaxThreadgroupBytes) fail("threadgroup memory above 32 KiB");
    it = g->tg_mem.emplace(key, std::vector<unsigned char>(bytes, 0xFF)).first;
  } else if (it->second.size() != bytes) {
    fail("threadgroup array size differs between threads");
  }
  return it->second.data();
}

void dispatch(uint32_t num_groups, uint32_t threads, Order order, uint64_t seed,
              const std::function<void(const ThreadIds&)>& body) {
  if (threads == 0 || threads > 1024) fail("threads per threadgroup must be 1..1024");
  std::mt19937_64 rng(seed);
  const uint32_t nsg = (threads + 31) / 32;
  for (uint32_t tg = 0; tg < num_groups; ++tg) {
    Group g;
    g.body = &body;
    g.fibers.resize(threads);
    g_group = &g;
    for (uint32_t t = 0; t < threads; ++t)
      init_fiber(g.fibers[t], ThreadIds{tg, t, threads, tg * threads + t, t % 32, t / 32, nsg});
    g_stats.threads += threads;
    std::vector<uint32_t> sched(threads);
    for (;;) {
      // Run every ready fiber until it waits or exits, in the requested order.
      sched.clear();
      for (uint32_t t = 0; t < threads; ++t)
        if (g.fibers[t].state == State::kReady) sched.push_back(t);
      if (order == Order::kReverse) std::reverse(sched.begin(), sched.end());
      if (order == Order::kRandom) std::shuffle(sched.begin(), sched.end(), rng);
      for (uint32_t t : sched) switch_to_fiber(g, g.fibers[t]);
      // Rendezvous.
      bool all_done = true, progressed = false;
      for (auto& f : g.fibers) all_done = all_done && f.state == State::kDone;
      if (all_done) break;
      std::vector<uint32_t> sgs(nsg);
      for (uint32_t i = 0; i < nsg; ++i) sgs[i] = i;
      if (order == Order::kReverse) std::reverse(sgs.begin(), sgs.end());
      if (order == Order::kRandom) std::shuffle(sgs.begin(), sgs.end(), rng);
      for (uint32_t sg : sgs) progressed = try_simd(g, sg, threads) || progressed;
      if (progressed) continue;
      uint32_t at_barrier = 0, done = 0;
      for (auto& f : g.fibers) {
        if (f.state == State::kDone) ++done;
        else if (f.state == State::kWaiting && f.op == Op::kBarrier) ++at_barrier;
      }
      if (at_barrier == threads) {
        for (auto& f : g.fibers) f.state = State::kReady;
        ++g_stats.barriers;
        continue;
      }
      char msg[200];
      snprintf(msg, sizeof msg,
               "deadlock in threadgroup %u: %u thread(s) at a barrier, %u exited, %u waiting on SIMD operations", tg,
               at_barrier, done, threads - at_barrier - done);
      fail(msg);
    }
    g_group = nullptr;
  }
}

}  // namespace emu
