// Packed rows of a batch (include/fmkv/params.h fmkv_batch): sequence s owns rows
// [row_offsets[s], row_offsets[s + 1]). Portable: host C++, CUDA host and device, MSL.
#ifndef FMKV_FORMAT_ROWS_H
#define FMKV_FORMAT_ROWS_H
#include "../../include/fmkv/format.h"
#include "portability.h"

namespace fmkv {

// Sequence owning packed row r: the last s with row_offsets[s] <= r (empty sequences skipped).
FMKV_HD int32_t seq_of_row(FMKV_DEVICE const int64_t* row_offsets, int32_t num_seqs, int64_t r) {
  int32_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (row_offsets[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace fmkv

#endif  // FMKV_FORMAT_ROWS_H
