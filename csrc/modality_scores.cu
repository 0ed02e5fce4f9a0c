// Launcher of modality_scores: fills the kernels' arguments from ModalityScoresParams and enqueues them.
//
// S-A (every architecture): scores_tile_kernel (the combine folded into each unit's last CTA), then
// scores_reduce_kernel, both through launch_kernel (csrc/kernels/launch.cuh). Inside a stage's chain they follow its
// rules; outside one the op opens its own two-kernel chain, so that on sm_90+ the reduce is launched with programmatic
// dependent launch and its CTAs start as the tile kernel's drain. S-B (sm_90a builds on an sm_90 device, one batch element, <= 32 rows per KV head, D = 128, half
// types): the persistent kernel of csrc/modality_scores_sm90a.cu. The split count is chosen here from the device's SM
// count and the tile kernel's occupancy, both asked once per (device, kernel, shared-memory size) and cached (host
// attributes, no device work per call).
#include <algorithm>
#include <climits>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/launch.cuh"
#include "kernels/modality_scores.cuh"
#include "modality_scores_sm90a.h"

namespace macer {
namespace {

constexpr const char* kOp = "modality_scores";
constexpr int kMaxDevices = 64;
constexpr int kMaxChunks = scores::kMaxHeadDim * 4 / scores::kChunkBytes;  // fp32 at D = 256

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

int64_t row_tiles_of(int64_t q_heads, int64_t q_len, int64_t kv_heads) {
  return ceil_div(q_heads / kv_heads * q_len, scores::kRowTile);
}
int64_t tiles_of(int64_t num_keys) { return ceil_div(num_keys, scores::kTileKeys); }
// The partial array's stride over splits: the most splits any device may choose, rounded up to even (the combine
// reads two splits per 16-byte load).
int64_t max_split_stride(int64_t num_keys) {
  const int64_t s = std::min<int64_t>(tiles_of(num_keys), scores::kMaxSplits);
  return s + (s & 1);
}

struct Workspace {
  float* logits;
  float2* partial;
  float2* stats;
};

Workspace carve(void* base, int64_t units, int64_t num_keys) {
  auto* p = static_cast<unsigned char*>(base);
  Workspace w{};
  w.logits = reinterpret_cast<float*>(p);
  p += align_up(sizeof(float) * units * tiles_of(num_keys) * scores::kLogitsPerTile);
  w.partial = reinterpret_cast<float2*>(p);
  p += align_up(sizeof(float2) * units * kNumLabels * scores::kRowTile * max_split_stride(num_keys));
  w.stats = reinterpret_cast<float2*>(p);
  return w;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

struct DeviceFacts {
  int sms = 0, major = 0;
};

DeviceFacts device_facts(int device) {
  static std::mutex mutex;
  static DeviceFacts cache[kMaxDevices];
  require(device >= 0 && device < kMaxDevices, kOp, "device index must be in [0, 63]");
  std::lock_guard<std::mutex> lock(mutex);
  DeviceFacts& f = cache[device];
  if (f.sms == 0) {
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device));
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device));
  }
  return f;
}

// Tile-kernel CTAs resident at once on `device` (SMs x resident blocks) for `chunks` query chunks. The first call per
// (device, kernel) opts the kernel in to the shared memory of its largest query tile.
template <typename T, bool kVec>
int64_t ctas_per_wave(int device, int chunks) {
  static std::mutex mutex;
  static int64_t cache[kMaxDevices][kMaxChunks + 1];  // 0 = not yet asked
  static bool opted[kMaxDevices];
  const DeviceFacts f = device_facts(device);
  std::lock_guard<std::mutex> lock(mutex);
  if (!opted[device]) {
    MACER_CUDA_CHECK(kOp, cudaFuncSetAttribute(scores::scores_tile_kernel<T, kVec>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               scores::tile_smem_bytes(kMaxChunks)));
    opted[device] = true;
  }
  int64_t& ctas = cache[device][chunks];
  if (ctas == 0) {
    int blocks = 0;
    MACER_CUDA_CHECK(kOp, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                              &blocks, scores::scores_tile_kernel<T, kVec>, scores::kThreads,
                              scores::tile_smem_bytes(chunks)));
    ctas = std::max<int64_t>(1, int64_t{f.sms} * std::max(blocks, 1));
  }
  return ctas;
}

// The S-A path: tile kernel, then the reduce. Returns nothing; every launch is checked.
template <typename T, bool kVec>
void launch_sa(const ModalityScoresParams& p, const Workspace& w) {
  using S = typename scores::SmemOf<T>::type;
  scores::TileArgs a{};
  a.query = p.query;
  a.key = p.key;
  a.modality = p.modality;
  a.positions = p.query_positions;
  a.logits = w.logits;
  a.partial = w.partial;
  a.stats = w.stats;
  a.counters = p.counters + scores::kSbCounterWords;
  a.modality_dtype = p.modality_dtype;
  a.positions_dtype = p.positions_dtype;
  a.q_len = static_cast<int>(p.q_len);
  a.group = static_cast<int>(p.q_heads / p.kv_heads);
  a.rows = static_cast<int>(a.group * p.q_len);
  a.row_tiles = static_cast<int>(row_tiles_of(p.q_heads, p.q_len, p.kv_heads));
  a.kv_heads = static_cast<int>(p.kv_heads);
  a.head_dim = static_cast<int>(p.head_dim);
  a.chunks = static_cast<int>(ceil_div(p.head_dim * static_cast<int64_t>(sizeof(S)), scores::kChunkBytes));
  a.num_keys = static_cast<int>(p.num_keys);
  a.k_row_bytes = static_cast<uint32_t>(p.k_stride[2] * static_cast<int64_t>(sizeof(T)));
  for (int i = 0; i < 4; ++i) a.q_stride[i] = p.q_stride[i];
  for (int i = 0; i < 3; ++i) a.k_stride[i] = p.k_stride[i];
  for (int i = 0; i < 2; ++i) a.mod_stride[i] = p.mod_stride[i];
  for (int i = 0; i < 2; ++i) a.pos_stride[i] = p.pos_stride[i];
  a.scale_log2 = static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);  // log2(e)
  a.eps = p.eps;
  const ScoresSplitPlan plan = modality_scores_split_plan(p.batch, p.kv_heads, a.row_tiles, p.num_keys,
                                                          ctas_per_wave<T, kVec>(p.device, a.chunks));
  a.tiles = static_cast<int>(plan.tiles);
  a.splits = static_cast<int>(plan.splits);
  a.split_stride = static_cast<int>(max_split_stride(p.num_keys));
  a.split_tiles = static_cast<int>(plan.split_tiles);
  a.split_extra = static_cast<int>(plan.split_extra);
  auto stream = static_cast<cudaStream_t>(p.stream);
  launch_kernel(kOp, "scores_tile_kernel", scores::scores_tile_kernel<T, kVec>,
                dim3(static_cast<unsigned>(a.splits), static_cast<unsigned>(p.kv_heads),
                     static_cast<unsigned>(p.batch)),
                dim3(scores::kThreads), scores::tile_smem_bytes(a.chunks), stream, a);

  scores::ReduceArgs r{};
  r.logits = w.logits;
  r.stats = w.stats;
  r.modality = p.modality;
  r.out = p.out;
  r.modality_dtype = p.modality_dtype;
  r.mod_stride[0] = p.mod_stride[0];
  r.mod_stride[1] = p.mod_stride[1];
  r.num_keys = a.num_keys;
  r.tiles = a.tiles;
  r.units_per_batch = a.kv_heads * a.row_tiles;
  r.rows = a.rows;
  r.row_tiles = a.row_tiles;
  r.scale_log2 = a.scale_log2;
  r.inv_rows = static_cast<float>(1.0 / static_cast<double>(p.q_heads * p.q_len));
  launch_kernel(kOp, "scores_reduce_kernel", scores::scores_reduce_kernel,
                dim3(static_cast<unsigned>(a.tiles), static_cast<unsigned>(p.batch)), dim3(scores::kThreads), 0,
                stream, r);
}

template <typename T>
void dispatch_sa(const ModalityScoresParams& p, const Workspace& w) {
  constexpr int64_t esize = sizeof(T);
  const bool vec = !std::is_same<T, double>::value && aligned16(p.key) && (p.head_dim * esize) % 16 == 0 &&
                   (p.k_stride[0] * esize) % 16 == 0 && (p.k_stride[1] * esize) % 16 == 0 &&
                   (p.k_stride[2] * esize) % 16 == 0 && p.k_stride[2] * esize < (int64_t{1} << 25);
  if constexpr (std::is_same<T, double>::value) {
    launch_sa<double, false>(p, w);
  } else if (vec) {
    launch_sa<T, true>(p, w);
  } else {
    launch_sa<T, false>(p, w);
  }
}

void check_params(const ModalityScoresParams& p) {
  require(p.head_dim >= 1 && p.head_dim <= scores::kMaxHeadDim, kOp,
          "head dimension D must be in [1, " + std::to_string(scores::kMaxHeadDim) + "], got " +
              std::to_string(p.head_dim));
  require(p.q_heads >= 1 && p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0, kOp,
          "Hq must be a positive multiple of Hkv");
  require(p.kv_heads <= 65535 && p.batch <= 65535, kOp, "B and Hkv must be at most 65535 (CUDA grid limits)");
  require(p.q_len >= 1, kOp, "Lq must be >= 1");
  require(p.batch * p.q_heads * p.q_len <= INT_MAX, kOp, "B * Hq * Lq must be at most 2^31 - 1 (CUDA grid limit)");
  require(p.num_keys >= 0 && p.num_keys <= INT_MAX - scores::kTileKeys, kOp,
          "N must be in [0, 2^31 - 65] (32-bit key indices)");
  require(p.q_dtype == kFloat32 || p.q_dtype == kFloat64 || p.q_dtype == kFloat16 || p.q_dtype == kBFloat16, kOp,
          "query/key dtype code must be float32, float16, bfloat16 or float64, got " + std::to_string(p.q_dtype));
  require(is_int_code(p.modality_dtype) && is_int_code(p.positions_dtype), kOp,
          "modality and query_positions dtype codes must be integer codes");
}

void check_buffers(const ModalityScoresParams& p) {
  require(p.counters != nullptr, kOp,
          "counters must be given: modality_scores_counter_count(...) int32, zero before the first call");
}

std::string sb_ineligible(const ModalityScoresParams& p) {
  if (p.path == 1) return "S-A asked for";
  if (!sm90a::scores_compiled()) return "not built with 90a in MACER_CUDA_ARCHS";
  return sm90a::scores_ineligible(p);
}

}  // namespace

ScoresSplitPlan modality_scores_split_plan(int64_t batch, int64_t kv_heads, int64_t row_tiles, int64_t num_keys,
                                           int64_t wave) {
  require(batch >= 1 && kv_heads >= 1 && row_tiles >= 1 && num_keys >= 1 && wave >= 1, kOp,
          "split plan: B, Hkv, row tiles, N and wave must be >= 1");
  ScoresSplitPlan plan{};
  plan.tiles = tiles_of(num_keys);
  // With S splits the grid is S * Hkv * B CTAs in ceil(S Hkv B / wave) waves, each CTA running row_tiles x (its
  // ceil(T / S) tiles + about one tile of fixed work: staging the query, writing its partials), and each unit's last
  // CTA merging S partials per (label, row) (about one tile's time per 32 splits). The plan takes the S in
  // [1, min(T, kMaxSplits)] of least modelled time, the fewest splits among equals: at most 128 evaluations.
  const int64_t ctas = kv_heads * batch;
  const int64_t limit = std::min<int64_t>(plan.tiles, scores::kMaxSplits);
  auto cost = [&](int64_t s) {
    return ceil_div(s * ctas, wave) * row_tiles * (ceil_div(plan.tiles, s) + 1) + row_tiles * ceil_div(s, 32);
  };
  plan.splits = 1;
  int64_t best = cost(1);
  for (int64_t s = 2; s <= limit; ++s) {
    const int64_t c = cost(s);
    if (c < best) {
      best = c;
      plan.splits = s;
    }
  }
  plan.split_tiles = plan.tiles / plan.splits;
  plan.split_extra = plan.tiles % plan.splits;
  return plan;
}

size_t modality_scores_workspace_bytes(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads,
                                       int64_t num_keys) {
  require(batch >= 0 && q_heads >= 1 && kv_heads >= 1 && q_heads % kv_heads == 0 && q_len >= 1 && num_keys >= 0,
          kOp, "workspace: B, N >= 0, Lq >= 1 and Hq a positive multiple of Hkv");
  const int64_t units = batch * kv_heads * row_tiles_of(q_heads, q_len, kv_heads);
  size_t bytes = align_up(sizeof(float) * units * tiles_of(num_keys) * scores::kLogitsPerTile) +
                 align_up(sizeof(float2) * units * kNumLabels * scores::kRowTile * max_split_stride(num_keys)) +
                 align_up(sizeof(float2) * units * kNumLabels * scores::kRowTile);
  return std::max(bytes, sm90a::scores_workspace_bytes(batch, q_heads, q_len, kv_heads, num_keys));
}

int64_t modality_scores_counter_count(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads) {
  require(batch >= 0 && q_heads >= 1 && kv_heads >= 1 && q_heads % kv_heads == 0 && q_len >= 1, kOp,
          "counters: B >= 0, Lq >= 1 and Hq a positive multiple of Hkv");
  const int64_t units = batch * kv_heads * row_tiles_of(q_heads, q_len, kv_heads);
  return scores::kSbCounterWords + 2 * units;
}

int64_t modality_scores_max_head_dim() { return scores::kMaxHeadDim; }

int64_t modality_scores_split_begin(int64_t split, int64_t split_tiles, int64_t split_extra) {
  return scores::split_begin(split, split_tiles, split_extra);
}

bool modality_scores_key_visible(int64_t n, int64_t num_keys, int64_t pos, int64_t label) {
  return scores::key_visible(n, num_keys, pos, label);
}

std::pair<int, int> modality_scores_fragment(int warp, int lane, int e) {
  return {scores::frag_key(warp, lane, e), scores::frag_row(lane, e)};
}

std::vector<std::pair<std::string, int64_t>> modality_scores_constants() {
  return {{"threads", scores::kThreads},
          {"warps", scores::kWarps},
          {"tile_keys", scores::kTileKeys},
          {"warp_keys", scores::kWarpKeys},
          {"row_tile", scores::kRowTile},
          {"rows_per_thread", scores::kRowsPerThread},
          {"frag_elems", scores::kFragElems},
          {"label_slots", scores::kLabelSlots},
          {"rescale_threshold", static_cast<int64_t>(scores::kRescaleThreshold)},
          {"chunk_bytes", scores::kChunkBytes},
          {"pitch", scores::kPitch},
          {"stages", scores::kStages},
          {"max_splits", scores::kMaxSplits},
          {"combine_batch", scores::kCombineBatch},
          {"max_head_dim", scores::kMaxHeadDim},
          {"num_labels", kNumLabels},
          {"mask_broken", scores::kMaskBroken},
          {"sb_consumers", scores::sb::kConsumers},
          {"sb_group", scores::sb::kGroup},
          {"sb_max_ctas", scores::sb::kMaxCtas},
          {"sb_max_heads", scores::sb::kMaxHeads},
          {"sb_counter_words", scores::kSbCounterWords}};
}

std::pair<std::string, std::string> modality_scores_path(const ModalityScoresParams& p) {
  check_params(p);
  const std::string why = sb_ineligible(p);
  return {why.empty() ? "sb" : "sa", why};
}

void modality_scores(const ModalityScoresParams& p) {
  check_params(p);
  if (p.batch == 0 || p.num_keys == 0) return;
  check_buffers(p);
  const DeviceGuard device_guard = use_device(p.device, kOp);
  if (sb_ineligible(p).empty()) {
    sm90a::scores_launch(p);  // one cooperative launch (inside a stage's chain, the chain's caller marks it started)
    return;
  }
  // Outside a stage's chain, the op's own: the tile kernel plainly, the reduce with PDL where the device has it.
  std::optional<ChainScope> own_chain;
  if (!chain_state().active) own_chain.emplace(stage_chain_supported(p.device));
  const int64_t units = p.batch * p.kv_heads * row_tiles_of(p.q_heads, p.q_len, p.kv_heads);
  const Workspace w = carve(p.workspace, units, p.num_keys);
  switch (p.q_dtype) {
    case kFloat32: dispatch_sa<float>(p, w); break;
    case kFloat64: dispatch_sa<double>(p, w); break;
    case kFloat16: dispatch_sa<__half>(p, w); break;
    case kBFloat16: dispatch_sa<__nv_bfloat16>(p, w); break;
  }
}

int64_t modality_scores_stream_k_words(int64_t batch, int64_t kv_heads, int64_t num_keys) {
  return batch * kv_heads * std::max<int64_t>(tiles_of(num_keys), 1);
}

// The K-streaming baseline's grid: one CTA per tile of each (batch, KV head) up to as many CTAs as the device holds
// at once (SMs x resident stream_k CTAs per SM), so that its only limit is the memory system.
int64_t modality_scores_stream_k(const StreamKParams& p) {
  require(p.dtype == kFloat32 || p.dtype == kFloat16 || p.dtype == kBFloat16, kOp,
          "stream_k: key dtype code must be float32, float16 or bfloat16");
  require(p.batch >= 1 && p.kv_heads >= 1 && p.num_keys >= 1 && p.num_keys <= INT_MAX - scores::kTileKeys &&
              p.head_dim >= 1 && p.head_dim <= scores::kMaxHeadDim,
          kOp, "stream_k: sizes out of range");
  const int64_t esize = p.dtype == kFloat32 ? 4 : 2;
  require(aligned16(p.key) && (p.head_dim * esize) % 16 == 0 && (p.k_stride[0] * esize) % 16 == 0 &&
              (p.k_stride[1] * esize) % 16 == 0 && (p.k_stride[2] * esize) % 16 == 0 &&
              p.k_stride[2] * esize < (int64_t{1} << 25),
          kOp, "stream_k: K must take the vectorised path (16-byte aligned rows and strides)");
  const DeviceGuard device_guard = use_device(p.device, kOp);
  const DeviceFacts f = device_facts(p.device);
  static std::mutex mutex;
  static int resident[kMaxDevices];
  int blocks = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (resident[p.device] == 0) {
      MACER_CUDA_CHECK(kOp, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident[p.device],
                                                                          scores::stream_k_kernel, scores::kThreads,
                                                                          0));
      resident[p.device] = std::max(resident[p.device], 1);
    }
    blocks = resident[p.device];
  }
  const int64_t tiles = tiles_of(p.num_keys);
  const int64_t splits =
      std::min<int64_t>(tiles, std::max<int64_t>(1, ceil_div(int64_t{f.sms} * blocks, p.kv_heads * p.batch)));
  scores::StreamArgs a{};
  a.key = p.key;
  a.out = p.out;
  a.num_keys = static_cast<int>(p.num_keys);
  a.chunks = static_cast<int>(ceil_div(p.head_dim * esize, scores::kChunkBytes));
  a.split_tiles = static_cast<int>(tiles / splits);
  a.split_extra = static_cast<int>(tiles % splits);
  a.k_row_bytes = static_cast<uint32_t>(p.k_stride[2] * esize);
  a.d_bytes = static_cast<uint32_t>(p.head_dim * esize);
  a.k_stride_bytes[0] = p.k_stride[0] * esize;
  a.k_stride_bytes[1] = p.k_stride[1] * esize;
  launch_kernel(kOp, "stream_k_kernel", scores::stream_k_kernel,
                dim3(static_cast<unsigned>(splits), static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch)),
                dim3(scores::kThreads), 0, static_cast<cudaStream_t>(p.stream), a);
  return splits * p.kv_heads * p.batch;
}

}  // namespace macer

#ifndef MACER_HAS_SM90A
// Built without 90a: S-B is absent; every call takes S-A.
namespace macer {
namespace sm90a {
bool scores_compiled() { return false; }
std::string scores_ineligible(const ModalityScoresParams&) { return "not built with 90a in MACER_CUDA_ARCHS"; }
size_t scores_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int64_t) { return 0; }
void scores_launch(const ModalityScoresParams&) {
  throw std::runtime_error("macer_kernels.modality_scores: S-B is not built (add 90a to MACER_CUDA_ARCHS)");
}
}  // namespace sm90a
}  // namespace macer
#endif
