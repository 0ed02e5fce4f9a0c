// Launcher of compact_many: groups of up to kMaxCompactTensors tensors, one launch per group (one for a stage's
// hidden states + cos + sin + position ids), for a 1-D keep [k] or a batch's 2-D keep [B, W].
#include <algorithm>

#include "kernels/compact.cuh"
#include "kernels/launch.cuh"

namespace macer {

namespace {

// The single stride of dims [from, to) if they flatten into one (size-1 dims ignored; 1 if there are none).
bool merged_stride(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, size_t from, size_t to,
                   int64_t& out) {
  int64_t prev_stride = 0;
  bool any = false;
  out = 1;
  for (size_t i = from; i < to; ++i) {
    if (shape[i] == 1) continue;
    if (any && prev_stride != shape[i] * strides[i]) return false;
    prev_stride = strides[i];
    out = strides[i];
    any = true;
  }
  return true;
}

}  // namespace

CompactTensor compact_descriptor(const void* src, void* dst, const std::vector<int64_t>& shape,
                                 const std::vector<int64_t>& strides, int64_t element_bytes, int64_t dim,
                                 bool batched) {
  constexpr const char* kOp = "compact";
  const size_t rank = shape.size();
  require(strides.size() == rank && dim >= 0 && static_cast<size_t>(dim) < rank, kOp,
          "shape and strides must have the same length and dim must index them");
  require(element_bytes == 1 || element_bytes == 2 || element_bytes == 4 || element_bytes == 8 ||
              element_bytes == 16, kOp, "element size must be 1, 2, 4, 8 or 16 bytes");
  require(!batched || dim >= 1, kOp, "with a 2-D keep [B, W] the sequence dim needs a batch dim before it");
  const size_t d = static_cast<size_t>(dim);
  const size_t outer_end = batched ? d - 1 : d;  // the batch dim (batched) keeps its own stride
  int64_t outer = 1, inner = 1, outer_stride = 0, inner_stride = 0;
  for (size_t i = 0; i < outer_end; ++i) outer *= shape[i];
  for (size_t i = d + 1; i < rank; ++i) inner *= shape[i];
  require(merged_stride(shape, strides, 0, outer_end, outer_stride) &&
              merged_stride(shape, strides, d + 1, rank, inner_stride),
          kOp, "the dims before and after the sequence dim must each flatten to one stride (copy it first)");
  if (outer == 1) outer_stride = 0;
  const int64_t batch = batched ? shape[d - 1] : 1;
  const int64_t batch_stride = batch > 1 ? strides[d - 1] : 0;
  const int64_t seq_stride = shape[d] > 1 ? strides[d] : 0;
  CompactTensor t{};
  t.src = src;
  t.dst = dst;
  t.outer = outer;
  t.batch = batch;
  t.outer_stride = outer_stride * element_bytes;
  t.batch_stride = batch_stride * element_bytes;
  t.seq_stride = seq_stride * element_bytes;
  if (inner_stride != 1 && inner > 1) {  // rows whose elements are not adjacent move one element at a time
    t.unit_bytes = element_bytes;
    t.row_units = inner;
    t.unit_stride = inner_stride * element_bytes;
    return t;
  }
  const int64_t row_bytes = inner * element_bytes;
  const auto address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src));
  int64_t unit = 16;
  while (unit > 1 && (row_bytes % unit || address % unit || t.outer_stride % unit || t.batch_stride % unit ||
                      t.seq_stride % unit))
    unit >>= 1;
  t.unit_bytes = unit;
  t.row_units = row_bytes / unit;
  t.unit_stride = unit;
  return t;
}

void compact_many(const CompactParams& p) {
  constexpr const char* kOp = "compact";
  require(p.keep_rows >= 0 && p.k >= 0, kOp, "keep_rows and k must be >= 0");
  const int64_t batch = std::max<int64_t>(p.keep_rows, 1);
  for (const CompactTensor& t : p.tensors) {
    const int64_t u = t.unit_bytes;
    require(u == 1 || u == 2 || u == 4 || u == 8 || u == 16, kOp,
            "unit_bytes must be 1, 2, 4, 8 or 16, got " + std::to_string(u));
    require(t.outer >= 0 && t.row_units >= 0, kOp, "outer and row_units must be >= 0");
    // The kernel reads keep row b < t.batch: it must be the keep's row count (1 for a 1-D keep).
    require(t.batch == batch, kOp, "with a " + std::string(p.keep_rows ? "2-D keep [B, W]" : "1-D keep") +
                                       " every tensor's batch must be " + std::to_string(batch) + " (the dim before "
                                       "the sequence dim, of size B, for a 2-D keep), got " + std::to_string(t.batch));
  }
  if (p.k == 0) return;
  const DeviceGuard device_guard = use_device(p.device, kOp);
  for (size_t first = 0; first < p.tensors.size(); first += kMaxCompactTensors) {
    gather::Group g{};
    g.count = static_cast<int>(std::min<size_t>(kMaxCompactTensors, p.tensors.size() - first));
    g.keep = p.keep;
    g.k = p.k;
    int64_t most_bytes = 0;
    for (int i = 0; i < g.count; ++i) {
      g.t[i] = p.tensors[first + i];
      most_bytes = std::max(most_bytes, g.t[i].outer * g.t[i].batch * p.k * g.t[i].row_units * g.t[i].unit_bytes);
    }
    if (most_bytes == 0) continue;
    // About 16 KiB of output per block for the largest tensor, capped so the grid-stride loop takes over on huge
    // inputs (8192 blocks keep every SM of an H100 busy several times over).
    const int64_t blocks = std::min<int64_t>(8192, std::max<int64_t>(1, ceil_div(most_bytes, 16 * 1024)));
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(g.count));
    launch_kernel(kOp, "compact_kernel", gather::compact_kernel, grid, dim3(gather::kThreads), 0,
                  static_cast<cudaStream_t>(p.stream), g);
  }
}

}  // namespace macer
