// Host model of the CUDA byte permute prmt.b32 (default mode, the selector nibbles' sign-replicate bit
// included), for the format-3 prototypes' host checks: byte i of the result is byte (s_i & 7) of the 8-byte
// value b:a, or 0xff / 0x00 from that byte's bit 7 when s_i & 8.
#pragma once
#include <cstdint>

inline uint32_t prmt_host(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t x = a | ((uint64_t)b << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (s >> (4 * i)) & 15u;
    uint32_t byte = (uint32_t)(x >> (8 * (n & 7))) & 255u;
    if (n & 8) byte = (byte & 0x80u) ? 0xffu : 0u;
    r |= byte << (8 * i);
  }
  return r;
}
