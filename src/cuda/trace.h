// Latency trace of the CUDA decode launches (diagnostic builds with -DFMKV_CUDA_TRACE=ON only):
// layout of the device buffer and the host functions that read it. Shared by the kernels
// (common.cuh, FMKV_TRACE) and fmkv_cuda_bench --trace. Thread 0 of every CTA records clock64() at
// numbered phases (slots 0..7), %globaltimer at phases 0 and 7 (slots kTraceEntryTime,
// kTraceExitTime), the CTA's role (slot kTraceRole) and its SM (%smid, slot kTraceSm) into
// trace[kernel][cta][slot]; kernel 0 is the attention launch, 1 the merge.
#pragma once
#include <cstddef>

namespace fmkv {
namespace cuda {

constexpr int kTraceCtas = 8192, kTraceSlots = 12, kTracePhases = 8;
constexpr int kTraceEntryTime = 8, kTraceExitTime = 9, kTraceRole = 10, kTraceSm = 11;
enum TraceRole { kTraceSplit = 1, kTraceFp16Part = 2, kTraceFused = 3, kTraceEmptySplit = 4, kTraceMerge = 5 };

#ifdef FMKV_CUDA_TRACE
unsigned long long* trace_buffer();                    // device buffer [2][kTraceCtas][kTraceSlots], zeroed once
void trace_read(unsigned long long* host, size_t n);   // n = 2 * kTraceCtas * kTraceSlots values
void trace_clear();
#endif

}  // namespace cuda
}  // namespace fmkv
