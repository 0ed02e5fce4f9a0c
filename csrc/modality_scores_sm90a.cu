// Launcher of step S-B (csrc/kernels/modality_scores_sm90a.cuh): compiled for sm_90a only, in its own object library
// (CMakeLists.txt), and taken by modality_scores (csrc/modality_scores.cu) when scores_ineligible() is empty.
//
// Per call: the K tensor map (cuTensorMapEncodeTiled through the runtime's driver entry point: the module still links
// no libcuda), then one cooperative launch of one CTA per SM (at most one per 64-key tile). The device facts (SM count,
// capability, cooperative support, opt-in shared memory) are asked once per device and cached.
#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "kernels/modality_scores_sm90a.cuh"
#include "modality_scores_sm90a.h"

namespace macer {
namespace sm90a {
namespace {

constexpr const char* kOp = "modality_scores";
constexpr int kMaxDevices = 64;
namespace sb = scores::sb;

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

struct Facts {
  bool asked = false;
  int major = 0, minor = 0, sms = 0, cooperative = 0, smem_optin = 0;
};

Facts device_facts(int device) {
  static std::mutex mutex;
  static Facts cache[kMaxDevices];
  require(device >= 0 && device < kMaxDevices, kOp, "device index must be in [0, 63]");
  std::lock_guard<std::mutex> lock(mutex);
  Facts& f = cache[device];
  if (!f.asked) {
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device));
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, device));
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device));
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.cooperative, cudaDevAttrCooperativeLaunch, device));
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    f.asked = true;
  }
  return f;
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static std::mutex mutex;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MACER_CUDA_CHECK(kOp, cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                                           &status));
    require(status == cudaDriverEntryPointSuccess && ptr != nullptr, kOp,
            "the driver has no cuTensorMapEncodeTiled (S-B needs a CUDA 12 driver)");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }
  return fn;
}

int64_t tiles_of(int64_t n) { return (n + scores::kTileKeys - 1) / scores::kTileKeys; }

struct Layout {
  int ctas, slots, smem;
};

// The grid (one CTA per SM, at most one per tile) and the on-chip logits each CTA keeps: as many of its units as the
// opt-in shared memory holds.
Layout layout_for(const ModalityScoresParams& p, const Facts& f) {
  Layout l{};
  const int64_t tiles = tiles_of(p.num_keys);
  l.ctas = static_cast<int>(std::min<int64_t>({tiles, f.sms, sb::kMaxCtas}));
  const int64_t units = p.kv_heads * ((tiles + l.ctas - 1) / l.ctas);
  const int64_t room = (f.smem_optin - sb::smem_fixed_bytes(static_cast<int>(p.kv_heads))) / sb::kUnitBytes;
  l.slots = static_cast<int>(std::max<int64_t>(0, std::min(room, units)));
  l.smem = sb::smem_bytes(static_cast<int>(p.kv_heads), l.slots);
  return l;
}

// Whether an S-B CTA can be resident on `device` with the device's largest dynamic shared memory (then with any
// smaller amount too): asked once per (device, dtype), which also opts the kernel in to that shared memory.
template <typename T>
bool resident(int device, int smem_optin) {
  static std::mutex mutex;
  static int cache[kMaxDevices];  // 0 = not asked, 1 = yes, -1 = no
  std::lock_guard<std::mutex> lock(mutex);
  if (cache[device] == 0) {
    MACER_CUDA_CHECK(kOp, cudaFuncSetAttribute(sb::scores_sb_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               smem_optin));
    int blocks = 0;
    MACER_CUDA_CHECK(kOp, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, sb::scores_sb_kernel<T>,
                                                                        sb::kThreads, smem_optin));
    cache[device] = blocks >= 1 ? 1 : -1;
  }
  return cache[device] > 0;
}

struct SbWorkspace {
  float* spill;
  float2* partial;
  float2* group_partial;
  float2* stats;
  int* masks;
};

SbWorkspace carve(void* base, int64_t kv_heads, int64_t num_keys) {
  auto* p = static_cast<unsigned char*>(base);
  SbWorkspace w{};
  w.spill = reinterpret_cast<float*>(p);
  p += align_up(sizeof(float) * kv_heads * tiles_of(num_keys) * scores::kLogitsPerTile);
  w.partial = reinterpret_cast<float2*>(p);
  p += align_up(sizeof(float2) * kv_heads * sb::kPairs * sb::kMaxCtas);
  w.group_partial = reinterpret_cast<float2*>(p);
  p += align_up(sizeof(float2) * sb::kMaxGroups * kv_heads * sb::kPairs);
  w.stats = reinterpret_cast<float2*>(p);
  p += align_up(sizeof(float2) * kv_heads * sb::kPairs);
  w.masks = reinterpret_cast<int*>(p);
  return w;
}

bool shape_fits(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads) {
  return batch == 1 && kv_heads >= 1 && kv_heads <= sb::kMaxHeads && q_heads % kv_heads == 0 &&
         q_heads / kv_heads * q_len <= scores::kRowTile;
}

template <typename T>
void launch(const ModalityScoresParams& p, const Facts& f) {
  const Layout l = layout_for(p, f);
  const SbWorkspace w = carve(p.workspace, p.kv_heads, p.num_keys);
  CUtensorMap map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.head_dim), static_cast<cuuint64_t>(p.num_keys),
                              static_cast<cuuint64_t>(p.kv_heads)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.k_stride[2] * 2), static_cast<cuuint64_t>(p.k_stride[1] * 2)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(scores::kTileKeys), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult encoded = encode_fn()(
      &map, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
      const_cast<void*>(p.key), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  require(encoded == CUDA_SUCCESS, kOp, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(encoded));

  sb::Args a{};
  a.query = p.query;
  a.modality = p.modality;
  a.positions = p.query_positions;
  a.out = p.out;
  a.spill = w.spill;
  a.partial = w.partial;
  a.group_partial = w.group_partial;
  a.stats = w.stats;
  a.masks = w.masks;
  a.counters = p.counters;
  a.modality_dtype = p.modality_dtype;
  a.positions_dtype = p.positions_dtype;
  a.q_len = static_cast<int>(p.q_len);
  a.group = static_cast<int>(p.q_heads / p.kv_heads);
  a.rows = static_cast<int>(a.group * p.q_len);
  a.kv_heads = static_cast<int>(p.kv_heads);
  a.num_keys = static_cast<int>(p.num_keys);
  a.tiles = static_cast<int>(tiles_of(p.num_keys));
  a.ctas = l.ctas;
  a.slots = l.slots;
  for (int i = 0; i < 4; ++i) a.q_stride[i] = p.q_stride[i];
  for (int i = 0; i < 2; ++i) a.mod_stride[i] = p.mod_stride[i];
  for (int i = 0; i < 2; ++i) a.pos_stride[i] = p.pos_stride[i];
  a.scale_log2 = static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);
  a.eps = p.eps;
  a.inv_rows = static_cast<float>(1.0 / static_cast<double>(p.q_heads * p.q_len));

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(l.ctas));
  cfg.blockDim = dim3(sb::kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(l.smem);
  cfg.stream = static_cast<cudaStream_t>(p.stream);
  cudaLaunchAttribute attrs[2];
  int n = 0;
  attrs[n].id = cudaLaunchAttributeCooperative;  // every CTA resident, or the launch fails (no deadlock)
  attrs[n].val.cooperative = 1;
  ++n;
  // The spill stays in L2 where the process has set a persisting set-aside (cudaLimitPersistingL2CacheSize): a
  // window over the spill that this launch's accesses mark persisting. Without a set-aside the window does nothing,
  // so it is only attached then.
  size_t persisting = 0;
  const int64_t spilled_units = std::max<int64_t>(0, p.kv_heads * ((a.tiles + l.ctas - 1) / l.ctas) - l.slots);
  if (spilled_units > 0) MACER_CUDA_CHECK(kOp, cudaDeviceGetLimit(&persisting, cudaLimitPersistingL2CacheSize));
  if (spilled_units > 0 && persisting > 0) {
    attrs[n].id = cudaLaunchAttributeAccessPolicyWindow;
    attrs[n].val.accessPolicyWindow.base_ptr = w.spill;
    attrs[n].val.accessPolicyWindow.num_bytes =
        std::min<size_t>(persisting, sizeof(float) * p.kv_heads * tiles_of(p.num_keys) * scores::kLogitsPerTile);
    attrs[n].val.accessPolicyWindow.hitRatio = 1.0f;
    attrs[n].val.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    attrs[n].val.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  check_cuda(cudaLaunchKernelEx(&cfg, sb::scores_sb_kernel<T>, map, a), kOp, "launch of scores_sb_kernel");
}

}  // namespace

bool scores_compiled() { return true; }

std::string scores_ineligible(const ModalityScoresParams& p) {
  if (!shape_fits(p.batch, p.q_heads, p.q_len, p.kv_heads)) {
    return "S-B takes B = 1, at most 8 KV heads and at most 32 query rows per KV head";
  }
  if (p.head_dim != sb::kHeadDim) return "S-B takes D = 128";
  if (p.q_dtype != kBFloat16 && p.q_dtype != kFloat16) return "S-B takes bf16 / fp16";
  if (reinterpret_cast<uintptr_t>(p.key) % 16 != 0 || (p.k_stride[1] * 2) % 16 != 0 || (p.k_stride[2] * 2) % 16 != 0) {
    return "S-B's tensor map needs K 16-byte aligned with strides multiple of 16 bytes";
  }
  if (p.num_keys < 1) return "nothing to score";
  const Facts f = device_facts(p.device);
  if (f.major != 9 || f.minor != 0) return "the device is not sm_90";
  if (!f.cooperative) return "the device has no cooperative launch";
  const Layout l = layout_for(p, f);
  if (l.smem > f.smem_optin) return "S-B's shared memory does not fit this device";
  const DeviceGuard device_guard = use_device(p.device, kOp);
  const bool fits = p.q_dtype == kBFloat16 ? resident<__nv_bfloat16>(p.device, f.smem_optin)
                                           : resident<__half>(p.device, f.smem_optin);
  if (!fits) return "an S-B CTA cannot be resident on this device (cooperative grid)";
  return "";
}

size_t scores_workspace_bytes(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads, int64_t num_keys) {
  if (!shape_fits(batch, q_heads, q_len, kv_heads)) return 0;
  return align_up(sizeof(float) * kv_heads * tiles_of(num_keys) * scores::kLogitsPerTile) +
         align_up(sizeof(float2) * kv_heads * sb::kPairs * sb::kMaxCtas) +
         align_up(sizeof(float2) * sb::kMaxGroups * kv_heads * sb::kPairs) +
         align_up(sizeof(float2) * kv_heads * sb::kPairs) + align_up(sizeof(int) * (sb::kMaxCtas + sb::kMaxGroups));
}

void scores_launch(const ModalityScoresParams& p) {
  const Facts f = device_facts(p.device);
  if (p.q_dtype == kBFloat16) {
    launch<__nv_bfloat16>(p, f);
  } else {
    launch<__half>(p, f);
  }
}

}  // namespace sm90a
}  // namespace macer
