// Writes the format-1 snapshot goldens: build against the format-1 library (commit 7978fef), run
// with the output directory (tests/golden/README.md has the commands). Built against any later
// library it writes the same caches in that library's format.
#include <cstdio>
#include <fstream>

#include "../format1_snapshot.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <output directory>\n", argv[0]);
    return 2;
  }
  std::printf("format version %d\n", fmkv_format_version());
  for (const auto& c : fmkv_format1::cases()) {
    const std::vector<uint8_t> b = fmkv_format1::build(c);
    const std::string path = std::string(argv[1]) + "/" + c.file;
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write((const char*)b.data(), (std::streamsize)b.size());
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("%s: %zu bytes\n", path.c_str(), b.size());
  }
  return 0;
}
