// Torch-free launcher interface of macer_kernels._C.
//
// The Python wrappers (macer_kernels/cuda/*.py) validate tensors and fill these plain structs with raw device
// pointers, sizes and strides (in elements unless a name says bytes). Every launcher enqueues its kernels on the
// given stream and throws std::runtime_error naming the op and the CUDA error string on any failure; it never
// synchronises the device. This header includes no CUDA header so that the pybind11 bindings compile as plain C++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace macer {

// Element type codes shared with macer_kernels/cuda/_ext.py (DTYPE_CODES). Keep both in sync.
enum DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt16 = 6,
  kInt32 = 7,
  kInt64 = 8,
};

// Largest modality label (labels are 0..kMaxModalities); mirrors macer_kernels.modality_scores.MAX_MODALITIES.
constexpr int kMaxModalities = 8;
constexpr int kNumLabels = kMaxModalities + 1;

// ---------------------------------------------------------------------------------------------------------------
// modality_scores (eq:macer_score): csrc/modality_scores.cu (step S-A, every architecture) and, where built with
// 90a and the shape fits, csrc/modality_scores_sm90a.cu (step S-B, one persistent kernel). docs/cuda.md.
struct ModalityScoresParams {
  const void* query;            // [B, Hq, Lq, D], dtype q_dtype (any strides)
  const void* key;              // [B, Hkv, N, D], same dtype, key stride over D is 1
  const void* modality;         // [B, N] integer labels in -1..kMaxModalities (-1: padding), dtype modality_dtype
  const void* query_positions;  // [B, Lq] integer positions in 0..N-1, dtype positions_dtype
  float* out;                   // [B, N] float32, contiguous
  void* workspace;              // modality_scores_workspace_bytes(...) bytes, 256-byte aligned
  // modality_scores_counter_count(...) int32, all zero before the first call; every call leaves them zero again
  // (the last CTA of each unit resets its own), so one buffer serves every call on one stream and graph replays.
  int* counters;
  int q_dtype, modality_dtype, positions_dtype;
  int64_t batch, q_heads, q_len, head_dim, kv_heads, num_keys;
  int64_t q_stride[4];    // query strides (elements)
  int64_t k_stride[3];    // key strides over B, Hkv, N (elements)
  int64_t mod_stride[2];  // modality strides over B, N
  int64_t pos_stride[2];  // query_positions strides over B, Lq
  float scale, eps;
  int device;    // CUDA device index of the tensors (made current for the launches)
  void* stream;  // cudaStream_t
  // 0: choose (S-B where built and eligible, else S-A); 1: S-A only. For the benchmark and the tests.
  int path;
};
size_t modality_scores_workspace_bytes(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads,
                                       int64_t num_keys);
int64_t modality_scores_counter_count(int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_heads);
int64_t modality_scores_max_head_dim();
// How the tile kernel splits the key tiles of one (batch, KV head): `wave` CTAs fill the device (SMs x resident
// CTAs, asked by the launcher); pure host arithmetic, exposed for the CPU tests. Split s covers tiles
// [s * split_tiles + min(s, split_extra), (s + 1) * split_tiles + min(s + 1, split_extra)).
struct ScoresSplitPlan {
  int64_t tiles, splits, split_tiles, split_extra;
};
ScoresSplitPlan modality_scores_split_plan(int64_t batch, int64_t kv_heads, int64_t row_tiles, int64_t num_keys,
                                           int64_t wave);
// Enqueues the scoring kernels through launch_kernel (csrc/kernels/launch.cuh): inside a stage's ChainScope they
// follow the chain; outside one the op chains its own two S-A kernels (PDL on sm_90+). S-B's cooperative launch is
// its own (a chain's caller marks the chain started after this call, as stage_launch does).
void modality_scores(const ModalityScoresParams& p);
// Which kernels a call takes (no launch): "sa" or "sb", and why not "sb" (empty when it is "sb").
std::pair<std::string, std::string> modality_scores_path(const ModalityScoresParams& p);
// The tile kernel's own host/device helpers and constants (csrc/kernels/modality_scores.cuh), for the CPU replay:
// the first tile of a split, whether a key is visible to a row (exists, not after the causal limit, a label 0..8),
// the accumulator fragment's (key, row) of element e of a lane of a warp, and (name, value) of every constant the
// kernels' schedule depends on.
int64_t modality_scores_split_begin(int64_t split, int64_t split_tiles, int64_t split_extra);
bool modality_scores_key_visible(int64_t n, int64_t num_keys, int64_t pos, int64_t label);
std::pair<int, int> modality_scores_fragment(int warp, int lane, int e);
std::vector<std::pair<std::string, int64_t>> modality_scores_constants();
// The K-streaming baseline (bench_modality_scores' "read K once", on the scoring op's launch path): the tile
// kernel's per-thread loads over K on a grid the device holds at once, nothing else. out:
// modality_scores_stream_k_words(...) uint32.
struct StreamKParams {
  const void* key;  // [B, Hkv, N, D], 16-byte aligned rows (the scoring kernel's vectorised path)
  uint32_t* out;
  int dtype;
  int64_t batch, kv_heads, num_keys, head_dim;
  int64_t k_stride[3];
  int device;
  void* stream;
};
int64_t modality_scores_stream_k_words(int64_t batch, int64_t kv_heads, int64_t num_keys);
int64_t modality_scores_stream_k(const StreamKParams& p);  // returns the number of words written (one per CTA)

// ---------------------------------------------------------------------------------------------------------------
// topk_indices and coverage_select (eq:chunk_coverage_greedy)
struct SelectParams {
  const void* scores;     // [n] floating, dtype scores_dtype, stride scores_stride
  const void* chunk_ids;  // [n] non-negative integers (coverage_select only), dtype chunk_dtype
  int64_t* out;           // [k] int64, strictly increasing
  void* workspace;        // select_workspace_bytes(n) bytes, 16-byte aligned
  size_t workspace_bytes;
  int scores_dtype, chunk_dtype;
  int64_t n, k, scores_stride, chunk_stride;
  double coverage_weight;
  int device;
  void* stream;
};
size_t select_workspace_bytes(int64_t n, int device);  // queries CUB (needs a CUDA device)
size_t select_workspace_bytes_no_query(int64_t n);     // the part that is not CUB's temporary storage
void topk_indices(const SelectParams& p);
void coverage_select(const SelectParams& p);

// ---------------------------------------------------------------------------------------------------------------
// Radix selection in shared memory (csrc/kernels/select_cta.cuh): one launch, one CTA per row -- or, on sm_90, one
// thread block cluster per row -- for n up to select_cta_max_n(device, coverage, wide). topk_indices and
// coverage_select are one row with labels == nullptr and one modality; stage_select is B rows with up to
// kMaxStageModalities selected labels (each >= 0). Labels < 0 (PAD_LABEL = -1, a batch's padding) are never
// candidates and never kept.
constexpr int kMaxStageModalities = 8;
struct SelectCtaModality {
  int64_t label;           // tokens with this label are this modality's candidates
  int64_t keep;            // how many of them to keep, in [0, n]
  double coverage_weight;  // lambda_c >= 0 (coverage only)
  int coverage;            // 0: top-K, ties to the lower index; 1: the chunk-coverage greedy
};
struct SelectCtaParams {
  const char* op;         // op name for error messages
  const void* scores;     // [B, N] floating, dtype scores_dtype (float64 only without coverage)
  const void* labels;     // [B, N] integer labels, or nullptr: every token is a candidate of modalities[0]
  const void* chunk_ids;  // [B, N] integer chunk ids (read for coverage candidates only), or nullptr
  int64_t* out;           // [B, out_len] int64: row b's len_b kept positions ascending, right-aligned after
                          // out_len - len_b entries of -1 (all -1 for a row contradicting its budgets or out_len)
  int scores_dtype, labels_dtype, chunk_dtype;
  int64_t scores_stride[2], labels_stride[2], chunk_stride[2];  // elements
  int64_t out_stride, out_len;
  int64_t batch, n;
  int num_modalities;
  SelectCtaModality modalities[kMaxStageModalities];
  // Per-row budgets, or nullptr (every row keeps modalities[m].keep): contiguous int32 [B, num_modalities] on the
  // device, keeps[b * num_modalities + m] = row b's keep of modality m, in [0, modalities[m].keep] (the spec's keep
  // is the maximum over rows); an entry outside that range makes its row all -1. Needs labels.
  const int32_t* keeps;
  // Per-row flags, or nullptr: nonfinite[b] = whether row b has a non-finite score (NaN, +-inf) at a token of a
  // selected label (every token without labels). Written by the same launch (select_stage's return_flags).
  bool* nonfinite;
  int device;
  void* stream;
  // 1: launch with programmatic stream serialization (a PDL chain: the kernel starts while its predecessor on the
  // stream finishes and waits in griddepcontrol.wait before its first read); 0: a plain launch.
  int pdl;
};
// Largest n select_cta takes on `device`: one CTA's shared memory, or a cluster's on sm_90. `wide`: float64 scores
// (64-bit keys; coverage never takes them, the callers route float64 coverage to the multi-CTA chain).
int64_t select_cta_max_n(int device, bool coverage, bool wide);
void select_cta(const SelectCtaParams& p);
// The launch plan for a row of n tokens, from the dynamic shared memory a CTA may use and the largest cluster the
// device runs (1 without clusters): host arithmetic, the same the launcher does, exposed for the CPU replay.
// cluster == 0: n does not fit.
struct SelectCtaPlan {
  int cluster;         // CTAs per row
  int64_t cap;         // tokens per CTA: ceil(n / cluster)
  int layout;          // 0: top-K, 1: coverage in one CTA, 2: coverage in a cluster (csrc/kernels/select_cta.cuh)
  int table;           // float64 bonus table entries
  int64_t bytes;       // dynamic shared memory per CTA
};
SelectCtaPlan select_cta_plan(int64_t n, bool coverage, bool wide, int64_t dynamic_bytes, int max_cluster);
// The device's inputs to the plan, asked once per device: (dynamic shared memory per CTA, largest cluster).
std::pair<int64_t, int> select_cta_device_limits(int device);
int64_t select_cta_max_n_for(int64_t dynamic_bytes, bool coverage, bool wide, int max_cluster);
// Host-side facts of the kernel, for the CPU replay (tests/test_cuda_select_emulation.py) to check itself against:
// (name, value) of every constant the algorithm depends on, its static shared memory, and the order keys of scores
// given by their raw bits.
std::vector<std::pair<std::string, int64_t>> select_cta_constants();
uint32_t select_descending_key32(uint32_t float_bits);
uint64_t select_descending_key64(uint64_t double_bits);

// ---------------------------------------------------------------------------------------------------------------
// compact / compact_many: one gather launch for up to kMaxCompactTensors tensors sharing a sequence axis
constexpr int kMaxCompactTensors = 8;
struct CompactTensor {
  const void* src;   // viewed as [outer, batch, N, row_units] units of unit_bytes
  void* dst;         // contiguous [outer, batch, k, row_units]
  int64_t outer, batch, row_units;  // batch: 1 for a 1-D keep, B (the keep's rows) for a 2-D keep
  int64_t unit_bytes;                                           // 1, 2, 4, 8 or 16
  int64_t outer_stride, batch_stride, seq_stride, unit_stride;  // bytes
};
struct CompactParams {
  std::vector<CompactTensor> tensors;  // any number; launched in groups of kMaxCompactTensors
  // keep_rows == 0: keep is [k], strictly increasing indices in 0..N-1, and every tensor has batch 1.
  // keep_rows == B >= 1: keep is [B, k] (contiguous), row b the positions of batch element b: a run of -1 (an
  // all-zero output row each), then strictly increasing indices in 0..N-1; every tensor has batch B.
  const int64_t* keep;
  int64_t keep_rows;
  int64_t k;
  int device;
  void* stream;
};
void compact_many(const CompactParams& p);
// The descriptor of a tensor of `shape` / `strides` (elements) and `element_bytes`, compacted along `dim` into the
// contiguous `dst`: [outer, batch, N, row_units] units of the widest size (16..1 bytes) dividing the row size, the
// strides and the base address. `batched` (a 2-D keep): dim - 1 is the batch dim (batch = its size), else batch = 1.
// Throws std::invalid_argument when the dims before (before dim - 1 when batched) or after `dim` do not flatten to
// one stride each (the caller copies such a tensor to contiguous memory first).
CompactTensor compact_descriptor(const void* src, void* dst, const std::vector<int64_t>& shape,
                                 const std::vector<int64_t>& strides, int64_t element_bytes, int64_t dim,
                                 bool batched);

// ---------------------------------------------------------------------------------------------------------------
// The prepared stage (csrc/stage.cu; macer_kernels.stage.PreparedStage): one call launches a MACER stage's kernels
// -- scoring (modality_scores), selection (select_cta) and the compaction of the caller's row tables with the
// stage's keep (compact_many) -- on one stream, chained with programmatic dependent launch where
// stage_chain_supported(device) (csrc/kernels/launch.cuh). The plan is built once per stage shape and holds every
// size, stride, dtype, budget and the persistent buffers (workspace, scores, question-row positions, per-sample
// budgets); a call patches the pointers of its inputs and outputs. Nothing is allocated and nothing is read back.
struct StageGather {
  std::vector<int64_t> shape;    // [..., B, N, ...]: the batch dim (size B) just before the sequence dim
  std::vector<int64_t> strides;  // elements; the dims before the batch dim and after `dim` each flatten to one
  int64_t element_bytes;
  int64_t dim;  // the sequence dim; its output is the same shape with N -> out_len, contiguous
};
struct StagePlan {
  // Everything but query, key, modality (the per-call labels), the query strides and the key strides.
  ModalityScoresParams scores;
  // Everything but labels and chunk_ids (per call), out (the keep [B, out_len]) and nonfinite (the flags [B]);
  // scores is scores.out.
  SelectCtaParams select;
  std::vector<StageGather> gather;  // compacted with the keep as a [B, out_len] keep (-1 entries: zero rows)
  int64_t query_row0;               // the question rows' first index in the query's dim 2 (host-known)
  bool chain;                       // chain the launches with PDL
};
struct StageCall {
  const void* query;  // [B, Hq, >= row0 + Lq, D]: rows row0 .. row0 + Lq - 1 are the stage's question rows
  int64_t q_stride[4];
  const void* key;
  int64_t k_stride[3];
  const void* labels;     // [B, N], the plan's labels dtype, contiguous
  const void* chunk_ids;  // [B, N] or nullptr (no coverage modality)
  int64_t* keep;          // [B, out_len] int64, contiguous
  bool* nonfinite;        // [B]
  std::vector<const void*> gather_src;  // one per plan.gather entry, laid out as it says
  std::vector<void*> gather_dst;
  void* stream;
};
// Launches the stage (scoring 2 kernels with S-A or 1 with S-B, + 1 + 1); every argument is checked before the
// first launch.
void stage_launch(const StagePlan& plan, const StageCall& call);
// Whether a chain on `device` uses PDL: compute capability 9.0 or newer, and this module's code for the device was
// compiled for sm_90 or newer (below that grid_dependency_wait compiles to nothing). Asked once per device.
bool stage_chain_supported(int device);

// ---------------------------------------------------------------------------------------------------------------
// Runtime queries (no kernel launches): used by macer_kernels.cuda.unavailable_reason().
struct DeviceReport {
  int count;                // CUDA devices visible (0 on error)
  std::string error;        // empty if cudaGetDeviceCount succeeded
  int major, minor;         // compute capability of the current device (0, 0 if none)
  int runtime_version;      // CUDART_VERSION the module was built with
  int driver_version;       // 0 if no driver
};
DeviceReport device_report();
// Make `device` current in this module's (static) CUDA runtime for the guard's lifetime; the previous device is
// current again when it ends. The runtime's current device lives in the thread's driver context, which torch's
// runtime reads too: a launcher that left it switched would move the caller's later work to another GPU.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* op);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // -1: nothing to restore
};
[[nodiscard]] DeviceGuard use_device(int device, const char* op);
std::vector<int> compiled_archs();  // SASS architectures compiled into this module, e.g. {89, 90}
int ptx_arch();                     // architecture of the embedded PTX (0 if none)

}  // namespace macer
