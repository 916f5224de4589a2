// Format primitives: RawConfig (fmkv_config), the config's sizes, bytes per token, codebooks and
// the quantization of one head vector (host memory, reference arithmetic).
#include <nanobind/stl/string.h>

#include <vector>

#include "bindings.h"
#include "convert.h"
#include "fmkv/format_text.hpp"

namespace fmkv_py {

using namespace nb::literals;

void bind_format(nb::module_& m) {
  nb::class_<fmkv_config>(m, "RawConfig", "fmkv_config as a plain struct (fmkv.Config wraps it)")
      .def("__init__", [](fmkv_config* c) { new (c) fmkv_config; fmkv_config_default(c); })
      .def_rw("head_dim", &fmkv_config::head_dim)
      .def_rw("num_kv_heads", &fmkv_config::num_kv_heads)
      .def_rw("k_bits", &fmkv_config::k_bits)
      .def_rw("v_bits", &fmkv_config::v_bits)
      .def_rw("page_size", &fmkv_config::page_size)
      .def_rw("sink_tokens", &fmkv_config::sink_tokens)
      .def_rw("window_tokens", &fmkv_config::window_tokens)
      .def_rw("scale_rule", &fmkv_config::scale_rule)
      .def_rw("seed", &fmkv_config::seed)
      .def_rw("format_version", &fmkv_config::format_version)
      .def_rw("scale_group", &fmkv_config::scale_group);
  m.attr("SCALE_RMS") = (int)FMKV_SCALE_RMS;
  m.attr("SCALE_LSQ") = (int)FMKV_SCALE_LSQ;
  m.attr("GROUP_SIZE") = (int)FMKV_GROUP_SIZE;  // coordinates per code group
  m.attr("SCALE_GROUP") = (int)FMKV_SCALE_GROUP;  // coordinates per scale of a default cache (scale_group 0)
  {
    nb::list sgs;  // the scale groups a cache can use (fmkv_scale_group_supported, 0 excluded), ascending
    for (int32_t sg = FMKV_GROUP_SIZE; sg <= FMKV_MAX_HEAD_DIM; sg *= 2)
      if (fmkv_scale_group_supported(sg)) sgs.append(sg);
    m.attr("SCALE_GROUPS") = nb::tuple(sgs);
  }
  m.def("resolved_scale_group", [](int64_t sg) {  // a config's scale_group: 0 means SCALE_GROUP
    if (!fits_i32(sg) || !fmkv_scale_group_supported((int32_t)sg))
      fail("scale_group " + std::to_string(sg) + " is not supported (0 = default, 32 or 64)");
    return fmkv_resolved_scale_group((int32_t)sg);
  }, "scale_group"_a);
  {
    nb::list widths;  // the code widths of a K or V side (fmkv_code_bits_supported), ascending
    for (int32_t b : fmkv::supported_code_bits()) widths.append(b);
    m.attr("CODE_BITS") = nb::tuple(widths);
  }
  m.attr("CODE_BITS_TEXT") = fmkv::supported_code_bits_text(false);       // "2, 3 or 4", as messages list them
  m.attr("K_CODE_BITS_TEXT") = fmkv::supported_code_bits_text(true);      // "2, 3, 4 or 16"
  m.attr("CODEBOOK_MAX_BITS") = (int)FMKV_CODE_BITS_MAX;  // codebooks exist for widths 1 .. this (fmkv.codebook)

  m.def("config_validate", [](const fmkv_config& c) { fmkv::check(fmkv_config_validate(&c)); });
  m.def("config_page_bytes", [](const fmkv_config& c) {
    fmkv::check(fmkv_config_validate(&c));
    return fmkv_config_page_bytes(&c);
  });
  m.def("config_fp16_slot_bytes", [](const fmkv_config& c) {
    fmkv::check(fmkv_config_validate(&c));
    return fmkv_config_fp16_slot_bytes(&c);
  });
  m.def("bytes_per_token_head", [](int64_t d, int64_t bits, int64_t scale_group) {
    if (!fits_i32(d) || !fmkv_head_dim_supported((int32_t)d))
      fail("head_dim " + std::to_string(d) + " is not supported (" + fmkv::supported_head_dims_text() + ")");
    if (!fits_i32(bits) || (!fmkv_code_bits_supported((int32_t)bits) && bits != FMKV_FP16_BITS))
      fail("bits " + std::to_string(bits) + " is not supported (" + fmkv::supported_code_bits_text(true) + ")");
    if (!fits_i32(scale_group) || !fmkv_scale_group_supported((int32_t)scale_group))
      fail("scale_group " + std::to_string(scale_group) + " is not supported (0 = default, 32 or 64)");
    return fmkv_bytes_per_token_head((int32_t)d, (int32_t)bits, (int32_t)scale_group);
  }, "head_dim"_a, "bits"_a, "scale_group"_a = 0);

  // The rotation (FORMAT.md "Rotation") and the token regions, for the Python layers that need them
  // (fmkv.torch_quant, fmkv.hf, fmkv.reference): the numbers come from include/fmkv/format.h.
  m.def("rotation_sign_words", [](uint64_t seed, int32_t layer, int32_t head_dim) {
    if (!fmkv_head_dim_supported(head_dim)) fail("head_dim " + std::to_string(head_dim) + " is not supported (" + fmkv::supported_head_dims_text() + ")");
    std::vector<uint64_t> w((size_t)head_dim / 64);
    for (int32_t k = 0; k < head_dim / 64; ++k) w[(size_t)k] = fmkv_rotation_sign_word(seed, layer, k);
    size_t n = w.size();
    return numpy_array(std::move(w), {n});
  }, "seed"_a, "layer"_a, "head_dim"_a, "Rotation sign words of (seed, layer): bit i of word i // 64 set means s_i = -1.");
  m.def("layer_seed", [](uint64_t seed, int32_t layer) { return fmkv_rotation_state(seed, layer); }, "seed"_a, "layer"_a,
        "The seed whose layer-0 rotation equals (seed, layer)'s (a one-layer cache holding layer `layer`).");
  m.def("rotation_norm", [](int32_t head_dim) {
    if (!fmkv_head_dim_supported(head_dim)) fail("head_dim " + std::to_string(head_dim) + " is not supported (" + fmkv::supported_head_dims_text() + ")");
    return fmkv_rotation_norm(head_dim);
  }, "head_dim"_a, "The float32 nearest 1/sqrt(head_dim), applied after the unnormalised FWHT.");
  m.def("compressed_end", [](int32_t sink, int32_t window, int64_t length) {
    return fmkv_compressed_end(sink, window, length);
  }, "sink"_a, "window"_a, "length"_a, "E = max(sink, length - window): tokens [sink, E) of a sequence are compressed.");
  m.attr("FP16_BITS") = (int)FMKV_FP16_BITS;

  m.def("codebook", [](int64_t bits) {
    if (bits < 1 || bits > FMKV_CODE_BITS_MAX)
      fail("bits " + std::to_string(bits) + " is not supported (codebooks exist for 1.." + std::to_string(FMKV_CODE_BITS_MAX) + " bits)");
    std::vector<float> mags((size_t)1 << (bits - 1));
    fmkv::check(fmkv_codebook((int32_t)bits, mags.data()));
    size_t n = mags.size();
    return numpy_array(std::move(mags), {n});
  }, "bits"_a);
  m.def("codebook_levels", [](int64_t format_version, int64_t bits, bool is_v) {
    if (!fits_i32(format_version) || !fits_i32(bits)) fail("format_version and bits must be 32-bit integers");
    std::vector<float> mags((size_t)1 << (fmkv_code_bits_supported((int32_t)bits) ? bits - 1 : 0));
    fmkv::check(fmkv_codebook_levels((int32_t)format_version, (int32_t)bits, is_v ? 1 : 0, mags.data()));
    size_t n = mags.size();
    return numpy_array(std::move(mags), {n});
  }, "format_version"_a, "bits"_a, "is_v"_a);

  // Returns (codes uint8 [d], scale bits uint16 [d / scale_group]); the Python layer views scales as float16.
  m.def("quantize_vector", [](const AnyArray& x, int64_t bits, uint64_t seed, int64_t layer, int32_t scale_rule,
                              int64_t format_version, bool is_v, int64_t scale_group) {
    std::vector<uint16_t> xh = vector_f16("x", x);
    const int32_t d = (int32_t)xh.size();
    if (!fmkv_head_dim_supported(d)) fail("x: length " + std::to_string(d) + " is not a supported head_dim (" + fmkv::supported_head_dims_text() + ")");
    std::vector<uint8_t> codes(d);
    const int32_t sg = narrow_i32("scale_group", scale_group);
    if (!fmkv_scale_group_supported(sg)) fail("scale_group " + std::to_string(scale_group) + " is not supported (0 = default, 32 or 64)");
    std::vector<uint16_t> scales(fmkv_scales_per_vector(d, sg));
    fmkv::check(fmkv_quantize_vector_as(narrow_i32("format_version", format_version), is_v ? 1 : 0, sg, d, narrow_i32("bits", bits),
                                        scale_rule, seed, narrow_i32("layer", layer), xh.data(), codes.data(), scales.data()));
    size_t nc = codes.size(), ns = scales.size();
    return nb::make_tuple(numpy_array(std::move(codes), {nc}), numpy_array(std::move(scales), {ns}));
  }, "x"_a, "bits"_a, "seed"_a = 0, "layer"_a = 0, "scale_rule"_a = (int)FMKV_SCALE_LSQ, "format_version"_a = 0,
     "is_v"_a = false, "scale_group"_a = 0);

  m.def("dequantize_vector", [](const AnyArray& codes, const AnyArray& scale_bits, int64_t bits, uint64_t seed, int64_t layer,
                                int64_t format_version, bool is_v, int64_t scale_group) {
    std::vector<uint8_t> c = vector_exact<uint8_t>("codes", codes, nb::dlpack::dtype_code::UInt, "uint8");
    std::vector<uint16_t> s = vector_exact<uint16_t>("scales", scale_bits, nb::dlpack::dtype_code::UInt, "float16 / uint16 bits");
    const int32_t d = (int32_t)c.size();
    if (!fmkv_head_dim_supported(d)) fail("codes: length " + std::to_string(d) + " is not a supported head_dim (" + fmkv::supported_head_dims_text() + ")");
    const int32_t sg = narrow_i32("scale_group", scale_group);
    if (!fmkv_scale_group_supported(sg)) fail("scale_group " + std::to_string(scale_group) + " is not supported (0 = default, 32 or 64)");
    if ((int32_t)s.size() != fmkv_scales_per_vector(d, sg))
      fail("scales: length " + std::to_string(s.size()) + ", expected head_dim / scale_group = " + std::to_string(fmkv_scales_per_vector(d, sg)));
    std::vector<float> out(d);
    fmkv::check(fmkv_dequantize_vector_as(narrow_i32("format_version", format_version), is_v ? 1 : 0, sg, d, narrow_i32("bits", bits),
                                          seed, narrow_i32("layer", layer), c.data(), s.data(), out.data()));
    return numpy_array(std::move(out), {(size_t)d});
  }, "codes"_a, "scales"_a, "bits"_a, "seed"_a = 0, "layer"_a = 0, "format_version"_a = 0, "is_v"_a = false,
     "scale_group"_a = 0);
}

}  // namespace fmkv_py
