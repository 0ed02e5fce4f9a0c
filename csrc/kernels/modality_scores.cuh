// Allocation-normalised modality scores (eq:macer_score), step S-A (every architecture): keys on the MMA's M
// dimension, per-(row, label) statistics kept per thread, cp.async loads, the combine folded into the tile kernel's
// last CTA, and a reduce launched with programmatic dependent launch (PDL) where the device has it.
//
// For query row r = (h, q) with causal limit pos(q), logits l_ri = scale * q_r . k_i (i <= pos(q)) and label m(i):
//
//   A_r(i) / (S_r,m(i) + eps) = exp(l_ri - M_r) / (E_r,m(i) + eps * Z_r)
//
// where M_r is any reference (the softmax normaliser cancels except inside eps), E_r,m = sum_{j in m, j <= pos}
// exp(l_rj - M_r) and Z_r = sum_{j <= pos} exp(l_rj - M_r) over all visible keys, text included. With a separate
// reference M_r,m per modality this reads
//
//   exp(l_ri - M_r,m) / (E'_r,m + eps * Z_r * exp(M_r - M_r,m)),   E'_r,m = sum_{j in m} exp(l_rj - M_r,m),
//
// which stays exact when one modality gets almost no attention (E_r,m would underflow against the row maximum).
// A key is visible to row r when it exists, j <= pos(q) and its label is in 0..8 (PAD_LABEL = -1, a batch's left
// padding, and out-of-range labels are not): an invisible key adds nothing to any sum and scores 0.
//
//   1. scores_tile_kernel, grid (splits, Hkv, B), 4 warps: each CTA owns a contiguous range of 64-key tiles (a split)
//      of one KV head and all query rows of the head's GQA group, 32 at a time (a row tile). The query rows are
//      staged once per row tile; K streams through a kStages-deep ring of 128-byte-per-key chunks (cp.async, L2
//      evict-first) -- or, for fp64 and unaligned K, plain loads into the same ring. Each warp computes its 16 keys x
//      32 rows with mma.sync (bf16/fp16) or FFMA (fp32/fp64, in fp32) into the fragment of scores_fragment.cuh, and
//      per tile: (a) the raw dot products, -inf where not visible (only tiles on the causal edge, the N tail or with
//      PAD keys test per element), go to the logits workspace with four 16-byte stores per thread in the fragment's
//      own order (no per-element index arithmetic); (b) each thread's running (max, sum) per (row, label) takes
//      them in registers. At the end of a split the pairs are merged over the warp and the CTA into one partial per
//      (label, row); the last CTA of each (batch, KV head, row tile) -- found with a self-resetting atomic counter --
//      merges the splits' partials in a fixed order and writes (-M_r,m, W_r,m) per (label, row), W the reciprocal
//      denominator above (NaN for every row of a unit with a non-finite visible logit: the non-finite rule).
//   2. scores_reduce_kernel, grid (tiles, B), 4 warps in the same fragment map: s_i = 1/(Lq Hq) sum_r exp2(l_ri *
//      scale - M_r,m(i)) * W_r,m(i), each thread summing its 8 rows per unit in order, then over the 4 lanes that
//      share its keys; labels 0 and PAD score 0.
//
// Everything is fp32; exp2 with log2(e) folded into the scale. Deterministic: every sum has a fixed order.
#pragma once

#include <type_traits>

#include "scores_fragment.cuh"

namespace macer {
namespace scores {

// Shared-memory element type: half types stay half (tensor cores), fp32 and fp64 are computed in fp32.
template <typename T>
struct SmemOf {
  using type = float;
};
template <>
struct SmemOf<__half> {
  using type = __half;
};
template <>
struct SmemOf<__nv_bfloat16> {
  using type = __nv_bfloat16;
};

struct TileArgs {
  const void* query;
  const void* key;
  const void* modality;
  const void* positions;
  float* logits;    // [units][tiles][kWarps][4][32 lanes][4]: the fragment's raw dot products, -inf where invisible
  float2* partial;  // [units][kNumLabels][kRowTile][split_stride]: (nref, sum) per split
  float2* stats;    // [units][kNumLabels][kRowTile]: (-M_r,m clamped, W_r,m)
  int* counters;    // [units] arrivals, then [units] label masks; zero before the call and after it
  int modality_dtype, positions_dtype;
  int q_len, group, rows, row_tiles, kv_heads;  // rows = group * q_len (query rows per KV head)
  int head_dim, chunks;                         // chunks: head_dim in kChunkBytes pieces of the smem type
  int num_keys, tiles;
  int splits, split_stride, split_tiles, split_extra;
  uint32_t k_row_bytes;  // the vectorised path's key stride in bytes (< 2^25, so 64 of them fit 32 bits)
  int64_t q_stride[4], k_stride[3], mod_stride[2], pos_stride[2];
  float scale_log2;  // scale * log2(e)
  float eps;
};

template <typename S>
__device__ __forceinline__ S to_smem(float x);
template <>
__device__ __forceinline__ float to_smem<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half to_smem<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_smem<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// The value an element of T holds, in the shared-memory type S (exact for T == S; fp64 -> fp32 rounds once).
template <typename T, typename S>
__device__ __forceinline__ S convert(T x) {
  if constexpr (std::is_same<T, S>::value) {
    return x;
  } else {
    return to_smem<S>(static_cast<float>(x));
  }
}

// ---- K chunk loads ------------------------------------------------------------------------------------------------

// Thread `tid` copies pieces (key (tid >> 3) + 16 i, piece tid & 7), i = 0..3, of each chunk: its four sources are
// one 64-bit pointer plus i x 16 key rows, its destinations one shared address plus i x 16 pitches (immediates). A
// piece past N or past D is zero-filled (src-size 0: nothing is read). The split's source walks as one pointer,
// advanced by a chunk (128 B) and at each tile's end to the next tile's first row.
__device__ __forceinline__ void issue_chunk(const unsigned char* chunk_src, uint32_t k_row_bytes, int keys_left,
                                           bool in_d, uint32_t stage, int tid, uint64_t policy) {
  const int key0 = tid >> 3;
  const unsigned char* src = chunk_src + static_cast<uint32_t>(key0) * k_row_bytes + (tid & 7) * 16;
  const uint32_t dst = stage + piece_offset(key0, tid & 7);
  const uint32_t step = 16u * k_row_bytes;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool ok = in_d && key0 + 16 * i < keys_left;
    cp_async16(dst + i * 16 * kPitch, ok ? src + i * step : chunk_src, ok ? 16u : 0u, policy);
  }
}

// The fallback for fp64 and for K that is not 16-byte aligned: element loads (any stride over keys) converted to S
// and stored at the same positions, synchronously. Chunk `chunk` of tile `tile`.
template <typename T, typename S>
__device__ __forceinline__ void generic_chunk(const T* kbase, int64_t stride_n, int tile, int chunk, int num_keys,
                                              int head_dim, unsigned char* stage, int tid) {
  constexpr int kElems = kChunkBytes / sizeof(S);  // per key row
  constexpr int kShift = kElems == 64 ? 6 : 5;
  static_assert(kElems == (1 << kShift), "chunk elements");
#pragma unroll 4
  for (int e = tid; e < kTileKeys * kElems; e += kThreads) {
    const int key = e >> kShift, d = e & (kElems - 1);
    const int n = tile * kTileKeys + key, dg = chunk * kElems + d;
    const S x = n < num_keys && dg < head_dim ? convert<T, S>(kbase[n * stride_n + dg]) : to_smem<S>(0.0f);
    *reinterpret_cast<S*>(stage + key * kPitch + d * sizeof(S)) = x;
  }
}

// ---- the dot products of one chunk --------------------------------------------------------------------------------

// Tensor cores: 4 k16-steps per 128-byte chunk; A = the warp's 16 keys (ldmatrix.x4), B = 32 query rows (two
// ldmatrix.x4), 4 mma.sync.m16n8k16 per step into acc[4 j + c].
template <typename S>
__device__ __forceinline__ void chunk_dots(float (&acc)[kFragElems], uint32_t stage, uint32_t qchunk, int warp,
                                           int lane) {
  const int mi = lane >> 3, r8 = lane & 7;
  const uint32_t a_addr = stage + piece_offset(kWarpKeys * warp + (mi & 1) * 8 + r8, mi >> 1);
  const uint32_t b_addr = qchunk + piece_offset((mi >> 1) * 8 + r8, mi & 1);
#pragma unroll
  for (int kk = 0; kk < kChunkBytes / 32; ++kk) {
    uint32_t a[4], b01[4], b23[4];
    ldmatrix_x4(a, a_addr + 32 * kk);
    ldmatrix_x4(b01, b_addr + 32 * kk);
    ldmatrix_x4(b23, b_addr + 16 * kPitch + 32 * kk);
    mma_16816<S>(acc + 0, a, b01[0], b01[1]);
    mma_16816<S>(acc + 4, a, b01[2], b01[3]);
    mma_16816<S>(acc + 8, a, b23[0], b23[1]);
    mma_16816<S>(acc + 12, a, b23[2], b23[3]);
  }
}

// CUDA cores (fp32 / fp64 inputs): the same fragment, each element a sequential fp32 FFMA chain over d; per 4 d the
// thread reads its 2 key rows and 8 query rows as float4 (conflict-free through the padded pitch).
template <>
__device__ __forceinline__ void chunk_dots<float>(float (&acc)[kFragElems], uint32_t stage, uint32_t qchunk,
                                                  int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int ka = kWarpKeys * warp + g;
#pragma unroll 2
  for (int p = 0; p < kChunkBytes / 16; ++p) {
    float4 k0, k1;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(k0.x), "=f"(k0.y), "=f"(k0.z), "=f"(k0.w)
                 : "r"(stage + piece_offset(ka, p)));
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(k1.x), "=f"(k1.y), "=f"(k1.z), "=f"(k1.w)
                 : "r"(stage + piece_offset(ka + 8, p)));
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int row = 8 * (i >> 1) + 2 * t + (i & 1);
      float4 q;
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(q.x), "=f"(q.y), "=f"(q.z), "=f"(q.w)
                   : "r"(qchunk + piece_offset(row, p)));
      float& xa = acc[frag_elem(i, 0)];
      float& xb = acc[frag_elem(i, 1)];
      xa = fmaf(k0.x, q.x, xa);
      xa = fmaf(k0.y, q.y, xa);
      xa = fmaf(k0.z, q.z, xa);
      xa = fmaf(k0.w, q.w, xa);
      xb = fmaf(k1.x, q.x, xb);
      xb = fmaf(k1.y, q.y, xb);
      xb = fmaf(k1.z, q.z, xb);
      xb = fmaf(k1.w, q.w, xb);
    }
  }
}

__device__ __forceinline__ int key_label(const TileArgs& a, int b, int n) {
  return n < a.num_keys ? static_cast<int>(load_int(a.modality, a.modality_dtype,
                                                    b * a.mod_stride[0] + static_cast<int64_t>(n) * a.mod_stride[1]))
                        : -1;
}

// ---- the last CTA of a unit: merge the splits' partials, write the stats ------------------------------------------

// Thread p of the CTA takes (label, row) pairs p, p + kThreads, ... of the labels present (ascending) x 32 rows and
// merges that pair's `splits` partials: kCombineBatch at a time (8 independent 16-byte loads, two splits each),
// the batch by a pairwise tree (0+1, 2+3, ..., then (01)+(23), ...), the batches in order into the running pair.
// Then per row (threads 0..31): M_r = max_m M_r,m, Z_r, and (-M_r,m, W_r,m) for each present label.
__device__ __noinline__ void combine_unit(const float2* __restrict__ partial, float2* __restrict__ stats, int unit,
                                         int rt, int rows, int splits, int split_stride, float eps, int mask,
                                         float2* tot) {
  const unsigned present = static_cast<unsigned>(mask) & ((1u << kNumLabels) - 1u);
  const bool broken = (mask & kMaskBroken) != 0;
  const int labels = __popc(present);
  for (int p = threadIdx.x; p < labels * kRowTile; p += kThreads) {
    const int li = p / kRowTile, r = p % kRowTile;
    unsigned bits = present;
    for (int k = 0; k < li; ++k) bits &= bits - 1u;
    const int m = __ffs(bits) - 1;
    const float2* src = partial + partial_offset(unit, m, r, split_stride);
    float nr = kEmptyNegRef, s = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += kCombineBatch) {
      float4 x[kCombineBatch / 2];
#pragma unroll
      for (int k = 0; k < kCombineBatch / 2; ++k) {
        x[k] = s0 + 2 * k < splits ? __ldcg(reinterpret_cast<const float4*>(src + s0 + 2 * k))
                                     : make_float4(kEmptyNegRef, 0.0f, kEmptyNegRef, 0.0f);
      }
      float bn[kCombineBatch / 2], bs[kCombineBatch / 2];
#pragma unroll
      for (int k = 0; k < kCombineBatch / 2; ++k) {
        bn[k] = x[k].x;
        bs[k] = x[k].y;
        merge_pair(bn[k], bs[k], x[k].z, x[k].w);
      }
#pragma unroll
      for (int w = 1; w < kCombineBatch / 2; w <<= 1) {
#pragma unroll
        for (int k = 0; k < kCombineBatch / 2; k += 2 * w) merge_pair(bn[k], bs[k], bn[k + w], bs[k + w]);
      }
      merge_pair(nr, s, bn[0], bs[0]);
    }
    tot[li * kRowTile + r] = make_float2(nr, s);
  }
  __syncthreads();
  if (threadIdx.x >= kRowTile) return;
  const int r = threadIdx.x;
  row_stats(tot, present, r, rt * kRowTile + r < rows, broken, eps, stats + stats_offset(unit, 0, 0));
}

// ---- kernel 1 -----------------------------------------------------------------------------------------------------

// kVec: K through cp.async (T is bf16, fp16 or fp32, K 16-byte aligned with the key stride < 2^25 bytes and D a
// multiple of 16 bytes); otherwise element loads (generic_chunk). Both fill the same ring, so the loop is one.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) scores_tile_kernel(const TileArgs a) {
  using S = typename SmemOf<T>::type;
  constexpr int kElems = kChunkBytes / sizeof(S);
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* qs = smem;                               // [chunks][32 rows][kPitch]
  unsigned char* ring = smem + a.chunks * kQChunkBytes;   // [kStages][64 keys][kPitch]
  __shared__ float2 warp_acc[kWarps][kNumLabels * kRowTile];  // each warp's merged pairs (flush_slot)
  __shared__ int64_t row_off[kRowTile];
  __shared__ int row_pos[kRowTile];
  __shared__ int info[kWarps + 1];  // per-warp label masks, then "this CTA is the unit's last"

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
  const int t_first = static_cast<int>(split_begin(split, a.split_tiles, a.split_extra));
  const int t_end = static_cast<int>(split_begin(split + 1, a.split_tiles, a.split_extra));
  const T* kbase = static_cast<const T*>(a.key) + b * a.k_stride[0] + kvh * a.k_stride[1];
  const unsigned char* kbytes = reinterpret_cast<const unsigned char*>(kbase);
  const T* qbase = static_cast<const T*>(a.query) + b * a.q_stride[0];
  const uint64_t k_policy = l2_evict_first_policy(), logit_policy = l2_evict_last_policy();
  const uint32_t ring_addr = smem_addr(ring), qs_addr = smem_addr(qs);
  const uint32_t d_bytes = static_cast<uint32_t>(a.head_dim) * sizeof(T);
  const int chunks = a.chunks, units = (t_end - t_first) * chunks;

  // Q, K, the labels and the positions may be a predecessor's output (the stage's chain): wait for it before the
  // first global access; then let the successor (the reduce) be scheduled, to wait in its turn.
  grid_dependency_wait();
  launch_dependents();

  for (int rt = 0; rt < a.row_tiles; ++rt) {
    const int unit = unit_index(b, kvh, rt, a.kv_heads, a.row_tiles);
    const int rows_here = min(kRowTile, a.rows - rt * kRowTile);
    if (tid < kRowTile) {
      const int rr = rt * kRowTile + tid;
      const bool real = rr < a.rows;
      const int h = kvh * a.group + rr / a.q_len, q = rr % a.q_len;
      row_off[tid] = real ? h * a.q_stride[1] + q * a.q_stride[2] : -1;
      row_pos[tid] = real ? static_cast<int>(load_int(a.positions, a.positions_dtype,
                                                      b * a.pos_stride[0] + q * a.pos_stride[1]))
                          : -1;
    }
    for (int i = tid; i < kWarps * kNumLabels * kRowTile; i += kThreads) {
      (&warp_acc[0][0])[i] = make_float2(kEmptyNegRef, 0.0f);
    }
    __syncthreads();
    // The K ring's prologue first, so its loads are in flight while the query is staged.
    int it = t_first, ic = 0;  // next unit to issue: (tile, chunk)
    const unsigned char* isrc = kbytes + static_cast<int64_t>(t_first) * kTileKeys * a.k_row_bytes;
    const int64_t tile_step = static_cast<int64_t>(kTileKeys) * a.k_row_bytes - chunks * kChunkBytes;
    const uint32_t my_piece_byte = static_cast<uint32_t>(tid & 7) * 16u;
    auto issue = [&](int slot) {
      if (it < t_end) {
        if constexpr (kVec) {
          issue_chunk(isrc, a.k_row_bytes, a.num_keys - it * kTileKeys, my_piece_byte + ic * kChunkBytes < d_bytes,
                      ring_addr + slot * kStageBytes, tid, k_policy);
          isrc += kChunkBytes;
        } else {
          generic_chunk<T, S>(kbase, a.k_stride[2], it, ic, a.num_keys, a.head_dim, ring + slot * kStageBytes, tid);
        }
        if (++ic == chunks) {
          ic = 0;
          ++it;
          isrc += tile_step;
        }
      }
      if constexpr (kVec) cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue(s);
    // The query rows of this row tile: [chunks][32][128 B], zero past D and on padding rows.
    for (int r = 0; r < kRowTile; ++r) {
      const int64_t off = row_off[r];
      for (int d = tid; d < chunks * kElems; d += kThreads) {
        const S x = off >= 0 && d < a.head_dim ? convert<T, S>(qbase[off + d * a.q_stride[3]]) : to_smem<S>(0.0f);
        *reinterpret_cast<S*>(qs + (d / kElems) * kQChunkBytes + r * kPitch + (d % kElems) * sizeof(S)) = x;
      }
    }
    // The smallest causal limit of the row tile's real rows: a warp's 16 keys up to it are visible to every row.
    int min_pos = __reduce_min_sync(0xffffffffu, row_pos[lane] < 0 ? INT_MAX : row_pos[lane]);

    ThreadStats st;
    st.reset();
    float z = 0.0f;  // fma(l, 0, z) over visible pairs: NaN iff one of them is not finite
    unsigned seen = 0u;
    // Labels of the warp's 16 keys: lane l < 16 holds key 16 warp + l's, one tile ahead.
    int lab_next = lane < kWarpKeys ? key_label(a, b, t_first * kTileKeys + kWarpKeys * warp + lane) : -1;
    float acc[kFragElems];
#pragma unroll
    for (int e = 0; e < kFragElems; ++e) acc[e] = 0.0f;
    int ct = t_first, cc = 0, slot = 0;
    for (int u = 0; u < units; ++u) {
      if constexpr (kVec) cp_async_wait<kStages - 2>();
      __syncthreads();  // unit u is in its slot for every thread; every thread is done with unit u - 1's slot
      issue(slot == 0 ? kStages - 1 : slot - 1);
      chunk_dots<S>(acc, ring_addr + slot * kStageBytes, qs_addr + cc * kQChunkBytes, warp, lane);
      slot = slot + 1 == kStages ? 0 : slot + 1;
      if (++cc < chunks) continue;
      cc = 0;
      // ---- epilogue of tile ct --------------------------------------------------------------------------------
      const int lab = lab_next;
      lab_next = lane < kWarpKeys && ct + 1 < t_end
                     ? key_label(a, b, (ct + 1) * kTileKeys + kWarpKeys * warp + lane)
                     : -1;
      const int n_w = ct * kTileKeys + kWarpKeys * warp;  // the warp's first key
      const bool lane_ok = lane >= kWarpKeys || (n_w + lane < a.num_keys && lab >= 0 && lab < kNumLabels);
      const unsigned mask = __reduce_or_sync(0xffffffffu, lane < kWarpKeys && lane_ok ? 1u << lab : 0u);
      const bool all_ok = __all_sync(0xffffffffu, lane_ok);
      const int lab_a = __shfl_sync(0xffffffffu, lab, g), lab_b = __shfl_sync(0xffffffffu, lab, g + 8);
      // acc becomes the tile's stored values in place: the raw dot products, -inf where a pair is not visible.
      if (all_ok && n_w + kWarpKeys - 1 <= min_pos) {
        // Every pair of the warp is visible to every real row (padding rows hold 0 . k, non-finite only where k
        // is, which makes the real rows' logits non-finite too).
#pragma unroll
        for (int e = 0; e < kFragElems; ++e) z = fmaf(acc[e], 0.0f, z);
      } else {
        const int na = n_w + g;
#pragma unroll
        for (int e = 0; e < kFragElems; ++e) {
          const bool second = (e >> 1) & 1;
          const bool vis =
              key_visible(na + 8 * second, a.num_keys, row_pos[frag_row(lane, e)], second ? lab_b : lab_a);
          if (vis) z = fmaf(acc[e], 0.0f, z);
          acc[e] = vis ? acc[e] : -INFINITY;
        }
      }
      float* dst = a.logits + logits_offset(unit, ct, a.tiles, warp, lane);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (!group_stored(q, lane, rows_here)) continue;
        st_global_v4(dst + kLogitsQStride * q, acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3],
                     logit_policy);
      }
      seen |= mask;
      const bool select = !all_ok || __popc(mask) > 1;
      if (!select && st.label[0] >= 0 && mask == 1u << st.label[0]) {
        update_slot<false>(st.nref[0], st.sum[0], acc, true, true, a.scale_log2);  // the common case
      } else {
        update_labels(st, mask, select, lab_a, lab_b, acc, a.scale_log2, warp_acc[warp], lane);
      }
#pragma unroll
      for (int e = 0; e < kFragElems; ++e) acc[e] = 0.0f;
      ++ct;
    }
    if constexpr (kVec) cp_async_wait<0>();

    // ---- end of the split for this row tile: one partial per (label, row) --------------------------------------
    flush_all(st, warp_acc[warp], lane);
    if (lane == 0) info[warp] = static_cast<int>(seen);
    const int bad = __syncthreads_or(z != z);
    for (int p = tid; p < kNumLabels * kRowTile; p += kThreads) {
      float nr = warp_acc[0][p].x, s = warp_acc[0][p].y;
#pragma unroll
      for (int w = 1; w < kWarps; ++w) merge_pair(nr, s, warp_acc[w][p].x, warp_acc[w][p].y);
      float2* out = a.partial + partial_offset(unit, p / kRowTile, p % kRowTile, a.split_stride);
      out[split] = make_float2(nr, s);
      if (split + 1 == a.splits && a.split_stride > a.splits) out[a.splits] = make_float2(kEmptyNegRef, 0.0f);
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      int mask = bad ? kMaskBroken : 0;
      for (int w = 0; w < kWarps; ++w) mask |= info[w];
      atomicOr(a.counters + a.kv_heads * a.row_tiles * gridDim.z + unit, mask);
      __threadfence();
      info[kWarps] = atomicAdd(a.counters + unit, 1) == a.splits - 1;
    }
    __syncthreads();
    if (info[kWarps]) {
      __threadfence();
      int mask = 0;
      if (tid == 0) {
        // Read and reset (the counters are zero again for the next call, also inside a replayed graph).
        mask = atomicExch(a.counters + a.kv_heads * a.row_tiles * gridDim.z + unit, 0);
        atomicExch(a.counters + unit, 0);
        info[0] = mask;
      }
      __syncthreads();
      mask = info[0];
      combine_unit(a.partial, a.stats, unit, rt, a.rows, a.splits, a.split_stride, a.eps, mask,
                   reinterpret_cast<float2*>(ring));
    }
    __syncthreads();  // the ring, row arrays and accumulators are rewritten by the next row tile
  }
}

// ---- kernel 2 -----------------------------------------------------------------------------------------------------

struct ReduceArgs {
  const float* logits;
  const float2* stats;
  const void* modality;
  float* out;  // [B, N]
  int modality_dtype;
  int64_t mod_stride[2];
  int num_keys, tiles, units_per_batch;  // units_per_batch = Hkv * row_tiles
  int rows, row_tiles;                   // query rows per KV head, row tiles per KV head
  float scale_log2, inv_rows;            // inv_rows = 1 / (Hq Lq)
};

// A block per 64-key tile of one batch element, the tile kernel's fragment map: thread (warp, lane) reads its 16
// logits of every unit (4 x 16 bytes), and for its keys of a scored label the (-M, W) of its 8 rows; acc_k +=
// exp2(l * scale - M) * W over units in order, rows in slot order; then xor 1, 2 over the lanes sharing its keys.
__global__ void __launch_bounds__(kThreads) scores_reduce_kernel(const ReduceArgs a) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, b = blockIdx.y;
  grid_dependency_wait();  // the logits and stats of the tile kernel, the labels of the stage
  launch_dependents();
  const int n_w = tile * kTileKeys + kWarpKeys * warp;
  const int lab = lane < kWarpKeys && n_w + lane < a.num_keys
                      ? static_cast<int>(load_int(a.modality, a.modality_dtype,
                                                  b * a.mod_stride[0] + static_cast<int64_t>(n_w + lane) *
                                                                            a.mod_stride[1]))
                      : -1;
  const int lab_a = __shfl_sync(0xffffffffu, lab, g), lab_b = __shfl_sync(0xffffffffu, lab, g + 8);
  const bool scored_a = lab_a >= 1 && lab_a < kNumLabels, scored_b = lab_b >= 1 && lab_b < kNumLabels;
  float acc_a = 0.0f, acc_b = 0.0f;
  const int unit0 = b * a.units_per_batch;
  for (int k = 0; k < a.units_per_batch; ++k) {
    const int unit = unit0 + k;
    const float4* src = reinterpret_cast<const float4*>(a.logits + logits_offset(unit, tile, a.tiles, warp, lane));
    const int rows_here = min(kRowTile, a.rows - (k % a.row_tiles) * kRowTile);
    float v[kFragElems];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      // Groups of padding rows were never stored: -inf (their weights are 0).
      const float4 x = group_stored(q, lane, rows_here) ? __ldcs(src + q * (kLogitsQStride / 4))
                                                        : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      v[4 * q] = x.x;
      v[4 * q + 1] = x.y;
      v[4 * q + 2] = x.z;
      v[4 * q + 3] = x.w;
    }
    if (scored_a) {
      const float4* sa = reinterpret_cast<const float4*>(a.stats + stats_offset(unit, lab_a, 2 * t));
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const float4 w = __ldg(sa + 4 * j);  // rows 8 j + 2 t and + 1
        acc_a = fmaf(fast_exp2(fmaf(v[frag_elem(2 * j, 0)], a.scale_log2, w.x)), w.y, acc_a);
        acc_a = fmaf(fast_exp2(fmaf(v[frag_elem(2 * j + 1, 0)], a.scale_log2, w.z)), w.w, acc_a);
      }
    }
    if (scored_b) {
      const float4* sb = reinterpret_cast<const float4*>(a.stats + stats_offset(unit, lab_b, 2 * t));
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const float4 w = __ldg(sb + 4 * j);
        acc_b = fmaf(fast_exp2(fmaf(v[frag_elem(2 * j, 1)], a.scale_log2, w.x)), w.y, acc_b);
        acc_b = fmaf(fast_exp2(fmaf(v[frag_elem(2 * j + 1, 1)], a.scale_log2, w.z)), w.w, acc_b);
      }
    }
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    acc_a += __shfl_xor_sync(0xffffffffu, acc_a, off);
    acc_b += __shfl_xor_sync(0xffffffffu, acc_b, off);
  }
  // Lane l < 16 writes key 16 warp + l: held by lane 4 (l % 8) (t = 0), as its key a (l < 8) or b.
  const float ta = __shfl_sync(0xffffffffu, acc_a, 4 * (lane & 7));
  const float tb = __shfl_sync(0xffffffffu, acc_b, 4 * (lane & 7));
  if (lane < kWarpKeys && n_w + lane < a.num_keys) {
    const bool scored = lab >= 1 && lab < kNumLabels;
    a.out[b * static_cast<int64_t>(a.num_keys) + n_w + lane] = scored ? (lane < 8 ? ta : tb) * a.inv_rows : 0.0f;
  }
}

// ---- the K-streaming baseline -------------------------------------------------------------------------------------

// Reads K once, [B, Hkv, N, D] through its strides, with the tile kernel's per-thread pieces (key (tid >> 3) + 16 i,
// 16 bytes at 16 (tid & 7) of each 128-byte chunk) and L2 evict-first loads, and nothing else: each thread XORs what
// it read into one word, and the CTA writes one word (so no load is dead). 8 loads in flight per thread (two
// chunks), the grid as large as the device holds (the launcher's choice): the benchmark's measured "read K once",
// through the same wrapper, module call and launcher as the scoring op.
struct StreamArgs {
  const void* key;
  uint32_t* out;  // [B * Hkv * splits]
  int num_keys, chunks, split_tiles, split_extra;
  uint32_t k_row_bytes, d_bytes;
  int64_t k_stride_bytes[2];  // over B, Hkv
};

__global__ void __launch_bounds__(kThreads) stream_k_kernel(const StreamArgs a) {
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  grid_dependency_wait();
  const int t_first = static_cast<int>(split_begin(split, a.split_tiles, a.split_extra));
  const int t_end = static_cast<int>(split_begin(split + 1, a.split_tiles, a.split_extra));
  const unsigned char* base =
      static_cast<const unsigned char*>(a.key) + b * a.k_stride_bytes[0] + kvh * a.k_stride_bytes[1];
  const uint64_t policy = l2_evict_first_policy();
  const uint32_t piece = static_cast<uint32_t>(tid & 7) * 16u;
  const int key0 = tid >> 3;
  uint32_t x = 0u;
  for (int t = t_first; t < t_end; ++t) {
    const unsigned char* tile = base + static_cast<int64_t>(t) * kTileKeys * a.k_row_bytes;
    for (int c = 0; c < a.chunks; c += 2) {
      uint4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int key = key0 + 16 * (i & 3);
        const uint32_t byte = static_cast<uint32_t>(c + (i >> 2)) * kChunkBytes + piece;
        if (c + (i >> 2) < a.chunks && t * kTileKeys + key < a.num_keys && byte < a.d_bytes) {
          asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                       : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w)
                       : "l"(tile + static_cast<uint32_t>(key) * a.k_row_bytes + byte), "l"(policy));
        } else {
          v[i] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) x ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    }
  }
  for (int off = 16; off > 0; off >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, off);
  __shared__ uint32_t warp_x[kWarps];
  if ((tid & 31) == 0) warp_x[tid >> 5] = x;
  __syncthreads();
  if (tid == 0) {
    a.out[(static_cast<int64_t>(b) * gridDim.y + kvh) * gridDim.x + split] =
        warp_x[0] ^ warp_x[1] ^ warp_x[2] ^ warp_x[3];
  }
}

}  // namespace scores
}  // namespace macer
