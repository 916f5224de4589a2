// The raw ops over caller-owned tensors (the torch.library ops in fmkv.torch_ops use these), the
// workspace size of a call, and the device synchronisation that raises device-detected errors.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "bindings.h"
#include "convert.h"
#include "device.h"

namespace fmkv_py {
namespace {

using namespace nb::literals;

// One layer's storage lives in the caller's tensors: pages (uint8, num_pages * page_bytes bytes),
// fp16_k / fp16_v (2-byte elements, num_slots * num_kv_heads * (sink + window) * head_dim; may
// be empty when sink + window == 0). The batch: slots int32 [n], seq_lens int64 [n],
// row_offsets int64 [n + 1], block_table int32 [n, stride]. All contiguous, all on the backend's
// device (host memory for 'ref' / 'cpu', one CUDA device for 'cuda'; see DeviceCheck).
// On 'cuda' the ops are stream-ordered on the caller's stream and do not synchronise: errors that
// only the device can see (block-table entries, lengths, slots, NaN/Inf inputs) are recorded in
// the device error word and raised by synchronize('cuda') (fmkv_device_synchronize).

struct RawLayer {
  fmkv_layer_cache lc{};
};

RawLayer raw_layer(const fmkv_config& c, int64_t layer_index, const MutArray& pages, const MutArray& fk, const MutArray& fv) {
  fmkv::check(fmkv_config_validate(&c));
  RawLayer r;
  if (!is_dtype(pages.dtype(), nb::dlpack::dtype_code::UInt, 8))
    fail("pages: dtype " + dtype_name(pages.dtype()) + " is not supported (expected uint8)");
  require_contiguous("pages", pages);
  const int64_t pb = fmkv_config_page_bytes(&c), nbytes = (int64_t)numel(pages);
  if (nbytes % pb != 0)
    fail("pages: " + std::to_string(nbytes) + " bytes is not a multiple of the page size " + std::to_string(pb) + " bytes");
  r.lc.pages = (uint8_t*)pages.data();
  r.lc.num_pages = nbytes / pb;
  const int64_t slot_elems = fmkv_config_fp16_slot_bytes(&c) / 4;
  for (const MutArray* a : {&fk, &fv}) {
    const char* n = a == &fk ? "fp16_k" : "fp16_v";
    if (a->dtype().bits != 16 || a->dtype().lanes != 1 || a->dtype().code == (uint8_t)nb::dlpack::dtype_code::Bfloat)
      fail(std::string(n) + ": dtype " + dtype_name(a->dtype()) + " is not supported (expected float16, or int16/uint16 bits)");
    require_contiguous(n, *a);
    if (slot_elems > 0 && (numel(*a) == 0 || (int64_t)numel(*a) % slot_elems != 0))
      fail(std::string(n) + ": " + std::to_string(numel(*a)) + " elements is not a positive multiple of one sequence slot (" +
           std::to_string(slot_elems) + " = num_kv_heads * (sink_tokens + window_tokens) * head_dim)");
  }
  if (numel(fk) != numel(fv)) fail("fp16_k and fp16_v differ in size");
  r.lc.fp16_k = slot_elems > 0 ? (uint16_t*)fk.data() : nullptr;
  r.lc.fp16_v = slot_elems > 0 ? (uint16_t*)fv.data() : nullptr;
  if (slot_elems > 0 && (int64_t)numel(fk) / slot_elems > std::numeric_limits<int32_t>::max())
    fail("fp16_k: too many sequence slots", FMKV_ERR_OVERFLOW);
  r.lc.num_slots = slot_elems > 0 ? (int32_t)((int64_t)numel(fk) / slot_elems) : 1;
  r.lc.layer = to_i32("layer", layer_index, 0);
  return r;
}

struct RawBatch {
  fmkv_batch b{};
  int32_t dummy_table = 0;  // a non-NULL host block table when it has no entries
};

void raw_batch(RawBatch& r, bool device, const AnyArray& slots, const AnyArray& seq_lens, const AnyArray& row_offsets,
               const AnyArray& block_table) {
  const int32_t* sl = index_array<int32_t>("slots", slots, 1, "int32");
  const int64_t* ln = index_array<int64_t>("seq_lens", seq_lens, 1, "int64");
  const int64_t* ro = index_array<int64_t>("row_offsets", row_offsets, 1, "int64");
  const int32_t* bt = index_array<int32_t>("block_table", block_table, 2, "int32");
  const size_t n = slots.shape(0);
  if (n > (size_t)std::numeric_limits<int32_t>::max()) fail("slots: too many sequences", FMKV_ERR_OVERFLOW);
  if (seq_lens.shape(0) != n) fail("seq_lens: " + std::to_string(seq_lens.shape(0)) + " entries, expected one per sequence (" + std::to_string(n) + ")");
  if (row_offsets.shape(0) != n + 1) fail("row_offsets: " + std::to_string(row_offsets.shape(0)) + " entries, expected num_seqs + 1 = " + std::to_string(n + 1));
  if (block_table.shape(0) != n) fail("block_table: " + std::to_string(block_table.shape(0)) + " rows, expected one per sequence (" + std::to_string(n) + ")");
  r.b.num_seqs = (int32_t)n;
  r.b.slots = sl;
  r.b.seq_lens = ln;
  r.b.row_offsets = ro;
  if (numel(block_table) > 0) {
    r.b.block_table = bt;
    r.b.block_table_stride = (int64_t)block_table.shape(1);
  } else if (device) {  // no entries: never dereferenced (a sequence that needs a page fails on the device)
    r.b.block_table = nullptr;
    r.b.block_table_stride = 0;
  } else {
    r.b.block_table = &r.dummy_table;
    r.b.block_table_stride = (int64_t)block_table.shape(1);
  }
}

// One layer's storage and batch arrays must all live where the backend works (DeviceCheck).
void check_layer_devices(DeviceCheck& dev, const MutArray& pages, const MutArray& fk, const MutArray& fv, const AnyArray& slots,
                         const AnyArray& seq_lens, const AnyArray& row_offsets, const AnyArray& block_table) {
  dev("pages", pages);
  dev("fp16_k", fk);
  dev("fp16_v", fv);
  dev("slots", slots);
  dev("seq_lens", seq_lens);
  dev("row_offsets", row_offsets);
  dev("block_table", block_table);
}

void raw_append(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                const AnyArray& row_offsets, const AnyArray& block_table, const AnyArray& k, const AnyArray& v,
                uintptr_t stream) {
  const fmkv_backend b = backend_from_name(backend);
  DeviceCheck dev(b);
  check_layer_devices(dev, pages, fk, fv, slots, seq_lens, row_offsets, block_table);
  dev("k", k);
  dev("v", v);
  RawLayer L = raw_layer(cfg, layer_index, pages, fk, fv);
  RawBatch B;
  raw_batch(B, dev.cuda(), slots, seq_lens, row_offsets, block_table);
  if (dev.cuda()) {
    fmkv_tensor kt = device_tensor("k", k, "[tokens, num_kv_heads, head_dim]");
    fmkv_tensor vt = device_tensor("v", v, "[tokens, num_kv_heads, head_dim]");
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_append(b, &cfg, &L.lc, &B.b, &kt, &vt, stream_ptr(stream)));
    return;
  }
  HostTensor kt = host_tensor("k", k, "[tokens, num_kv_heads, head_dim]", true);
  HostTensor vt = host_tensor("v", v, "[tokens, num_kv_heads, head_dim]", true);
  nb::gil_scoped_release nogil;
  fmkv::check(fmkv_append(b, &cfg, &L.lc, &B.b, &kt.t, &vt.t, nullptr));
}

// The attention-side arguments shared by attention_raw and append_attention_raw: q, out (shape and
// dtype of q), options, the optional workspace; resolved for host or device memory.
struct RawAttention {
  fmkv_tensor q{}, out{}, lse{};  // lse.data == nullptr: not asked (fmkv_attention)
  fmkv_attention_opts opts{};
  void* ws = nullptr;
  size_t ws_bytes = 0;
  HostTensor q_host;  // keeps a converted host q alive
};

void raw_attention_args(RawAttention& r, bool cuda, int32_t num_seqs, const AnyArray& q, const MutArray& out,
                        double softmax_scale, double softcap, const std::optional<MutArray>& workspace,
                        int64_t max_seq_len, const std::optional<MutArray>& lse = std::nullopt) {
  const fmkv_dtype odt = float_dtype("out", AnyArray(out));
  if (!(softmax_scale >= 0) || !std::isfinite(softmax_scale)) fail("softmax_scale must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  if (!(softcap >= 0) || !std::isfinite(softcap)) fail("softcap must be finite and >= 0 (0 disables it)");
  if (max_seq_len < 0) fail("max_seq_len must be >= 0 (0: no bound), got " + std::to_string(max_seq_len));
  r.opts = fmkv_attention_opts{(float)softmax_scale, (float)softcap, max_seq_len};
  if (workspace) {
    if (!is_dtype(workspace->dtype(), nb::dlpack::dtype_code::UInt, 8))
      fail("workspace: dtype " + dtype_name(workspace->dtype()) + " is not supported (expected uint8)");
    require_contiguous("workspace", *workspace);
    r.ws = workspace->data();
    r.ws_bytes = numel(*workspace);
  }
  if (cuda) {
    r.q = device_tensor("q", q, "[query_tokens, q_heads, head_dim]");
  } else {
    r.q_host = host_tensor("q", q, "[query_tokens, q_heads, head_dim]", true);
    r.q = r.q_host.t;
  }
  if (out.ndim() != 3 || (int64_t)out.shape(0) != r.q.rows || (int64_t)out.shape(1) != r.q.heads || (int64_t)out.shape(2) != r.q.dim)
    fail("out: shape " + shape_str(AnyArray(out)) + " must equal q's shape " + shape_str(q));
  require_contiguous("out", out);
  r.out = fmkv::make_tensor(out.data(), odt, r.q.rows, r.q.heads, r.q.dim);
  if (lse) {  // float32 [query_tokens, q_heads]
    if (!is_dtype(lse->dtype(), nb::dlpack::dtype_code::Float, 32))
      fail("lse: dtype " + dtype_name(lse->dtype()) + " is not supported (expected float32)");
    if (lse->ndim() != 2 || (int64_t)lse->shape(0) != r.q.rows || (int64_t)lse->shape(1) != r.q.heads)
      fail("lse: shape " + shape_str(AnyArray(*lse)) + " must be [query_tokens, q_heads] of q's shape " + shape_str(q));
    require_contiguous("lse", *lse);
    r.lse = fmkv::make_tensor(lse->data(), FMKV_F32, r.q.rows, r.q.heads, 1);
  }
  if (cuda && r.q.rows > 0 && num_seqs > 0 && !r.ws)
    fail("workspace: the cuda backend needs a workspace tensor (uint8, on q's device) of "
         "attention_workspace_bytes('cuda', config, q_heads, rows, num_seqs, max_seq_len) bytes");
}

// attention_raw (kv == nullptr) and append_attention_raw (kv = the rows of k and v to append first,
// fmkv_append_attention; seq_lens are then the lengths before the append).
void attention_call(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                    const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                    const AnyArray& row_offsets, const AnyArray& block_table, const std::pair<AnyArray, AnyArray>* kv,
                    const AnyArray& q, const MutArray& out, double softmax_scale, double softcap,
                    const std::optional<MutArray>& workspace, uintptr_t stream, int64_t max_seq_len,
                    const std::optional<MutArray>& lse = std::nullopt) {
  const fmkv_backend b = backend_from_name(backend);
  DeviceCheck dev(b);
  check_layer_devices(dev, pages, fk, fv, slots, seq_lens, row_offsets, block_table);
  if (kv) {
    dev("k", kv->first);
    dev("v", kv->second);
  }
  dev("q", q);
  dev("out", out);
  if (lse) dev("lse", *lse);
  if (workspace) dev("workspace", *workspace);
  RawLayer L = raw_layer(cfg, layer_index, pages, fk, fv);
  RawBatch B;
  raw_batch(B, dev.cuda(), slots, seq_lens, row_offsets, block_table);
  RawAttention A;
  raw_attention_args(A, dev.cuda(), B.b.num_seqs, q, out, softmax_scale, softcap, workspace, max_seq_len, lse);
  void* st = dev.cuda() ? stream_ptr(stream) : nullptr;
  if (!kv) {
    nb::gil_scoped_release nogil;
    if (A.lse.data) fmkv::check(fmkv_attention_lse(b, &cfg, &L.lc, &B.b, &A.q, &A.opts, &A.out, &A.lse, A.ws, A.ws_bytes, st));
    else fmkv::check(fmkv_attention(b, &cfg, &L.lc, &B.b, &A.q, &A.opts, &A.out, A.ws, A.ws_bytes, st));
    return;
  }
  HostTensor kh, vh;
  fmkv_tensor kt, vt;
  if (dev.cuda()) {
    kt = device_tensor("k", kv->first, "[tokens, num_kv_heads, head_dim]");
    vt = device_tensor("v", kv->second, "[tokens, num_kv_heads, head_dim]");
  } else {
    kh = host_tensor("k", kv->first, "[tokens, num_kv_heads, head_dim]", true);
    vh = host_tensor("v", kv->second, "[tokens, num_kv_heads, head_dim]", true);
    kt = kh.t;
    vt = vh.t;
  }
  nb::gil_scoped_release nogil;
  fmkv::check(fmkv_append_attention(b, &cfg, &L.lc, &B.b, &kt, &vt, &A.q, &A.opts, &A.out, A.ws, A.ws_bytes, st));
}

void raw_attention(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                   const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                   const AnyArray& row_offsets, const AnyArray& block_table, const AnyArray& q, const MutArray& out,
                   double softmax_scale, double softcap, std::optional<MutArray> workspace, uintptr_t stream,
                   int64_t max_seq_len, std::optional<MutArray> lse) {
  attention_call(backend, cfg, layer_index, pages, fk, fv, slots, seq_lens, row_offsets, block_table, nullptr, q, out,
                 softmax_scale, softcap, workspace, stream, max_seq_len, lse);
}

void raw_append_attention(const std::string& backend, const fmkv_config& cfg, int64_t layer_index, const MutArray& pages,
                          const MutArray& fk, const MutArray& fv, const AnyArray& slots, const AnyArray& seq_lens,
                          const AnyArray& row_offsets, const AnyArray& block_table, const AnyArray& k, const AnyArray& v,
                          const AnyArray& q, const MutArray& out, double softmax_scale, double softcap,
                          std::optional<MutArray> workspace, uintptr_t stream, int64_t max_seq_len) {
  const std::pair<AnyArray, AnyArray> kv(k, v);
  attention_call(backend, cfg, layer_index, pages, fk, fv, slots, seq_lens, row_offsets, block_table, &kv, q, out,
                 softmax_scale, softcap, workspace, stream, max_seq_len);
}

}  // namespace

void bind_raw_ops(nb::module_& m) {
  // stream: a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream), 0 = the legacy
  // default stream; ignored by the host backends.
  m.def("append_raw", &raw_append, "backend"_a, "config"_a, "layer"_a, "pages"_a, "fp16_k"_a, "fp16_v"_a, "slots"_a,
        "seq_lens"_a, "row_offsets"_a, "block_table"_a, "k"_a, "v"_a, "stream"_a = (uintptr_t)0);
  m.def("attention_raw", &raw_attention, "backend"_a, "config"_a, "layer"_a, "pages"_a, "fp16_k"_a, "fp16_v"_a,
        "slots"_a, "seq_lens"_a, "row_offsets"_a, "block_table"_a, "q"_a, "out"_a, "softmax_scale"_a = 0.0,
        "softcap"_a = 0.0, "workspace"_a = nb::none(), "stream"_a = (uintptr_t)0, "max_seq_len"_a = 0,
        "lse"_a = nb::none());  // lse: float32 [query_tokens, q_heads], written (fmkv_attention_lse) when given
  m.def("append_attention_raw", &raw_append_attention, "backend"_a, "config"_a, "layer"_a, "pages"_a, "fp16_k"_a,
        "fp16_v"_a, "slots"_a, "seq_lens"_a, "row_offsets"_a, "block_table"_a, "k"_a, "v"_a, "q"_a, "out"_a,
        "softmax_scale"_a = 0.0, "softcap"_a = 0.0, "workspace"_a = nb::none(), "stream"_a = (uintptr_t)0,
        "max_seq_len"_a = 0);
  m.attr("FUSED_MAX_ROWS") = FMKV_FUSED_MAX_ROWS;
  m.def("attention_workspace_bytes", [](const std::string& backend, const fmkv_config& c, int64_t q_heads, int64_t max_rows,
                                         int64_t num_seqs, int64_t max_seq_len) {
    const fmkv_backend b = backend_from_name(backend);
    fmkv::check(fmkv_config_validate(&c));
    return fmkv_attention_workspace_bytes(b, &c, to_i32("q_heads", q_heads, 0), max_rows < 0 ? 0 : max_rows,
                                          to_i32("num_seqs", num_seqs, 0), max_seq_len < 0 ? 0 : max_seq_len);
  }, "backend"_a, "config"_a, "q_heads"_a, "max_rows"_a, "num_seqs"_a, "max_seq_len"_a = 0,
     "Workspace bytes attention_raw needs on a backend (0 for host backends): fmkv_attention_workspace_bytes.");
  m.def("backend_available", [](const std::string& backend) {
    return fmkv_backend_available(backend_from_name(backend)) != 0;
  }, "backend"_a);
  // Raises what every op of the backend would raise for caches of this config (fmkv_backend_check_config).
  m.def("backend_check_config", [](const std::string& backend, const fmkv_config& c) {
    fmkv::check(fmkv_backend_check_config(backend_from_name(backend), &c));
  }, "backend"_a, "config"_a);
  // Raises what the backend's attention ops would raise for caches of this config (fmkv_backend_check_attention).
  m.def("backend_check_attention", [](const std::string& backend, const fmkv_config& c) {
    fmkv::check(fmkv_backend_check_attention(backend_from_name(backend), &c));
  }, "backend"_a, "config"_a);
  // Waits for the backend's device and raises the first error its kernels recorded since the last
  // call (CUDA: block-table entries, slots, lengths, NaN/Inf inputs; the failed op wrote nothing and
  // later fmkv CUDA ops were skipped). Reads the error word of the calling thread's current device.
  m.def("synchronize", [](const std::string& backend) {
    const fmkv_backend b = backend_from_name(backend);
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_device_synchronize(b));
  }, "backend"_a);
}

}  // namespace fmkv_py
