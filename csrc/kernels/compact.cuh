// compact / compact_many: gather the kept sequence positions of several tensors in one launch.
//
// Each tensor is seen as [outer, batch, N, row_units] units of unit_bytes (1, 2, 4, 8 or 16 bytes, the widest that
// divides its row size, strides and base address, so hidden states move in 16-byte loads) and is written
// contiguously as [outer, batch, k, row_units]: output row (o, b, r) is input row (o, b, keep[b * k + r]), or zeros
// where that keep entry is negative (the -1 fill of a batch's right-aligned keep rows: nothing is read for it).
// batch is 1 for a 1-D keep (b = 0) and B for a 2-D keep [B, k]. blockIdx.y picks the tensor; a grid-stride loop
// over its outer * batch * k * row_units units keeps every block busy whatever the mix of sizes (hidden states dwarf
// cos/sin and position ids).
#pragma once

#include "common.cuh"

namespace macer {
namespace gather {

constexpr int kThreads = 256;

struct Group {
  CompactTensor t[kMaxCompactTensors];
  int count;
  const int64_t* keep;
  int64_t k;
};

template <typename U>
__device__ __forceinline__ void copy_units(const CompactTensor& t, const int64_t* keep, int64_t k) {
  const int64_t total = t.outer * t.batch * k * t.row_units;
  const auto* src = static_cast<const unsigned char*>(t.src);
  U* dst = static_cast<U*>(t.dst);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t u = i % t.row_units;
    const int64_t rest = i / t.row_units;
    const int64_t r = rest % k, ob = rest / k;  // ob = o * batch + b
    // A 1-D keep (batch 1, uniform per tensor) skips the division by the batch.
    const int64_t b = t.batch == 1 ? 0 : ob % t.batch, o = t.batch == 1 ? ob : ob / t.batch;
    const int64_t j = __ldg(keep + b * k + r);
    U value{};  // zeros for a -1 entry
    if (j >= 0) {
      const int64_t offset = o * t.outer_stride + b * t.batch_stride + j * t.seq_stride + u * t.unit_stride;
      value = *reinterpret_cast<const U*>(src + offset);
    }
    dst[i] = value;  // dst is contiguous: unit i of the output
  }
}

__global__ void __launch_bounds__(kThreads) compact_kernel(const Group g) {
  // A stage's chain may launch this kernel before its predecessor ends (csrc/kernels/launch.cuh): wait for it
  // before the first global access; then let the successor be scheduled.
  grid_dependency_wait();
  launch_dependents();
  if (static_cast<int>(blockIdx.y) >= g.count) return;
  const CompactTensor& t = g.t[blockIdx.y];
  switch (t.unit_bytes) {  // uniform per block
    case 16: copy_units<uint4>(t, g.keep, g.k); break;
    case 8: copy_units<uint2>(t, g.keep, g.k); break;
    case 4: copy_units<unsigned>(t, g.keep, g.k); break;
    case 2: copy_units<unsigned short>(t, g.keep, g.k); break;
    default: copy_units<unsigned char>(t, g.keep, g.k); break;
  }
}

}  // namespace gather
}  // namespace macer
