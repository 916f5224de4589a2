// The backends compiled into this build, by fmkv_backend id. Each backend defines its table
// (`<name>_backend`, src/<name>/backend.*); cmake/backends.cmake writes the list of registered names
// into fmkv_backend_list.inc (FMKV_BACKEND(name) lines). A build without that list (hand-compiled
// tools such as tests/fuzz/run.sh) has the reference backend only.
#include "../core/backend.h"

namespace fmkv {

#define FMKV_BACKEND(name) extern const BackendOps name##_backend;
#ifdef FMKV_BACKEND_LIST
#include "fmkv_backend_list.inc"
#else
FMKV_BACKEND(ref)
#endif
#undef FMKV_BACKEND

namespace {
#define FMKV_BACKEND(name) &name##_backend,
const BackendOps* const kRegistered[] = {
#ifdef FMKV_BACKEND_LIST
#include "fmkv_backend_list.inc"
#else
    FMKV_BACKEND(ref)
#endif
};
#undef FMKV_BACKEND
}  // namespace

const BackendOps* find_backend(fmkv_backend b) {
  for (const BackendOps* ops : kRegistered)
    if (ops->id == b) return ops;
  return nullptr;
}

}  // namespace fmkv
