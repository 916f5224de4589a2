# Snapshot save/load (include/fmkv/io.h, docs/FILE-FORMAT.md). Included by the top-level
# CMakeLists.txt before add_library(fmkv ...).
list(APPEND FMKV_CORE_SOURCES
  src/io/crc32c.cpp
  src/io/layout.cpp
  src/io/save.cpp
  src/io/load.cpp
  src/io/format1.cpp)
