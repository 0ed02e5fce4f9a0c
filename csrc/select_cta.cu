// Launcher of the radix selection kernel (csrc/kernels/select_cta.cuh): one launch, no workspace, no
// synchronisation. Per device, once: the shared memory a block may opt in to (minus the kernels' static shared
// memory) and the largest thread block cluster the device co-schedules with it (host attributes and an occupancy
// query, no device work). Per call: the plan (cluster size, tokens per CTA, shared-memory layout) is host arithmetic.
#include <algorithm>
#include <climits>
#include <mutex>

#include "kernels/launch.cuh"
#include "kernels/select_cta.cuh"

namespace macer {
namespace {

constexpr int kMaxDevices = 64;

struct DeviceLimits {
  int64_t dynamic_bytes;  // dynamic shared memory every instantiation is opted in to
  int max_cluster;        // largest cluster co-scheduled with that much shared memory per CTA (1: no clusters)
  bool ready;
};
std::mutex limits_mutex;
DeviceLimits device_limits_table[kMaxDevices];

template <typename KeyT, bool kCluster>
void* kernel_ptr() {
  return reinterpret_cast<void*>(&cta::select_cta_kernel<KeyT, kCluster>);
}

// The largest cluster (<= kMaxCluster) of CTAs with `bytes` of dynamic shared memory each that the device can run.
// 1 below sm_90, and where the code the device runs was compiled below sm_90 (a build without sm_90 code, its PTX
// JIT-compiled for a newer GPU): the cluster kernels are trap stubs there.
int query_max_cluster(int device, int64_t bytes, const char* op) {
  int major = 0, minor = 0;
  MACER_CUDA_CHECK(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MACER_CUDA_CHECK(op, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major < 9) return 1;
  const int arch = 10 * major + minor;
  const std::vector<int> sass = compiled_archs();
  const int code_arch = std::find(sass.begin(), sass.end(), arch) != sass.end() ? arch : ptx_arch();
  if (code_arch < 90) return 1;
  for (int c = cta::kMaxCluster; c >= 2; --c) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(c));
    config.blockDim = dim3(cta::kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(bytes);
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(c);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    const cudaError_t err =
        cudaOccupancyMaxActiveClusters(&clusters, cta::select_cta_kernel<uint32_t, true>, &config);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // an unsupported size: try a smaller one
      continue;
    }
    if (clusters >= 1) return c;
  }
  return 1;
}

DeviceLimits device_limits(int device, const char* op) {
  require(device >= 0 && device < kMaxDevices, op, "device index must be in [0, 63]");
  std::lock_guard<std::mutex> lock(limits_mutex);
  DeviceLimits& limits = device_limits_table[device];
  if (!limits.ready) {
    const DeviceGuard device_guard = use_device(device, op);
    int optin = 0;
    MACER_CUDA_CHECK(op, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    void* const kernels[] = {kernel_ptr<uint32_t, false>(), kernel_ptr<uint64_t, false>(),
                             kernel_ptr<uint32_t, true>(), kernel_ptr<uint64_t, true>()};
    size_t static_bytes = 0;
    for (void* kernel : kernels) {
      cudaFuncAttributes attr{};
      MACER_CUDA_CHECK(op, cudaFuncGetAttributes(&attr, kernel));
      static_bytes = std::max(static_bytes, attr.sharedSizeBytes);
    }
    const int64_t avail = static_cast<int64_t>(optin) - static_cast<int64_t>(static_bytes);
    for (void* kernel : kernels) {
      MACER_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(avail)));
    }
    limits.dynamic_bytes = avail;
    limits.max_cluster = query_max_cluster(device, avail, op);
    limits.ready = true;
  }
  return limits;
}

template <typename KeyT, bool kCluster>
void launch(const cta::SelectKernelArgs& a, const char* op) {
  const SelectCtaParams& p = a.p;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(p.batch * a.cluster));
  config.blockDim = dim3(cta::kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(a.layout.bytes);
  config.stream = static_cast<cudaStream_t>(p.stream);
  cudaLaunchAttribute attributes[2] = {};
  unsigned count = 0;
  if (kCluster) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = static_cast<unsigned>(a.cluster);
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  // PDL when the caller asks (p.pdl) or when a prepared stage's chain (kernels/launch.cuh) has launched the
  // scoring before this kernel; the kernel waits for its predecessor either way (grid_dependency_wait).
  ChainState& chain = chain_state();
  const bool pdl = p.pdl || (chain.active && chain.pdl && chain.launched > 0);
  if (chain.active) ++chain.launched;
  if (pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  MACER_CUDA_CHECK(op, cudaLaunchKernelEx(&config, cta::select_cta_kernel<KeyT, kCluster>, a));
}

}  // namespace

SelectCtaPlan select_cta_plan(int64_t n, bool coverage, bool wide, int64_t dynamic_bytes, int max_cluster) {
  const SelectCtaPlan none{0, 0, 0, 0, 0};
  if (n < 1 || dynamic_bytes < 0 || (coverage && wide)) return none;
  max_cluster = std::max(1, std::min(max_cluster, cta::kMaxCluster));
  const int table = coverage ? static_cast<int>(std::min<int64_t>(cta::kMaxTable, n)) : 0;
  auto plan = [&](int c, int kind) {
    const int64_t cap = ceil_div(n, c);
    // One CTA's coverage sort moves 16-bit token numbers.
    if (c > n || (kind == cta::kLayoutCoverageSingle && cap > 65535)) return none;
    const int64_t bytes = cta::make_layout(cap, kind, wide, table).bytes;
    return bytes <= dynamic_bytes ? SelectCtaPlan{c, cap, kind, table, bytes} : none;
  };
  if (!coverage) {  // top-K: one CTA up to kSingleTopKMax, above it about kClusterTopKTokens per CTA, else what fits
    const int64_t want = n > cta::kSingleTopKMax ? ceil_div(n, cta::kClusterTopKTokens) : 1;
    for (int c = static_cast<int>(std::min<int64_t>(want, max_cluster)); c <= max_cluster; ++c) {
      const SelectCtaPlan p = plan(c, cta::kLayoutTopK);
      if (p.cluster > 0) return p;
    }
    for (int c = 1; c < std::min<int64_t>(want, max_cluster); ++c) {
      const SelectCtaPlan p = plan(c, cta::kLayoutTopK);
      if (p.cluster > 0) return p;
    }
    return none;
  }
  // Coverage: one CTA up to kSingleCoverageMax tokens, above it a cluster of about kClusterCoverageTokens tokens per
  // CTA (the sort's passes shrink with the tokens per CTA; each costs two cluster barriers), else whatever fits.
  const bool clusters = max_cluster >= 2 && n <= cta::kMaxClusterCoverageN;
  if (clusters && n > cta::kSingleCoverageMax) {
    const int64_t want = std::max<int64_t>(2, ceil_div(n, cta::kClusterCoverageTokens));
    for (int c = static_cast<int>(std::min<int64_t>(want, max_cluster)); c <= max_cluster; ++c) {
      const SelectCtaPlan p = plan(c, cta::kLayoutCoverageCluster);
      if (p.cluster > 0) return p;
    }
  }
  const SelectCtaPlan single = plan(1, cta::kLayoutCoverageSingle);
  if (single.cluster > 0) return single;
  if (clusters) {
    for (int c = 2; c <= max_cluster; ++c) {
      const SelectCtaPlan p = plan(c, cta::kLayoutCoverageCluster);
      if (p.cluster > 0) return p;
    }
  }
  return none;
}

int64_t select_cta_max_n_for(int64_t dynamic_bytes, bool coverage, bool wide, int max_cluster) {
  require(dynamic_bytes >= 0, "select_cta_max_n_for", "dynamic_bytes must be >= 0");
  require(max_cluster >= 1, "select_cta_max_n_for", "max_cluster must be >= 1");
  auto fits = [&](int64_t n) { return select_cta_plan(n, coverage, wide, dynamic_bytes, max_cluster).cluster > 0; };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;  // fits(lo), and hi is the first power of two that does not (the feasible n are 1..max)
  while (hi < (int64_t{1} << 40) && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) lo = mid; else hi = mid;
  }
  return lo;
}

std::vector<std::pair<std::string, int64_t>> select_cta_constants() {
  return {
      {"threads", cta::kThreads},
      {"warps", cta::kWarps},
      {"select_bits", cta::kSelectBits},
      {"sort_bits", cta::kSortBits},
      {"small", cta::kSmall},
      {"max_table", cta::kMaxTable},
      {"max_cluster", cta::kMaxCluster},
      {"composite_bits", cta::kCompositeBits},
      {"code_kept", cta::kCodeKept},
      {"code_pad", cta::kCodePad},
      {"chunk_overflow", cta::kChunkOverflow},
      {"single_topk_max", cta::kSingleTopKMax},
      {"cluster_topk_tokens", cta::kClusterTopKTokens},
      {"single_coverage_max", cta::kSingleCoverageMax},
      {"cluster_coverage_tokens", cta::kClusterCoverageTokens},
      {"max_cluster_coverage_n", cta::kMaxClusterCoverageN},
      {"max_stage_modalities", kMaxStageModalities},
      {"static_smem_bytes", static_cast<int64_t>(sizeof(cta::Shared))},
  };
}

// The kernels' own key functions (common.cuh, __host__ __device__) on scores given by their bits: no conversion
// between the caller's bits and the function.
uint32_t select_descending_key32(uint32_t float_bits) {
  float x;
  memcpy(&x, &float_bits, sizeof x);
  return descending_key32(x);
}

uint64_t select_descending_key64(uint64_t double_bits) {
  double x;
  memcpy(&x, &double_bits, sizeof x);
  return descending_key64(x);
}

std::pair<int64_t, int> select_cta_device_limits(int device) {
  const DeviceLimits limits = device_limits(device, "select_cta_device_limits");
  return {limits.dynamic_bytes, limits.max_cluster};
}

int64_t select_cta_max_n(int device, bool coverage, bool wide) {
  const DeviceLimits limits = device_limits(device, "select_cta_max_n");
  // Float64 coverage is never planned (one CTA compares 32-bit score keys): its callers take the multi-CTA chain.
  return select_cta_max_n_for(limits.dynamic_bytes, coverage, wide && !coverage, limits.max_cluster);
}

void select_cta(const SelectCtaParams& params) {
  const SelectCtaParams& p = params;
  const char* op = p.op;
  require(p.num_modalities >= 1 && p.num_modalities <= kMaxStageModalities, op,
          "the number of selected modalities must be in [1, " + std::to_string(kMaxStageModalities) + "]");
  require(p.batch >= 1 && p.batch <= INT_MAX, op, "B must be in [1, 2^31 - 1]");
  require(p.n >= 1, op, "n must be >= 1");
  require(is_float_code(p.scores_dtype), op, "scores dtype code must be a floating code");
  require(p.labels != nullptr || p.num_modalities == 1, op, "without labels exactly one modality is selected");
  require(p.labels == nullptr || is_int_code(p.labels_dtype), op, "labels dtype code must be an integer code");
  require(p.out_len >= 0 && p.out_len <= p.n, op, "out_len must be in [0, n]");
  bool coverage = false;
  for (int m = 0; m < p.num_modalities; ++m) {
    const SelectCtaModality& mod = p.modalities[m];
    require(mod.keep >= 0 && mod.keep <= p.n, op, "keep must be in [0, n]");
    require(p.labels == nullptr || mod.label >= 0, op, "modality labels must be >= 0 (label -1 is padding)");
    if (!mod.coverage) continue;
    coverage = true;
    require(mod.coverage_weight >= 0.0, op, "coverage_weight must be >= 0");
  }
  const bool wide = p.scores_dtype == kFloat64;
  if (coverage) {
    require(p.chunk_ids != nullptr && is_int_code(p.chunk_dtype), op,
            "coverage needs chunk_ids with an integer dtype code");
    require(!wide, op, "coverage compares 32-bit score keys: float64 scores take the multi-CTA path");
  }
  require(p.labels != nullptr || p.out_len == p.modalities[0].keep, op, "without labels out_len must equal keep");
  require(p.labels != nullptr || p.keeps == nullptr, op, "per-row keeps need labels");
  const DeviceLimits limits = device_limits(p.device, op);
  const SelectCtaPlan plan = select_cta_plan(p.n, coverage, wide, limits.dynamic_bytes, limits.max_cluster);
  require(plan.cluster > 0, op,
          "n = " + std::to_string(p.n) + " exceeds the limit " +
              std::to_string(select_cta_max_n_for(limits.dynamic_bytes, coverage, wide, limits.max_cluster)) +
              " of this device (select_cta_max_n)");
  require(p.batch * plan.cluster <= INT_MAX, op, "B times the cluster size must be at most 2^31 - 1");
  if (p.out_len == 0 && p.nonfinite == nullptr) return;  // nothing to write
  const DeviceGuard device_guard = use_device(p.device, op);
  cta::SelectKernelArgs a{};
  a.p = p;
  a.layout = cta::make_layout(plan.cap, plan.layout, wide, plan.table);
  a.cap = plan.cap;
  a.cluster = plan.cluster;
  a.table = plan.table;
  a.coverage = coverage ? 1 : 0;
  if (wide) {
    if (plan.cluster > 1) launch<uint64_t, true>(a, op); else launch<uint64_t, false>(a, op);
  } else {
    if (plan.cluster > 1) launch<uint32_t, true>(a, op); else launch<uint32_t, false>(a, op);
  }
  MACER_LAUNCH_CHECK(op, "select_cta_kernel");
}

}  // namespace macer
