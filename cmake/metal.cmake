# Metal backend (Apple platforms only). Included from the top-level CMakeLists.txt:
#   if(APPLE) include(cmake/metal.cmake OPTIONAL) endif()
# Adds src/metal/backend.mm to the library and registers the backend, and builds one metallib per
# .metal file with fast math OFF (bit-exact float32 quantization; docs/METAL.md). When the Metal
# compiler (xcrun metal) is missing, the backend compiles the kernels from the source directory at
# run time with MTLCompileOptions mathMode = safe.
if(NOT APPLE)
  return()
endif()
enable_language(OBJCXX)
find_library(FMKV_METAL_FRAMEWORK Metal REQUIRED)
find_library(FMKV_FOUNDATION_FRAMEWORK Foundation REQUIRED)
target_sources(fmkv PRIVATE ${PROJECT_SOURCE_DIR}/src/metal/backend.mm)
set_source_files_properties(${PROJECT_SOURCE_DIR}/src/metal/backend.mm PROPERTIES COMPILE_OPTIONS "-fobjc-arc")
target_link_libraries(fmkv PUBLIC ${FMKV_METAL_FRAMEWORK} ${FMKV_FOUNDATION_FRAMEWORK})
target_compile_definitions(fmkv PRIVATE FMKV_METAL_SOURCE_DIR="${PROJECT_SOURCE_DIR}/src/metal")
fmkv_register_backend(metal)

execute_process(COMMAND xcrun -sdk macosx -f metal OUTPUT_VARIABLE FMKV_METAL_COMPILER
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE FMKV_METAL_FOUND)
if(FMKV_METAL_FOUND EQUAL 0 AND FMKV_METAL_COMPILER)
  set(FMKV_METALLIB_DIR ${CMAKE_BINARY_DIR}/metallib)
  set(FMKV_METALLIBS "")
  foreach(k quantize decode_attention)
    add_custom_command(
      OUTPUT ${FMKV_METALLIB_DIR}/${k}.metallib
      COMMAND ${CMAKE_COMMAND} -E make_directory ${FMKV_METALLIB_DIR}
      COMMAND xcrun -sdk macosx metal -std=metal3.1 -fno-fast-math -Wall -Werror
              -c ${PROJECT_SOURCE_DIR}/src/metal/${k}.metal -o ${FMKV_METALLIB_DIR}/${k}.air
      COMMAND xcrun -sdk macosx metallib ${FMKV_METALLIB_DIR}/${k}.air -o ${FMKV_METALLIB_DIR}/${k}.metallib
      DEPENDS ${PROJECT_SOURCE_DIR}/src/metal/${k}.metal ${PROJECT_SOURCE_DIR}/src/metal/kernel_core.h
              ${PROJECT_SOURCE_DIR}/src/format/portability.h ${PROJECT_SOURCE_DIR}/src/metal/params_msl.h
              ${PROJECT_SOURCE_DIR}/src/format/codebooks.inc
      COMMENT "metal (fast math off): ${k}.metal")
    list(APPEND FMKV_METALLIBS ${FMKV_METALLIB_DIR}/${k}.metallib)
  endforeach()
  add_custom_target(fmkv_metallibs ALL DEPENDS ${FMKV_METALLIBS})
  add_dependencies(fmkv fmkv_metallibs)
  target_compile_definitions(fmkv PRIVATE FMKV_METALLIB_DIR_BUILT="${FMKV_METALLIB_DIR}")
else()
  message(STATUS "fmkv: no Metal compiler (xcrun metal); kernels compile from source at run time")
endif()
