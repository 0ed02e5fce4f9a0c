// Allocation-normalised modality scores (eq:macer_score) as a split-K decode-attention pass plus two small passes.
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
//
//   1. scores_tile_kernel, grid (key tiles, Hkv, B): loads one K tile once (16-byte loads) and reuses it for every
//      query row of its GQA group (G = Hq / Hkv heads x Lq rows); bf16/fp16 tiles go through tensor cores (WMMA,
//      fp32 accumulate), fp32/fp64 through CUDA cores in fp32. Writes the logits (log2 units, -inf where not
//      visible) and, per (row, tile, label), the partial (max, sum of exp2 below it).
//   2. scores_combine_kernel, one warp per row: merges the partials into (M_r,m, 1 / denominator) per label.
//   3. scores_reduce_kernel, one thread per key: s_i = 1/(Lq Hq) sum_r exp2(l_ri - M_r,m(i)) * inv_r,m(i).
// Everything is fp32; exp2 with log2(e) folded into the scale.
#pragma once

#include <mma.h>

#include <cmath>

#include "common.cuh"

namespace macer {
namespace scores {

constexpr int kThreads = 128;  // 4 warps
constexpr int kRowTile = 32;   // query rows per pass over a K tile (two 16-row WMMA fragments)

// Per input dtype: keys per tile, shared-memory element type, padding, and whether tensor cores are used.
// 16-bit tiles are 64 keys (four 16-key fragments, one per warp); fp32 tiles are 32 keys (one key per lane) so that
// a 256-wide fp32 K tile plus the query tile fit in the 99 KB an sm_89 block may use.
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
constexpr int kMinKeysPerTile = 32;  // workspace is sized for the smallest tile

struct TileArgs {
  const void* query;
  const void* key;
  const void* modality;
  const void* positions;
  float* logits;    // [B, Hq*Lq, N]
  float2* partial;  // [B, Hq*Lq, tiles, kNumLabels]
  int modality_dtype, positions_dtype;
  int64_t q_heads, q_len, head_dim, kv_heads, num_keys, tiles;
  int64_t q_stride[4], k_stride[3], mod_stride[2], pos_stride[2];
  float scale_log2;  // scale * log2(e)
  bool vec16;        // key base, strides and D allow 16-byte loads
  bool q_vec16;      // the same for the query (whose stride over D is 1)
  int padded_dim;    // D rounded up to TileConfig::kDimAlign
};

__host__ __device__ inline int smem_ld(int padded_dim, int pad) { return padded_dim + pad; }

template <typename T>
__host__ inline size_t tile_smem_bytes(int padded_dim) {
  using C = TileConfig<T>;
  const size_t ld = smem_ld(padded_dim, C::kPad);
  return (C::kKeys + kRowTile) * ld * sizeof(typename C::Smem) + kRowTile * (C::kKeys + 4) * sizeof(float) +
         C::kKeys * sizeof(int) + 16;
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
  int* labels = reinterpret_cast<int*>(s + kRowTile * lds);
  unsigned* present = reinterpret_cast<unsigned*>(labels + kKeys);

  const int64_t tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int64_t n0 = tile * kKeys;
  const int64_t group = a.q_heads / a.kv_heads;
  const int64_t rows = group * a.q_len;            // query rows sharing this KV head
  const int64_t rows_per_batch = a.q_heads * a.q_len;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) *present = 0u;
  __syncthreads();
  for (int j = threadIdx.x; j < kKeys; j += kThreads) {
    int lab = -1;
    if (n0 + j < a.num_keys) {
      lab = static_cast<int>(load_int(a.modality, a.modality_dtype, b * a.mod_stride[0] + (n0 + j) * a.mod_stride[1]));
      if (lab >= 0 && lab < kNumLabels) atomicOr(present, 1u << lab);
    }
    labels[j] = lab;
  }
  // K tile: each 16-byte chunk is read once from global memory and serves all `rows` query rows.
  const T* kbase = static_cast<const T*>(a.key) + b * a.k_stride[0] + kvh * a.k_stride[1];
  const int chunks = a.padded_dim / V;
  for (int c = threadIdx.x; c < kKeys * chunks; c += kThreads) {
    const int j = c / chunks, d0 = (c % chunks) * V;
    const int valid = n0 + j < a.num_keys ? static_cast<int>(a.head_dim - d0 < V ? a.head_dim - d0 : V) : 0;
    load_chunk<T, S>(kbase + (n0 + j) * a.k_stride[2] + d0, valid, a.vec16, ks + j * ld + d0);
  }

  // Element offset of each query row of the current row tile (-1 past the last row): the 64-bit div/mod by Lq runs
  // once per row here instead of once per staged element.
  __shared__ int64_t row_offset[kRowTile];
  const T* qbase = static_cast<const T*>(a.query) + b * a.q_stride[0];
  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    if (threadIdx.x < kRowTile) {
      const int64_t rr = r0 + threadIdx.x;
      row_offset[threadIdx.x] =
          rr < rows ? (kvh * group + rr / a.q_len) * a.q_stride[1] + (rr % a.q_len) * a.q_stride[2] : -1;
    }
    __syncthreads();
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
    __syncthreads();
    tile_logits<T>(ks, qs, s, ld, lds, a.padded_dim);
    __syncthreads();

    // Epilogue: warp w handles rows w, w+4, ...; lane handles keys lane + 32u.
    const int rows_here = static_cast<int>(rows - r0 < kRowTile ? rows - r0 : kRowTile);
    for (int r = warp; r < rows_here; r += kThreads / 32) {
      const int64_t rr = r0 + r;
      const int64_t q = rr % a.q_len;
      const int64_t pos = load_int(a.positions, a.positions_dtype, b * a.pos_stride[0] + q * a.pos_stride[1]);
      const int64_t row = b * rows_per_batch + kvh * rows + rr;  // = b*Hq*Lq + h*Lq + q
      float v[kKeysPerLane];
      int lab[kKeysPerLane];
#pragma unroll
      for (int u = 0; u < kKeysPerLane; ++u) {
        const int j = lane + 32 * u;
        const int64_t n = n0 + j;
        lab[u] = labels[j];
        v[u] = (n < a.num_keys && n <= pos) ? s[r * lds + j] * a.scale_log2 : -INFINITY;
        if (n < a.num_keys) a.logits[row * a.num_keys + n] = v[u];
      }
      float2* part = a.partial + (row * a.tiles + tile) * kNumLabels;
      unsigned mask = *present;
      if (lane < kNumLabels && !((mask >> lane) & 1u)) part[lane] = make_float2(-INFINITY, 0.0f);
      while (mask) {  // usually one or two labels per tile
        const int m = __ffs(mask) - 1;
        mask &= mask - 1u;
        float mx = -INFINITY;
#pragma unroll
        for (int u = 0; u < kKeysPerLane; ++u) {
          if (lab[u] == m) mx = fmaxf(mx, v[u]);
        }
        mx = warp_max(mx);
        float sum = 0.0f;
        if (mx != -INFINITY) {
#pragma unroll
          for (int u = 0; u < kKeysPerLane; ++u) {
            if (lab[u] == m && v[u] != -INFINITY) sum += exp2f(v[u] - mx);
          }
        }
        sum = warp_sum(sum);
        if (lane == 0) part[m] = make_float2(mx, sum);
      }
    }
    __syncthreads();  // qs, s and row_offset are rewritten by the next row tile
  }
}

// One warp per query row: merge the per-tile (max, sum) partials of every label, then
// stats[row][m] = (M_r,m, 1 / (E'_r,m + eps * Z_r * exp2(M_r - M_r,m))).
__global__ void __launch_bounds__(kThreads)
    scores_combine_kernel(const float2* __restrict__ partial, float2* __restrict__ stats, int64_t total_rows,
                          int64_t tiles, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= total_rows) return;  // uniform per warp
  float mx[kNumLabels], sm[kNumLabels];
#pragma unroll
  for (int m = 0; m < kNumLabels; ++m) {
    mx[m] = -INFINITY;
    sm[m] = 0.0f;
  }
  for (int64_t t = lane; t < tiles; t += 32) {
    const float2* p = partial + (row * tiles + t) * kNumLabels;
#pragma unroll
    for (int m = 0; m < kNumLabels; ++m) {
      const float2 pm = p[m];
      if (pm.x == -INFINITY) continue;
      if (pm.x > mx[m]) {
        sm[m] = sm[m] * exp2f(mx[m] - pm.x) + pm.y;  // exp2f(-inf) = 0 when nothing was seen yet
        mx[m] = pm.x;
      } else {
        sm[m] += pm.y * exp2f(pm.x - mx[m]);
      }
    }
  }
  float row_max = -INFINITY;
#pragma unroll
  for (int m = 0; m < kNumLabels; ++m) {
    const float M = warp_max(mx[m]);
    sm[m] = warp_sum(mx[m] == -INFINITY ? 0.0f : sm[m] * exp2f(mx[m] - M));
    mx[m] = M;
    row_max = fmaxf(row_max, M);
  }
  float z = 0.0f;  // Z_r relative to row_max; >= 1 because key 0 is visible to every row
#pragma unroll
  for (int m = 0; m < kNumLabels; ++m) {
    if (mx[m] != -INFINITY) z += sm[m] * exp2f(mx[m] - row_max);
  }
#pragma unroll
  for (int m = 0; m < kNumLabels; ++m) {
    if (lane != m) continue;
    float inv;
    if (mx[m] == -INFINITY) {
      // No visible key of this label: every numerator is exactly 0, so the row contributes 0 (the reference's
      // eps -> 0+ limit; eps = 0 must not turn 0 / 0 into NaN).
      inv = 0.0f;
    } else {
      // An overflowing exp2 makes inv = 0, the correct limit (eps * Z dominates the modality's mass).
      const float eps_term = eps > 0.0f ? eps * z * exp2f(row_max - mx[m]) : 0.0f;
      inv = 1.0f / (sm[m] + eps_term);
    }
    stats[row * kNumLabels + m] = make_float2(mx[m], inv);
  }
}

// One thread per key: sum the normalised attention over all Hq*Lq rows of its batch (coalesced logits reads).
__global__ void __launch_bounds__(256)
    scores_reduce_kernel(const float* __restrict__ logits, const float2* __restrict__ stats, const void* modality,
                         int modality_dtype, int64_t mod_stride_b, int64_t mod_stride_n, float* __restrict__ out,
                         int64_t rows_per_batch, int64_t num_keys) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = blockIdx.y;
  if (n >= num_keys) return;
  const int64_t m = load_int(modality, modality_dtype, b * mod_stride_b + n * mod_stride_n);
  float acc = 0.0f;
  if (m > 0 && m < kNumLabels) {
    for (int64_t r = 0; r < rows_per_batch; ++r) {
      const int64_t row = b * rows_per_batch + r;
      const float l = logits[row * num_keys + n];
      const float2 st = __ldg(stats + row * kNumLabels + m);
      const float p = l == -INFINITY ? 0.0f : exp2f(l - st.x);  // l <= st.x for visible keys of label m
      acc += p * st.y;
    }
    acc /= static_cast<float>(rows_per_batch);
  }
  out[b * num_keys + n] = acc;
}

}  // namespace scores
}  // namespace macer
