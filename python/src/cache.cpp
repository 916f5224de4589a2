// fmkv.Cache's native part: fmkv::HostCache behind one mutex, with the host arrays' checks.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "fmkv/io.hpp"

namespace fmkv_py {
namespace {

using namespace nb::literals;

class Cache {
 public:
  Cache(const fmkv_config& cfg, int64_t num_layers, int64_t num_pages, int64_t max_seqs, const std::string& backend)
      : backend_(backend_from_name(backend)),
        cache_(checked_config(cfg), to_i32("num_layers", num_layers, 1), num_pages, to_i32("max_seqs", max_seqs, 1)) {
    if (backend_ != FMKV_BACKEND_REF && backend_ != FMKV_BACKEND_CPU)
      fail("backend '" + backend + "' works on device memory; fmkv.Cache holds host memory (use 'ref' or 'cpu')",
           FMKV_ERR_UNSUPPORTED);
    if (!fmkv_backend_available(backend_))
      fail("backend '" + backend + "' is not compiled into this build", FMKV_ERR_UNSUPPORTED);
  }

  std::string backend() const { return fmkv_backend_name(backend_); }
  const fmkv_config& config() const { return cache_.config(); }

  int32_t add_sequence() { std::lock_guard<std::mutex> g(mu_); return cache_.add_sequence(); }
  void remove_sequence(int64_t s) { std::lock_guard<std::mutex> g(mu_); cache_.remove_sequence(seq(s)); }
  int64_t length(int64_t layer, int64_t s) {
    std::lock_guard<std::mutex> g(mu_);
    return cache_.length(check_layer(layer), seq(s));
  }
  std::vector<int32_t> block_table(int64_t s) { std::lock_guard<std::mutex> g(mu_); return cache_.block_table(seq(s)); }
  int64_t free_pages() { std::lock_guard<std::mutex> g(mu_); return cache_.free_pages(); }
  int64_t resident_bytes() { std::lock_guard<std::mutex> g(mu_); return cache_.resident_bytes(); }
  int64_t used_bytes() { std::lock_guard<std::mutex> g(mu_); return cache_.used_bytes(); }
  int32_t num_layers() const { return cache_.num_layers(); }

  void append(int64_t layer, int64_t s, const AnyArray& k, const AnyArray& v) {
    const fmkv_config& c = cache_.config();
    HostTensor kt = host_tensor("k", k, "[tokens, num_kv_heads, head_dim]");
    HostTensor vt = host_tensor("v", v, "[tokens, num_kv_heads, head_dim]");
    // Shape checks up front so a malformed call reserves no pages.
    for (const HostTensor* t : {&kt, &vt}) {
      const char* n = t == &kt ? "k" : "v";
      if (t->t.heads != c.num_kv_heads || t->t.dim != c.head_dim)
        fail(std::string(n) + ": shape " + shape_str(t == &kt ? k : v) + " does not match [tokens, num_kv_heads=" +
             std::to_string(c.num_kv_heads) + ", head_dim=" + std::to_string(c.head_dim) + "]");
    }
    if (kt.t.rows != vt.t.rows)
      fail("k has " + std::to_string(kt.t.rows) + " tokens but v has " + std::to_string(vt.t.rows));
    const int32_t l = check_layer(layer), sq = seq(s);
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(mu_);
    if (kt.t.rows == 0) {  // nothing to append: only check the sequence exists
      cache_.length(check_layer(l), sq);
      return;
    }
    cache_.append(backend_, check_layer(l), sq, kt.t, vt.t);
  }

  nb::ndarray<nb::numpy, float> attention(int64_t layer, int64_t s, const AnyArray& q, nb::object softmax_scale,
                                          double softcap, const std::string& out_dtype) {
    HostTensor qt = query_tensor(q);
    const fmkv_attention_opts opts = attention_opts(softmax_scale, softcap);
    const fmkv_dtype odt = out_dtype_from_name(out_dtype);
    const int32_t l = check_layer(layer), sq = seq(s);
    const size_t n = (size_t)qt.t.rows * qt.t.heads * qt.t.dim;
    std::vector<float> out(n);
    {
      nb::gil_scoped_release nogil;
      std::vector<uint16_t> half(odt == FMKV_F32 ? 0 : n);
      void* buf = odt == FMKV_F32 ? (void*)out.data() : (void*)half.data();
      fmkv_tensor ot = fmkv::make_tensor(buf, odt, qt.t.rows, qt.t.heads, qt.t.dim);
      {
        std::lock_guard<std::mutex> g(mu_);
        if (qt.t.rows == 0) cache_.length(check_layer(l), sq);  // no query rows: only check the sequence
        else cache_.attention(backend_, check_layer(l), sq, qt.t, ot, opts);
      }
      if (odt == FMKV_F16)
        for (size_t i = 0; i < n; ++i) {
          // Refused rather than returned as inf: the output is a convex combination of cached V rows,
          // which the decompression can push past the fp16 range when V holds values near +-65504.
          if ((half[i] & 0x7c00u) == 0x7c00u) {
            const size_t hd = (size_t)qt.t.heads * qt.t.dim;
            fail("attention output [" + std::to_string(i / hd) + "][" + std::to_string(i % hd / qt.t.dim) + "][" +
                     std::to_string(i % qt.t.dim) + "] overflows float16 (|x| > 65504): use out_dtype='float32' "
                     "(or 'bfloat16') for this data",
                 FMKV_ERR_NON_FINITE);
          }
          out[i] = f16_to_f32(half[i]);
        }
      else if (odt == FMKV_BF16)
        for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(half[i]);
    }
    return numpy_array(std::move(out), {(size_t)qt.t.rows, (size_t)qt.t.heads, (size_t)qt.t.dim});
  }

  // Attention in float32 and lse[row][q_head] = log of the softmax denominator (fmkv_attention_lse).
  nb::tuple attention_lse(int64_t layer, int64_t s, const AnyArray& q, nb::object softmax_scale, double softcap) {
    HostTensor qt = query_tensor(q);
    const fmkv_attention_opts opts = attention_opts(softmax_scale, softcap);
    const int32_t l = check_layer(layer), sq = seq(s);
    std::vector<float> out((size_t)qt.t.rows * qt.t.heads * qt.t.dim), lse((size_t)qt.t.rows * qt.t.heads);
    {
      nb::gil_scoped_release nogil;
      fmkv_tensor ot = fmkv::make_tensor(out.data(), FMKV_F32, qt.t.rows, qt.t.heads, qt.t.dim);
      fmkv_tensor lt = fmkv::make_tensor(lse.data(), FMKV_F32, qt.t.rows, qt.t.heads, 1);
      std::lock_guard<std::mutex> g(mu_);
      if (qt.t.rows == 0) cache_.length(check_layer(l), sq);
      else cache_.attention(backend_, check_layer(l), sq, qt.t, ot, lt, opts);
    }
    const size_t rows = (size_t)qt.t.rows, heads = (size_t)qt.t.heads, dim = (size_t)qt.t.dim;
    return nb::make_tuple(numpy_array(std::move(out), {rows, heads, dim}), numpy_array(std::move(lse), {rows, heads}));
  }

  // Snapshots (include/fmkv/io.hpp): sequences `seqs` (their first num_tokens tokens, -1 = all) to `path`
  // (atomically), or to bytes when path is None.
  nb::object save(nb::object path, const std::vector<int64_t>& seqs, int64_t num_tokens, bool allow_dequantized) {
    if (seqs.empty()) fail("save: no sequence given");
    if (num_tokens < -1) fail("save: num_tokens must be >= 0, or -1 for every cached token");
    std::vector<int32_t> s32;
    for (int64_t s : seqs) s32.push_back(seq(s));
    const uint32_t flags = allow_dequantized ? FMKV_SAVE_ALLOW_DEQUANTIZED : 0u;
    const bool to_file = !path.is_none();
    const std::string p = to_file ? nb::cast<std::string>(path) : std::string();
    std::vector<uint8_t> bytes;
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> g(mu_);
      if (to_file) fmkv::save(p, cache_, s32, num_tokens, flags);
      else bytes = fmkv::save_memory(cache_, s32, num_tokens, flags);
    }
    if (to_file) return nb::none();
    return nb::bytes((const char*)bytes.data(), bytes.size());
  }

  // Sequence file_seq of a snapshot file (mapped, checked against this cache's config and layer count) or of
  // snapshot bytes, copied in as a new sequence; its id. Nothing changes on error.
  int32_t restore_file(const std::string& path, int64_t file_seq) {
    const int32_t fs = narrow_i32("file_seq", file_seq);
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(mu_);
    return fmkv::restore(cache_, path, fs);
  }
  int32_t restore_bytes(nb::bytes data, int64_t file_seq) {
    const int32_t fs = narrow_i32("file_seq", file_seq);
    fmkv_load_options o;
    fmkv_load_options_default(&o);
    o.expect_config = &cache_.config();
    o.expect_num_layers = cache_.num_layers();
    const fmkv::Snapshot snap = fmkv::Snapshot::load_memory(data.c_str(), data.size(), &o);
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(mu_);
    return fmkv::restore(cache_, snap, fs);
  }

 private:
  HostTensor query_tensor(const AnyArray& q) const {
    const fmkv_config& c = cache_.config();
    HostTensor qt = host_tensor("q", q, "[query_tokens, q_heads, head_dim]");
    if (qt.t.dim != c.head_dim || qt.t.heads < c.num_kv_heads || qt.t.heads % c.num_kv_heads != 0)
      fail("q: shape " + shape_str(q) + " does not match [query_tokens, q_heads, head_dim=" + std::to_string(c.head_dim) +
           "] with q_heads a multiple of num_kv_heads=" + std::to_string(c.num_kv_heads));
    return qt;
  }
  static fmkv_attention_opts attention_opts(nb::object softmax_scale, double softcap) {
    fmkv_attention_opts opts{0.0f, 0.0f, 0};
    if (!softmax_scale.is_none()) {
      if (!nb::isinstance<nb::float_>(softmax_scale) && !nb::isinstance<nb::int_>(softmax_scale))
        fail_type("softmax_scale must be a real number or None, got " +
                  std::string(nb::type_name(softmax_scale.type()).c_str()));
      double sc = nb::cast<double>(softmax_scale);
      if (!(sc > 0) || !std::isfinite(sc)) fail("softmax_scale must be finite and > 0 (None means 1/sqrt(head_dim))");
      opts.softmax_scale = (float)sc;
    }
    if (!(softcap >= 0) || !std::isfinite(softcap)) fail("softcap must be finite and >= 0 (0 disables it)");
    opts.softcap = (float)softcap;
    return opts;
  }

  static const fmkv_config& checked_config(const fmkv_config& c) {
    fmkv::check(fmkv_config_validate(&c));
    return c;
  }
  int32_t check_layer(int64_t l) const {
    if (l < 0 || l >= cache_.num_layers())
      fail("layer " + std::to_string(l) + " outside [0, " + std::to_string(cache_.num_layers()) + ")", FMKV_ERR_OUT_OF_RANGE);
    return (int32_t)l;
  }
  static int32_t seq(int64_t s) {
    if (s < 0 || s > std::numeric_limits<int32_t>::max())
      fail("sequence " + std::to_string(s) + " does not exist", FMKV_ERR_OUT_OF_RANGE);
    return (int32_t)s;
  }

  fmkv_backend backend_;
  fmkv::HostCache cache_;
  std::mutex mu_;
};

}  // namespace

void bind_cache(nb::module_& m) {
  nb::class_<Cache>(m, "Cache", "fmkv::HostCache: paged compressed KV cache in host memory (fmkv.Cache wraps it)")
      .def(nb::init<const fmkv_config&, int64_t, int64_t, int64_t, const std::string&>(), "config"_a, "num_layers"_a,
           "num_pages"_a, "max_seqs"_a, "backend"_a)
      .def_prop_ro("backend", &Cache::backend)
      .def_prop_ro("raw_config", [](const Cache& c) { return c.config(); })
      .def_prop_ro("num_layers", &Cache::num_layers)
      .def_prop_ro("free_pages", &Cache::free_pages)
      .def_prop_ro("resident_bytes", &Cache::resident_bytes)
      .def_prop_ro("used_bytes", &Cache::used_bytes)
      .def("add_sequence", &Cache::add_sequence)
      .def("remove_sequence", &Cache::remove_sequence, "seq"_a)
      .def("length", &Cache::length, "layer"_a, "seq"_a)
      .def("block_table", &Cache::block_table, "seq"_a)
      .def("append", &Cache::append, "layer"_a, "seq"_a, "k"_a, "v"_a)
      .def("attention", &Cache::attention, "layer"_a, "seq"_a, "q"_a, "softmax_scale"_a = nb::none(),
           "softcap"_a = 0.0, "out_dtype"_a = "float32")
      .def("attention_lse", &Cache::attention_lse, "layer"_a, "seq"_a, "q"_a, "softmax_scale"_a = nb::none(),
           "softcap"_a = 0.0)
      .def("save", &Cache::save, "path"_a.none(), "seqs"_a, "num_tokens"_a, "allow_dequantized"_a)
      .def("restore_file", &Cache::restore_file, "path"_a, "file_seq"_a)
      .def("restore_bytes", &Cache::restore_bytes, "data"_a, "file_seq"_a);
}

}  // namespace fmkv_py
