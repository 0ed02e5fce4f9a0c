// One launch path for every kernel of the module: cudaLaunchKernelEx, with programmatic dependent launch (PDL)
// inside a stage's chain.
//
// A launcher calls launch_kernel(op, name, kernel, grid, block, smem, stream, args...) where it would write
// kernel<<<grid, block, smem, stream>>>(args...). Outside a chain the two are the same launch. Inside a chain (a
// ChainScope on this thread: csrc/stage.cu opens one around a prepared stage's launchers) every launch after the
// chain's first carries cudaLaunchAttributeProgrammaticStreamSerialization when the scope allows it (sm_90+ and a
// build whose code for the device has the waits, see stage_chain_supported): the kernel may be scheduled while its
// predecessor still runs, as soon as every block of the predecessor has called launch_dependents() or exited, so
// the launch latency between two kernels of a stage overlaps the predecessor's tail. Correctness rests on the
// kernels: each calls grid_dependency_wait() (common.cuh) before its first global read or write, which returns once
// the predecessor grid has completed and its writes are visible. Because every kernel of a chain waits before doing
// anything, a grid completes only after its predecessor completed: the ordering is transitive, and the first work
// after the chain (an ordinary launch) sees every kernel of the chain complete.
//
// The chain's first kernel is launched plainly: it follows the model's own work on the stream (attention, a
// layer), whose kernels know nothing of the chain.
#pragma once

#include "common.cuh"

namespace macer {

// The chain open on this thread (launches are made on the caller's thread; a scope never crosses threads).
struct ChainState {
  bool active = false;  // a ChainScope is open
  bool pdl = false;     // its launches after the first use PDL
  int launched = 0;     // kernels launched in this scope so far
};

inline ChainState& chain_state() {
  static thread_local ChainState state;
  return state;
}

// RAII: launches made while it lives form one chain. Scopes do not nest (a stage is one chain).
class ChainScope {
 public:
  explicit ChainScope(bool pdl) {
    ChainState& s = chain_state();
    require(!s.active, "stage", "a kernel chain is already open on this thread");
    s.active = true;
    s.pdl = pdl;
    s.launched = 0;
  }
  ~ChainScope() { chain_state() = ChainState{}; }
  ChainScope(const ChainScope&) = delete;
  ChainScope& operator=(const ChainScope&) = delete;
  int launched() const { return chain_state().launched; }
  // After a launcher that may launch through a path of its own (its kernels wait for their predecessor all the
  // same): the launches that follow in the chain are not its first.
  void started() {
    ChainState& s = chain_state();
    if (s.launched == 0) s.launched = 1;
  }
};

template <typename... Params, typename... Args>
void launch_kernel(const char* op, const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  ChainState& chain = chain_state();
  if (chain.active && chain.pdl && chain.launched > 0) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (chain.active) ++chain.launched;
  if (err != cudaSuccess) {
    cudaGetLastError();  // a launch error is not sticky: clear it so that later launches report their own
    throw std::runtime_error(std::string("macer_kernels.") + op + ": launch of " + name + " failed: " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

}  // namespace macer
