// Launcher of modality_scores: fills the kernels' arguments from ModalityScoresParams and enqueues the three passes.
// The number of key-tile splits is chosen here from the device's SM count and the tile kernel's occupancy, both
// asked once per (device, dtype, padded D) and cached (host attributes, no device work per call).
#include <algorithm>
#include <climits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/launch.cuh"
#include "kernels/modality_scores.cuh"

namespace macer {
namespace {

constexpr const char* kOp = "modality_scores";
constexpr int kMaxDevices = 64;

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Partials per (row, label) the workspace holds: an upper bound of the splits of every dtype on every device.
int64_t max_splits(int64_t num_keys) {
  return std::min(ceil_div(num_keys, scores::kMinKeysPerTile), scores::kMaxSplits);
}

struct Workspace {
  float* logits;
  float2* partial;
  float2* stats;
};

Workspace carve(void* base, int64_t batch, int64_t rows, int64_t num_keys) {
  auto* p = static_cast<unsigned char*>(base);
  Workspace w{};
  w.logits = reinterpret_cast<float*>(p);
  p += align_up(sizeof(float) * batch * rows * num_keys);
  w.partial = reinterpret_cast<float2*>(p);
  p += align_up(sizeof(float2) * batch * rows * kNumLabels * max_splits(num_keys));
  w.stats = reinterpret_cast<float2*>(p);
  return w;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Tile-kernel CTAs that run at once on `device` for this dtype and padded D (SMs x resident blocks). The first call
// per device also opts the kernel in to the shared memory of its largest tile (D = 256), so any D may launch later.
template <typename T>
int64_t ctas_per_wave(int device, int padded_dim) {
  using C = scores::TileConfig<T>;
  static std::mutex mutex;
  static int64_t cache[kMaxDevices][scores::kMaxHeadDim + 1];  // 0 = not yet asked
  require(device >= 0 && device < kMaxDevices, kOp, "device index must be in [0, 63]");
  std::lock_guard<std::mutex> lock(mutex);
  int64_t& ctas = cache[device][padded_dim];
  if (ctas == 0) {
    const int max_padded = static_cast<int>(ceil_div(scores::kMaxHeadDim, C::kDimAlign) * C::kDimAlign);
    MACER_CUDA_CHECK(kOp, cudaFuncSetAttribute(scores::scores_tile_kernel<T>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(scores::tile_smem_bytes<T>(max_padded))));
    int sms = 0, blocks = 0;
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    MACER_CUDA_CHECK(kOp, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                              &blocks, scores::scores_tile_kernel<T>, scores::kThreads,
                              scores::tile_smem_bytes<T>(padded_dim)));
    ctas = std::max<int64_t>(1, int64_t{sms} * std::max(blocks, 1));
  }
  return ctas;
}

// Launches the tile kernel; returns the number of splits (partials per (row, label)).
template <typename T>
int64_t launch_tiles(const ModalityScoresParams& p, const Workspace& w) {
  using C = scores::TileConfig<T>;
  scores::TileArgs a{};
  a.query = p.query;
  a.key = p.key;
  a.modality = p.modality;
  a.positions = p.query_positions;
  a.logits = w.logits;
  a.partial = w.partial;
  a.modality_dtype = p.modality_dtype;
  a.positions_dtype = p.positions_dtype;
  a.q_heads = p.q_heads;
  a.q_len = p.q_len;
  a.head_dim = p.head_dim;
  a.kv_heads = p.kv_heads;
  a.num_keys = p.num_keys;
  for (int i = 0; i < 4; ++i) a.q_stride[i] = p.q_stride[i];
  for (int i = 0; i < 3; ++i) a.k_stride[i] = p.k_stride[i];
  for (int i = 0; i < 2; ++i) a.mod_stride[i] = p.mod_stride[i];
  for (int i = 0; i < 2; ++i) a.pos_stride[i] = p.pos_stride[i];
  a.scale_log2 = static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);  // log2(e)
  constexpr int64_t V = 16 / sizeof(T);
  const int64_t esize = sizeof(T);
  a.vec16 = aligned16(p.key) && p.head_dim % V == 0 && (p.k_stride[0] * esize) % 16 == 0 &&
            (p.k_stride[1] * esize) % 16 == 0 && (p.k_stride[2] * esize) % 16 == 0;
  a.q_vec16 = p.q_stride[3] == 1 && aligned16(p.query) && p.head_dim % V == 0 &&
              (p.q_stride[0] * esize) % 16 == 0 && (p.q_stride[1] * esize) % 16 == 0 &&
              (p.q_stride[2] * esize) % 16 == 0;
  a.padded_dim = static_cast<int>(ceil_div(p.head_dim, C::kDimAlign) * C::kDimAlign);

  const ScoresSplitPlan plan =
      modality_scores_split_plan(p.q_dtype, p.batch, p.kv_heads, p.num_keys, ctas_per_wave<T>(p.device, a.padded_dim));
  a.tiles = plan.tiles;
  a.splits = plan.splits;
  a.split_tiles = plan.split_tiles;
  a.split_extra = plan.split_extra;
  a.group = p.q_heads / p.kv_heads;

  const size_t smem = scores::tile_smem_bytes<T>(a.padded_dim);
  const dim3 grid(static_cast<unsigned>(a.splits), static_cast<unsigned>(p.kv_heads),
                  static_cast<unsigned>(p.batch));
  launch_kernel(kOp, "scores_tile_kernel", scores::scores_tile_kernel<T>, grid, dim3(scores::kThreads), smem,
                static_cast<cudaStream_t>(p.stream), a);
  return a.splits;
}

}  // namespace

ScoresSplitPlan modality_scores_split_plan(int q_dtype, int64_t batch, int64_t kv_heads, int64_t num_keys,
                                           int64_t wave) {
  require(batch >= 1 && kv_heads >= 1 && num_keys >= 1 && wave >= 1, kOp,
          "split plan: B, Hkv, N and wave must be >= 1");
  ScoresSplitPlan plan{};
  plan.tiles = ceil_div(num_keys, scores::tile_keys(q_dtype));
  // Whole waves of CTAs over (splits, Hkv, B). With S splits the grid is S * Hkv * B CTAs, ceil(S Hkv B / wave)
  // waves, each as long as a split: ceil(T / S) tiles plus about one tile of fixed work per CTA (staging the query,
  // writing its partials). S = 1 at Hkv * B = 400 on a 660-CTA wave would run one 60 % full wave of whole-row CTAs;
  // the estimate picks the S of least waves x (tiles per split + 1), the fewest splits among equals (fewer
  // partials). Among the S that run in w waves the largest, floor(w * wave / (Hkv B)), has the shortest splits, so
  // only those are tried, for w = 1 .. kMaxWaves. Every split gets at least one tile (S <= T) and the workspace
  // bound holds (S <= max_splits(N)).
  const int64_t ctas = kv_heads * batch;
  const int64_t limit = std::min(plan.tiles, max_splits(num_keys));
  constexpr int64_t kMaxWaves = 16;  // beyond this the last wave's share of the time is under 1/16 anyway
  auto cost = [&](int64_t s) { return ceil_div(s * ctas, wave) * (ceil_div(plan.tiles, s) + 1); };
  plan.splits = 1;
  int64_t best = cost(1);
  for (int64_t w = 1; w <= kMaxWaves; ++w) {
    const int64_t s = std::min(limit, w * wave / ctas);
    if (s >= 1 && cost(s) < best) {
      best = cost(s);
      plan.splits = s;
    }
    if (s >= limit) break;
  }
  plan.split_tiles = plan.tiles / plan.splits;
  plan.split_extra = plan.tiles % plan.splits;
  return plan;
}

size_t modality_scores_workspace_bytes(int64_t batch, int64_t q_heads, int64_t q_len, int64_t num_keys) {
  const int64_t rows = q_heads * q_len;
  return align_up(sizeof(float) * batch * rows * num_keys) +
         align_up(sizeof(float2) * batch * rows * kNumLabels * max_splits(num_keys)) +
         align_up(sizeof(float2) * batch * rows * kNumLabels);
}

int64_t modality_scores_max_head_dim() { return scores::kMaxHeadDim; }

int64_t modality_scores_split_begin(int64_t split, int64_t split_tiles, int64_t split_extra) {
  return scores::split_begin(split, split_tiles, split_extra);
}

bool modality_scores_key_visible(int64_t n, int64_t num_keys, int64_t pos, int64_t label) {
  return scores::key_visible(n, num_keys, pos, label);
}

std::vector<std::pair<std::string, int64_t>> modality_scores_constants() {
  return {{"threads", scores::kThreads},
          {"warps", scores::kWarps},
          {"row_tile", scores::kRowTile},
          {"rows_per_warp", scores::kRowsPerWarp},
          {"threads_per_row", scores::kThreadsPerRow},
          {"load_batch", scores::kLoadBatch},
          {"keys_fp32", scores::TileConfig<float>::kKeys},
          {"keys_fp64", scores::TileConfig<double>::kKeys},
          {"keys_fp16", scores::TileConfig<__half>::kKeys},
          {"keys_bf16", scores::TileConfig<__nv_bfloat16>::kKeys},
          {"min_keys_per_tile", scores::kMinKeysPerTile},
          {"max_splits", scores::kMaxSplits},
          {"max_head_dim", scores::kMaxHeadDim},
          {"num_labels", kNumLabels},
          {"combine_threads", scores::kCombineThreads},
          {"reduce_warps", scores::kReduceWarps},
          {"reduce_keys", scores::kReduceKeys},
          {"reduce_unroll", scores::kReduceUnroll}};
}

void modality_scores(const ModalityScoresParams& p) {
  require(p.head_dim >= 1 && p.head_dim <= scores::kMaxHeadDim, kOp,
          "head dimension D must be in [1, " + std::to_string(scores::kMaxHeadDim) + "], got " +
              std::to_string(p.head_dim));
  require(p.q_heads >= 1 && p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0, kOp,
          "Hq must be a positive multiple of Hkv");
  require(p.kv_heads <= 65535 && p.batch <= 65535, kOp, "B and Hkv must be at most 65535 (CUDA grid limits)");
  require(p.q_len >= 1, kOp, "Lq must be >= 1");
  require(p.batch * p.q_heads * p.q_len <= INT_MAX, kOp, "B * Hq * Lq must be at most 2^31 - 1 (CUDA grid limit)");
  require(p.q_dtype == kFloat32 || p.q_dtype == kFloat64 || p.q_dtype == kFloat16 || p.q_dtype == kBFloat16, kOp,
          "query/key dtype code must be float32, float16, bfloat16 or float64, got " + std::to_string(p.q_dtype));
  require(is_int_code(p.modality_dtype) && is_int_code(p.positions_dtype), kOp,
          "modality and query_positions dtype codes must be integer codes");
  if (p.batch == 0 || p.num_keys == 0) return;
  const DeviceGuard device_guard = use_device(p.device, kOp);
  const int64_t rows = p.q_heads * p.q_len;
  const Workspace w = carve(p.workspace, p.batch, rows, p.num_keys);
  int64_t splits = 0;
  switch (p.q_dtype) {
    case kFloat32: splits = launch_tiles<float>(p, w); break;
    case kFloat64: splits = launch_tiles<double>(p, w); break;
    case kFloat16: splits = launch_tiles<__half>(p, w); break;
    case kBFloat16: splits = launch_tiles<__nv_bfloat16>(p, w); break;
  }
  const int64_t total_rows = p.batch * rows;
  auto stream = static_cast<cudaStream_t>(p.stream);
  launch_kernel(kOp, "scores_combine_kernel", scores::scores_combine_kernel, dim3(static_cast<unsigned>(total_rows)),
                dim3(scores::kCombineThreads), 0, stream, w.partial, w.stats, splits, p.eps);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.num_keys, scores::kReduceKeys)), static_cast<unsigned>(p.batch));
  launch_kernel(kOp, "scores_reduce_kernel", scores::scores_reduce_kernel, grid, dim3(scores::kReduceThreads), 0,
                stream, w.logits, w.stats, p.modality, p.modality_dtype, p.mod_stride[0], p.mod_stride[1], p.out,
                rows, p.num_keys);
}

}  // namespace macer
