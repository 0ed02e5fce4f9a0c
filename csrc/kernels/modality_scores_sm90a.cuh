// Allocation-normalised modality scores, step S-B (sm_90a): one persistent kernel per call, one CTA per SM
// (cooperative launch), the logits kept on chip, one global wait.
//
// The S-A kernels (modality_scores.cuh) write every (row, key) logit to global memory and read it back in a second
// kernel: at N = 100k that round trip alone is 2 x 51 MB against 102 MB of K. Here each CTA owns a contiguous range of
// 64-key tiles of every KV head (B = 1, the rows of one KV head <= 32, D = 128, bf16 / fp16):
//
//   Phase 1. A producer thread streams (KV head, tile) units in order through a kStages-deep ring: TMA 3-D boxes
//     (64 d x 64 keys x 1 head, 128-byte swizzle, zero-filled past N, L2 evict-first), completing on mbarriers. Two
//     consumer warpgroups take alternate tiles (consumer c the tiles j = c, c + 2, ... of the CTA's range) and run
//     wgmma.m64n32k16 x 8 per unit, A = the K tile, B = the head's 32 query rows (staged once); the accumulator
//     fragment is S-A's (scores_fragment.cuh), so the epilogue is the same code: the visibility decision, the non-
//     finite check, the per-thread (row, label) pairs. The raw dot products stay in shared memory (8 KB per unit);
//     units past the on-chip capacity go to a global spill buffer (S-A's layout, L2 evict-last; an access-policy
//     window makes it persisting where the process has set an L2 set-aside). At each head's end the consumers merge
//     their warps' pairs into the CTA's partial for that head.
//   Combine. Each CTA publishes its partials and label mask and arrives at its group's counter; the last of each
//     group of kGroup CTAs merges the group's partials (CTA order), the last group merger merges the groups' (group
//     order), writes (-M_r,m, W_r,m) and bumps a generation word. Every CTA waits for the generation to move: the
//     kernel's one global synchronisation. Counters are reset by their last arriver and the generation only grows,
//     so the buffer needs no reset between calls or graph replays. The cooperative launch guarantees that every CTA
//     is resident (it fails, and the launcher falls back to S-A, where they would not be).
//   Phase 2. Each consumer thread re-reads its own units (same fragment, same addresses: no layout change) and forms
//     s_i = 1/(Lq Hq) sum_h sum_r exp2(l * scale - M) W, in S-A's reduce order (heads in order, rows in slot order,
//     then xor 1, 2 over the lanes holding the same keys): deterministic.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; the map is encoded on the host through the runtime's entry point)

#include "scores_fragment.cuh"

namespace macer {
namespace scores {
namespace sb {

constexpr int kThreads = 384;  // warpgroup 0: the producer (one thread issues TMA); warpgroups 1, 2: consumers
constexpr int kConsumerThreads = kConsumers * 128;
constexpr int kConsumerWarps = kConsumers * 4;
static_assert(kThreads == 128 * (1 + kConsumers), "a producer warpgroup and the consumers");
constexpr int kStages = 4;
constexpr int kHeadDim = 128;
constexpr int kBoxBytes = 64 * 128;          // 64 rows x 64 d x 2 B: one TMA box, one 128-byte swizzle span wide
constexpr int kStageBytes = 2 * kBoxBytes;   // a 64-key tile, D = 128
constexpr int kQBoxBytes = kRowTile * 128;   // 32 rows x 64 d x 2 B
constexpr int kQHeadBytes = 2 * kQBoxBytes;  // 8 KB per KV head
constexpr int kUnitBytes = kTileKeys * kRowTile * 4;  // one (head, tile)'s fp32 logits: 8 KB
constexpr int kPairs = kNumLabels * kRowTile;                 // (label, row) pairs per head
// Counter words (the first kSbCounterWords of the counter buffer): group arrivals, top arrivals, generation.
constexpr int kTopCounter = 32;
constexpr int kGeneration = 33;
static_assert(kMaxGroups <= kTopCounter && kGeneration < kSbCounterWords, "S-B counter words");

struct Args {
  const void* query;
  const void* modality;
  const void* positions;
  float* out;             // [1, N]
  float* spill;           // S-A's logits layout with unit = KV head
  float2* partial;        // [Hkv][kPairs][ctas]
  float2* group_partial;  // [groups][Hkv][kPairs]
  float2* stats;          // [Hkv][kPairs]
  int* masks;             // [ctas] then [groups]: label bits | kMaskBroken
  int* counters;          // the first kSbCounterWords words of the counter buffer
  int modality_dtype, positions_dtype;
  int q_len, group, rows, kv_heads, num_keys, tiles, ctas, slots;  // slots: units kept on chip per CTA
  int64_t q_stride[4], mod_stride[2], pos_stride[2];
  float scale_log2, eps, inv_rows;
};

// Shared memory, from a 1024-byte aligned base (the 128-byte swizzle's atom): Q [Hkv][2 boxes][32][128 B], the ring
// [kStages][2 boxes][64][128 B], the consumer warps' pair accumulators, the barriers and small arrays, then `slots`
// units of on-chip logits.
__host__ __device__ inline int smem_fixed_bytes(int kv_heads) {
  return 1024 + kv_heads * kQHeadBytes + kStages * kStageBytes + kConsumerWarps * kPairs * 8 + 1024;
}
__host__ __device__ inline int smem_bytes(int kv_heads, int slots) {
  return smem_fixed_bytes(kv_heads) + slots * kUnitBytes;
}

#if defined(__CUDA_ARCH__)

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One TMA box of the K tensor map: coordinates (d, key, head), innermost first.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int d, int n, int h, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"(map), "r"(d), "r"(n), "r"(h), "r"(bar), "l"(policy)
      : "memory");
}

// A wgmma shared-memory descriptor for a K-major operand in 128-byte swizzled 8-row atoms (1024 bytes apart):
// start address >> 4, leading byte offset unused (1), stride byte offset 1024 >> 4, layout 1 (SWIZZLE_128B).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Pins the accumulator registers around a wgmma sequence (CUTLASS's warpgroup_fence_operand): without it the
// compiler may copy one between two wgmmas, and ptxas then serialises them.
__device__ __forceinline__ void fence_operands(float (&d)[kFragElems]) {
#pragma unroll
  for (int e = 0; e < kFragElems; ++e) asm volatile("" : "+f"(d[e])::"memory");
}
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// D[64 keys x 32 rows] (+)= A[64 x 16] B[16 x 32], both from shared memory, fp32 accumulation; `accumulate` = 0
// ignores D's previous value. The thread's 16 elements are S-A's fragment (warp = its warp in the warpgroup).
template <typename T>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[kFragElems], uint64_t desc_a, uint64_t desc_b,
                                                int accumulate);
#define MACER_WGMMA_M64N32K16(TYPE, PTX_TYPE)                                                                      \
  template <>                                                                                                      \
  __device__ __forceinline__ void wgmma_m64n32k16<TYPE>(float (&d)[kFragElems], uint64_t desc_a, uint64_t desc_b, \
                                                        int accumulate) {                                          \
    asm volatile(                                                                                                  \
        "{\n"                                                                                                      \
        ".reg .pred p;\n"                                                                                          \
        "setp.ne.b32 p, %18, 0;\n"                                                                                 \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX_TYPE "." PTX_TYPE                                        \
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n"      \
        "}\n"                                                                                                      \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),          \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])     \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                              \
  }
MACER_WGMMA_M64N32K16(__nv_bfloat16, "bf16")
MACER_WGMMA_M64N32K16(__half, "f16")
#undef MACER_WGMMA_M64N32K16

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void consumer_barrier() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads)); }

#endif  // __CUDA_ARCH__

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) scores_sb_kernel(const __grid_constant__ CUtensorMap kmap,
                                                                 const Args a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // Aligned to 1024 bytes by an offset into the array itself (not through an integer cast of the pointer, which
  // would lose the shared address space and turn every access below into a generic one).
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* qs = smem;                                // [Hkv][2][32][128 B], swizzled
  unsigned char* ring = qs + a.kv_heads * kQHeadBytes;     // [kStages][2][64][128 B], swizzled (TMA)
  float2* warp_acc = reinterpret_cast<float2*>(ring + kStages * kStageBytes);  // [kConsumerWarps][kPairs]
  unsigned char* misc = reinterpret_cast<unsigned char*>(warp_acc + kConsumerWarps * kPairs);
  uint64_t* full = reinterpret_cast<uint64_t*>(misc);      // [kStages]
  uint64_t* empty = full + kStages;                        // [kStages]
  int* row_pos = reinterpret_cast<int*>(empty + kStages);  // [32]
  int* info = row_pos + kRowTile;                          // [0] mask, [1] group last, [2] top
  float* slots = reinterpret_cast<float*>(misc + 1024);    // [a.slots][kWarps][4][32][4]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = tid >> 7;
  const int cta = blockIdx.x, ctas = a.ctas;
  const int t0 = static_cast<int>(split_begin(cta, a.tiles / ctas, a.tiles % ctas));
  const int nt = static_cast<int>(split_begin(cta + 1, a.tiles / ctas, a.tiles % ctas)) - t0;
  const int units = a.kv_heads * nt;
  const uint32_t ring_addr = smem_addr(ring), qs_addr = smem_addr(qs);

  int gen0 = 0;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(full + s), 1);
      mbar_init(smem_addr(empty + s), 128);  // the consumer warpgroup that read the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(&kmap) : "memory");
    info[0] = 0;
  }
  for (int i = tid; i < kConsumerWarps * kPairs; i += kThreads) warp_acc[i] = make_float2(kEmptyNegRef, 0.0f);
  grid_dependency_wait();  // Q, K, labels and positions may come from the stage's previous kernel
  if (tid == 128) gen0 = ld_acquire(a.counters + kGeneration);  // before this CTA arrives: it cannot move before

  // The query rows of every head, [h][box][row][128 B] with the 128-byte swizzle (chunk c of row r at c ^ (r % 8)),
  // zero on padding rows; then a proxy fence, since the tensor cores read them through the async proxy.
  if (tid < kRowTile) {
    const int q = tid % a.q_len;
    row_pos[tid] = tid < a.rows ? static_cast<int>(load_int(a.positions, a.positions_dtype, q * a.pos_stride[1]))
                                : -1;
  }
  const T* qbase = static_cast<const T*>(a.query);
  for (int i = tid; i < a.kv_heads * kRowTile * kHeadDim; i += kThreads) {
    const int d = i % kHeadDim, r = (i / kHeadDim) % kRowTile, h = i / (kHeadDim * kRowTile);
    T x = T(0.0f);
    if (r < a.rows) {
      const int hq = h * a.group + r / a.q_len, q = r % a.q_len;
      x = qbase[hq * a.q_stride[1] + q * a.q_stride[2] + d * a.q_stride[3]];
    }
    const int box = d / 64, chunk = (d % 64) / 8;
    *reinterpret_cast<T*>(qs + h * kQHeadBytes + box * kQBoxBytes + r * 128 + ((chunk ^ (r & 7)) << 4) +
                          (d % 8) * 2) = x;
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int min_pos = __reduce_min_sync(0xffffffffu, row_pos[lane] < 0 ? INT_MAX : row_pos[lane]);

  if (wg == 0) {
    // ---- producer: one thread walks the units (h, j) in order through the ring, then the warpgroup leaves --------
    // Its registers go to the consumers (384 threads x 168 at entry: 40 here, 232 there); everything after this
    // branch runs on the 256 consumer threads, synchronised by named barrier 1.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) {
      const uint64_t policy = l2_evict_first_policy();
      for (int seq = 0; seq < units; ++seq) {
        const int s = seq % kStages, round = seq / kStages;
        const int h = seq / nt, tile = t0 + seq % nt;
        if (round > 0) mbar_wait(smem_addr(empty + s), (round - 1) & 1);
        const uint32_t bar = smem_addr(full + s), dst = ring_addr + s * kStageBytes;
        mbar_expect_tx(bar, kStageBytes);
        tma_load_3d(dst, &kmap, 0, tile * kTileKeys, h, bar, policy);
        tma_load_3d(dst + kBoxBytes, &kmap, 64, tile * kTileKeys, h, bar, policy);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int ctid = tid - 128, cw = wg - 1, wq = warp & 3, g = lane >> 2;
  {
    // ---- consumers: phase 1 ----------------------------------------------------------------------------------------
    const int cwarp = cw * 4 + wq;
    float2* my_acc = warp_acc + cwarp * kPairs;
    const uint64_t spill_policy = l2_evict_last_policy();
    ThreadStats st;
    st.reset();
    float z = 0.0f;
    unsigned seen = 0u;
    for (int h = 0; h < a.kv_heads; ++h) {
      for (int j = cw; j < nt; j += kConsumers) {
        const int seq = h * nt + j, s = seq % kStages;
        const int tile = t0 + j, n_w = tile * kTileKeys + kWarpKeys * wq;
        const int lab = lane < kWarpKeys && n_w + lane < a.num_keys
                            ? static_cast<int>(load_int(a.modality, a.modality_dtype,
                                                        static_cast<int64_t>(n_w + lane) * a.mod_stride[1]))
                            : -1;
        mbar_wait(smem_addr(full + s), (seq / kStages) & 1);
        float acc[kFragElems];
        // The 8 k-steps' descriptors differ from the first by a constant (the start address field, in 16-byte
        // units): 2 per k16 step inside a 128-byte swizzle span, a box further for d >= 64.
        // Only the low word moves (a 32-bit add, no carry), and all 8 pairs are formed before the first wgmma.
        const uint64_t da = sw128_desc(ring_addr + s * kStageBytes), db = sw128_desc(qs_addr + h * kQHeadBytes);
        const uint32_t da_hi = static_cast<uint32_t>(da >> 32), db_hi = static_cast<uint32_t>(db >> 32);
        uint64_t desc_a[kHeadDim / 16], desc_b[kHeadDim / 16];
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          desc_a[kk] = (static_cast<uint64_t>(da_hi) << 32) |
                       (static_cast<uint32_t>(da) + ((kk >> 2) * kBoxBytes + (kk & 3) * 32) / 16);
          desc_b[kk] = (static_cast<uint64_t>(db_hi) << 32) |
                       (static_cast<uint32_t>(db) + ((kk >> 2) * kQBoxBytes + (kk & 3) * 32) / 16);
        }
#pragma unroll
        for (int e = 0; e < kFragElems; ++e) acc[e] = 0.0f;
        fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) wgmma_m64n32k16<T>(acc, desc_a[kk], desc_b[kk], kk > 0);
        wgmma_commit();
        wgmma_wait0();
        fence_operands(acc);
        mbar_arrive(smem_addr(empty + s));
        // The epilogue: S-A's, with this unit's keys.
        const bool lane_ok = lane >= kWarpKeys || (n_w + lane < a.num_keys && lab >= 0 && lab < kNumLabels);
        const unsigned mask = __reduce_or_sync(0xffffffffu, lane < kWarpKeys && lane_ok ? 1u << lab : 0u);
        const bool all_ok = __all_sync(0xffffffffu, lane_ok);
        const int lab_a = __shfl_sync(0xffffffffu, lab, g), lab_b = __shfl_sync(0xffffffffu, lab, g + 8);
        if (all_ok && n_w + kWarpKeys - 1 <= min_pos) {
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
        const int u = h * nt + j;
        if (u < a.slots) {
          float* dst = slots + static_cast<int64_t>(u) * (kUnitBytes / 4) + wq * (32 * kFragElems) + lane * 4;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            *reinterpret_cast<float4*>(dst + kLogitsQStride * q) =
                make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
          }
        } else {
          float* dst = a.spill + logits_offset(h, tile, a.tiles, wq, lane);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            if (!group_stored(q, lane, a.rows)) continue;
            st_global_v4(dst + kLogitsQStride * q, acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3],
                         spill_policy);
          }
        }
        seen |= mask;
        const bool select = !all_ok || __popc(mask) > 1;
        if (!select && st.label[0] >= 0 && mask == 1u << st.label[0]) {
          update_slot<false>(st.nref[0], st.sum[0], acc, true, true, a.scale_log2);
        } else {
          update_labels(st, mask, select, lab_a, lab_b, acc, a.scale_log2, my_acc, lane);
        }
      }
      // End of head h: the 8 consumer warps' pairs -> this CTA's partial of head h (warp order), accumulators reset.
      flush_all(st, my_acc, lane);
      consumer_barrier();
      for (int p = ctid; p < kPairs; p += kConsumerThreads) {
        float nr = warp_acc[p].x, sm = warp_acc[p].y;
        warp_acc[p] = make_float2(kEmptyNegRef, 0.0f);
        for (int w = 1; w < kConsumerWarps; ++w) {
          merge_pair(nr, sm, warp_acc[w * kPairs + p].x, warp_acc[w * kPairs + p].y);
          warp_acc[w * kPairs + p] = make_float2(kEmptyNegRef, 0.0f);
        }
        a.partial[(static_cast<int64_t>(h) * kPairs + p) * ctas + cta] = make_float2(nr, sm);
      }
      consumer_barrier();
    }
    if (lane == 0) atomicOr(info, static_cast<int>(seen));
    if (__any_sync(0xffffffffu, z != z) && lane == 0) atomicOr(info, kMaskBroken);
  }
  __threadfence();  // every thread's partials, before the CTA arrives
  consumer_barrier();
  launch_dependents();

  // ---- combine: the group's last CTA merges the group, the last group merger merges the groups -------------------
  const int grp = cta / kGroup, groups = (ctas + kGroup - 1) / kGroup;
  const int grp_size = min(kGroup, ctas - grp * kGroup);
  float2* tot = reinterpret_cast<float2*>(ring);  // the ring is free now: [Hkv][kPairs] merged pairs
  if (ctid == 0) {
    a.masks[cta] = info[0];
    __threadfence();
    info[1] = atomicAdd(a.counters + grp, 1) == grp_size - 1;
  }
  consumer_barrier();
  if (info[1]) {
    __threadfence();
    if (ctid == 0) atomicExch(a.counters + grp, 0);
    int gmask = 0;
    for (int c = grp * kGroup; c < grp * kGroup + grp_size; ++c) gmask |= __ldcg(a.masks + c);
    for (int p = ctid; p < a.kv_heads * kPairs; p += kConsumerThreads) {
      const float2* src = a.partial + static_cast<int64_t>(p) * ctas + grp * kGroup;
      float nr = kEmptyNegRef, sm = 0.0f;
      for (int c = 0; c < grp_size; ++c) {
        const float2 x = __ldcg(src + c);
        merge_pair(nr, sm, x.x, x.y);
      }
      a.group_partial[static_cast<int64_t>(grp) * a.kv_heads * kPairs + p] = make_float2(nr, sm);
    }
    if (ctid == 0) a.masks[ctas + grp] = gmask;
    __threadfence();
    consumer_barrier();
    if (ctid == 0) info[2] = atomicAdd(a.counters + kTopCounter, 1) == groups - 1;
    consumer_barrier();
    if (info[2]) {
      __threadfence();
      if (ctid == 0) atomicExch(a.counters + kTopCounter, 0);
      int mask = 0;
      for (int k = 0; k < groups; ++k) mask |= __ldcg(a.masks + ctas + k);
      const unsigned present = static_cast<unsigned>(mask) & ((1u << kNumLabels) - 1u);
      const int labels = __popc(present);
      for (int p = ctid; p < a.kv_heads * labels * kRowTile; p += kConsumerThreads) {
        const int h = p / (labels * kRowTile), li = (p / kRowTile) % labels, r = p % kRowTile;
        unsigned bits = present;
        for (int k = 0; k < li; ++k) bits &= bits - 1u;
        const int m = __ffs(bits) - 1;
        float nr = kEmptyNegRef, sm = 0.0f;
        for (int k = 0; k < groups; ++k) {
          const float2 x = __ldcg(a.group_partial + (static_cast<int64_t>(k) * a.kv_heads + h) * kPairs +
                                  m * kRowTile + r);
          merge_pair(nr, sm, x.x, x.y);
        }
        tot[(h * kNumLabels + li) * kRowTile + r] = make_float2(nr, sm);
      }
      consumer_barrier();
      for (int p = ctid; p < a.kv_heads * kRowTile; p += kConsumerThreads) {
        const int h = p / kRowTile, r = p % kRowTile;
        row_stats(tot + h * kNumLabels * kRowTile, present, r, r < a.rows, (mask & kMaskBroken) != 0, a.eps,
                  a.stats + h * kPairs);
      }
      __threadfence();
      consumer_barrier();
      if (ctid == 0) atomicAdd(a.counters + kGeneration, 1);  // releases every CTA's wait below
    }
  }
  // The one global wait: until the last group merger has published the statistics.
  if (ctid == 0) {
    while (ld_acquire(a.counters + kGeneration) == gen0) __nanosleep(64);
  }
  consumer_barrier();
  __threadfence();

  // ---- phase 2: the statistics to shared memory, then each consumer thread scores its keys ------------------------
  float2* table = reinterpret_cast<float2*>(ring);  // [Hkv][kPairs] (-M, W)
  for (int i = ctid; i < a.kv_heads * kPairs; i += kConsumerThreads) table[i] = __ldcg(a.stats + i);
  consumer_barrier();
  const int t = lane & 3;
  for (int j = cw; j < nt; j += kConsumers) {
    const int tile = t0 + j, n_w = tile * kTileKeys + kWarpKeys * wq;
    const int lab = lane < kWarpKeys && n_w + lane < a.num_keys
                        ? static_cast<int>(load_int(a.modality, a.modality_dtype,
                                                    static_cast<int64_t>(n_w + lane) * a.mod_stride[1]))
                        : -1;
    const int lab_a = __shfl_sync(0xffffffffu, lab, g), lab_b = __shfl_sync(0xffffffffu, lab, g + 8);
    const bool scored_a = lab_a >= 1 && lab_a < kNumLabels, scored_b = lab_b >= 1 && lab_b < kNumLabels;
    float acc_a = 0.0f, acc_b = 0.0f;
    for (int h = 0; h < a.kv_heads; ++h) {
      const int u = h * nt + j;
      float v[kFragElems];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float4 x;
        if (u < a.slots) {
          x = *reinterpret_cast<const float4*>(slots + static_cast<int64_t>(u) * (kUnitBytes / 4) +
                                               wq * (32 * kFragElems) + lane * 4 + kLogitsQStride * q);
        } else if (group_stored(q, lane, a.rows)) {
          x = __ldcg(reinterpret_cast<const float4*>(a.spill + logits_offset(h, tile, a.tiles, wq, lane) +
                                                     kLogitsQStride * q));
        } else {
          x = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);  // padding rows: never stored, weight 0
        }
        v[4 * q] = x.x;
        v[4 * q + 1] = x.y;
        v[4 * q + 2] = x.z;
        v[4 * q + 3] = x.w;
      }
      if (scored_a) {
        const float4* sa = reinterpret_cast<const float4*>(table + h * kPairs + lab_a * kRowTile + 2 * t);
#pragma unroll
        for (int jj = 0; jj < kNTiles; ++jj) {
          const float4 w = sa[4 * jj];
          acc_a = fmaf(fast_exp2(fmaf(v[frag_elem(2 * jj, 0)], a.scale_log2, w.x)), w.y, acc_a);
          acc_a = fmaf(fast_exp2(fmaf(v[frag_elem(2 * jj + 1, 0)], a.scale_log2, w.z)), w.w, acc_a);
        }
      }
      if (scored_b) {
        const float4* sb = reinterpret_cast<const float4*>(table + h * kPairs + lab_b * kRowTile + 2 * t);
#pragma unroll
        for (int jj = 0; jj < kNTiles; ++jj) {
          const float4 w = sb[4 * jj];
          acc_b = fmaf(fast_exp2(fmaf(v[frag_elem(2 * jj, 1)], a.scale_log2, w.x)), w.y, acc_b);
          acc_b = fmaf(fast_exp2(fmaf(v[frag_elem(2 * jj + 1, 1)], a.scale_log2, w.z)), w.w, acc_b);
        }
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      acc_a += __shfl_xor_sync(0xffffffffu, acc_a, off);
      acc_b += __shfl_xor_sync(0xffffffffu, acc_b, off);
    }
    const float ta = __shfl_sync(0xffffffffu, acc_a, 4 * (lane & 7));
    const float tb = __shfl_sync(0xffffffffu, acc_b, 4 * (lane & 7));
    if (lane < kWarpKeys && n_w + lane < a.num_keys) {
      const bool scored = lab >= 1 && lab < kNumLabels;
      a.out[n_w + lane] = scored ? (lane < 8 ? ta : tb) * a.inv_rows : 0.0f;
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // S-B is compiled for sm_90a only
#endif
}

}  // namespace sb
}  // namespace scores
}  // namespace macer
