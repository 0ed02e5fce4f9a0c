// Allocation-normalised modality scores (eq:macer_score) as a flash-decoding split over key tiles plus two small
// passes.
//
// For query row r = (h, q) with causal limit pos(q), logits l_ri = scale * q_r . k_i (i <= pos(q)) and label m(i):
//
//   A_r(i) / (S_r,m(i) + eps) = exp(l_ri - M_r) / (E_r,m(i) + eps * Z_r)
//
// where M_r is any reference (the softmax normaliser cancels except inside eps), E_r,m = sum_{j in m, j <= pos}
// exp(l_rj - M_r) and Z_r = sum_{j <= pos} exp(l_rj - M_r) over all visible keys, text included. With a separate
// reference M_r,m = max_{j in m} l_rj per modality this reads
//
//   exp(l_ri - M_r,m) / (E'_r,m + eps * Z_r * exp(M_r - M_r,m)),   E'_r,m = sum_{j in m} exp(l_rj - M_r,m) >= 1,
//
// which stays exact when one modality gets almost no attention (E_r,m would underflow against the row maximum).
// A key is visible to row r when it exists, j <= pos(q) and its label is not PAD_LABEL (-1, a batch's left
// padding): an invisible key has logit -inf, adds nothing to any sum and scores 0.
//
//   1. scores_tile_kernel, grid (splits, Hkv, B): each CTA owns a contiguous range of key tiles (a split) of one KV
//      head. It stages the query rows of the head's GQA group (G = Hq / Hkv heads x Lq rows) once, then for each
//      tile loads K once (16-byte loads, kLoadBatch per thread issued before any is stored, evict-first in L2; the
//      next tile's labels are loaded during this tile), computes the logits on tensor cores (bf16/fp16: WMMA, fp32
//      accumulate) or CUDA cores (fp32/fp64, in fp32), writes them (log2 units, -inf where not visible, evict-last
//      in L2 for the reduce) and merges the tile's (max, sum of exp2 below it) per (row, label) into a running pair
//      in shared memory, kThreadsPerRow threads per row. One partial per (row, label, split) is written at the end:
//      the number of splits is chosen on the host for whole waves of CTAs, so the partials are a few per row, not
//      one per tile.
//   2. scores_combine_kernel, one block per row and one warp per label: merges the splits' partials into
//      (M_r,m, 1 / denominator).
//   3. scores_reduce_kernel, a block per kReduceKeys keys, its warps splitting the rows: s_i = 1/(Lq Hq)
//      sum_r exp2(l_ri - M_r,m(i)) * inv_r,m(i).
// Everything is fp32; exp2 with log2(e) folded into the scale.
#pragma once

#include <mma.h>

#include <cmath>

#include "common.cuh"

namespace macer {
namespace scores {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = 32;   // query rows per pass over a split's K tiles (two 16-row WMMA fragments)
// The epilogue: warp w owns rows [kRowsPerWarp w, kRowsPerWarp (w + 1)) of the row tile; for the per-label
// reductions each of them is taken by kThreadsPerRow threads of the warp (adjacent lanes), so all 32 rows reduce at
// once with two shuffle steps, instead of a warp per row with two 5-step shuffle chains, 7-8 rows in series.
constexpr int kRowsPerWarp = kRowTile / kWarps;
constexpr int kThreadsPerRow = 32 / kRowsPerWarp;
static_assert(kRowsPerWarp * kWarps == kRowTile && kThreadsPerRow * kRowsPerWarp == 32, "epilogue row mapping");
// 16-byte K chunks each thread issues before it stores any: a compile-time count, so they are all in flight at once
// (128 threads x 8 x 16 B = 16 KB per CTA, a whole bf16 tile up to D = 128; one chunk at a time gave 2 KB).
constexpr int kLoadBatch = 8;

template <typename T>
struct TileConfig {
  static constexpr bool kMma = false;
  static constexpr int kKeys = 32;
  // Resident CTAs per SM that ptxas must allow (__launch_bounds__): without it, sm_90's fp32 tile kernel took 96
  // registers and spilled 20 B around the batched K loads; 4 caps it at 128 (no spill; 111-127 used). On an H100
  // that is 4 resident CTAs at D <= 128 where shared memory would allow 5 or more (64 KB of K loads in flight per SM
  // instead of 10 KB before at D = 128); sm_89 stays at shared memory's 2.
  static constexpr int kMinBlocks = 4;
  static constexpr int kPad = 4;  // keeps rows 16-byte aligned and spreads lanes over banks
  static constexpr int kDimAlign = 4;
  using Smem = float;
};
template <>
struct TileConfig<__half> {
  static constexpr bool kMma = true;
  static constexpr int kKeys = 64;
  static constexpr int kMinBlocks = 0;  // no bound: 64 / 72 registers (sm_89 / sm_90; a bound of 5-6 gave 80-96)
  static constexpr int kPad = 8;  // WMMA needs a leading dimension that is a multiple of 8 halves
  static constexpr int kDimAlign = 16;
  using Smem = __half;
};
template <>
struct TileConfig<__nv_bfloat16> {
  static constexpr bool kMma = true;
  static constexpr int kKeys = 64;
  static constexpr int kMinBlocks = 0;  // no bound: 64 / 72 registers (sm_89 / sm_90; a bound of 5-6 gave 80-96)
  static constexpr int kPad = 8;
  static constexpr int kDimAlign = 16;
  using Smem = __nv_bfloat16;
};

constexpr int kMaxHeadDim = 256;
constexpr int kMinKeysPerTile = 32;  // the workspace is sized for the smallest tile
// Splits per (batch, KV head) at most: the workspace holds min(ceil(N / kMinKeysPerTile), kMaxSplits) partials per
// (row, label) whatever the device. 1024 splits fill any current GPU even at B = Hkv = 1 (132 SMs x 6 CTAs).
constexpr int64_t kMaxSplits = 1024;

struct TileArgs {
  const void* query;
  const void* key;
  const void* modality;
  const void* positions;
  float* logits;    // [B, Hq*Lq, N]
  float2* partial;  // [B, Hq*Lq, kNumLabels, splits]
  int modality_dtype, positions_dtype;
  int64_t q_heads, q_len, head_dim, kv_heads, num_keys, tiles, splits;
  int64_t group;                     // Hq / Hkv
  int64_t split_tiles, split_extra;  // tiles / splits and tiles % splits (no 64-bit division on the device)
  int64_t q_stride[4], k_stride[3], mod_stride[2], pos_stride[2];
  float scale_log2;  // scale * log2(e)
  bool vec16;        // key base, strides and D allow 16-byte loads
  bool q_vec16;      // the same for the query (whose stride over D is 1)
  int padded_dim;    // D rounded up to TileConfig::kDimAlign
};

__host__ __device__ inline int smem_ld(int padded_dim, int pad) { return padded_dim + pad; }

// Dynamic shared memory of scores_tile_kernel: the K tile, the query tile, the fp32 logits tile, and the labels and
// per-warp label masks of two consecutive tiles (double-buffered, see the kernel).
template <typename T>
__host__ inline size_t tile_smem_bytes(int padded_dim) {
  using C = TileConfig<T>;
  const size_t ld = smem_ld(padded_dim, C::kPad);
  return (C::kKeys + kRowTile) * ld * sizeof(typename C::Smem) + kRowTile * (C::kKeys + 4) * sizeof(float) +
         2 * C::kKeys * sizeof(int) + 2 * kWarps * sizeof(unsigned);
}

// First tile of split `split` when `tiles` tiles go to `splits` splits (1 <= splits <= tiles), given
// split_tiles = tiles / splits and split_extra = tiles % splits: the first split_extra splits get one tile more, so
// lengths differ by at most one and every split has at least one tile; split `splits` begins at `tiles`.
__host__ __device__ inline int64_t split_begin(int64_t split, int64_t split_tiles, int64_t split_extra) {
  return split * split_tiles + (split < split_extra ? split : split_extra);
}

// Whether key n (label `label`) is visible to a query row whose causal limit is `pos`: it exists, is not after the
// limit and is not padding (PAD_LABEL = -1). The tile kernel's only visibility test; the host build exposes it to
// the CPU replay (_C.modality_scores_visible).
__host__ __device__ inline bool key_visible(int64_t n, int64_t num_keys, int64_t pos, int64_t label) {
  return n < num_keys && n <= pos && label >= 0;
}

// Keys per tile for a query/key dtype code (the tile kernel's TileConfig<T>::kKeys).
__host__ inline int tile_keys(int q_dtype) {
  return q_dtype == kFloat16 || q_dtype == kBFloat16 ? TileConfig<__half>::kKeys : TileConfig<float>::kKeys;
}

// L2 eviction priorities (sm_80+). K is read once per CTA: evict-first, so it does not push out the logits, which
// the reduce reads back once and should find in L2 (evict-last; 45 MB at the 7B shapes and N = 100k, 50 MB of L2 on
// an H100). L1 is bypassed for K (no reuse within the CTA: the tile goes to shared memory).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint4 load16_evict_first(const void* src, uint64_t policy) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(src), "l"(policy));
  return v;
}
// No "memory" clobber: nothing in the tile kernel reads the logits back, so the store need not order other accesses
// (it would force the shared-memory reads around it to be reissued).
__device__ __forceinline__ void store_evict_last(float* dst, float v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;" ::"l"(dst), "f"(v), "l"(policy));
}

// The bits of V = 16 / sizeof(T) consecutive elements at src, zero past `valid` (all-zero bits are 0.0 in every
// float type): one 16-byte load where `vec` allows it (kStream: evict-first, see above), else element loads.
template <typename T, bool kStream>
__device__ __forceinline__ uint4 fetch_chunk(const T* src, int valid, bool vec, uint64_t policy) {
  constexpr int V = 16 / sizeof(T);
  if (vec && valid == V) {
    if constexpr (kStream) {
      return load16_evict_first(src, policy);
    } else {
      return __ldg(reinterpret_cast<const uint4*>(src));
    }
  }
  alignas(16) T vals[V];
  *reinterpret_cast<uint4*>(vals) = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if (i < valid) vals[i] = src[i];
  }
  return *reinterpret_cast<const uint4*>(vals);
}

// Store a fetched chunk into shared memory of type S: 16-bit and fp32 types as they are, fp64 converted to fp32.
template <typename T, typename S>
__device__ __forceinline__ void store_chunk(uint4 bits, S* dst) {
  if constexpr (sizeof(S) == sizeof(T)) {
    *reinterpret_cast<uint4*>(dst) = bits;
  } else {
    constexpr int V = 16 / sizeof(T);
    alignas(16) T vals[V];
    *reinterpret_cast<uint4*>(vals) = bits;
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = static_cast<float>(vals[i]);
  }
}

// The K tile [kKeys][padded D] (zero past N and D) into shared memory, `chunks` = padded D / V chunks per key. Each
// thread issues up to kLoadBatch loads into registers before it stores any (see kLoadBatch); a tile of more than
// kLoadBatch * kThreads chunks (D > 128 for bf16, fp64 above D = 64) takes two or more such batches.
template <typename T, typename S, int kKeys>
__device__ __forceinline__ void load_k_tile(const T* kbase, int64_t stride_n, int64_t n0, int64_t num_keys,
                                            int64_t head_dim, unsigned chunks, bool vec, S* ks, int ld,
                                            uint64_t policy) {
  constexpr int V = 16 / sizeof(T);
  const unsigned total = kKeys * chunks;
  for (unsigned c0 = 0; c0 < total; c0 += kLoadBatch * kThreads) {
    uint4 bits[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const unsigned c = c0 + u * kThreads + threadIdx.x;
      const unsigned j = c / chunks, d0 = (c % chunks) * V;
      const int64_t left = head_dim - d0;
      const int valid = c < total && n0 + j < num_keys && left > 0 ? static_cast<int>(left < V ? left : V) : 0;
      bits[u] = valid > 0 ? fetch_chunk<T, true>(kbase + (n0 + j) * stride_n + d0, valid, vec, policy)
                          : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const unsigned c = c0 + u * kThreads + threadIdx.x;
      if (c < total) store_chunk<T, S>(bits[u], ks + (c / chunks) * ld + (c % chunks) * V);
    }
  }
}

// Label of key n of batch element b: -1 past N (set no bit below, index nothing).
__device__ __forceinline__ int key_label(const TileArgs& a, int64_t b, int64_t n) {
  return n < a.num_keys ? static_cast<int>(load_int(a.modality, a.modality_dtype, b * a.mod_stride[0] +
                                                                                       n * a.mod_stride[1]))
                        : -1;
}

template <typename T>
__device__ __forceinline__ typename TileConfig<T>::Smem to_smem(T x) {
  if constexpr (TileConfig<T>::kMma) {
    return x;
  } else {
    return static_cast<float>(x);
  }
}

// Logits of kRowTile query rows against kKeys keys in shared memory, into S[row][key] (fp32).
template <typename T>
__device__ __forceinline__ void tile_logits(const typename TileConfig<T>::Smem* ks, const typename TileConfig<T>::Smem* qs,
                                            float* s, int ld, int lds, int padded_dim) {
  using C = TileConfig<T>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (C::kMma) {
    // Warp w owns keys [16w, 16w + 16) and both 16-row fragments: one B fragment load feeds two MMAs.
    namespace wmma = nvcuda::wmma;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a0, a1;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bk;  // K stored [key][d] = B (d x key) col-major
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c0, c1;
    wmma::fill_fragment(c0, 0.0f);
    wmma::fill_fragment(c1, 0.0f);
    for (int d0 = 0; d0 < padded_dim; d0 += 16) {
      wmma::load_matrix_sync(bk, ks + warp * 16 * ld + d0, ld);
      wmma::load_matrix_sync(a0, qs + d0, ld);
      wmma::load_matrix_sync(a1, qs + 16 * ld + d0, ld);
      wmma::mma_sync(c0, a0, bk, c0);
      wmma::mma_sync(c1, a1, bk, c1);
    }
    wmma::store_matrix_sync(s + warp * 16, c0, lds, wmma::mem_row_major);
    wmma::store_matrix_sync(s + 16 * lds + warp * 16, c1, lds, wmma::mem_row_major);
  } else {
    // Lane = key (rows of K are ld apart, ld/4 odd for D % 8 == 0: float4 reads hit distinct banks); warp w owns
    // rows [8w, 8w + 8), whose query values are broadcast to all lanes.
    float acc[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) acc[i] = 0.0f;
    const float* kr = ks + lane * ld;
    for (int d = 0; d < padded_dim; d += 4) {
      const float4 kv = *reinterpret_cast<const float4*>(kr + d);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float4 qv = *reinterpret_cast<const float4*>(qs + (warp * kRowsPerWarp + i) * ld + d);
        acc[i] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, acc[i]))));
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) s[(warp * kRowsPerWarp + i) * lds + lane] = acc[i];
  }
}

// One CTA per (split, KV head, batch). Rows of the GQA group are taken in row tiles of kRowTile, outermost: for
// Hq / Hkv * Lq <= kRowTile (e.g. 7B: 7 x 4 = 28) the query is staged once and each K tile of the split is read
// once; a larger group re-reads the split's K tiles once per row tile (from L2 when the split fits there), which
// keeps the running state of one row tile in shared memory.
//
// Barriers per tile: (A) after the loads (K, labels, masks; the query of the row tile the first time), (B) after the
// logits. The labels and masks are double-buffered by tile parity: tile t + 2 rewrites the buffer of tile t only
// after barrier (A) of tile t + 1, which every thread reaches after tile t's epilogue; K and the logits tile are
// rewritten only after (B) and (A) respectively, so no third barrier is needed. The epilogue's two passes touch
// only the rows of their own warp (of s and of run), so a __syncwarp orders them.
template <typename T>
__global__ void __launch_bounds__(kThreads, TileConfig<T>::kMinBlocks) scores_tile_kernel(const TileArgs a) {
  // A stage's chain may launch this kernel before its predecessor ends (csrc/kernels/launch.cuh): wait for it
  // before the first global access; then let the successor be scheduled.
  grid_dependency_wait();
  launch_dependents();
  using C = TileConfig<T>;
  using S = typename C::Smem;
  constexpr int kKeys = C::kKeys;
  constexpr int kKeysPerLane = kKeys / 32;
  constexpr int kKeysPerThread = kKeys / kThreadsPerRow;  // keys of one row per thread in the reductions
  constexpr int V = 16 / sizeof(T);
  const int ld = smem_ld(a.padded_dim, C::kPad);
  constexpr int lds = kKeys + 4;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  S* ks = reinterpret_cast<S*>(smem_raw);
  S* qs = ks + kKeys * ld;
  float* s = reinterpret_cast<float*>(qs + kRowTile * ld);
  int* labels = reinterpret_cast<int*>(s + kRowTile * lds);                 // [2][kKeys]
  unsigned* present = reinterpret_cast<unsigned*>(labels + 2 * kKeys);  // [2][kWarps]: labels 0..8 seen per warp
  // Per query row of the current row tile, computed once per row tile: the element offset of its query (-1 past the
  // last row), its causal limit and its global row index. The div/mod by Lq runs once per row here, not per staged
  // element or per tile.
  __shared__ int64_t row_offset[kRowTile];
  __shared__ int64_t row_pos[kRowTile];
  __shared__ int64_t row_index[kRowTile];  // = b*Hq*Lq + h*Lq + q
  // run[r][m] = (max, sum of exp2 below it) of row r0 + r over the visible keys of label m in the tiles merged so
  // far; (-inf, 0) while none. Only the threads of the warp that owns row r (r / kRowsPerWarp) touch it until the
  // row tile ends.
  __shared__ float2 run[kRowTile][kNumLabels];
  // The non-finite rule (modality_scores' docstring): row r0 + r has a visible key whose logit is not finite. Its
  // partials are written as (-inf, NaN), which the combine turns into NaN weights for every label of the row.
  __shared__ int row_broken[kRowTile];

  const int64_t split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int64_t t_first = split_begin(split, a.split_tiles, a.split_extra);
  const int64_t t_end = split_begin(split + 1, a.split_tiles, a.split_extra);
  const int64_t group = a.group;
  const int64_t rows = group * a.q_len;  // query rows sharing this KV head (the host checks B*Hq*Lq < 2^31)
  const int64_t rows_per_batch = a.q_heads * a.q_len;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* kbase = static_cast<const T*>(a.key) + b * a.k_stride[0] + kvh * a.k_stride[1];
  const T* qbase = static_cast<const T*>(a.query) + b * a.q_stride[0];
  const int chunks = a.padded_dim / V;
  const uint64_t k_policy = l2_evict_first_policy(), logit_policy = l2_evict_last_policy();

  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    const int rows_here = static_cast<int>(rows - r0 < kRowTile ? rows - r0 : kRowTile);
    if (threadIdx.x < kRowTile) {
      const int64_t rr = r0 + threadIdx.x;
      // rr < 2^31: 32-bit div/mod, inline (the 64-bit ones are a subroutine call that made ptxas spill).
      const unsigned rr32 = static_cast<unsigned>(rr), lq32 = static_cast<unsigned>(a.q_len);
      const int64_t h = kvh * group + rr32 / lq32, q = rr32 % lq32;
      const bool real = rr < rows;
      row_offset[threadIdx.x] = real ? h * a.q_stride[1] + q * a.q_stride[2] : -1;
      row_pos[threadIdx.x] =
          real ? load_int(a.positions, a.positions_dtype, b * a.pos_stride[0] + q * a.pos_stride[1]) : -1;
      row_index[threadIdx.x] = b * rows_per_batch + kvh * rows + rr;
      row_broken[threadIdx.x] = 0;
    }
    for (int i = threadIdx.x; i < kRowTile * kNumLabels; i += kThreads) {
      run[i / kNumLabels][i % kNumLabels] = make_float2(-INFINITY, 0.0f);
    }
    // The first tile's labels (thread j < kKeys holds key j's); later tiles' are loaded one tile ahead, below.
    int next_label = threadIdx.x < kKeys ? key_label(a, b, t_first * kKeys + threadIdx.x) : -1;
    __syncthreads();
    // The query tile, once per row tile; published by barrier (A) of the first tile.
    if (a.q_stride[3] == 1) {  // rows of Q are contiguous over D: 16-byte chunks like K (scalar where unaligned)
      for (int c = threadIdx.x; c < kRowTile * chunks; c += kThreads) {
        const int r = c / chunks, d0 = (c % chunks) * V;
        const int64_t offset = row_offset[r];
        const int64_t left = a.head_dim - d0;
        const int valid = offset < 0 || left <= 0 ? 0 : static_cast<int>(left < V ? left : V);
        store_chunk<T, S>(fetch_chunk<T, false>(qbase + (valid > 0 ? offset + d0 : 0), valid, a.q_vec16, 0),
                          qs + r * ld + d0);
      }
    } else {
      for (int i = threadIdx.x; i < kRowTile * a.padded_dim; i += kThreads) {
        const int r = i / a.padded_dim, d = i % a.padded_dim;
        const int64_t offset = row_offset[r];
        qs[r * ld + d] = offset >= 0 && d < a.head_dim ? to_smem<T>(qbase[offset + d * a.q_stride[3]])
                                                       : to_smem<T>(T(0.0f));
      }
    }

    for (int64_t t = t_first; t < t_end; ++t) {
      const int64_t n0 = t * kKeys;
      int* tile_labels = labels + (t & 1) * kKeys;
      unsigned* tile_present = present + (t & 1) * kWarps;
      // K tile: each 16-byte chunk is read once from global memory and serves all rows of the row tile.
      load_k_tile<T, S, kKeys>(kbase, a.k_stride[2], n0, a.num_keys, a.head_dim, static_cast<unsigned>(chunks),
                               a.vec16, ks, ld, k_policy);
      // Labels of the tile (loaded during the previous tile); -1 past N. PAD (-1) and out-of-range labels set no
      // bit, so they index nothing below.
      unsigned mine = 0u;
      if (threadIdx.x < kKeys) {
        tile_labels[threadIdx.x] = next_label;
        if (next_label >= 0 && next_label < kNumLabels) mine = 1u << next_label;
        // The next tile's label, in flight during this tile's logits and epilogue (its value is used next tile).
        next_label = t + 1 < t_end ? key_label(a, b, n0 + kKeys + threadIdx.x) : -1;
      }
      mine = __reduce_or_sync(0xffffffffu, mine);
      if (lane == 0) tile_present[warp] = mine;
      __syncthreads();  // (A)
      tile_logits<T>(ks, qs, s, ld, lds, a.padded_dim);
      __syncthreads();  // (B)

      // Epilogue, pass 1 (warp w, its kRowsPerWarp rows one at a time, lane = key: 128-byte coalesced stores): the
      // logits in log2 units, -inf where not visible, to global memory and back into s; the rows' non-finite flags.
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = warp * kRowsPerWarp + i;
        const bool real = r < rows_here;
        const int64_t pos = row_pos[r], row = row_index[r];
        bool bad = false;
#pragma unroll
        for (int u = 0; u < kKeysPerLane; ++u) {
          const int j = lane + 32 * u;
          const int64_t n = n0 + j;
          const float l = s[r * lds + j] * a.scale_log2;
          const bool visible = real && key_visible(n, a.num_keys, pos, tile_labels[j]);
          const float v = visible ? l : -INFINITY;
          bad |= visible && !isfinite(l);
          s[r * lds + j] = v;
          if (real && n < a.num_keys) store_evict_last(a.logits + row * a.num_keys + n, v, logit_policy);
        }
        if (__any_sync(0xffffffffu, bad) && lane == 0) row_broken[r] = 1;
      }
      __syncwarp();  // pass 2 reads the warp's rows of s, written by every lane
      // Pass 2: row r = warp's row lane / kThreadsPerRow, its thread g = lane % kThreadsPerRow holding keys
      // g, g + kThreadsPerRow, ... For each label present in the tile (usually one or two; the mask is the CTA's,
      // so the loop is warp-uniform): the row's tile max over its visible keys of that label and the sum of exp2
      // below max(M_run, max), each reduced over the row's threads by xor shuffles, merged into run[r][m].
      unsigned tile_mask = 0u;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) tile_mask |= tile_present[w];
      const int r = warp * kRowsPerWarp + lane / kThreadsPerRow, g = lane % kThreadsPerRow;
      float v[kKeysPerThread];
      int lab[kKeysPerThread];
#pragma unroll
      for (int u = 0; u < kKeysPerThread; ++u) {
        const int j = g + kThreadsPerRow * u;  // bank (4 r + j) % 32: the warp's 8 rows x 4 threads are distinct
        v[u] = s[r * lds + j];
        lab[u] = tile_labels[j];
      }
      while (tile_mask) {
        const int m = __ffs(tile_mask) - 1;
        tile_mask &= tile_mask - 1u;
        float mx = -INFINITY;
#pragma unroll
        for (int u = 0; u < kKeysPerThread; ++u) {
          if (lab[u] == m) mx = fmaxf(mx, v[u]);
        }
#pragma unroll
        for (int off = 1; off < kThreadsPerRow; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float2 prev = run[r][m];
        const float ref = fmaxf(prev.x, mx);
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < kKeysPerThread; ++u) {
          if (lab[u] == m && v[u] != -INFINITY) sum += exp2f(v[u] - ref);
        }
#pragma unroll
        for (int off = 1; off < kThreadsPerRow; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        __syncwarp();  // every thread of the row has read run[r][m] before its thread 0 replaces it
        // mx == -inf: no visible key of label m in this tile for this row (also every row past rows_here). exp2f of
        // -inf = 0 rescales an empty running pair (prev = (-inf, 0)) to 0.
        if (g == 0 && mx != -INFINITY) run[r][m] = make_float2(ref, prev.y * exp2f(prev.x - ref) + sum);
      }
    }
    __syncthreads();  // every warp's last merge into run is done
    // One partial per (row, label) of this split, (-inf, 0) for a label the split never saw.
    for (int i = threadIdx.x; i < rows_here * kNumLabels; i += kThreads) {
      const int r = i / kNumLabels, m = i % kNumLabels;
      a.partial[(row_index[r] * kNumLabels + m) * a.splits + split] =
          row_broken[r] ? make_float2(-INFINITY, __int_as_float(0x7fc00000)) : run[r][m];
    }
    __syncthreads();  // run, the per-row arrays and the query tile are rewritten by the next row tile
  }
}

constexpr int kCombineThreads = 32 * kNumLabels;  // one warp per label

// One block per query row, warp m for label m: merge the splits' (max, sum) partials, then
// stats[row][m] = (M_r,m, 1 / (E'_r,m + eps * Z_r * exp2(M_r - M_r,m))).
__global__ void __launch_bounds__(kCombineThreads)
    scores_combine_kernel(const float2* __restrict__ partial, float2* __restrict__ stats, int64_t splits,
                          float eps) {
  // A stage's chain may launch this kernel before its predecessor ends (csrc/kernels/launch.cuh): wait for it
  // before the first global access; then let the successor be scheduled.
  grid_dependency_wait();
  launch_dependents();
  __shared__ float2 label_total[kNumLabels];
  const int64_t row = blockIdx.x;
  const int m = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float2* p = partial + (row * kNumLabels + m) * splits;
  float mx = -INFINITY, sm = 0.0f;
  int broken = 0;  // a split saw a non-finite visible logit of this row (its partials are (-inf, NaN))
#pragma unroll 4
  for (int64_t i = lane; i < splits; i += 32) {
    const float2 pm = p[i];
    broken |= pm.y != pm.y;
    if (pm.x == -INFINITY) continue;
    if (pm.x > mx) {
      sm = sm * exp2f(mx - pm.x) + pm.y;  // exp2f(-inf) = 0 when nothing was seen yet
      mx = pm.x;
    } else {
      sm += pm.y * exp2f(pm.x - mx);
    }
  }
  const float label_max = warp_max(mx);
  sm = warp_sum(mx == -INFINITY ? 0.0f : sm * exp2f(mx - label_max));
  if (lane == 0) label_total[m] = make_float2(label_max, sm);
  const bool row_broken = __syncthreads_or(broken) != 0;
  if (lane != 0) return;
  float row_max = -INFINITY;
#pragma unroll
  for (int k = 0; k < kNumLabels; ++k) row_max = fmaxf(row_max, label_total[k].x);
  float z = 0.0f;  // Z_r relative to row_max; >= 1 because the key at the row's own position is visible
#pragma unroll
  for (int k = 0; k < kNumLabels; ++k) {
    if (label_total[k].x != -INFINITY) z += label_total[k].y * exp2f(label_total[k].x - row_max);
  }
  float inv;
  if (row_broken) {
    // The non-finite rule: NaN weights make every scored key of the batch element NaN in the reduce (0 * NaN for
    // the keys this row does not see), text keys stay 0.
    inv = __int_as_float(0x7fc00000);
  } else if (label_max == -INFINITY) {
    // No visible key of this label: every numerator is exactly 0, so the row contributes 0 (the reference's
    // eps -> 0+ limit; eps = 0 must not turn 0 / 0 into NaN).
    inv = 0.0f;
  } else {
    // An overflowing exp2 makes inv = 0, the correct limit (eps * Z dominates the modality's mass).
    const float eps_term = eps > 0.0f ? eps * z * exp2f(row_max - label_max) : 0.0f;
    inv = 1.0f / (sm + eps_term);
  }
  stats[row * kNumLabels + m] = make_float2(label_max, inv);
}

constexpr int kReduceWarps = 8;
constexpr int kReduceThreads = 32 * kReduceWarps;
constexpr int kReduceKeys = 32;   // keys per block, one per lane: each warp reads 128 contiguous bytes per row
constexpr int kReduceUnroll = 4;  // rows in flight per thread (x 8 warps: 32 logit loads per key in flight)

// A block per kReduceKeys keys of one batch element: lane = key, warp w sums the rows w, w + kReduceWarps, ... in
// order (so N = 2.4k gives 75 blocks of 8 warps, where one thread per key gave 10 blocks), then warp 0 adds the
// warps' sums in warp order: s_i = (sum_w acc_w) / (Hq Lq). The logits are read once (streaming loads).
__global__ void __launch_bounds__(kReduceThreads)
    scores_reduce_kernel(const float* __restrict__ logits, const float2* __restrict__ stats, const void* modality,
                         int modality_dtype, int64_t mod_stride_b, int64_t mod_stride_n, float* __restrict__ out,
                         int64_t rows_per_batch, int64_t num_keys) {
  // A stage's chain may launch this kernel before its predecessor ends (csrc/kernels/launch.cuh): wait for it
  // before the first global access; then let the successor be scheduled.
  grid_dependency_wait();
  launch_dependents();
  __shared__ float warp_acc[kReduceWarps][kReduceKeys];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kReduceKeys + lane;
  const int64_t b = blockIdx.y;
  const int64_t m = n < num_keys ? load_int(modality, modality_dtype, b * mod_stride_b + n * mod_stride_n) : -1;
  const bool scored = m > 0 && m < kNumLabels;  // text (0), PAD (-1) and out-of-range labels score 0, index nothing
  float acc = 0.0f;
  if (scored) {
    const float* lp = logits + b * rows_per_batch * num_keys + n;
    const float2* sp = stats + b * rows_per_batch * kNumLabels + m;
    constexpr int kStep = kReduceUnroll * kReduceWarps;
    int64_t r = warp;
    for (; r + (kReduceUnroll - 1) * kReduceWarps < rows_per_batch; r += kStep) {
      float l[kReduceUnroll];
      float2 st[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        l[u] = __ldcs(lp + (r + u * kReduceWarps) * num_keys);
        st[u] = __ldg(sp + (r + u * kReduceWarps) * kNumLabels);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        acc += (l[u] == -INFINITY ? 0.0f : exp2f(l[u] - st[u].x)) * st[u].y;  // l <= st.x for visible keys of m
      }
    }
    for (; r < rows_per_batch; r += kReduceWarps) {
      const float l = __ldcs(lp + r * num_keys);
      const float2 st = __ldg(sp + r * kNumLabels);
      acc += (l == -INFINITY ? 0.0f : exp2f(l - st.x)) * st.y;
    }
  }
  warp_acc[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || n >= num_keys) return;
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kReduceWarps; ++w) total += warp_acc[w][lane];
  out[b * num_keys + n] = scored ? total / static_cast<float>(rows_per_batch) : 0.0f;
}

}  // namespace scores
}  // namespace macer
