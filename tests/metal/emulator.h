// CPU emulator for the fmkv Metal kernels (tests/metal/).
//
// Runs the exact text of src/metal/*.metal, compiled as host C++ against tests/metal/emu/metal_stdlib.
// Threadgroups run one after another; inside a threadgroup every thread is a cooperative fiber
// (ucontext) that runs until it reaches a SIMD-group operation (simd_shuffle_xor, simd_ballot) or a
// threadgroup barrier, where it waits. The scheduler resumes the runnable fibers in forward,
// reverse or random order; a SIMD-group operation completes when every live lane of the 32-lane
// group has reached the same operation, a barrier when every thread of the threadgroup has.
// Strict checks (a failure aborts with a message): divergent SIMD operations, SIMD operations
// with exited lanes, shuffles from lanes that do not exist (partial SIMD groups), barriers not
// reached by every thread, threadgroup memory over 32 KiB. Threadgroup memory is allocated per
// threadgroup with exact sizes (AddressSanitizer sees overflows) and poisoned with 0xFF bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

namespace emu {

enum class Order { kForward = 0, kReverse = 1, kRandom = 2 };

struct ThreadIds {
  uint32_t group;            // threadgroup_position_in_grid (1-D)
  uint32_t thread_in_group;  // thread_position_in_threadgroup
  uint32_t threads;          // threads_per_threadgroup
  uint32_t grid_thread;      // thread_position_in_grid
  uint32_t lane;             // thread_index_in_simdgroup
  uint32_t simdgroup;        // simdgroup_index_in_threadgroup
  uint32_t simdgroups;       // simdgroups_per_threadgroup
};

struct Stats {
  uint64_t threads = 0, switches = 0, simd_ops = 0, barriers = 0;
};

// Runs body(ids) for every thread of num_groups threadgroups of `threads` threads each.
void dispatch(uint32_t num_groups, uint32_t threads, Order order, uint64_t seed,
              const std::function<void(const ThreadIds&)>& body);
Stats& stats();

// ---- called from kernel code (through metal_stdlib) ----
enum class Op { kShuffleXor = 1, kBallot = 2, kBarrier = 3 };
uint64_t sync_op(Op op, uint64_t value, uint32_t arg);
void* threadgroup_alloc(const void* key, size_t bytes);
[[noreturn]] void fail(const char* what);

}  // namespace emu
