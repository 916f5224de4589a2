# CUDA backend of fmkv (src/cuda). Included by the top-level CMakeLists.txt after add_library(fmkv)
# when nvcc is found. Targets sm_90 (H100/H200) unless CMAKE_CUDA_ARCHITECTURES is given; the
# kernels use mma.sync (sm_80+) and __reduce_or_sync (sm_80+), so 80/86/89/90 all build.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)

# The top-level add_compile_options() (-ffp-contract=off, -Wall, sanitizers) are GCC/Clang flags that
# nvcc rejects: restrict the fmkv target's inherited options to C/C++ sources.
get_target_property(_fmkv_opts fmkv COMPILE_OPTIONS)
if(_fmkv_opts)
  set(_fmkv_wrapped "")
  foreach(_o IN LISTS _fmkv_opts)
    list(APPEND _fmkv_wrapped "$<$<COMPILE_LANGUAGE:C,CXX>:${_o}>")
  endforeach()
  set_property(TARGET fmkv PROPERTY COMPILE_OPTIONS "${_fmkv_wrapped}")
endif()

set(FMKV_CUDA_SOURCES
  ${PROJECT_SOURCE_DIR}/src/cuda/backend.cpp
  ${PROJECT_SOURCE_DIR}/src/cuda/runtime.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/append.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/decode_attention.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/decode_k2.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/decode_k3.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/decode_k4.cu
  ${PROJECT_SOURCE_DIR}/src/cuda/decode_k16.cu)
target_sources(fmkv PRIVATE ${FMKV_CUDA_SOURCES})
# fmkv was created before enable_language(CUDA): its CUDA_ARCHITECTURES (and a compiler launcher such as
# ccache, from CMAKE_CUDA_COMPILER_LAUNCHER or the environment variable of that name) were never initialised.
set_property(TARGET fmkv PROPERTY CUDA_ARCHITECTURES ${CMAKE_CUDA_ARCHITECTURES})
if(CMAKE_CUDA_COMPILER_LAUNCHER)
  set_property(TARGET fmkv PROPERTY CUDA_COMPILER_LAUNCHER ${CMAKE_CUDA_COMPILER_LAUNCHER})
endif()
# Host-side float code of nvcc translation units must not contract either; the quantizer also
# uses explicit __f*_rn intrinsics, -fmad=false makes any remaining expression safe.
set_source_files_properties(${PROJECT_SOURCE_DIR}/src/cuda/append.cu PROPERTIES COMPILE_OPTIONS "-fmad=false")
target_compile_options(fmkv PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-ffp-contract=off>)
fmkv_register_backend(cuda)
# Decode attention: a default build compiles a small grid of (head_dim, K bits, V bits) for every page
# size (src/cuda/decode_attention.cuh, attn_compiled); ON compiles all 36 combinations.
option(FMKV_CUDA_FULL_GRID "Compile the CUDA decode attention for every head_dim x K x V combination" OFF)
if(FMKV_CUDA_FULL_GRID)
  target_compile_definitions(fmkv PRIVATE FMKV_CUDA_FULL_GRID=1)
endif()
# Latency trace of the decode launches (per-CTA phase timestamps, read by fmkv_cuda_bench --trace;
# tests/cuda/trace.sh): a diagnostic build only, never on by default.
option(FMKV_CUDA_TRACE "Record per-CTA phase timestamps in the CUDA decode kernels (diagnostic build)" OFF)
if(FMKV_CUDA_TRACE)
  target_compile_definitions(fmkv PUBLIC FMKV_CUDA_TRACE=1)
endif()
target_link_libraries(fmkv PUBLIC CUDA::cudart_static)
set(FMKV_HAVE_CUDA_BACKEND ON)
set(FMKV_HAVE_CUDA_BACKEND ON CACHE INTERNAL "fmkv CUDA backend compiled")

option(FMKV_CUDA_BENCH "Build the CUDA decode benchmark (bench/cuda_bench.cu)" ON)
if(FMKV_CUDA_BENCH AND EXISTS ${PROJECT_SOURCE_DIR}/bench/cuda_bench.cu)
  add_executable(fmkv_cuda_bench ${PROJECT_SOURCE_DIR}/bench/cuda_bench.cu)
  target_include_directories(fmkv_cuda_bench PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(fmkv_cuda_bench PRIVATE fmkv CUDA::cudart_static)
endif()

# CUDA-only error tests (tests/cuda/test_cuda_errors.cpp): skip themselves without a usable device.
if(FMKV_BUILD_TESTS AND EXISTS ${PROJECT_SOURCE_DIR}/tests/cuda/test_cuda_errors.cpp)
  find_package(GTest)
  if(GTest_FOUND)
    add_executable(fmkv_cuda_tests ${PROJECT_SOURCE_DIR}/tests/cuda/test_cuda_errors.cpp)
    target_include_directories(fmkv_cuda_tests PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
    target_compile_definitions(fmkv_cuda_tests PRIVATE FMKV_WITH_CUDA=1)
    target_link_libraries(fmkv_cuda_tests PRIVATE fmkv GTest::GTest GTest::Main)
    enable_testing()
    add_test(NAME fmkv_cuda_tests COMMAND fmkv_cuda_tests)
  endif()
endif()

if(FMKV_BUILD_TESTS)
  # Metal kernel core (src/metal/kernel_core.h) run as CUDA, bit-exact vs src/ref; needs a GPU
  # (run on the H200: docs/results/metal_core_cuda.log).
  add_executable(fmkv_metal_core_cuda_test ${PROJECT_SOURCE_DIR}/tests/metal/cuda_core_test.cu)
  target_include_directories(fmkv_metal_core_cuda_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(fmkv_metal_core_cuda_test PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-fmad=false>)
  target_link_libraries(fmkv_metal_core_cuda_test PRIVATE fmkv CUDA::cudart_static)
  # Snapshot save/load around a CUDA cache (public C API); "ref" mode needs no GPU.
  # The device's fp16 conversions (half.h under __CUDA_ARCH__) against the portable ones, every input;
  # skipped (exit 77) without a usable device.
  add_executable(fmkv_half_cuda_test ${PROJECT_SOURCE_DIR}/tests/cuda/half_cuda_test.cu)
  target_include_directories(fmkv_half_cuda_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  add_test(NAME fmkv_half_cuda_test COMMAND fmkv_half_cuda_test)
  set_tests_properties(fmkv_half_cuda_test PROPERTIES SKIP_RETURN_CODE 77)
  # The balanced split plan of ragged batches evaluated on the device (every split taken exactly once);
  # skipped (exit 77) without a usable device.
  add_executable(fmkv_balanced_plan_cuda_test ${PROJECT_SOURCE_DIR}/tests/cuda/balanced_plan_cuda_test.cu)
  target_include_directories(fmkv_balanced_plan_cuda_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/include)
  add_test(NAME fmkv_balanced_plan_cuda_test COMMAND fmkv_balanced_plan_cuda_test)
  set_tests_properties(fmkv_balanced_plan_cuda_test PROPERTIES SKIP_RETURN_CODE 77)
  add_executable(fmkv_io_cuda_test ${PROJECT_SOURCE_DIR}/tests/cuda/io_cuda_test.cpp)
  target_link_libraries(fmkv_io_cuda_test PRIVATE fmkv)
  add_test(NAME fmkv_io_cuda_test_ref COMMAND fmkv_io_cuda_test ref)
endif()
