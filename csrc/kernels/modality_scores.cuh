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
//      tile loads K once (16-byte loads), computes the logits on tensor cores (bf16/fp16: WMMA, fp32 accumulate) or
//      CUDA cores (fp32/fp64, in fp32), writes them (log2 units, -inf where not visible) and merges the tile's
//      (max, sum of exp2 below it) per (row, label) into a running pair in shared memory. One partial per
//      (row, label, split) is written at the end: the number of splits is chosen on the host to fill the GPU, so
//      the partials are a few per row, not one per tile.
//   2. scores_combine_kernel, one block per row and one warp per label: merges the splits' partials into
//      (M_r,m, 1 / denominator).
//   3. scores_reduce_kernel, one thread per key: s_i = 1/(Lq Hq) sum_r exp2(l_ri - M_r,m(i)) * inv_r,m(i).
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

template <typename T>
struct TileConfig {
  static constexpr bool kMma = false;
  static constexpr int kKeys = 32;
  static constexpr int kPad = 4;  // keeps rows 16-byte aligned and spreads lanes over banks
  static constexpr int kDimAlign = 4;
  using Smem = float;
};
template <>
struct TileConfig<__half> {
  static constexpr bool kMma = true;
  static constexpr int kKeys = 64;
  static constexpr int kPad = 8;  // WMMA needs a leading dimension that is a multiple of 8 halves
  static constexpr int kDimAlign = 16;
  using Smem = __half;
};
template <>
struct TileConfig<__nv_bfloat16> {
  static constexpr bool kMma = true;
  static constexpr int kKeys = 64;
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

// Copy V = 16 / sizeof(T) consecutive elements (zero past `valid`) from global memory into shared memory of type S.
template <typename T, typename S>
__device__ __forceinline__ void load_chunk(const T* src, int valid, bool vec, S* dst) {
  constexpr int V = 16 / sizeof(T);
  alignas(16) T vals[V];
  if (vec && valid == V) {
    *reinterpret_cast<uint4*>(vals) = __ldg(reinterpret_cast<const uint4*>(src));
  } else {
    *reinterpret_cast<uint4*>(vals) = make_uint4(0u, 0u, 0u, 0u);  // all-zero bits are 0.0 in every float type
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (i < valid) vals[i] = src[i];
    }
  }
  if constexpr (sizeof(S) == sizeof(T)) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(vals);  // 16-bit types are kept as they are
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = static_cast<float>(vals[i]);
  }
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
    constexpr int kRowsPerWarp = kRowTile / (kThreads / 32);
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
// rewritten only after (B) and (A) respectively, so no third barrier is needed.
template <typename T>
__global__ void __launch_bounds__(kThreads) scores_tile_kernel(const TileArgs a) {
  using C = TileConfig<T>;
  using S = typename C::Smem;
  constexpr int kKeys = C::kKeys;
  constexpr int kKeysPerLane = kKeys / 32;
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
  // far; (-inf, 0) while none. Only the warp that owns row r (r % kWarps) touches it until the row tile ends.
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
    __syncthreads();
    // The query tile, once per row tile; published by barrier (A) of the first tile.
    if (a.q_stride[3] == 1) {  // rows of Q are contiguous over D: 16-byte chunks like K (scalar where unaligned)
      for (int c = threadIdx.x; c < kRowTile * chunks; c += kThreads) {
        const int r = c / chunks, d0 = (c % chunks) * V;
        const int64_t offset = row_offset[r];
        const int64_t left = a.head_dim - d0;
        const int valid = offset < 0 || left <= 0 ? 0 : static_cast<int>(left < V ? left : V);
        load_chunk<T, S>(qbase + (valid > 0 ? offset + d0 : 0), valid, a.q_vec16, qs + r * ld + d0);
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
      // Labels of the tile; -1 past N. PAD (-1) and out-of-range labels set no bit, so they index nothing below.
      unsigned mine = 0u;
      for (int j = threadIdx.x; j < kKeys; j += kThreads) {
        int lab = -1;
        if (n0 + j < a.num_keys) {
          lab = static_cast<int>(
              load_int(a.modality, a.modality_dtype, b * a.mod_stride[0] + (n0 + j) * a.mod_stride[1]));
          if (lab >= 0 && lab < kNumLabels) mine |= 1u << lab;
        }
        tile_labels[j] = lab;
      }
      mine = __reduce_or_sync(0xffffffffu, mine);
      if (lane == 0) tile_present[warp] = mine;
      // K tile: each 16-byte chunk is read once from global memory and serves all rows of the row tile.
      for (int c = threadIdx.x; c < kKeys * chunks; c += kThreads) {
        const int j = c / chunks, d0 = (c % chunks) * V;
        const int valid = n0 + j < a.num_keys ? static_cast<int>(a.head_dim - d0 < V ? a.head_dim - d0 : V) : 0;
        load_chunk<T, S>(kbase + (n0 + j) * a.k_stride[2] + d0, valid, a.vec16, ks + j * ld + d0);
      }
      __syncthreads();  // (A)
      tile_logits<T>(ks, qs, s, ld, lds, a.padded_dim);
      __syncthreads();  // (B)

      // Epilogue: warp w handles rows w, w+4, ...; lane handles keys lane + 32u.
      unsigned tile_mask = 0u;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) tile_mask |= tile_present[w];
      for (int r = warp; r < rows_here; r += kWarps) {
        const int64_t pos = row_pos[r], row = row_index[r];
        float v[kKeysPerLane];
        int lab[kKeysPerLane];
        bool bad = false;
#pragma unroll
        for (int u = 0; u < kKeysPerLane; ++u) {
          const int j = lane + 32 * u;
          const int64_t n = n0 + j;
          lab[u] = tile_labels[j];
          // Visible: the key exists, is not after the row's causal limit and is not padding (PAD_LABEL = -1).
          const bool visible = n < a.num_keys && n <= pos && lab[u] >= 0;
          const float l = s[r * lds + j] * a.scale_log2;
          v[u] = visible ? l : -INFINITY;
          bad |= visible && !isfinite(l);
          if (n < a.num_keys) a.logits[row * a.num_keys + n] = v[u];
        }
        if (__any_sync(0xffffffffu, bad) && lane == 0) row_broken[r] = 1;
        unsigned mask = tile_mask;
        while (mask) {  // usually one or two labels per tile
          const int m = __ffs(mask) - 1;
          mask &= mask - 1u;
          float mx = -INFINITY;
#pragma unroll
          for (int u = 0; u < kKeysPerLane; ++u) {
            if (lab[u] == m) mx = fmaxf(mx, v[u]);
          }
          mx = warp_max(mx);            // the same value in every lane, so the branch below is warp-uniform
          if (mx == -INFINITY) continue;  // no visible key of label m in this tile for this row
          const float2 prev = run[r][m];
          const float ref = fmaxf(prev.x, mx);
          float sum = 0.0f;
#pragma unroll
          for (int u = 0; u < kKeysPerLane; ++u) {
            if (lab[u] == m && v[u] != -INFINITY) sum += exp2f(v[u] - ref);
          }
          sum = warp_sum(sum);
          __syncwarp();  // every lane has read run[r][m] before lane 0 replaces it
          // exp2f(-inf) = 0 rescales an empty running pair (prev = (-inf, 0)) to 0.
          if (lane == 0) run[r][m] = make_float2(ref, prev.y * exp2f(prev.x - ref) + sum);
        }
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

constexpr int kReduceThreads = 256;
constexpr int kReduceUnroll = 8;  // independent logit loads in flight per thread

// One thread per key: sum the normalised attention over all Hq*Lq rows of its batch (coalesced logits reads).
__global__ void __launch_bounds__(kReduceThreads)
    scores_reduce_kernel(const float* __restrict__ logits, const float2* __restrict__ stats, const void* modality,
                         int modality_dtype, int64_t mod_stride_b, int64_t mod_stride_n, float* __restrict__ out,
                         int64_t rows_per_batch, int64_t num_keys) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = blockIdx.y;
  if (n >= num_keys) return;
  const int64_t m = load_int(modality, modality_dtype, b * mod_stride_b + n * mod_stride_n);
  float acc = 0.0f;
  if (m > 0 && m < kNumLabels) {  // text (0), PAD (-1) and out-of-range labels score 0 and index nothing
    const float* lp = logits + b * rows_per_batch * num_keys + n;
    const float2* sp = stats + b * rows_per_batch * kNumLabels + m;
    int64_t r = 0;
    for (; r + kReduceUnroll <= rows_per_batch; r += kReduceUnroll) {
      float l[kReduceUnroll];
      float2 st[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        l[u] = lp[(r + u) * num_keys];
        st[u] = __ldg(sp + (r + u) * kNumLabels);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        acc += (l[u] == -INFINITY ? 0.0f : exp2f(l[u] - st[u].x)) * st[u].y;  // l <= st.x for visible keys of m
      }
    }
    for (; r < rows_per_batch; ++r) {
      const float l = lp[r * num_keys];
      const float2 st = __ldg(sp + r * kNumLabels);
      acc += (l == -INFINITY ? 0.0f : exp2f(l - st.x)) * st.y;
    }
    acc /= static_cast<float>(rows_per_batch);
  }
  out[b * num_keys + n] = acc;
}

}  // namespace scores
}  // namespace macer
