// Launchers of topk_indices and coverage_select: a fixed chain of elementwise kernels and stable radix sorts,
// independent of k (no k-step loop), enqueued on the caller's stream without a host synchronisation.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/select.cuh"

namespace macer {
namespace {

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

int bit_width(uint64_t x) {  // bits needed for values 0..x (at least 1: CUB needs begin_bit < end_bit)
  int bits = 1;
  while (bits < 64 && (x >> bits) != 0) ++bits;
  return bits;
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::max<int64_t>(1, ceil_div(n, select::kThreads))); }

size_t sort_temp_bytes(const char* op, int num_items) {
  size_t bytes = 0;
  MACER_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                                       static_cast<uint64_t*>(nullptr),
                                                       static_cast<const int64_t*>(nullptr),
                                                       static_cast<int64_t*>(nullptr), num_items));
  return bytes;
}

// The workspace: two key and two value buffers for the sorts, the score order and greedy values of
// coverage_select, and CUB's temporary storage (sized for n items and all 64 key bits, the largest request made).
constexpr size_t kArrays = 6;
struct Workspace {
  uint64_t* keys[2];
  int64_t* vals[2];
  int64_t* by_score;  // token indices by (score desc, index asc)
  double* value;      // greedy value of each token
  void* temp;
  size_t temp_bytes;
};

Workspace carve(const SelectParams& p) {
  const size_t array = align_up(sizeof(int64_t) * static_cast<size_t>(p.n));
  auto* base = static_cast<unsigned char*>(p.workspace);
  Workspace w{};
  w.keys[0] = reinterpret_cast<uint64_t*>(base + 0 * array);
  w.keys[1] = reinterpret_cast<uint64_t*>(base + 1 * array);
  w.vals[0] = reinterpret_cast<int64_t*>(base + 2 * array);
  w.vals[1] = reinterpret_cast<int64_t*>(base + 3 * array);
  w.by_score = reinterpret_cast<int64_t*>(base + 4 * array);
  w.value = reinterpret_cast<double*>(base + 5 * array);
  w.temp = base + kArrays * array;
  w.temp_bytes = p.workspace_bytes > kArrays * array ? p.workspace_bytes - kArrays * array : 0;
  return w;
}

void check_temp(const char* op, size_t needed, const Workspace& w) {
  require(needed <= w.temp_bytes, op,
          "workspace too small for CUB's temporary storage (size it with select_workspace_bytes(n))");
}

// CUB's temporary storage per (device, items, key bits), asked once: a size query walks CUB's host-side dispatch
// (device attribute lookups, tuning selection) on every call otherwise, and each op sorts two or four times.
size_t sort_temp_bytes_cached(const char* op, int device, int num, int end_bit) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, size_t> cache;
  const auto key = std::make_tuple(device, num, end_bit);
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  size_t bytes = 0;
  MACER_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                                       static_cast<uint64_t*>(nullptr),
                                                       static_cast<const int64_t*>(nullptr),
                                                       static_cast<int64_t*>(nullptr), num, 0, end_bit));
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() > 4096) cache.clear();  // bounded: shapes vary with the prompt
  cache[key] = bytes;
  return bytes;
}

// Stable sort of `count` (key, value) pairs by key bits [0, end_bit): keys[0], vals[0] -> keys[1], vals_out.
void sort_pairs(const char* op, int device, Workspace& w, int64_t count, int end_bit, int64_t* vals_out,
                cudaStream_t stream) {
  const int num = static_cast<int>(count);
  size_t needed = sort_temp_bytes_cached(op, device, num, end_bit);
  check_temp(op, needed, w);
  MACER_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(w.temp, needed, w.keys[0], w.keys[1], w.vals[0], vals_out,
                                                       num, 0, end_bit, stream));
}

void check_params(const char* op, const SelectParams& p) {
  require(p.n >= 0 && p.n <= INT_MAX / 2, op, "n must be in [0, " + std::to_string(INT_MAX / 2) + "]");
  require(p.k >= 0 && p.k <= p.n, op, "k must be in [0, n]");
  require(is_float_code(p.scores_dtype), op, "scores dtype code must be a floating code");
  require(p.workspace_bytes >= select_workspace_bytes_no_query(p.n), op,
          "workspace too small (use select_workspace_bytes(n))");
}

// Token indices by (score desc, index asc) into `order`: the first step of both ops.
void sort_by_score(const char* op, const SelectParams& p, Workspace& w, int64_t* order, cudaStream_t stream) {
  select::score_keys_kernel<<<blocks_for(p.n), select::kThreads, 0, stream>>>(p.scores, p.scores_dtype,
                                                                               p.scores_stride, p.n, w.keys[0],
                                                                               w.vals[0]);
  MACER_LAUNCH_CHECK(op, "score_keys_kernel");
  sort_pairs(op, p.device, w, p.n, 64, order, stream);
}

// The first k entries of `order` (token indices), sorted ascending, into p.out.
void write_sorted_head(const char* op, const SelectParams& p, Workspace& w, const int64_t* order,
                       cudaStream_t stream) {
  select::head_keys_kernel<<<blocks_for(p.k), select::kThreads, 0, stream>>>(order, p.k, w.keys[0], w.vals[0]);
  MACER_LAUNCH_CHECK(op, "head_keys_kernel");
  sort_pairs(op, p.device, w, p.k, bit_width(static_cast<uint64_t>(p.n - 1)), p.out, stream);
}

}  // namespace

size_t select_workspace_bytes_no_query(int64_t n) {
  return kArrays * align_up(sizeof(int64_t) * static_cast<size_t>(n));
}

size_t select_workspace_bytes(int64_t n, int device) {
  constexpr const char* kOp = "select_workspace_bytes";
  require(n >= 0 && n <= INT_MAX / 2, kOp, "n must be in [0, " + std::to_string(INT_MAX / 2) + "]");
  const DeviceGuard device_guard = use_device(device, kOp);
  const int num = static_cast<int>(std::max<int64_t>(n, 1));
  return select_workspace_bytes_no_query(n) + sort_temp_bytes(kOp, num);
}

void topk_indices(const SelectParams& p) {
  constexpr const char* kOp = "topk_indices";
  check_params(kOp, p);
  if (p.k == 0) return;
  const DeviceGuard device_guard = use_device(p.device, kOp);
  auto stream = static_cast<cudaStream_t>(p.stream);
  Workspace w = carve(p);
  sort_by_score(kOp, p, w, w.vals[1], stream);
  write_sorted_head(kOp, p, w, w.vals[1], stream);
}

void coverage_select(const SelectParams& p) {
  constexpr const char* kOp = "coverage_select";
  check_params(kOp, p);
  require(p.coverage_weight >= 0.0, kOp, "coverage_weight must be >= 0");
  require(is_int_code(p.chunk_dtype), kOp, "chunk_ids dtype code must be an integer code");
  if (p.k == 0) return;
  const DeviceGuard device_guard = use_device(p.device, kOp);
  auto stream = static_cast<cudaStream_t>(p.stream);
  Workspace w = carve(p);
  const unsigned blocks = blocks_for(p.n);
  // 1. by_score = (score desc, index asc); 2. stably by chunk id: chunk order (chunk asc, score desc, index asc).
  sort_by_score(kOp, p, w, w.by_score, stream);
  select::chunk_keys_kernel<<<blocks, select::kThreads, 0, stream>>>(w.by_score, p.chunk_ids, p.chunk_dtype,
                                                                     p.chunk_stride, p.n, w.keys[0], w.vals[0]);
  MACER_LAUNCH_CHECK(kOp, "chunk_keys_kernel");
  const int chunk_bits = p.chunk_dtype == kInt8 || p.chunk_dtype == kUInt8 ? 8
                         : p.chunk_dtype == kInt16                       ? 16
                         : p.chunk_dtype == kInt32                       ? 32
                                                                         : 64;
  sort_pairs(kOp, p.device, w, p.n, chunk_bits, w.vals[1], stream);
  // 3. each token's greedy value from its rank inside the chunk.
  select::coverage_values_kernel<<<blocks, select::kThreads, 0, stream>>>(
      w.vals[1], w.keys[1], p.scores, p.scores_dtype, p.scores_stride, p.coverage_weight, p.n, w.value);
  MACER_LAUNCH_CHECK(kOp, "coverage_values_kernel");
  // 4. by_score stably re-sorted by value desc: the greedy's pick order (value desc, score desc, index asc).
  select::value_keys_kernel<<<blocks, select::kThreads, 0, stream>>>(w.by_score, w.value, p.n, w.keys[0],
                                                                     w.vals[0]);
  MACER_LAUNCH_CHECK(kOp, "value_keys_kernel");
  sort_pairs(kOp, p.device, w, p.n, 64, w.vals[1], stream);
  // 5. the first k picks, ascending.
  write_sorted_head(kOp, p, w, w.vals[1], stream);
}

}  // namespace macer
