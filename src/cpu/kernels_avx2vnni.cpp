// AVX2 kernels with AVX-VNNI (N = 8): kernels_avx2.cpp compiled with -mavx2 -mfma -mf16c -mavxvnni
// (cmake/cpu_sources.cmake) over the traits Avx2VnniT, whose integer dot products score format 3's 3-bit K
// (kernels_impl.h, IntQuery); used only when the CPU reports AVX2, FMA, F16C and AVX-VNNI.
#define FMKV_AVX2_ENTRY kernels_avx2vnni
#define FMKV_AVX2_NAME "avx2vnni"
#define FMKV_AVX2_TRAITS Avx2VnniT
#include "kernels_avx2.cpp"
