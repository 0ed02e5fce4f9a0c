// Launcher of the one-CTA selection kernel (csrc/kernels/select_cta.cuh): one launch, no workspace, no
// synchronisation. The per-device shared-memory limit is queried once and cached (host attributes, no device work).
#include <algorithm>
#include <climits>
#include <mutex>

#include "kernels/launch.cuh"
#include "kernels/select_cta.cuh"

namespace macer {
namespace {

// Dynamic shared memory: n 64-bit keys (top-K and coverage alike: the coverage sort stores only the n real keys),
// then the picked-token bitmap.
size_t dynamic_bytes(int64_t n) { return static_cast<size_t>(n) * 8 + static_cast<size_t>(ceil_div(n, 32)) * 4; }

constexpr int kMaxDevices = 64;
std::mutex limits_mutex;
size_t dynamic_limit[kMaxDevices];  // 0 = not yet queried

// Dynamic shared memory a block may use on `device` (opt-in maximum minus the kernel's static shared memory); the
// kernel is opted in to all of it once per device.
size_t device_dynamic_limit(int device, const char* op) {
  require(device >= 0 && device < kMaxDevices, op, "device index must be in [0, 63]");
  std::lock_guard<std::mutex> lock(limits_mutex);
  if (dynamic_limit[device] == 0) {
    const DeviceGuard device_guard = use_device(device, op);
    int optin = 0;
    MACER_CUDA_CHECK(op, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attr{};
    MACER_CUDA_CHECK(op, cudaFuncGetAttributes(&attr, cta::select_cta_kernel));
    const size_t avail = static_cast<size_t>(optin) - attr.sharedSizeBytes;
    MACER_CUDA_CHECK(op, cudaFuncSetAttribute(cta::select_cta_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(avail)));
    dynamic_limit[device] = avail;
  }
  return dynamic_limit[device];
}

int64_t max_n_for(size_t avail, bool coverage) {
  int64_t n = static_cast<int64_t>(avail / 8);
  while (n > 0 && dynamic_bytes(n) > avail) --n;
  // coverage holds at most kMaxSortItems sorted positions per thread in registers
  return coverage ? std::min<int64_t>(n, int64_t{cta::kThreads} * cta::kMaxSortItems) : n;
}

}  // namespace

SelectCtaFacts select_cta_facts() {
  return {cta::kThreads, cta::kMaxSortItems, static_cast<int64_t>(sizeof(cta::Shared)), cta::kNever, kNanKey64,
          kNanKey32};
}

int64_t select_cta_max_n_for(int64_t dynamic_bytes, bool coverage) {
  require(dynamic_bytes >= 0, "select_cta_max_n_for", "dynamic_bytes must be >= 0");
  return max_n_for(static_cast<size_t>(dynamic_bytes), coverage);
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

int64_t select_cta_max_n(int device, bool coverage) {
  return max_n_for(device_dynamic_limit(device, "select_cta_max_n"), coverage);
}

void select_cta(const SelectCtaParams& params) {
  SelectCtaParams p = params;
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
  if (coverage) {
    require(p.chunk_ids != nullptr && is_int_code(p.chunk_dtype), op,
            "coverage needs chunk_ids with an integer dtype code");
    require(p.scores_dtype != kFloat64, op, "coverage in one CTA compares float32 score bits: float64 scores "
                                            "take the multi-CTA path");
  }
  require(p.labels != nullptr || p.out_len == p.modalities[0].keep, op, "without labels out_len must equal keep");
  require(p.labels != nullptr || p.keeps == nullptr, op, "per-row keeps need labels");
  const size_t avail = device_dynamic_limit(p.device, op);
  const int64_t limit = max_n_for(avail, coverage);
  require(p.n <= limit, op, "n = " + std::to_string(p.n) + " exceeds the one-CTA limit " + std::to_string(limit) +
                                " of this device (select_cta_max_n)");
  if (p.out_len == 0 && p.nonfinite == nullptr) return;  // nothing to write
  const DeviceGuard device_guard = use_device(p.device, op);
  p.key_capacity = p.n;
  launch_kernel(op, "select_cta_kernel", cta::select_cta_kernel, dim3(static_cast<unsigned>(p.batch)),
                dim3(cta::kThreads), dynamic_bytes(p.n), static_cast<cudaStream_t>(p.stream), p);
}

}  // namespace macer
