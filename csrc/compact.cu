// Launcher of compact_many: groups of up to kMaxCompactTensors tensors, one launch per group (one for a stage's
// hidden states + cos + sin + position ids).
#include <algorithm>

#include "kernels/compact.cuh"

namespace macer {

void compact_many(const CompactParams& p) {
  constexpr const char* kOp = "compact";
  for (const CompactTensor& t : p.tensors) {
    const int64_t u = t.unit_bytes;
    require(u == 1 || u == 2 || u == 4 || u == 8 || u == 16, kOp,
            "unit_bytes must be 1, 2, 4, 8 or 16, got " + std::to_string(u));
    require(t.outer >= 0 && t.row_units >= 0, kOp, "outer and row_units must be >= 0");
  }
  if (p.k == 0) return;
  use_device(p.device, kOp);
  for (size_t first = 0; first < p.tensors.size(); first += kMaxCompactTensors) {
    gather::Group g{};
    g.count = static_cast<int>(std::min<size_t>(kMaxCompactTensors, p.tensors.size() - first));
    g.keep = p.keep;
    g.k = p.k;
    int64_t most_bytes = 0;
    for (int i = 0; i < g.count; ++i) {
      g.t[i] = p.tensors[first + i];
      most_bytes = std::max(most_bytes, g.t[i].outer * p.k * g.t[i].row_units * g.t[i].unit_bytes);
    }
    if (most_bytes == 0) continue;
    // About 16 KiB of output per block for the largest tensor, capped so the grid-stride loop takes over on huge
    // inputs (8192 blocks keep every SM of an H100 busy several times over).
    const int64_t blocks = std::min<int64_t>(8192, std::max<int64_t>(1, ceil_div(most_bytes, 16 * 1024)));
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(g.count));
    gather::compact_kernel<<<grid, gather::kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(g);
    MACER_LAUNCH_CHECK(kOp, "compact_kernel");
  }
}

}  // namespace macer
