// Helpers shared by the kernels: checked CUDA calls, dtype-coded loads, warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../launchers.h"

namespace macer {

// Turn a CUDA error into a Python exception (pybind11 maps std::runtime_error to RuntimeError) naming the op, the
// call that failed and CUDA's error string.
inline void check_cuda(cudaError_t err, const char* op, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("macer_kernels.") + op + ": " + what + " failed: " + cudaGetErrorName(err) +
                             " (" + cudaGetErrorString(err) + ")");
  }
}
#define MACER_CUDA_CHECK(op, call) ::macer::check_cuda((call), (op), #call)
// After a launch: configuration errors surface from cudaGetLastError (errors of earlier asynchronous work on the
// stream may also be reported here; they are named as such by CUDA's string).
#define MACER_LAUNCH_CHECK(op, kernel) ::macer::check_cuda(cudaGetLastError(), (op), "launch of " kernel)

inline void require(bool ok, const char* op, const std::string& message) {
  if (!ok) throw std::invalid_argument(std::string("macer_kernels.") + op + ": " + message);
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool is_int_code(int dtype) { return dtype >= kInt8 && dtype <= kInt64; }
inline bool is_float_code(int dtype) { return dtype >= kFloat32 && dtype <= kFloat64; }

// Integer tensors of any width are read in place (no conversion launch): the dtype code is uniform per launch, so
// the switch costs one well-predicted branch.
__device__ __forceinline__ int64_t load_int(const void* base, int dtype, int64_t offset) {
  switch (dtype) {
    case kInt8: return static_cast<const int8_t*>(base)[offset];
    case kUInt8: return static_cast<const uint8_t*>(base)[offset];
    case kInt16: return static_cast<const int16_t*>(base)[offset];
    case kInt32: return static_cast<const int32_t*>(base)[offset];
    default: return static_cast<const int64_t*>(base)[offset];
  }
}

// Floating tensors read as float64 (exact for every input dtype), for the selection ops' float64 comparisons.
__device__ __forceinline__ double load_double(const void* base, int dtype, int64_t offset) {
  switch (dtype) {
    case kFloat16: return static_cast<double>(__half2float(static_cast<const __half*>(base)[offset]));
    case kBFloat16: return static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(base)[offset]));
    case kFloat64: return static_cast<const double*>(base)[offset];
    default: return static_cast<double>(static_cast<const float*>(base)[offset]);
  }
}

// Selection order keys: an unsigned integer whose ascending order is the descending order of the score, the same
// rule on every backend (macer_kernels.select.order_key): -0.0 ties with +0.0, and every NaN -- tested with x != x,
// never through its bits, so neither its sign nor its payload nor a conversion on the way here (float -> double
// may return the canonical NaN) matters -- gets kNanKey*, after -inf's key (0xFF800000 / 0xFFF0000000000000) and
// before ~0, which the kernels keep for "never" (tokens of another label, padding).
constexpr uint32_t kNanKey32 = 0xFFFFFFFFu;
constexpr uint64_t kNanKey64 = ~0ull - 1;

__host__ __device__ __forceinline__ uint32_t descending_key32(float x) {
  if (x != x) return kNanKey32;
  if (x == 0.0f) x = 0.0f;  // -0.0 -> +0.0: the reference compares them equal
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return ~((bits >> 31) ? ~bits : (bits | 0x80000000u));
}

__host__ __device__ __forceinline__ uint64_t descending_key64(double x) {
  if (x != x) return kNanKey64;
  if (x == 0.0) x = 0.0;
  uint64_t bits;
  memcpy(&bits, &x, sizeof bits);
  return ~((bits >> 63) ? ~bits : (bits | (1ull << 63)));
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Programmatic dependent launch (sm_90+; the prepared stage chains its kernels this way). A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while its predecessor on the stream still runs: every
// kernel of a chain calls grid_dependency_wait() before its first global read of anything a predecessor wrote (and
// before its first global write that a predecessor may still read), and may call launch_dependents() once its own
// successor can start its prologue. Both compile to nothing below sm_90, and the wait returns at once for a kernel
// launched without the attribute (its predecessor is complete), so every kernel calls them unconditionally.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace macer
