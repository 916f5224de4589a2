// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init/xorout 0xFFFFFFFF), the checksum of
// the fmkv snapshot file format (docs/FILE-FORMAT.md). Check value: crc32c("123456789") = 0xE3069283.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fmkv::io {

// CRC of data[0, n) continuing from `crc` (pass 0 to start; results chain: crc32c(b, crc32c(a)) ==
// crc32c(a + b)). Uses SSE4.2 when the CPU has it, slice-by-8 tables otherwise; both give the same
// value.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// The portable table implementation (the oracle for the hardware path; tests compare them).
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace fmkv::io
