// Snapshots (include/fmkv/io.h, docs/FILE-FORMAT.md) for Python: a loaded, validated file or buffer whose
// layers are numpy views of its memory (fmkv.Snapshot wraps it), and saving caller-owned host arrays (what
// fmkv.TorchCache stages its pages in). fmkv.Cache's own save / restore are in cache.cpp (fmkv::HostCache).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "fmkv/io.hpp"

namespace fmkv_py {
namespace {

using namespace nb::literals;

fmkv_load_options load_options(const fmkv_config* expect, int64_t expect_num_layers, bool reject_dequantized,
                               bool mmap) {
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  o.mode = mmap ? FMKV_LOAD_MMAP : FMKV_LOAD_COPY;
  o.flags = reject_dequantized ? FMKV_LOAD_REJECT_DEQUANTIZED : 0u;
  o.expect_config = expect;
  o.expect_num_layers = to_i32("expect_num_layers", expect_num_layers, 0);
  return o;
}

class PySnapshot {
 public:
  explicit PySnapshot(fmkv::Snapshot&& s) : s_(std::move(s)), info_(s_.info()) {}

  const fmkv_snapshot_info& info() const { return info_; }

  // (num_tokens, slot, dequantized_tokens, block_table) of file sequence i.
  std::tuple<int64_t, int32_t, int32_t, std::vector<int32_t>> sequence(int64_t i) const {
    const fmkv_snapshot_sequence q = s_.sequence(index("sequence", i, info_.num_seqs));
    return {q.num_tokens, q.slot, q.dequantized_tokens, std::vector<int32_t>(q.block_table, q.block_table + q.num_pages)};
  }

  // (rotation layer, pages uint8 [num_pages, page_bytes], fp16_k / fp16_v float16 [num_seqs, num_kv_heads,
  // sink + window, head_dim] or None): views of the snapshot's memory, which they keep alive.
  nb::tuple layer(nb::handle self, int64_t i) const {
    const fmkv_layer_cache l = s_.layer(index("layer", i, info_.num_layers));
    const fmkv_config& c = info_.config;
    const size_t pb = (size_t)fmkv_config_page_bytes(&c);
    const size_t shape_p[2] = {(size_t)l.num_pages, pb};
    nb::object pages = nb::cast(nb::ndarray<nb::numpy, uint8_t>(l.pages, 2, shape_p, self));
    const size_t rows = (size_t)(c.sink_tokens + c.window_tokens);
    if (rows == 0 || !l.fp16_k) return nb::make_tuple(l.layer, pages, nb::none(), nb::none());
    const size_t shape_f[4] = {(size_t)l.num_slots, (size_t)c.num_kv_heads, rows, (size_t)c.head_dim};
    const nb::dlpack::dtype f16{(uint8_t)nb::dlpack::dtype_code::Float, 16, 1};
    auto view = [&](uint16_t* p) {
      return nb::cast(nb::ndarray<nb::numpy>(p, 4, shape_f, self, nullptr, f16));
    };
    return nb::make_tuple(l.layer, pages, view(l.fp16_k), view(l.fp16_v));
  }

 private:
  static int32_t index(const char* what, int64_t i, int32_t n) {
    if (i < 0 || i >= n)
      fail(std::string("snapshot ") + what + " " + std::to_string(i) + " outside [0, " + std::to_string(n) + ")",
           FMKV_ERR_OUT_OF_RANGE);
    return (int32_t)i;
  }

  fmkv::Snapshot s_;
  fmkv_snapshot_info info_;
};

PySnapshot* load_file(const std::string& path, bool mmap, const fmkv_config* expect, int64_t expect_num_layers,
                      bool reject_dequantized) {
  const fmkv_load_options o = load_options(expect, expect_num_layers, reject_dequantized, mmap);
  fmkv::Snapshot s;
  {
    nb::gil_scoped_release nogil;
    s = fmkv::Snapshot::load(path, &o);
  }
  return new PySnapshot(std::move(s));
}

PySnapshot* load_bytes(nb::bytes data, const fmkv_config* expect, int64_t expect_num_layers, bool reject_dequantized) {
  const fmkv_load_options o = load_options(expect, expect_num_layers, reject_dequantized, false);
  return new PySnapshot(fmkv::Snapshot::load_memory(data.c_str(), data.size(), &o));  // copies: data may go
}

// One layer of caller-owned host arrays: (rotation layer, pages uint8 [num_pages, page_bytes] C-contiguous,
// fp16_k / fp16_v float16 [num_slots, num_kv_heads, sink + window, head_dim] C-contiguous, or None).
using LayerArrays = std::tuple<int64_t, AnyArray, nb::object, nb::object>;
// One sequence: (slot, per-layer lengths, num_tokens to save (-1: all), block table).
using SeqRecord = std::tuple<int64_t, std::vector<int64_t>, int64_t, std::vector<int32_t>>;

template <typename A>
void expect_array(const char* name, const A& a, nb::dlpack::dtype_code code, int bits, std::vector<size_t> shape) {
  require_host(name, a);
  if (!is_dtype(a.dtype(), code, bits))
    fail(std::string(name) + ": dtype " + dtype_name(a.dtype()) + " is not supported (expected " +
         (bits == 8 ? "uint8" : "float16") + ")");
  bool ok = a.ndim() == shape.size();
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] == (size_t)-1 || a.shape(i) == shape[i];
  if (!ok) fail(std::string(name) + ": shape " + shape_str(a) + " does not match the config's layer layout");
  require_contiguous(name, a);
}

nb::object save_arrays(nb::object path, const fmkv_config& cfg, const std::vector<LayerArrays>& layers,
                       const std::vector<SeqRecord>& seqs, bool allow_dequantized) {
  fmkv::check(fmkv_config_validate(&cfg));
  if (layers.empty() || layers.size() > (size_t)INT32_MAX) fail("snapshot: need 1 to 2^31 - 1 layers");
  if (seqs.empty() || seqs.size() > (size_t)INT32_MAX) fail("snapshot: need at least one sequence");
  const size_t pb = (size_t)fmkv_config_page_bytes(&cfg), rows = (size_t)(cfg.sink_tokens + cfg.window_tokens);
  std::vector<fmkv_layer_cache> lc;
  int64_t slots = -1;
  for (const LayerArrays& l : layers) {
    const AnyArray& pages = std::get<1>(l);
    expect_array("pages", pages, nb::dlpack::dtype_code::UInt, 8, {(size_t)-1, pb});
    fmkv_layer_cache c{(uint8_t*)pages.data(), (int64_t)pages.shape(0), nullptr, nullptr, 0,
                       narrow_i32("layer", std::get<0>(l))};
    if (rows) {
      AnyArray fk, fv;
      if (!nb::try_cast(std::get<2>(l), fk) || !nb::try_cast(std::get<3>(l), fv))
        fail("snapshot: fp16_k / fp16_v arrays are required (the config keeps sink + window tokens in fp16)");
      const std::vector<size_t> fs{(size_t)-1, (size_t)cfg.num_kv_heads, rows, (size_t)cfg.head_dim};
      expect_array("fp16_k", fk, nb::dlpack::dtype_code::Float, 16, fs);
      expect_array("fp16_v", fv, nb::dlpack::dtype_code::Float, 16, fs);
      if (fk.shape(0) != fv.shape(0)) fail("snapshot: fp16_k and fp16_v have different slot counts");
      c.fp16_k = (uint16_t*)fk.data();
      c.fp16_v = (uint16_t*)fv.data();
      c.num_slots = narrow_i32("fp16 slots", (int64_t)fk.shape(0));
    } else {
      c.num_slots = (int32_t)seqs.size();
    }
    if (slots >= 0 && slots != c.num_slots) fail("snapshot: the layers have different fp16 slot counts");
    slots = c.num_slots;
    lc.push_back(c);
  }
  std::vector<fmkv_save_sequence> ss;
  for (const SeqRecord& r : seqs) {
    const std::vector<int64_t>& lens = std::get<1>(r);
    if (lens.size() != layers.size())
      fail("snapshot: a sequence has " + std::to_string(lens.size()) + " layer lengths for " +
           std::to_string(layers.size()) + " layers");
    const std::vector<int32_t>& t = std::get<3>(r);
    ss.push_back(fmkv_save_sequence{narrow_i32("slot", std::get<0>(r)), lens[0], lens.data(), std::get<2>(r), t.data(),
                                    (int64_t)t.size()});
  }
  const uint32_t flags = allow_dequantized ? FMKV_SAVE_ALLOW_DEQUANTIZED : 0u;
  if (!path.is_none()) {
    const std::string p = nb::cast<std::string>(path);
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_save(p.c_str(), &cfg, (int32_t)lc.size(), lc.data(), (int32_t)ss.size(), ss.data(), flags));
    return nb::none();
  }
  void* data = nullptr;
  size_t size = 0;
  {
    nb::gil_scoped_release nogil;
    fmkv::check(fmkv_save_memory(&cfg, (int32_t)lc.size(), lc.data(), (int32_t)ss.size(), ss.data(), flags, &data, &size));
  }
  nb::bytes out((const char*)data, size);
  fmkv_buffer_free(data);
  return out;
}

}  // namespace

void bind_snapshot(nb::module_& m) {
  m.attr("FILE_VERSION") = (int)FMKV_FILE_VERSION;
  nb::class_<PySnapshot>(m, "RawSnapshot", "a validated snapshot (fmkv_snapshot); fmkv.Snapshot wraps it")
      .def_prop_ro("raw_config", [](const PySnapshot& s) { return s.info().config; })
      .def_prop_ro("num_layers", [](const PySnapshot& s) { return s.info().num_layers; })
      .def_prop_ro("num_seqs", [](const PySnapshot& s) { return s.info().num_seqs; })
      .def_prop_ro("file_pages", [](const PySnapshot& s) { return s.info().file_pages; })
      .def_prop_ro("num_pages", [](const PySnapshot& s) { return s.info().num_pages; })
      .def_prop_ro("mapped", [](const PySnapshot& s) { return s.info().mapped != 0; })
      .def_prop_ro("file_version", [](const PySnapshot& s) { return s.info().file_version; })
      .def_prop_ro("format_version", [](const PySnapshot& s) { return s.info().format_version; })
      .def_prop_ro("has_dequantized", [](const PySnapshot& s) { return (s.info().flags & 1u) != 0; })
      .def("sequence", &PySnapshot::sequence, "i"_a)
      .def("layer", [](nb::handle self, int64_t i) { return nb::cast<const PySnapshot&>(self).layer(self, i); }, "i"_a);
  m.def("snapshot_load_file", &load_file, "path"_a, "mmap"_a, "expect_config"_a.none(), "expect_num_layers"_a,
        "reject_dequantized"_a, nb::rv_policy::take_ownership);
  m.def("snapshot_load_bytes", &load_bytes, "data"_a, "expect_config"_a.none(), "expect_num_layers"_a,
        "reject_dequantized"_a, nb::rv_policy::take_ownership);
  m.def("snapshot_save_arrays", &save_arrays, "path"_a.none(), "config"_a, "layers"_a, "seqs"_a, "allow_dequantized"_a);
}

}  // namespace fmkv_py
