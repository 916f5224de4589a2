// fmkv Metal backend, host side (Objective-C++, Apple platforms only; compiled by the macOS build,
// never on Linux). Pipelines, buffers and dispatch for the kernels of quantize.metal and
// decode_attention.metal. Parameter blocks and launch shapes come from host_plan.h, which the
// Linux emulator tests exercise (tests/metal/); this file only binds buffers and encodes.
//
// Kernels are compiled with fast math OFF (bit-exact float32 quantization, docs/FORMAT.md): either a
// metallibs built with `xcrun metal -fno-fast-math` (directory FMKV_METALLIB_DIR at run time, or
// the build's FMKV_METALLIB_DIR_BUILT; cmake/metal.cmake), or at run time from the sources (FMKV_METAL_SOURCE_DIR, set by the build)
// with MTLCompileOptions mathMode = safe (fastMathEnabled = NO before macOS 15).
#if defined(__APPLE__)
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

#include "backend.h"

#include "../core/backend.h"
#include "host_plan.h"

namespace fmkv::metal {
namespace {

struct Allocation {
  id<MTLBuffer> buffer;
  size_t bytes;
};

struct Context {
  id<MTLDevice> device = nil;
  id<MTLCommandQueue> queue = nil;
  id<MTLComputePipelineState> compress = nil, fp16 = nil, partial = nil, merge = nil;
  id<MTLBuffer> dummy = nil;  // bound where an optional array is absent
  std::map<uintptr_t, Allocation> allocs;  // contents pointer -> buffer (alloc())
  std::mutex mu;
  std::string error;
};

[[noreturn]] void metal_fail(int code, const std::string& msg) { throw fmkv::Error(code, "metal: " + msg); }

std::string read_flattened(const std::string& path, std::set<std::string>& seen) {
  if (!seen.insert(path).second) return "";
  std::ifstream f(path);
  if (!f) metal_fail(kBackendError, "cannot read kernel source " + path);
  std::string dir = path.substr(0, path.find_last_of('/') + 1), line, out;
  while (std::getline(f, line)) {
    size_t a = line.find("#include \"");
    if (a != std::string::npos && line.find_first_not_of(" \t") == a) {
      size_t b = line.find('"', a + 10);
      out += read_flattened(dir + line.substr(a + 10, b - a - 10), seen);
    } else {
      out += line + "\n";
    }
  }
  return out;
}

// file: "quantize" or "decode_attention" (one library per .metal file).
id<MTLLibrary> load_library(id<MTLDevice> dev, const char* file) {
  NSError* err = nil;
  const char* dir = std::getenv("FMKV_METALLIB_DIR");
#ifdef FMKV_METALLIB_DIR_BUILT
  if (!dir) dir = FMKV_METALLIB_DIR_BUILT;
#endif
  if (dir) {
    std::string path = std::string(dir) + "/" + file + ".metallib";
    id<MTLLibrary> l = [dev newLibraryWithURL:[NSURL fileURLWithPath:@(path.c_str())] error:&err];
    if (!l) metal_fail(kBackendError, "cannot load " + path + ": " + err.localizedDescription.UTF8String);
    return l;
  }
#ifdef FMKV_METAL_SOURCE_DIR
  std::set<std::string> seen;
  std::string src = read_flattened(std::string(FMKV_METAL_SOURCE_DIR) + "/" + file + ".metal", seen);
  MTLCompileOptions* opts = [MTLCompileOptions new];
  if (@available(macOS 15.0, iOS 18.0, *)) {
    opts.mathMode = MTLMathModeSafe;
    opts.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
  } else {
    opts.fastMathEnabled = NO;
  }
  id<MTLLibrary> l = [dev newLibraryWithSource:@(src.c_str()) options:opts error:&err];
  if (!l) metal_fail(kBackendError, std::string("compiling ") + file + ": " + err.localizedDescription.UTF8String);
  return l;
#else
  (void)file;
  metal_fail(kUnsupported, "no metallib directory (FMKV_METALLIB_DIR) and no kernel sources compiled in");
#endif
}

id<MTLComputePipelineState> pipeline(id<MTLDevice> dev, id<MTLLibrary> lib, NSString* name) {
  NSError* err = nil;
  id<MTLFunction> fn = [lib newFunctionWithName:name];
  if (!fn) metal_fail(kBackendError, std::string("kernel ") + name.UTF8String + " missing from the library");
  id<MTLComputePipelineState> p = [dev newComputePipelineStateWithFunction:fn error:&err];
  if (!p) metal_fail(kBackendError, std::string("pipeline ") + name.UTF8String + ": " + err.localizedDescription.UTF8String);
  if (p.threadExecutionWidth != 32) metal_fail(kUnsupported, "the kernels need 32-lane SIMD groups");
  return p;
}

Context& ctx() {
  static Context c;
  static std::once_flag once;
  std::call_once(once, [] {
    @autoreleasepool {
      c.device = MTLCreateSystemDefaultDevice();
      if (!c.device) return;
      c.queue = [c.device newCommandQueue];
      c.dummy = [c.device newBufferWithLength:16 options:MTLResourceStorageModeShared];
      try {
        id<MTLLibrary> q = load_library(c.device, "quantize");
        id<MTLLibrary> a = load_library(c.device, "decode_attention");
        c.compress = pipeline(c.device, q, @"fmkv_append_compress");
        c.fp16 = pipeline(c.device, q, @"fmkv_append_fp16");
        c.partial = pipeline(c.device, a, @"fmkv_attention_partial");
        c.merge = pipeline(c.device, a, @"fmkv_attention_merge");
      } catch (const fmkv::Error& e) {
        c.error = e.what();
        c.compress = nil;
      }
    }
  });
  return c;
}

Context& ready() {
  Context& c = ctx();
  if (!c.device) metal_fail(kUnsupported, "no Metal device");
  if (!c.compress) metal_fail(kBackendError, c.error);
  return c;
}

// Buffer + offset of a pointer returned by alloc() (or inside such an allocation).
void bind(Context& c, id<MTLComputeCommandEncoder> enc, const void* p, NSUInteger index) {
  if (!p) {
    [enc setBuffer:c.dummy offset:0 atIndex:index];
    return;
  }
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.allocs.upper_bound((uintptr_t)p);
  if (it == c.allocs.begin()) metal_fail(kInvalidArgument, "pointer not allocated with fmkv_device_alloc(FMKV_BACKEND_METAL)");
  --it;
  size_t off = (uintptr_t)p - it->first;
  if (off >= it->second.bytes) metal_fail(kInvalidArgument, "pointer not allocated with fmkv_device_alloc(FMKV_BACKEND_METAL)");
  [enc setBuffer:it->second.buffer offset:off atIndex:index];
}

void run(Context& c, id<MTLCommandBuffer> cmd, const uint32_t* status) {
  [cmd commit];
  [cmd waitUntilCompleted];
  if (cmd.status != MTLCommandBufferStatusCompleted)
    metal_fail(kBackendError, std::string("command buffer failed: ") +
                            (cmd.error ? cmd.error.localizedDescription.UTF8String : "unknown error"));
  if (status[0] & FMKV_METAL_ERR_BLOCK_TABLE) metal_fail(kOutOfRange, "a block table entry is outside [0, num_pages)");
  if (status[1]) metal_fail(kInternal, "kernel launch shape rejected by the kernel");
}

}  // namespace

bool available() {
  Context& c = ctx();
  return c.device != nil && c.compress != nil;
}

std::string device_name() {
  Context& c = ctx();
  return c.device ? std::string(c.device.name.UTF8String) : std::string();
}

void* alloc(size_t bytes) {
  Context& c = ctx();
  if (!c.device) return nullptr;
  id<MTLBuffer> b = [c.device newBufferWithLength:(bytes ? bytes : 16) options:MTLResourceStorageModeShared];
  if (!b) return nullptr;
  std::lock_guard<std::mutex> lock(c.mu);
  c.allocs[(uintptr_t)b.contents] = Allocation{b, bytes ? bytes : 16};
  return b.contents;
}

void free(void* p) {
  Context& c = ctx();
  std::lock_guard<std::mutex> lock(c.mu);
  c.allocs.erase((uintptr_t)p);  // releases the MTLBuffer (ARC)
}

void copy(void* dst, const void* src, size_t bytes, bool) { std::memcpy(dst, src, bytes); }  // shared memory

void synchronize() {
  Context& c = ready();
  id<MTLCommandBuffer> cmd = [c.queue commandBuffer];
  [cmd commit];
  [cmd waitUntilCompleted];
}

void append(const AppendArgs& a) {
  Context& c = ready();
  @autoreleasepool {
    const fmkv_metal_append_params p = append_params(a);
    const AppendLaunch l = append_launch(p, kAppendThreads);
    if (l.compress_groups == 0) return;
    id<MTLBuffer> params = [c.device newBufferWithBytes:&p length:sizeof p options:MTLResourceStorageModeShared];
    uint32_t zero[2] = {0, 0};
    id<MTLBuffer> status = [c.device newBufferWithBytes:zero length:sizeof zero options:MTLResourceStorageModeShared];
    id<MTLCommandBuffer> cmd = [c.queue commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cmd computeCommandEncoder];  // serial: pass 2 after pass 1
    [enc setComputePipelineState:c.compress];
    [enc setBuffer:params offset:0 atIndex:0];
    bind(c, enc, a.layer.pages, 1);
    bind(c, enc, a.layer.fp16_k, 2);
    bind(c, enc, a.layer.fp16_v, 3);
    bind(c, enc, a.k.data, 4);
    bind(c, enc, a.v.data, 5);
    bind(c, enc, a.batch.seq_lens, 6);
    bind(c, enc, a.batch.row_offsets, 7);
    bind(c, enc, a.batch.block_table, 8);
    bind(c, enc, a.batch.slots, 9);
    [enc setBuffer:status offset:0 atIndex:10];
    [enc dispatchThreadgroups:MTLSizeMake(l.compress_groups, 1, 1)
        threadsPerThreadgroup:MTLSizeMake(l.compress_threads, 1, 1)];
    if (l.fp16_threads > 0) {
      [enc setComputePipelineState:c.fp16];
      [enc dispatchThreads:MTLSizeMake(l.fp16_threads, 1, 1) threadsPerThreadgroup:MTLSizeMake(kFp16Threads, 1, 1)];
    }
    [enc endEncoding];
    run(c, cmd, (const uint32_t*)status.contents);
  }
}

int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows, int32_t num_seqs,
                                  int64_t max_seq_len) {
  const int64_t group = q_heads / cfg.num_kv_heads;
  const int64_t tiles = std::max<int64_t>(1, (max_rows * group + FMKV_METAL_QTILE - 1) / FMKV_METAL_QTILE);
  const int64_t parts = (int64_t)attention_splits(max_seq_len) * kAttentionSimdgroups;
  return (int64_t)num_seqs * cfg.num_kv_heads * tiles * FMKV_METAL_QTILE * parts * (2 + cfg.head_dim) * 4;
}

void decode_attention(const AttentionArgs& a) {
  Context& c = ready();
  @autoreleasepool {
    int64_t max_len = 1;
    for (int32_t s = 0; s < a.batch.num_seqs; ++s) max_len = std::max<int64_t>(max_len, a.batch.seq_lens[s]);
    const fmkv_metal_attention_params p = attention_params(a, kAttentionSimdgroups, attention_splits(max_len));
    if (a.batch.num_seqs == 0 || p.max_rows == 0) return;
    const size_t ws_bytes = (size_t)attention_workspace_floats(p) * 4;
    id<MTLBuffer> params = [c.device newBufferWithBytes:&p length:sizeof p options:MTLResourceStorageModeShared];
    uint32_t zero[2] = {0, 0};
    id<MTLBuffer> status = [c.device newBufferWithBytes:zero length:sizeof zero options:MTLResourceStorageModeShared];
    id<MTLBuffer> temp = nil;  // workspace: the caller's when large enough, else a temporary buffer
    if (!a.workspace || a.workspace_bytes < ws_bytes)
      temp = [c.device newBufferWithLength:ws_bytes options:MTLResourceStorageModePrivate];
    id<MTLCommandBuffer> cmd = [c.queue commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cmd computeCommandEncoder];
    [enc setComputePipelineState:c.partial];
    [enc setBuffer:params offset:0 atIndex:0];
    bind(c, enc, a.layer.pages, 1);
    bind(c, enc, a.layer.fp16_k, 2);
    bind(c, enc, a.layer.fp16_v, 3);
    bind(c, enc, a.q.data, 4);
    bind(c, enc, a.batch.seq_lens, 5);
    bind(c, enc, a.batch.row_offsets, 6);
    bind(c, enc, a.batch.block_table, 7);
    bind(c, enc, a.batch.slots, 8);
    if (temp) [enc setBuffer:temp offset:0 atIndex:9];
    else bind(c, enc, a.workspace, 9);
    bind(c, enc, a.out.data, 10);
    [enc setBuffer:status offset:0 atIndex:11];
    bind(c, enc, a.lse.data, 12);  // fmkv_attention_lse (p.has_lse); the dummy buffer otherwise
    [enc dispatchThreadgroups:MTLSizeMake(attention_partial_groups(p), 1, 1)
        threadsPerThreadgroup:MTLSizeMake(kAttentionSimdgroups * 32, 1, 1)];
    [enc setComputePipelineState:c.merge];
    [enc dispatchThreadgroups:MTLSizeMake(attention_merge_groups(p, kMergeSimdgroups), 1, 1)
        threadsPerThreadgroup:MTLSizeMake(kMergeSimdgroups * 32, 1, 1)];
    [enc endEncoding];
    run(c, cmd, (const uint32_t*)status.contents);
  }
}

}  // namespace fmkv::metal

namespace fmkv {
extern const BackendOps metal_backend = {
    FMKV_BACKEND_METAL, /*host_memory=*/true, /*attention_rel_error=*/1e-5,  // unified memory
    metal::available, metal::device_name,
    metal::append, metal::decode_attention,
    /*append_attention=*/nullptr, metal::attention_workspace_bytes,
    metal::alloc, metal::free, metal::copy, metal::synchronize,
    /*attention_lse=*/true,  // the merge kernel writes M + log L (kernel_core.h fmkv_attention_merge_spec)
    /*max_format_version=*/3,
    /*max_scale_group=*/64,  // kernel_core.h: a 64-coordinate scale group spans two registers; scale g >> shift
    /*max_code_bits=*/5,     // kernel_core.h packs (fmkv_pack_group_lanes) and decodes codes of 2-5 bits
    /*check_attention=*/nullptr};  // decode_attention.metal: one kernel reads every head_dim and width pair
}  // namespace fmkv
#endif  // __APPLE__
