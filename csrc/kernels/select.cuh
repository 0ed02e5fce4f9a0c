// Elementwise kernels of topk_indices and coverage_select. The sorts themselves are CUB's stable
// DeviceRadixSort::SortPairs on (uint64 key, int64 index); for small n CUB's dispatch runs its single-tile kernel
// (one thread block, BlockRadixSort in shared memory), above that its multi-block onesweep sort. One key/value
// instantiation serves every sort below, to keep the build short.
//
// Ordering keys: a float64 is mapped to a uint64 whose unsigned order is the float order (flip all bits of
// negatives, the sign bit of the rest; -0.0 first becomes +0.0, since the reference compares -0.0 == 0.0); the
// complement gives descending order, and every NaN gets kNanKey64, after every number (common.cuh). Stability turns
// "ties to the lower index" into "keep the input order".
#pragma once

#include "common.cuh"

namespace macer {
namespace select {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t descending_key(double x) { return descending_key64(x); }  // common.cuh

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// keys[i] = descending key of scores[i] (read as float64), vals[i] = i.
__global__ void score_keys_kernel(const void* scores, int dtype, int64_t stride, int64_t n, uint64_t* keys,
                                  int64_t* vals) {
  const int64_t i = thread_index();
  if (i >= n) return;
  keys[i] = descending_key(load_double(scores, dtype, i * stride));
  vals[i] = i;
}

// keys[j] = vals[j] = order[j] for the first k entries: sorting them by index gives the ascending result.
__global__ void head_keys_kernel(const int64_t* order, int64_t k, uint64_t* keys, int64_t* vals) {
  const int64_t j = thread_index();
  if (j >= k) return;
  keys[j] = static_cast<uint64_t>(order[j]);
  vals[j] = order[j];
}

// keys[p] = chunk id of token order[p], vals[p] = order[p] (then a stable sort by chunk).
__global__ void chunk_keys_kernel(const int64_t* order, const void* chunk_ids, int dtype, int64_t stride, int64_t n,
                                  uint64_t* keys, int64_t* vals) {
  const int64_t p = thread_index();
  if (p >= n) return;
  const int64_t i = order[p];
  keys[p] = static_cast<uint64_t>(load_int(chunk_ids, dtype, i * stride));  // non-negative (validated)
  vals[p] = i;
}

// First position in [lo, hi] whose sorted chunk key equals sorted[hi] (sorted is ascending).
__device__ __forceinline__ int64_t segment_start(const uint64_t* sorted, int64_t lo, int64_t hi) {
  const uint64_t key = sorted[hi];
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// In chunk order (chunk asc, score desc, index asc) position p holds the t-th token of its chunk, t = p - start of
// the chunk; its greedy value v = s + sqrt(lambda_c / (1 + t)) is the same float64 expression as the reference's
// (IEEE division, square root and addition, no contraction), stored by token index.
__global__ void coverage_values_kernel(const int64_t* by_chunk, const uint64_t* sorted_chunks, const void* scores,
                                       int dtype, int64_t stride, double weight, int64_t n, double* value) {
  const int64_t p = thread_index();
  if (p >= n) return;
  const double t = static_cast<double>(p - segment_start(sorted_chunks, 0, p));
  const int64_t i = by_chunk[p];
  value[i] = __dadd_rn(load_double(scores, dtype, i * stride), __dsqrt_rn(__ddiv_rn(weight, __dadd_rn(1.0, t))));
}

// keys[j] = descending key of the value of token order[j], vals[j] = order[j]. With `order` already sorted by
// (score desc, index asc), one stable sort by these keys gives the greedy's order: (value desc, score desc, index asc).
__global__ void value_keys_kernel(const int64_t* order, const double* value, int64_t n, uint64_t* keys,
                                  int64_t* vals) {
  const int64_t j = thread_index();
  if (j >= n) return;
  const int64_t i = order[j];
  keys[j] = descending_key(value[i]);
  vals[j] = i;
}

}  // namespace select
}  // namespace macer
