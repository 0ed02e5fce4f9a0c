// The prepared stage: one host call launches a MACER stage's kernels -- scoring, selection, the compaction of the
// caller's row tables -- chained with programmatic dependent launch (csrc/kernels/launch.cuh) on sm_90 and newer.
// The launchers of each op (modality_scores, select_cta, compact_many) run unchanged inside the chain: a new
// scoring or selection kernel behind them joins the chain by launching through launch_kernel and calling
// grid_dependency_wait() first.
#include <mutex>

#include "kernels/launch.cuh"

namespace macer {
namespace {

constexpr const char* kOp = "stage";
constexpr int kMaxDevices = 64;

int64_t element_bytes(int dtype) {
  switch (dtype) {
    case kFloat64: case kInt64: return 8;
    case kFloat32: case kInt32: return 4;
    case kFloat16: case kBFloat16: case kInt16: return 2;
    default: return 1;
  }
}

// The kernels of a chain: their binary's PTX version says whether the waits were compiled in.
__global__ void chain_probe_kernel() { grid_dependency_wait(); }

}  // namespace

bool stage_chain_supported(int device) {
  static std::mutex mutex;
  static int cache[kMaxDevices];  // 0 = not asked, 1 = no, 2 = yes
  require(device >= 0 && device < kMaxDevices, kOp, "device index must be in [0, 63]");
  std::lock_guard<std::mutex> lock(mutex);
  if (cache[device] == 0) {
    const DeviceGuard device_guard = use_device(device, kOp);
    int major = 0;
    MACER_CUDA_CHECK(kOp, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    // Every kernel of the module is compiled for the same architectures, so the probe's binary stands for all: its
    // ptxVersion is the virtual architecture the code running on this device was compiled from (a JIT from older
    // PTX reports the older version, and there the waits are compiled out).
    cudaFuncAttributes attr{};
    MACER_CUDA_CHECK(kOp, cudaFuncGetAttributes(&attr, chain_probe_kernel));
    cache[device] = major >= 9 && attr.ptxVersion >= 90 ? 2 : 1;
  }
  return cache[device] == 2;
}

void stage_launch(const StagePlan& plan, const StageCall& call) {
  const size_t count = plan.gather.size();
  require(call.gather_src.size() == count && call.gather_dst.size() == count, kOp,
          "the call must give a source and a destination for each of the plan's " + std::to_string(count) +
              " gathered tables");
  require(call.query != nullptr && call.key != nullptr && call.labels != nullptr && call.keep != nullptr, kOp,
          "query, key, labels and keep must be given");
  bool coverage = false;
  for (int m = 0; m < plan.select.num_modalities; ++m) coverage = coverage || plan.select.modalities[m].coverage;
  require(!coverage || call.chunk_ids != nullptr, kOp, "the plan selects by coverage: chunk_ids must be given");

  ModalityScoresParams scores = plan.scores;
  const int64_t q_offset = plan.query_row0 * call.q_stride[2] * element_bytes(scores.q_dtype);
  scores.query = static_cast<const unsigned char*>(call.query) + q_offset;
  for (int i = 0; i < 4; ++i) scores.q_stride[i] = call.q_stride[i];
  scores.key = call.key;
  for (int i = 0; i < 3; ++i) scores.k_stride[i] = call.k_stride[i];
  scores.modality = call.labels;
  scores.stream = call.stream;

  SelectCtaParams select = plan.select;
  select.scores = scores.out;
  select.labels = call.labels;
  select.chunk_ids = coverage ? call.chunk_ids : nullptr;
  select.out = call.keep;
  select.nonfinite = call.nonfinite;
  select.stream = call.stream;

  CompactParams gather{};
  gather.keep = call.keep;
  gather.keep_rows = plan.select.batch;  // a [B, out_len] keep: its -1 entries give zero rows, never a read
  gather.k = plan.select.out_len;
  gather.device = plan.scores.device;
  gather.stream = call.stream;
  gather.tensors.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const StageGather& g = plan.gather[i];
    // The unit size depends on the addresses' alignment, so the descriptor is made per call (host arithmetic).
    gather.tensors.push_back(compact_descriptor(call.gather_src[i], call.gather_dst[i], g.shape, g.strides,
                                                g.element_bytes, g.dim, true));
  }

  const DeviceGuard device_guard = use_device(plan.scores.device, kOp);
  ChainScope chain(plan.chain);
  modality_scores(scores);
  chain.started();
  select_cta(select);
  compact_many(gather);
}

}  // namespace macer
