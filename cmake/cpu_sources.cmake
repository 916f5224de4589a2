# CPU backend sources (included by the top-level CMakeLists.txt before add_library(fmkv)).
# Per-ISA kernel files get their own -m flags; the run-time dispatch (src/cpu/backend.cpp)
# only calls them when __builtin_cpu_supports says the CPU has the features. On AArch64 the NEON
# kernels need no flags (Advanced SIMD is baseline) and are the default.
set(FMKV_CPU_SOURCES
  src/cpu/thread_pool.cpp
  src/cpu/quantize.cpp
  src/cpu/append.cpp
  src/cpu/decode_attention.cpp
  src/cpu/backend.cpp
  src/cpu/kernels_scalar.cpp)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  list(APPEND FMKV_CPU_SOURCES src/cpu/kernels_avx2.cpp src/cpu/kernels_avx2vnni.cpp src/cpu/kernels_avx512.cpp
       src/cpu/kernels_avx512vnni.cpp)
  set_source_files_properties(src/cpu/kernels_avx2.cpp PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
  set_source_files_properties(src/cpu/kernels_avx2vnni.cpp PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-mavxvnni")
  set_source_files_properties(src/cpu/kernels_avx512.cpp PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx2;-mfma;-mf16c")
  set_source_files_properties(src/cpu/kernels_avx512vnni.cpp PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vnni;-mavx2;-mfma;-mf16c")
  set_source_files_properties(src/cpu/backend.cpp PROPERTIES COMPILE_DEFINITIONS "FMKV_CPU_HAVE_AVX512=1")
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "^(aarch64|arm64|ARM64)$")
  list(APPEND FMKV_CPU_SOURCES src/cpu/kernels_neon.cpp)
  # -ffp-contract=off is global (CMakeLists.txt); repeated here because quantize's bit-exactness
  # depends on it (GCC would otherwise fuse vmulq + vaddq into FMLA).
  set_source_files_properties(src/cpu/kernels_neon.cpp PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
  set_source_files_properties(src/cpu/backend.cpp PROPERTIES COMPILE_DEFINITIONS "FMKV_CPU_HAVE_NEON=1")
endif()
