// AVX-512 kernels with VNNI and BW (N = 16): kernels_avx512.cpp compiled with -mavx512f -mavx512bw
// -mavx512vnni -mavx2 -mfma -mf16c (cmake/cpu_sources.cmake) over the traits Avx512VnniT, whose integer
// dot products score format 3's 3-bit K (kernels_impl.h, IntQuery); used only when the CPU reports
// AVX-512F, BW and VNNI.
#define FMKV_AVX512_ENTRY kernels_avx512vnni
#define FMKV_AVX512_NAME "avx512vnni"
#define FMKV_AVX512_TRAITS Avx512VnniT
#include "kernels_avx512.cpp"
