#!/usr/bin/env bash
# Builds the two standalone device tests into .gpu1/ (ignored via .git/info/exclude) for one
# device call: `.gpu1/cuda_core_test && .gpu1/io_cuda_test`. Both link the CUDA-enabled library of
# build-ci (cmake -DFMKV_CUDA=ON) statically; the binaries need only libc/libm on the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
CUDA=${CUDA:-/usr/local/cuda-13.0}
mkdir -p .gpu1
ninja -C build-ci fmkv
# 1. Metal kernel core as CUDA (warp = SIMD group), against src/ref and the C API.
"$CUDA/bin/nvcc" -std=c++17 -arch=sm_90 -fmad=false -O2 -Xcompiler -ffp-contract=off -DFMKV_GLIBC_COMPAT_ARC4RANDOM -Iinclude -Isrc \
  tests/metal/cuda_core_test.cu build-ci/libfmkv.a \
  -Xcompiler -static-libstdc++ -Xcompiler -static-libgcc -o .gpu1/cuda_core_test
# 2. Snapshot save/load around a CUDA cache (public C API only).
/usr/bin/c++ -std=c++17 -O2 -ffp-contract=off -Wall -DFMKV_GLIBC_COMPAT_ARC4RANDOM -Iinclude -o .gpu1/io_cuda_test tests/cuda/io_cuda_test.cpp \
  build-ci/libfmkv.a "$CUDA/lib/libcudart_static.a" -ldl -lrt -lpthread -static-libstdc++ -static-libgcc
# Host-side self-check of the io test on the reference backend (no GPU needed).
.gpu1/io_cuda_test ref | tail -1
for b in .gpu1/cuda_core_test .gpu1/io_cuda_test; do
  if ldd "$b" | grep -E 'libstdc\+\+|libcudart|libgcc_s'; then echo "$b: unexpected shared dependency" >&2; exit 1; fi
done
ls -la .gpu1
for b in .gpu1/cuda_core_test .gpu1/io_cuda_test; do
  echo "$b needs: $(objdump -T "$b" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
done
