// The scoring kernels' per-thread arithmetic, shared by the S-A kernels (csrc/kernels/modality_scores.cuh, mma.sync,
// every architecture) and the S-B kernel (csrc/kernels/modality_scores_sm90a.cuh, wgmma): the accumulator fragment's
// thread -> (key, row) map, the per-thread running (max, sum) per (row, label), their merges, and the PTX wrappers.
//
// Keys are on the MMA's M dimension and query rows on N. A warp owns 16 keys of a tile and all 32 rows of the row
// tile (4 n-tiles of 8); mma.sync.m16n8k16 and wgmma.m64nNk16 (one warp's 16 rows of M) give thread `lane` of the
// warp the same 16 accumulator elements, e = 4 j + c for n-tile j and c = 0..3:
//
//   key  = 16 warp + lane / 4 + 8 (c / 2)        (2 keys per thread: g = lane / 4 and g + 8)
//   row  = 8 j + 2 (lane % 4) + c % 2            (8 rows per thread: row slot i = 2 j + c % 2)
//
// so each thread keeps, for each of its 8 rows, a running (reference, sum of exp2 below it) per label in registers
// and never exchanges anything per tile. Labels are 0..8, too many to keep 9 x 8 pairs per thread: a thread keeps
// kLabelSlots label slots (a warp-uniform table label -> slot, most recently used first, so every branch on it is
// uniform and the per-tile update always works on slot 0); a label that finds no slot evicts the least recently used
// one, whose pairs are first merged over the warp (xor shuffles 4, 8, 16: the 8 lanes holding the same rows) into
// the warp's per-(label, row) accumulators in shared memory. Omni prompts have 3 labels
// (text, audio, video), so nothing is evicted before the end of a split.
//
// Numerics: the pair (nref, sum) stands for sum * 2^-nref, i.e. the reference is -nref, kept negated and clamped
// (kEmptyNegRef = FLT_MAX for "no key yet") so that exp2(fma(x, scale, nref)) needs no test: a masked key (-inf)
// gives exp2(-inf) = 0 whatever the reference. The reference moves only when a key exceeds it by more than
// kRescaleThreshold (log2 units; FlashAttention 4's lazy rescale): the terms stay below 2^8 and the rescale branch is
// taken a handful of times per thread. Everything is fp32; exp2 is MUFU.EX2 (ex2.approx.ftz: relative error ~2^-22,
// subnormal results flushed -- a term 126 binary orders below its reference).
#pragma once

#include <climits>

#include "common.cuh"

namespace macer {
namespace scores {

constexpr int kWarpKeys = 16;        // keys per warp and tile: the MMA's M (mma.sync m16) / a warp's share of wgmma m64
constexpr int kRowTile = 32;         // query rows per pass: the MMA's N, 4 n-tiles of 8
constexpr int kNTiles = kRowTile / 8;
constexpr int kRowsPerThread = 8;    // 2 per n-tile
constexpr int kFragElems = 16;       // accumulator elements per thread: 2 keys x 8 rows
constexpr int kLabelSlots = 3;       // per-thread label slots (text, audio, video without eviction)
constexpr float kRescaleThreshold = 8.0f;
constexpr float kEmptyNegRef = 3.402823466e38f;  // FLT_MAX: the negated reference of an empty pair

// The fragment map (see the top of this file); host and device, exposed to the CPU replay through _C.
__host__ __device__ constexpr int frag_key(int warp, int lane, int e) {
  return kWarpKeys * warp + (lane >> 2) + 8 * ((e >> 1) & 1);
}
__host__ __device__ constexpr int frag_row(int lane, int e) { return 8 * (e >> 2) + 2 * (lane & 3) + (e & 1); }
// The row slot i (0..7) of element e, and the element of row slot i for key slot k (0: key g, 1: key g + 8).
__host__ __device__ constexpr int frag_row_slot(int e) { return 2 * (e >> 2) + (e & 1); }
__host__ __device__ constexpr int frag_elem(int i, int k) { return 4 * (i >> 1) + 2 * k + (i & 1); }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Merge (nr2, s2) into (nr, s): one pair for the union of both key sets. Commutative in fp32 (each product is
// computed on its own, then one addition), so the xor butterflies give every lane the same bits. An empty pair
// (kEmptyNegRef, 0) contributes 0 * exp2(-huge) = 0.
__device__ __forceinline__ void merge_pair(float& nr, float& s, float nr2, float s2) {
  const float n = fminf(nr, nr2);
  s = s * fast_exp2(n - nr) + s2 * fast_exp2(n - nr2);
  nr = n;
}

// One thread's running pairs: kLabelSlots x kRowsPerThread, and the warp-uniform label table, most recently used
// label first (slot 0). The per-tile update always works on slot 0, so its code exists once.
struct ThreadStats {
  float nref[kLabelSlots][kRowsPerThread];
  float sum[kLabelSlots][kRowsPerThread];
  int label[kLabelSlots];  // -1: free

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int s = 0; s < kLabelSlots; ++s) {
      label[s] = -1;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        nref[s][i] = kEmptyNegRef;
        sum[s][i] = 0.0f;
      }
    }
  }
  // Slot s moves to the front, slots 0 .. s - 1 one back (s = 1: a swap; s = 2: a rotation).
  template <int s>
  __device__ __forceinline__ void to_front() {
    float n[kRowsPerThread], x[kRowsPerThread];
    const int l = label[s];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      n[i] = nref[s][i];
      x[i] = sum[s][i];
    }
#pragma unroll
    for (int k = s; k > 0; --k) {
      label[k] = label[k - 1];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        nref[k][i] = nref[k - 1][i];
        sum[k][i] = sum[k - 1][i];
      }
    }
    label[0] = l;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      nref[0][i] = n[i];
      sum[0][i] = x[i];
    }
  }
};

// Add the thread's keys of one label to its pairs: for each row slot i, x_a / x_b are the raw dot products (fp32,
// before the softmax scale) of key g and key g + 8, -inf where the pair is not visible. kSelect: the tile holds
// other labels too, so keys of another label are masked here (in_a / in_b).
template <bool kSelect>
__device__ __forceinline__ void update_slot(float (&nref)[kRowsPerThread], float (&sum)[kRowsPerThread],
                                            const float (&v)[kFragElems], bool in_a, bool in_b, float scale) {
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    float xa = v[frag_elem(i, 0)], xb = v[frag_elem(i, 1)];
    if (kSelect) {
      xa = in_a ? xa : -INFINITY;
      xb = in_b ? xb : -INFINITY;
    }
    const float mx = fmaxf(xa, xb);
    // mx * scale - reference: > 8 also when the pair is empty (nref = FLT_MAX) and mx is finite; false for -inf.
    if (fmaf(mx, scale, nref[i]) > kRescaleThreshold) {
      const float nr = -(mx * scale);
      sum[i] *= fast_exp2(nr - nref[i]);  // 0 for an empty pair
      nref[i] = nr;
    }
    sum[i] += fast_exp2(fmaf(xa, scale, nref[i])) + fast_exp2(fmaf(xb, scale, nref[i]));
  }
}

// Merge slot 0's pairs over the warp's 8 lanes that hold the same rows (xor 4, 8, 16) and into the warp's
// accumulators acc[label][row] (shared memory, (nref, sum)); lanes 0..3 own rows 2 lane + (0, 1) of each n-tile.
// Slot 0 is empty afterwards. Warp-uniform: every lane calls it.
__device__ __forceinline__ void flush_front(ThreadStats& st, float2* acc, int lane) {
  const int label = st.label[0];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    float nr = st.nref[0][i], s = st.sum[0][i];
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      const float nr2 = __shfl_xor_sync(0xffffffffu, nr, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
      merge_pair(nr, s, nr2, s2);
    }
    if (lane < 4) {
      float2& a = acc[label * kRowTile + 8 * (i >> 1) + 2 * lane + (i & 1)];
      float anr = a.x, as = a.y;
      merge_pair(anr, as, nr, s);
      a = make_float2(anr, as);
    }
    st.nref[0][i] = kEmptyNegRef;
    st.sum[0][i] = 0.0f;
  }
  st.label[0] = -1;
}

// Make label m the front slot (warp-uniform): found in slot 1 or 2, it moves to the front; absent, the least recently
// used slot (2) rotates to the front and is flushed there if it held another label (LRU eviction).
__device__ __forceinline__ void bring_to_front(ThreadStats& st, int m, float2* acc, int lane) {
  if (st.label[0] == m) return;
  if (st.label[1] == m) {
    st.to_front<1>();
    return;
  }
  const bool present = st.label[2] == m;
  st.to_front<2>();
  if (present) return;
  if (st.label[0] >= 0) flush_front(st, acc, lane);
  st.label[0] = m;
}

// Add the warp's keys of every label in `mask` (ascending) to the thread's pairs. `select`: the warp's keys are not
// all of one label (or some are PAD / out of range), so each label masks the others'.
__device__ __forceinline__ void update_labels(ThreadStats& st, unsigned mask, bool select, int lab_a, int lab_b,
                                              const float (&v)[kFragElems], float scale, float2* acc, int lane) {
  while (mask) {
    const int m = __ffs(mask) - 1;
    mask &= mask - 1u;
    bring_to_front(st, m, acc, lane);
    if (select) {
      update_slot<true>(st.nref[0], st.sum[0], v, lab_a == m, lab_b == m, scale);
    } else {
      update_slot<false>(st.nref[0], st.sum[0], v, true, true, scale);
    }
  }
}

// Flush every occupied slot, front first (e.g. at the end of a split); the table is empty afterwards.
__device__ __forceinline__ void flush_all(ThreadStats& st, float2* acc, int lane) {
#pragma unroll 1
  for (int k = 0; k < kLabelSlots; ++k) {
    if (st.label[0] >= 0) flush_front(st, acc, lane);
    st.to_front<kLabelSlots - 1>();  // the next slot comes to the front; the empty one goes last
  }
}

// ---- PTX wrappers (sm_80+) -------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy bypassing L1 (cp.async.cg), zero-filled when src_bytes = 0, with an L2 policy.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A B + D, m16n8k16, fp32 accumulation; A 16x16 (keys x d, row-major), B 16x8 (d x rows, "col": Q rows).
// d[0..3] of n-tile j are the thread's elements 4 j .. 4 j + 3 of the fragment.
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte store with an L2 policy (the logits: evict-last, so the reduce finds them in L2).
__device__ __forceinline__ void st_global_v4(float* dst, float a, float b, float c, float d, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "f"(a), "f"(b), "f"(c),
               "f"(d), "l"(policy)
               : "memory");
}

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

// ---- layout shared by S-A and S-B ----------------------------------------------------------------------------

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = kWarps * kWarpKeys;  // 64
constexpr int kChunkBytes = 128;               // bytes of one key row per pipeline stage
// Shared-memory pitch of a chunk row: 16 bytes of padding make the 8 rows an ldmatrix (or a warp's float4 reads)
// touches start in 8 different 16-byte bank groups, and keep every address a base plus an immediate offset.
constexpr int kPitch = kChunkBytes + 16;
constexpr int kStages = 3;  // cp.async ring depth: 2 chunks in flight while one is computed (2 CTAs fit sm_89)
constexpr int kStageBytes = kTileKeys * kPitch;   // 9 KB
constexpr int kQChunkBytes = kRowTile * kPitch;   // 4.5 KB
constexpr int kMaxHeadDim = 256;
constexpr int kMaxSplits = 128;  // splits per (batch, KV head) at most: the workspace bound and the combine's reads
constexpr int kCombineBatch = 16;  // splits the combine loads at once (8 x 16-byte loads per thread)
constexpr int kLogitsPerTile = kTileKeys * kRowTile;  // fp32 per (unit, tile)
constexpr int kMaskBroken = 1 << 16;  // in a unit's mask word: a split saw a non-finite visible logit
// The counter buffer: S-B's words first (group and top arrivals, the barrier generation), then S-A's 2 per unit.
constexpr int kSbCounterWords = 64;

// Unit u = (b, kvh, rt): one row tile of one KV head of one batch element. Units of batch b are contiguous.
__host__ __device__ inline int unit_index(int b, int kvh, int rt, int kv_heads, int row_tiles) {
  return (b * kv_heads + kvh) * row_tiles + rt;
}
// Thread (warp, lane)'s elements 4 q .. 4 q + 3 of (unit, tile) are at logits_offset(...) + 128 q: each 16-byte store
// instruction of a warp writes 512 contiguous bytes.
__host__ __device__ inline int64_t logits_offset(int unit, int tile, int tiles, int warp, int lane) {
  return ((static_cast<int64_t>(unit) * tiles + tile) * kWarps + warp) * (32 * kFragElems) + lane * 4;
}
constexpr int kLogitsQStride = 32 * 4;  // floats between a thread's element groups q and q + 1
// Whether a thread's element group q (n-tile q: rows 8 q + 2 (lane % 4) + 0, 1) holds a real row of a row tile with
// rows_here real rows: the groups that hold only padding rows are never stored nor read (at the 7B shapes, 28 rows
// per KV head, that is 1/8 of the logits' bytes).
__host__ __device__ constexpr bool group_stored(int q, int lane, int rows_here) {
  return 8 * q + 2 * (lane & 3) < rows_here;
}
__host__ __device__ inline int64_t partial_offset(int unit, int label, int row, int split_stride) {
  return ((static_cast<int64_t>(unit) * kNumLabels + label) * kRowTile + row) * split_stride;
}
__host__ __device__ inline int64_t stats_offset(int unit, int label, int row) {
  return (static_cast<int64_t>(unit) * kNumLabels + label) * kRowTile + row;
}

// First tile of split `split` when `tiles` tiles go to `splits` splits (1 <= splits <= tiles), given
// split_tiles = tiles / splits and split_extra = tiles % splits: the first split_extra splits get one tile more, so
// lengths differ by at most one and every split has at least one tile; split `splits` begins at `tiles`.
__host__ __device__ inline int64_t split_begin(int64_t split, int64_t split_tiles, int64_t split_extra) {
  return split * split_tiles + (split < split_extra ? split : split_extra);
}

// Whether key n (label `label`) is visible to a query row whose causal limit is `pos`: it exists, is not after the
// limit and its label is a label (0..kMaxModalities; PAD = -1 is not). The host build exposes it to the CPU replay.
__host__ __device__ inline bool key_visible(int64_t n, int64_t num_keys, int64_t pos, int64_t label) {
  return n < num_keys && n <= pos && label >= 0 && label < kNumLabels;
}

// Dynamic shared memory of scores_tile_kernel: the query tile (chunks x 4.5 KB) and the K ring (kStages x 9 KB).
__host__ __device__ inline int tile_smem_bytes(int chunks) { return chunks * kQChunkBytes + kStages * kStageBytes; }

// Byte offset, in a [keys or rows][kPitch] chunk buffer, of the 16-byte piece `piece` of row `r`.
__host__ __device__ constexpr uint32_t piece_offset(int r, int piece) {
  return static_cast<uint32_t>(r * kPitch + piece * 16);
}

// S-B's partition and combine (csrc/kernels/modality_scores_sm90a.cuh), here so that the host build reports them to
// the CPU replay whatever the architectures built.
namespace sb {
constexpr int kConsumers = 2;   // consumer warpgroups: consumer c takes the CTA's tiles j = c, c + 2, ...
constexpr int kGroup = 12;      // CTAs per first-level combine group
constexpr int kMaxCtas = 256;
constexpr int kMaxHeads = 8;
constexpr int kMaxGroups = (kMaxCtas + kGroup - 1) / kGroup;  // 22
}  // namespace sb

// Row r's (-M_r,m, W_r,m) for each present label m (ascending; tot[li * 32 + r] = the merged (nref, sum) of the li-th
// present label) into out[m * 32 + r]: M_r = max_m M_r,m, Z_r relative to it, W = 1 / (E' + eps Z exp2(M_r - M_r,m)).
// Shared by S-A's combine and S-B's.
__device__ __forceinline__ void row_stats(const float2* tot, unsigned present, int r, bool real, bool broken,
                                          float eps, float2* out) {
  const int labels = __popc(present);
  float row_max = -INFINITY;
  for (int li = 0; li < labels; ++li) {
    const float nr = tot[li * kRowTile + r].x;
    if (nr != kEmptyNegRef) row_max = fmaxf(row_max, -nr);
  }
  float z = 0.0f;  // Z_r relative to row_max
  for (int li = 0; li < labels; ++li) {
    const float2 x = tot[li * kRowTile + r];
    if (x.x != kEmptyNegRef) z += x.y * exp2f(-x.x - row_max);
  }
  unsigned bits = present;
  for (int li = 0; li < labels; ++li) {
    const int m = __ffs(bits) - 1;
    bits &= bits - 1u;
    const float2 x = tot[li * kRowTile + r];
    float2 w;
    if (!real) {
      w = make_float2(0.0f, 0.0f);  // padding rows of the row tile add nothing in the reduce
    } else if (broken) {
      // The non-finite rule: NaN weights make every scored key of the batch element NaN in the reduce (0 * NaN for
      // the keys this row does not see); text keys stay 0.
      w = make_float2(x.x == kEmptyNegRef ? 0.0f : x.x, __int_as_float(0x7fc00000));
    } else if (x.x == kEmptyNegRef) {
      // No visible key of this label: every numerator is exactly 0, so the row contributes 0 (the reference's
      // eps -> 0+ limit; eps = 0 must not turn 0 / 0 into NaN). -M = 0 keeps exp2(-inf * scale + 0) = 0.
      w = make_float2(0.0f, 0.0f);
    } else {
      // An overflowing exp2 makes W = 0, the correct limit (eps * Z dominates the modality's mass).
      const float eps_term = eps > 0.0f ? eps * z * exp2f(row_max + x.x) : 0.0f;
      w = make_float2(x.x, 1.0f / (x.y + eps_term));
    }
    out[m * kRowTile + r] = w;
  }
}

}  // namespace scores
}  // namespace macer
