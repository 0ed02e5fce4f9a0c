// Radix selection in shared memory: topk_indices, coverage_select and stage_select, one launch per call. A row (a
// standalone op's scores, or one sample of a stage) is held by one CTA of kThreads threads or, on sm_90, by a thread
// block cluster of up to kMaxCluster CTAs that exchange histograms, counts and sorted items through distributed
// shared memory. CTA r of a row's C CTAs owns the tokens [r * cap, min(n, (r + 1) * cap)), cap = ceil(n / C).
//
// Prologue (the only global reads, each a loop specialised for the input's dtype; every later loop reads shared
// memory): the score's order key (common.cuh: descending_key32 of fp32/fp16/bf16 scores, exact since both convert
// to float exactly; descending_key64 of fp64 scores), a one-byte code per token (its modality slot 0..M-1, kCodeKept
// for a label >= 0 that no modality selects, kCodePad for a label < 0), and for coverage members their chunk id as a
// byte (kChunkOverflow when outside [0, 254]). Ascending key = better; a NaN's key is the largest of all (kNanKey*),
// so it ranks after every number. Tokens of other labels are never candidates: no "never" key is needed.
//
// Per selected modality with budget k (0 < k < m members; k == m takes every member, k == 0 none):
//  * top-K: the k smallest of X = the key, ties to the lower index.
//  * coverage (eq:chunk_coverage_greedy): the greedy's picks are the k smallest of X = (key of v, score key) as one
//    96-bit number, ties to the lower index, where v = s + sqrt(lambda_c / (1 + t)) in IEEE float64 and t is the
//    member's rank in its chunk by (score desc, index asc) -- the reference's tie rule (value, then score, then
//    index). t comes from a stable LSD radix sort of the members by their 32-bit score key (8-bit digits; a digit
//    whose bits are equal over every member is skipped), then one counting pass over the chunk byte that gives each
//    member its place among the earlier members of its chunk without moving anything. Stability comes from the
//    warp-segmented counting of every pass: warp w of a CTA owns a contiguous segment of the items, counts its
//    digits per warp, and the exclusive scan over (digit, CTA, warp) gives every item its place, so equal digits keep
//    their order (the members start in index order). One CTA sorts 16-bit token numbers, looking keys up in shared
//    memory; a cluster sorts self-contained 8-byte items (key << 32 | chunk << 24 | token) scattered across the CTAs.
//    The bonus sqrt(lambda_c / (1 + t)) comes from a float64 table for t < table entries (the same operations, so the
//    same bits) and is computed directly above it.
//  * select: radix select over X with 11-bit digits from the top (3 passes for 32-bit keys, 6 for 64-bit, 9 for
//    coverage's 96 bits), one shared-memory histogram per pass (summed over the cluster). Each pass finds the bin
//    holding the need-th smallest; the members of lower bins are taken, those of the bin stay candidates, marked in a
//    bitmap by token (no candidate list, no atomics on it). It stops when the bin's count equals what is still needed
//    (the whole bin is taken), when the bin holds at most kSmall candidates (each is ranked against the others by
//    (X, token): exact, ties included), or after the last pass (every candidate has the same X: the tie group, taken
//    in index order by a scan of the bitmap).
// Finally every picked token and every token coded kCodeKept is written in ascending order, right-aligned in the
// row's output after -1s (all -1 for a row contradicting its budgets or out_len), from the kept bitmap by one scan.
#pragma once

#include <cub/block/block_scan.cuh>

#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

namespace macer {
namespace cta {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kSelectBits = 11;  // select digits: 2048 bins, 8 KB per histogram
constexpr int kSelectBins = 1 << kSelectBits;
constexpr int kSortBits = 8;  // sort digits: 256 bins x 32 warps of 16-bit counters, 16 KB
constexpr int kSortBins = 1 << kSortBits;
constexpr int kSmall = 64;        // candidates ranked pairwise once a bin holds at most this many
constexpr int kMaxTable = 2048;   // float64 bonus table entries
constexpr int kMaxCluster = 8;    // the portable cluster size
constexpr int kCompositeBits = 96;
constexpr unsigned kCodeKept = 8;  // a label >= 0 that no modality selects (codes 0..7 are modality slots)
constexpr unsigned kCodePad = 9;   // a label < 0: padding
constexpr unsigned kChunkOverflow = 255;
// Launch plan (csrc/select_cta.cu), where clusters exist: top-K rows above kSingleTopKMax tokens take a cluster of
// about kClusterTopKTokens tokens per CTA, coverage rows above kSingleCoverageMax one of about kClusterCoverageTokens
// (estimates of where a CTA's serial work outweighs a few cluster barriers; the GPU run tunes them). A cluster's
// coverage items hold the token in 24 bits and its rank in a 16-bit slot, hence kMaxClusterCoverageN.
constexpr int64_t kSingleTopKMax = 8192;
constexpr int64_t kClusterTopKTokens = 8192;
constexpr int64_t kSingleCoverageMax = 4096;
constexpr int64_t kClusterCoverageTokens = 2560;
constexpr int64_t kMaxClusterCoverageN = 65536;
static_assert(kMaxStageModalities <= 8, "codes 0..7 are modality slots");

// Where the per-token arrays live in dynamic shared memory (byte offsets; -1: absent), for `cap` tokens per CTA.
enum LayoutKind : int { kLayoutTopK = 0, kLayoutCoverageSingle = 1, kLayoutCoverageCluster = 2 };
struct Layout {
  int64_t key, kept, mark, code, chunk, buf_a, buf_b, rank, table, bytes;
};
__host__ __device__ inline int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }
__host__ __device__ inline Layout make_layout(int64_t cap, int kind, bool wide, int64_t table) {
  Layout l{-1, -1, -1, -1, -1, -1, -1, -1, -1, 0};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t offset = at;
    at = align16(at + bytes);
    return offset;
  };
  const int64_t words = (cap + 31) / 32;
  l.key = take(cap * (wide ? 8 : 4));
  l.kept = take(words * 4);  // picked tokens and tokens kept as they are
  l.mark = take(words * 4);  // the select's candidates
  l.code = take(cap);
  if (kind != kLayoutTopK) {
    l.chunk = take(cap);
    const int64_t item = kind == kLayoutCoverageSingle ? 2 : 8;  // a token number / a self-contained item
    l.buf_a = take(cap * item);
    l.buf_b = take(cap * item);
    if (kind == kLayoutCoverageCluster) l.rank = take(cap * 2);  // one CTA keeps ranks in the spare sort buffer
    l.table = take(table * 8);
  }
  l.bytes = at;
  return l;
}

struct SelectKernelArgs {
  SelectCtaParams p;
  Layout layout;
  int64_t cap;    // tokens per CTA
  int cluster;    // CTAs per row
  int table;      // bonus table entries
  int coverage;   // some modality uses coverage
};

using BlockScan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;

struct Shared {
  union {
    uint16_t run[kWarps][kSortBins];   // sort: per-warp digit counts, then running places
    uint32_t hist[2][kSelectBins];     // select: the histograms of two consecutive passes
  } u;
  uint32_t total[kSortBins];  // sort: this CTA's items per digit (read by the cluster)
  uint32_t base[kSortBins];   // sort: where this CTA's items of each digit start
  uint64_t small_hi[kSmall];  // the small candidate list (read by the cluster): X and token
  uint32_t small_lo[kSmall];
  uint32_t small_token[kSmall];
  // This CTA's facts, read by the cluster.
  int count[kMaxStageModalities];
  unsigned key_or[kMaxStageModalities], key_and[kMaxStageModalities];
  int overflow, nonfinite, small_count, tied, kept_total;
  // The row's facts (the cluster's sums), and block-wide results.
  int row_count[kMaxStageModalities];
  unsigned row_or[kMaxStageModalities], row_and[kMaxStageModalities];
  int row_keep[kMaxStageModalities];
  int row_overflow, row_nonfinite;
  int bin, below, cnt;
  typename BlockScan::TempStorage scan;
};

// The CTAs of one row: a cluster on sm_90 (kCluster), else one CTA. sync() is a barrier of every thread of the row
// with release/acquire ordering of shared memory; at(p, r) is p's address in CTA r's shared memory.
template <bool kCluster>
struct Group {
  int rank, size;
  __device__ void sync() const {
    if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      cooperative_groups::this_cluster().sync();
#endif
    } else {
      __syncthreads();
    }
  }
  template <class T>
  __device__ T* at(T* p, int r) const {
    if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      return cooperative_groups::this_cluster().map_shared_rank(p, r);
#endif
    }
    return p;
  }
};

struct Composite {  // a 96-bit selection key: hi * 2^32 + lo, ascending = better
  uint64_t hi;
  uint32_t lo;
};
__device__ __forceinline__ bool composite_less(Composite x, Composite y) {
  return x.hi < y.hi || (x.hi == y.hi && x.lo < y.lo);
}
// Bits [low, low + width) of the composite, width <= 11.
__device__ __forceinline__ unsigned digit_of(Composite x, int low, int width) {
  const uint64_t v = low >= 32 ? x.hi >> (low - 32) : (x.hi << (32 - low)) | (x.lo >> low);
  return static_cast<unsigned>(v) & ((1u << width) - 1u);
}
// Select pass p over the top `bits` bits of the composite: bits [low, top), 11 of them but the last.
__device__ __forceinline__ int pass_low(int p, int bits) {
  return max(kCompositeBits - bits, kCompositeBits - kSelectBits * (p + 1));
}
__device__ __forceinline__ int pass_width(int p, int bits) { return kCompositeBits - kSelectBits * p - pass_low(p, bits); }

__device__ __forceinline__ unsigned lane_id() { return threadIdx.x & 31u; }
__device__ __forceinline__ unsigned warp_id() { return threadIdx.x >> 5; }

// The float score of a 32-bit descending key (the inverse of descending_key32: -0.0 comes back as +0.0, every NaN as
// a NaN), exactly, as float64.
__device__ __forceinline__ double score_of_key(uint32_t key) {
  const uint32_t asc = ~key;
  const uint32_t bits = (asc >> 31) ? (asc & 0x7FFFFFFFu) : ~asc;
  return static_cast<double>(__uint_as_float(bits));
}
// The coverage bonus sqrt(lambda_c / (1 + t)) with the reference's float64 operations (IEEE division and square
// root, no contraction). Out of line: its division and square root are long sequences, and the hot loops take the
// table's value instead (t < table entries).
__device__ __noinline__ double bonus(double weight, unsigned t) {
  return __dsqrt_rn(__ddiv_rn(weight, __dadd_rn(1.0, static_cast<double>(t))));
}

template <typename KeyT>
__device__ __forceinline__ bool finite_key(KeyT key) {
  if constexpr (sizeof(KeyT) == 4) {
    return key != kNanKey32 && key != 0x007FFFFFu && key != 0xFF800000u;  // NaN, +inf, -inf
  } else {
    return key != kNanKey64 && key != 0x000FFFFFFFFFFFFFull && key != 0xFFF0000000000000ull;
  }
}

// Dynamic shared memory, addressed through the layout's offsets (kept in the kernel's parameters): 32-bit shared
// addresses instead of a 64-bit generic pointer per array held in registers.
extern __shared__ __align__(16) unsigned char select_smem[];

// The per-row state of one CTA.
template <typename KeyT, bool kCluster>
struct Ctx {
  const SelectKernelArgs* a;
  Shared* sh;
  Group<kCluster> g;
  int64_t row;  // the sample
  int first;    // the global index of local token 0
  int len;      // local tokens
  int rank_at;  // coverage: where each member's rank in its chunk lives (uint16 by local token), a byte offset
  __device__ KeyT* key() const { return reinterpret_cast<KeyT*>(select_smem + a->layout.key); }
  __device__ unsigned* kept() const { return reinterpret_cast<unsigned*>(select_smem + a->layout.kept); }
  __device__ unsigned* mark() const { return reinterpret_cast<unsigned*>(select_smem + a->layout.mark); }
  __device__ uint8_t* code() const { return select_smem + a->layout.code; }
  __device__ uint8_t* chunk() const { return select_smem + a->layout.chunk; }
  __device__ unsigned char* buf_a() const { return select_smem + a->layout.buf_a; }
  __device__ unsigned char* buf_b() const { return select_smem + a->layout.buf_b; }
  __device__ uint16_t* rank() const { return reinterpret_cast<uint16_t*>(select_smem + rank_at); }
  __device__ double* table() const { return reinterpret_cast<double*>(select_smem + a->layout.table); }
};

// Candidate keys: top-K reads the key; coverage computes (key of v, score key) from the key and the member's rank.
template <typename KeyT>
struct TopKSource {
  const KeyT* key;
  static constexpr int kBits = 8 * sizeof(KeyT);
  __device__ Composite operator()(int i) const {
    if constexpr (sizeof(KeyT) == 4) {
      return {static_cast<uint64_t>(key[i]) << 32, 0u};
    } else {
      return {static_cast<uint64_t>(key[i]), 0u};
    }
  }
};
struct CoverageSource {
  const uint32_t* key;
  const uint16_t* rank;
  const double* table;
  int entries;
  double weight;
  static constexpr int kBits = kCompositeBits;
  __device__ Composite operator()(int i) const {
    const uint32_t k = key[i];
    const unsigned t = rank[i];
    const double b = static_cast<int>(t) < entries ? table[t] : bonus(weight, t);
    return {descending_key64(__dadd_rn(score_of_key(k), b)), k};
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Prologue: one loop per input dtype (the switch is outside the loops).

template <typename KeyT, typename S>
__device__ void load_keys(const S* scores, int64_t stride, int64_t first, int len, KeyT* key) {
  for (int i = threadIdx.x; i < len; i += kThreads) {
    const S x = scores[(first + i) * stride];
    if constexpr (sizeof(KeyT) == 8) {
      key[i] = descending_key64(static_cast<double>(x));
    } else {
      key[i] = descending_key32(to_float(x));
    }
  }
}

__device__ __forceinline__ unsigned code_of(int64_t label, const SelectCtaParams& p) {
  for (int m = 0; m < p.num_modalities; ++m)
    if (label == p.modalities[m].label) return static_cast<unsigned>(m);
  return label < 0 ? kCodePad : kCodeKept;
}

template <typename L>
__device__ void load_codes(const L* labels, int64_t stride, int64_t first, int len, const SelectCtaParams& p,
                           uint8_t* code) {
  for (int i = threadIdx.x; i < len; i += kThreads)
    code[i] = static_cast<uint8_t>(code_of(static_cast<int64_t>(labels[(first + i) * stride]), p));
}

template <typename C>
__device__ void load_chunks(const C* chunks, int64_t stride, int64_t first, int len, const uint8_t* code,
                            unsigned coverage_slots, uint8_t* chunk) {
  for (int i = threadIdx.x; i < len; i += kThreads) {
    if (!((coverage_slots >> code[i]) & 1u)) continue;  // (codes 8 and 9 are never coverage slots)
    const int64_t c = static_cast<int64_t>(chunks[(first + i) * stride]);
    chunk[i] = static_cast<uint8_t>(c >= 0 && c < static_cast<int64_t>(kChunkOverflow) ? c : kChunkOverflow);
  }
}

template <typename KeyT, bool kCluster>
__device__ void prologue(Ctx<KeyT, kCluster>& c) {
  const SelectCtaParams& p = c.a->p;
  Shared& sh = *c.sh;
  const int64_t s0 = c.row * p.scores_stride[0];
  if constexpr (sizeof(KeyT) == 8) {
    load_keys(static_cast<const double*>(p.scores) + s0, p.scores_stride[1], c.first, c.len, c.key());
  } else {
    switch (p.scores_dtype) {
      case kFloat16:
        load_keys(static_cast<const __half*>(p.scores) + s0, p.scores_stride[1], c.first, c.len, c.key());
        break;
      case kBFloat16:
        load_keys(static_cast<const __nv_bfloat16*>(p.scores) + s0, p.scores_stride[1], c.first, c.len, c.key());
        break;
      default:
        load_keys(static_cast<const float*>(p.scores) + s0, p.scores_stride[1], c.first, c.len, c.key());
    }
  }
  if (p.labels == nullptr) {
    for (int i = threadIdx.x; i < c.len; i += kThreads) c.code()[i] = 0;
  } else {
    const int64_t l0 = c.row * p.labels_stride[0], l1 = p.labels_stride[1];
    switch (p.labels_dtype) {
      case kInt8: load_codes(static_cast<const int8_t*>(p.labels) + l0, l1, c.first, c.len, p, c.code()); break;
      case kUInt8: load_codes(static_cast<const uint8_t*>(p.labels) + l0, l1, c.first, c.len, p, c.code()); break;
      case kInt16: load_codes(static_cast<const int16_t*>(p.labels) + l0, l1, c.first, c.len, p, c.code()); break;
      case kInt32: load_codes(static_cast<const int32_t*>(p.labels) + l0, l1, c.first, c.len, p, c.code()); break;
      default: load_codes(static_cast<const int64_t*>(p.labels) + l0, l1, c.first, c.len, p, c.code());
    }
  }
  unsigned coverage_slots = 0;
  for (int m = 0; m < p.num_modalities; ++m) coverage_slots |= (p.modalities[m].coverage ? 1u : 0u) << m;
  if constexpr (sizeof(KeyT) == 4) {
    if (coverage_slots != 0) {
      const int64_t c0 = c.row * p.chunk_stride[0], c1 = p.chunk_stride[1];
      switch (p.chunk_dtype) {
        case kInt8:
          load_chunks(static_cast<const int8_t*>(p.chunk_ids) + c0, c1, c.first, c.len, c.code(), coverage_slots,
                      c.chunk());
          break;
        case kUInt8:
          load_chunks(static_cast<const uint8_t*>(p.chunk_ids) + c0, c1, c.first, c.len, c.code(), coverage_slots,
                      c.chunk());
          break;
        case kInt16:
          load_chunks(static_cast<const int16_t*>(p.chunk_ids) + c0, c1, c.first, c.len, c.code(), coverage_slots,
                      c.chunk());
          break;
        case kInt32:
          load_chunks(static_cast<const int32_t*>(p.chunk_ids) + c0, c1, c.first, c.len, c.code(), coverage_slots,
                      c.chunk());
          break;
        default:
          load_chunks(static_cast<const int64_t*>(p.chunk_ids) + c0, c1, c.first, c.len, c.code(), coverage_slots,
                      c.chunk());
      }
    }
  }
  // Every global read is done: the next kernel of a PDL chain may start its prologue (it still waits for this grid
  // to complete before reading the output).
  launch_dependents();
  if (threadIdx.x < kMaxStageModalities) {
    sh.count[threadIdx.x] = 0;
    sh.key_or[threadIdx.x] = 0;
    sh.key_and[threadIdx.x] = ~0u;
  }
  if (threadIdx.x == 0) sh.overflow = 0;
  __syncthreads();
  // Per-slot member counts, the kept-as-is bitmap, the non-finite flag, and per coverage slot the OR / AND of the
  // members' keys (a sort digit that is equal over every member is skipped) and whether a chunk id overflows.
  // Tokens base + 32 w + lane: warp w owns word base / 32 + w of the bitmaps in each iteration.
  const unsigned lane = lane_id(), warp = warp_id();
  bool bad = false;
  for (int base = 0; base < c.len; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const bool live = i < c.len;
    const unsigned code = live ? c.code()[i] : kCodePad;
    const unsigned peers = __match_any_sync(~0u, code);
    if (code < static_cast<unsigned>(p.num_modalities) && lane == static_cast<unsigned>(__ffs(peers) - 1))
      atomicAdd(&sh.count[code], __popc(peers));
    const unsigned kept = __ballot_sync(~0u, code == kCodeKept);
    if (lane == 0 && base + 32 * static_cast<int>(warp) < c.len) c.kept()[(base >> 5) + warp] = kept;
    if (live && code < static_cast<unsigned>(p.num_modalities)) bad |= !finite_key(c.key()[i]);
    if constexpr (sizeof(KeyT) == 4) {
      if (coverage_slots != 0) {
        const bool member = (coverage_slots >> code) & 1u;  // code 9 (not live) is never a slot
        const unsigned k = member ? c.key()[i] : 0u;
        const unsigned ored = __reduce_or_sync(peers, k), anded = __reduce_and_sync(peers, k);
        if (member && lane == static_cast<unsigned>(__ffs(peers) - 1)) {
          atomicOr(&sh.key_or[code], ored);
          atomicAnd(&sh.key_and[code], anded);
        }
        if (member && c.chunk()[i] == kChunkOverflow) atomicOr(&sh.overflow, 1 << code);
      }
    }
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) sh.nonfinite = bad;
}

// The row's facts: every CTA's counts, flags and key bits summed over the cluster (each CTA the same numbers).
template <typename KeyT, bool kCluster>
__device__ void exchange_facts(Ctx<KeyT, kCluster>& c) {
  Shared& sh = *c.sh;
  c.g.sync();
  const int t = threadIdx.x;
  if (t < kMaxStageModalities) {
    int count = 0;
    unsigned ored = 0, anded = ~0u;
    for (int r = 0; r < c.g.size; ++r) {
      const Shared* o = c.g.at(&sh, r);
      count += o->count[t];
      ored |= o->key_or[t];
      anded &= o->key_and[t];
    }
    sh.row_count[t] = count;
    sh.row_or[t] = ored;
    sh.row_and[t] = anded;
  } else if (t == kMaxStageModalities) {
    int overflow = 0, nonfinite = 0;
    for (int r = 0; r < c.g.size; ++r) {
      const Shared* o = c.g.at(&sh, r);
      overflow |= o->overflow;
      nonfinite |= o->nonfinite;
    }
    sh.row_overflow = overflow;
    sh.row_nonfinite = nonfinite;
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------------------
// Radix select.

enum PassKind : int { kNext = 0, kAll = 1, kSmallSet = 2, kTie = 3 };

// The bin of the histogram `par` (summed over the cluster) that holds the need-th smallest candidate: sh.bin, the
// candidates in lower bins (sh.below) and in the bin (sh.cnt). Thread t owns bins 2t and 2t + 1.
template <typename KeyT, bool kCluster>
__device__ void find_bin(Ctx<KeyT, kCluster>& c, int par, int need) {
  Shared& sh = *c.sh;
  const int t = threadIdx.x;
  unsigned h0 = 0, h1 = 0;
  for (int r = 0; r < c.g.size; ++r) {
    const uint32_t* h = c.g.at(&sh, r)->u.hist[par];
    h0 += h[2 * t];
    h1 += h[2 * t + 1];
  }
  int excl;
  BlockScan(sh.scan).ExclusiveSum(static_cast<int>(h0 + h1), excl);
  if (excl < need && need <= excl + static_cast<int>(h0 + h1)) {
    const bool first_bin = need <= excl + static_cast<int>(h0);
    sh.bin = first_bin ? 2 * t : 2 * t + 1;
    sh.below = first_bin ? excl : excl + static_cast<int>(h0);
    sh.cnt = static_cast<int>(first_bin ? h0 : h1);
  }
  __syncthreads();
}

// The tie group (the mark bitmap: candidates with one X) in index order across the cluster: the first `need` are
// taken. Thread t owns a run of words, so the scan is in index order.
template <typename KeyT, bool kCluster>
__device__ void take_ties(Ctx<KeyT, kCluster>& c, int need) {
  Shared& sh = *c.sh;
  const int words = (c.len + 31) >> 5;
  const int per = (words + kThreads - 1) / kThreads;
  const int w0 = min(words, static_cast<int>(threadIdx.x) * per), w1 = min(words, w0 + per);
  int local = 0;
  for (int w = w0; w < w1; ++w) local += __popc(c.mark()[w]);
  int before, total;
  BlockScan(sh.scan).ExclusiveSum(local, before, total);
  if (threadIdx.x == 0) sh.tied = total;
  c.g.sync();
  for (int r = 0; r < c.g.rank; ++r) before += c.g.at(&sh, r)->tied;
  for (int w = w0; w < w1 && before < need; ++w) {
    unsigned bits = c.mark()[w], take = 0;
    while (bits != 0 && before < need) {
      const unsigned bit = bits & (~bits + 1u);
      take |= bit;
      bits ^= bit;
      ++before;
    }
    c.kept()[w] |= take;
  }
}

// The candidates of a small bin, ranked against each other by (X, token) over the cluster: rank < need is taken.
template <typename KeyT, bool kCluster, class Source>
__device__ void take_small(Ctx<KeyT, kCluster>& c, const Source& source, int need) {
  Shared& sh = *c.sh;
  const int words = (c.len + 31) >> 5;
  for (int w = threadIdx.x; w < words; w += kThreads) {
    unsigned bits = c.mark()[w];
    while (bits != 0) {
      const int j = __ffs(bits) - 1;
      bits &= bits - 1u;
      const int i = (w << 5) + j;
      const Composite x = source(i);
      const int slot = atomicAdd(&sh.small_count, 1);  // at most kSmall over the cluster (the bin's count)
      sh.small_hi[slot] = x.hi;
      sh.small_lo[slot] = x.lo;
      sh.small_token[slot] = static_cast<uint32_t>(c.first + i);
    }
  }
  c.g.sync();
  const int mine = sh.small_count;
  if (static_cast<int>(threadIdx.x) < mine) {
    const Composite x{sh.small_hi[threadIdx.x], sh.small_lo[threadIdx.x]};
    const uint32_t token = sh.small_token[threadIdx.x];
    int rank = 0;
    for (int r = 0; r < c.g.size; ++r) {
      const Shared* o = c.g.at(&sh, r);
      const int count = o->small_count;
      for (int f = 0; f < count; ++f) {
        const Composite y{o->small_hi[f], o->small_lo[f]};
        rank += composite_less(y, x) || (y.hi == x.hi && y.lo == x.lo && o->small_token[f] < token);
      }
    }
    if (rank < need) {
      const int i = static_cast<int>(token - c.first);
      atomicOr(&c.kept()[i >> 5], 1u << (i & 31));
    }
  }
}

// The `need` smallest X among the members of `slot` (0 < need < members) into the kept bitmap. Ends with the
// cluster synchronised (its shared structures are free again).
template <typename KeyT, bool kCluster, class Source>
__device__ void select_best(Ctx<KeyT, kCluster>& c, unsigned slot, int need, const Source& source) {
  Shared& sh = *c.sh;
  constexpr int kBits = Source::kBits;
  constexpr int kLast = (kBits + kSelectBits - 1) / kSelectBits - 1;
  const unsigned lane = lane_id(), warp = warp_id();
  for (int j = threadIdx.x; j < kSelectBins; j += kThreads) sh.u.hist[0][j] = 0;
  __syncthreads();
  // Pass 0's histogram over the members. Few distinct top digits (scores share exponents): the lanes with one digit
  // add once (__match_any_sync).
  {
    const int low = pass_low(0, kBits), width = pass_width(0, kBits);
    for (int base = 0; base < c.len; base += kThreads) {
      const int i = base + static_cast<int>(threadIdx.x);
      const bool member = i < c.len && c.code()[i] == slot;
      const unsigned d = member ? digit_of(source(i), low, width) : kSelectBins;
      const unsigned peers = __match_any_sync(~0u, d);
      if (member && lane == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(&sh.u.hist[0][d], __popc(peers));
    }
  }
  int par = 0;
  for (int p = 0;; ++p) {
    c.g.sync();  // the pass's histograms are complete in every CTA
    find_bin(c, par, need);
    const unsigned b = static_cast<unsigned>(sh.bin);
    const int cnt = sh.cnt;
    need -= sh.below;
    const int kind = cnt == need ? kAll : p == kLast ? kTie : cnt <= kSmall ? kSmallSet : kNext;
    if (kind == kNext)
      for (int j = threadIdx.x; j < kSelectBins; j += kThreads) sh.u.hist[par ^ 1][j] = 0;
    if (kind == kSmallSet && threadIdx.x == 0) sh.small_count = 0;
    __syncthreads();
    const int low = pass_low(p, kBits), width = pass_width(p, kBits);
    const int next_low = pass_low(p + 1, kBits), next_width = pass_width(p + 1, kBits);
    // Filter the candidates (pass 0: the members; later: the mark bitmap) token by token, 32 consecutive tokens per
    // warp: lower bins are taken, the bin's candidates stay marked. Warp w owns word base / 32 + w of both bitmaps in
    // an iteration (no atomics), and the work is spread over every thread whatever the candidates' density.
    for (int base = 0; base < c.len; base += kThreads) {
      const int i = base + static_cast<int>(threadIdx.x);
      const int word = (base >> 5) + static_cast<int>(warp);
      const bool live = base + 32 * static_cast<int>(warp) < c.len;  // the warp's word exists
      bool candidate = false;
      if (i < c.len) candidate = p == 0 ? c.code()[i] == slot : ((c.mark()[word] >> lane) & 1u) != 0;
      Composite x{0, 0};
      unsigned d = kSelectBins;
      if (candidate) {
        x = source(i);
        d = digit_of(x, low, width);
      }
      const bool take = candidate && (d < b || (kind == kAll && d == b));
      const bool keep = candidate && kind != kAll && d == b;
      if (keep && kind == kNext) atomicAdd(&sh.u.hist[par ^ 1][digit_of(x, next_low, next_width)], 1u);
      const unsigned take_bits = __ballot_sync(~0u, take), keep_bits = __ballot_sync(~0u, keep);
      if (lane == 0 && live) {
        if (take_bits != 0) c.kept()[word] |= take_bits;
        c.mark()[word] = keep_bits;
      }
    }
    if (kind == kNext) {
      par ^= 1;
      continue;
    }
    __syncthreads();
    if (kind == kSmallSet) take_small(c, source, need);
    if (kind == kTie) take_ties(c, need);
    break;
  }
  c.g.sync();
}

// Every member of `slot` is kept (its budget is its count).
template <typename KeyT, bool kCluster>
__device__ void take_all(Ctx<KeyT, kCluster>& c, unsigned slot) {
  const unsigned lane = lane_id(), warp = warp_id();
  for (int base = 0; base < c.len; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const unsigned bits = __ballot_sync(~0u, i < c.len && c.code()[i] == slot);
    if (lane == 0 && base + 32 * static_cast<int>(warp) < c.len) c.kept()[(base >> 5) + warp] |= bits;
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------------------
// Coverage: each member's rank in its chunk.

// One stable counting pass over the row's items (this CTA's `len` of them, after the cluster's lower CTAs' items):
// warp w owns items [w * seg, (w + 1) * seg), counted per digit in rounds of 32 lanes; the exclusive scan over
// (digit, CTA, warp) gives each item its place. emit(item, place) gets the place in the sorted order, or with
// `rank_only` the number of earlier items with the same digit.
template <typename KeyT, bool kCluster, typename Item, class Digit, class Emit>
__device__ void counting_pass(Ctx<KeyT, kCluster>& c, const Item* src, int len, bool rank_only, Digit digit,
                              Emit emit) {
  Shared& sh = *c.sh;
  const unsigned lane = lane_id(), warp = warp_id();
  const int seg = (len + kWarps - 1) / kWarps;
  const int rounds = (seg + 31) / 32;
  const int lo = static_cast<int>(warp) * seg, hi = min(len, lo + seg);
  const unsigned lower_lanes = (1u << lane) - 1u;
  for (int j = threadIdx.x; j < kWarps * kSortBins / 2; j += kThreads) reinterpret_cast<uint32_t*>(sh.u.run)[j] = 0;
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    const int pos = lo + 32 * r + static_cast<int>(lane);
    const bool valid = pos < hi;
    const unsigned d = valid ? digit(src[pos]) : kSortBins;
    const unsigned peers = __match_any_sync(~0u, d);
    if (valid && lane == static_cast<unsigned>(__ffs(peers) - 1)) sh.u.run[warp][d] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  {  // per digit d (4 threads, 8 warps each): the exclusive prefix over warps, and this CTA's total
    const int d = threadIdx.x >> 2, q = threadIdx.x & 3;
    unsigned v[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += (v[j] = sh.u.run[8 * q + j][d]);
    unsigned incl = sum;
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      const unsigned y = __shfl_up_sync(~0u, incl, off, 4);
      if (q >= off) incl += y;
    }
    unsigned place = incl - sum;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sh.u.run[8 * q + j][d] = static_cast<uint16_t>(place);
      place += v[j];
    }
    if (q == 3) sh.total[d] = incl;
  }
  c.g.sync();  // every CTA's totals
  unsigned all = 0, prior = 0;
  if (threadIdx.x < kSortBins) {
    for (int r = 0; r < c.g.size; ++r) {
      const unsigned t = c.g.at(&sh, r)->total[threadIdx.x];
      all += t;
      if (r < c.g.rank) prior += t;
    }
  }
  int digits_before;
  BlockScan(sh.scan).ExclusiveSum(threadIdx.x < kSortBins ? static_cast<int>(all) : 0, digits_before);
  if (threadIdx.x < kSortBins) sh.base[threadIdx.x] = (rank_only ? 0u : static_cast<unsigned>(digits_before)) + prior;
  __syncthreads();
  for (int r = 0; r < rounds; ++r) {
    const int pos = lo + 32 * r + static_cast<int>(lane);
    const bool valid = pos < hi;
    const Item item = valid ? src[pos] : Item{};
    const unsigned d = valid ? digit(item) : kSortBins;
    const unsigned peers = __match_any_sync(~0u, d);
    unsigned before = 0;
    if (valid) before = sh.u.run[warp][d];
    __syncwarp();
    if (valid && lane == static_cast<unsigned>(__ffs(peers) - 1))
      sh.u.run[warp][d] = static_cast<uint16_t>(before + __popc(peers));
    __syncwarp();
    if (valid) emit(item, sh.base[d] + before + __popc(peers & lower_lanes));
  }
}

// The members of `slot` in index order: thread t's run of tokens, after the members of the runs before it.
template <typename KeyT, bool kCluster, typename Item, class Make>
__device__ int compact_members(Ctx<KeyT, kCluster>& c, unsigned slot, Item* out, Make make) {
  const int per = (c.len + kThreads - 1) / kThreads;
  const int lo = min(c.len, static_cast<int>(threadIdx.x) * per), hi = min(c.len, lo + per);
  int local = 0;
  for (int i = lo; i < hi; ++i) local += c.code()[i] == slot;
  int before, total;
  BlockScan(c.sh->scan).ExclusiveSum(local, before, total);
  for (int i = lo; i < hi; ++i)
    if (c.code()[i] == slot) out[before++] = make(i);
  __syncthreads();
  return total;
}

// Ranks by a direct count over the row in global memory, for chunk ids outside [0, 254] (never produced by
// temporal_chunks with fewer than 255 chunks): O(members x n / threads), correct and slow, out of the hot code. Its
// arguments are values (a reference to the kernel's parameters would copy them to local memory).
struct DirectArgs {
  const void *scores, *labels, *chunks;
  int scores_dtype, labels_dtype, chunk_dtype;
  int64_t s0, s1, l0, l1, c0, c1, n, label;
};
__device__ __noinline__ void ranks_direct(const DirectArgs d, int64_t first, int len, const uint8_t* code,
                                          unsigned slot, uint16_t* rank) {
  auto chunk = [&](int64_t j) { return load_int(d.chunks, d.chunk_dtype, d.c0 + j * d.c1); };
  auto key = [&](int64_t j) {
    return descending_key32(static_cast<float>(load_double(d.scores, d.scores_dtype, d.s0 + j * d.s1)));
  };
  auto member = [&](int64_t j) {
    return d.labels == nullptr || load_int(d.labels, d.labels_dtype, d.l0 + j * d.l1) == d.label;
  };
  for (int i = threadIdx.x; i < len; i += kThreads) {
    if (code[i] != slot) continue;
    const int64_t gi = first + i;
    const int64_t ci = chunk(gi);
    const uint32_t ki = key(gi);
    unsigned t = 0;
    for (int64_t j = 0; j < d.n; ++j) {
      if (j == gi || !member(j) || chunk(j) != ci) continue;
      const uint32_t kj = key(j);
      t += kj < ki || (kj == ki && j < gi);
    }
    rank[i] = static_cast<uint16_t>(t);
  }
}

template <typename KeyT, bool kCluster>
__device__ void ranks_by_count(Ctx<KeyT, kCluster>& c, unsigned slot, uint16_t* rank) {
  const SelectCtaParams& p = c.a->p;
  const DirectArgs d{p.scores, p.labels, p.chunk_ids, p.scores_dtype, p.labels_dtype, p.chunk_dtype,
                     c.row * p.scores_stride[0], p.scores_stride[1], c.row * p.labels_stride[0],
                     p.labels_stride[1], c.row * p.chunk_stride[0], p.chunk_stride[1], p.n,
                     p.modalities[slot].label};
  ranks_direct(d, c.first, c.len, c.code(), slot, rank);
}

// One CTA: sort 16-bit token numbers (buffers A and B), then the rank pass writes each member's rank by token into
// the buffer the last pass did not fill.
template <bool kCluster>
__device__ void ranks_single(Ctx<uint32_t, kCluster>& c, unsigned slot) {
  Shared& sh = *c.sh;
  uint16_t* src = reinterpret_cast<uint16_t*>(c.buf_a());
  uint16_t* dst = reinterpret_cast<uint16_t*>(c.buf_b());
  if ((sh.row_overflow >> slot) & 1) {
    ranks_by_count(c, slot, dst);
    __syncthreads();
    c.rank_at = static_cast<int>(reinterpret_cast<unsigned char*>(dst) - select_smem);
    return;
  }
  const int m = compact_members(c, slot, src, [](int i) { return static_cast<uint16_t>(i); });
  const unsigned varies = sh.row_or[slot] ^ sh.row_and[slot];
  const uint32_t* key = c.key();
  for (int p = 0; p < 4; ++p) {
    if (((varies >> (8 * p)) & 255u) == 0) continue;  // every member has this digit: the pass would move nothing
    const int shift = 8 * p;
    uint16_t* out = dst;
    counting_pass(c, src, m, false, [&](uint16_t t) { return (key[t] >> shift) & 255u; },
                  [&](uint16_t t, unsigned place) { out[place] = t; });
    __syncthreads();
    uint16_t* swap = src;
    src = dst;
    dst = swap;
  }
  const uint8_t* chunk = c.chunk();
  uint16_t* rank = dst;
  counting_pass(c, src, m, true, [&](uint16_t t) { return static_cast<unsigned>(chunk[t]); },
                [&](uint16_t t, unsigned r) { rank[t] = static_cast<uint16_t>(r); });
  __syncthreads();
  c.rank_at = static_cast<int>(reinterpret_cast<unsigned char*>(rank) - select_smem);
}

// A cluster: sort 8-byte items key << 32 | chunk << 24 | token (every item self-contained, so no lookups across
// CTAs); position q of the sorted order lives in CTA q / P at q % P (P = ceil(members / C)). The rank pass sends
// each rank to its token's CTA.
template <bool kCluster>
__device__ void ranks_cluster(Ctx<uint32_t, kCluster>& c, unsigned slot) {
  Shared& sh = *c.sh;
  if ((sh.row_overflow >> slot) & 1) {
    ranks_by_count(c, slot, c.rank());
    c.g.sync();
    return;
  }
  uint64_t* src = reinterpret_cast<uint64_t*>(c.buf_a());
  uint64_t* dst = reinterpret_cast<uint64_t*>(c.buf_b());
  const uint32_t* key = c.key();
  const uint8_t* chunk = c.chunk();
  const int64_t first = c.first;
  int len = compact_members(c, slot, src, [&](int i) {
    return static_cast<uint64_t>(key[i]) << 32 | static_cast<uint64_t>(chunk[i]) << 24 |
           static_cast<uint64_t>(first + i);
  });
  const int m = sh.row_count[slot];
  const int per = (m + c.g.size - 1) / c.g.size;
  const unsigned varies = sh.row_or[slot] ^ sh.row_and[slot];
  for (int p = 0; p < 4; ++p) {
    if (((varies >> (8 * p)) & 255u) == 0) continue;
    const int shift = 32 + 8 * p;
    uint64_t* out = dst;
    const Group<kCluster> g = c.g;
    counting_pass(c, src, len, false, [&](uint64_t x) { return static_cast<unsigned>(x >> shift) & 255u; },
                  [&](uint64_t x, unsigned place) {
                    const int owner = static_cast<int>(place) / per;
                    g.at(out, owner)[static_cast<int>(place) - owner * per] = x;
                  });
    c.g.sync();
    uint64_t* swap = src;
    src = dst;
    dst = swap;
    len = max(0, min(per, m - c.g.rank * per));
  }
  uint16_t* rank = c.rank();
  const int64_t cap = c.a->cap;
  const Group<kCluster> g = c.g;
  counting_pass(c, src, len, true, [](uint64_t x) { return static_cast<unsigned>(x >> 24) & 255u; },
                [&](uint64_t x, unsigned r) {
                  const int64_t token = static_cast<int64_t>(x & 0xFFFFFFu);
                  const int owner = static_cast<int>(token / cap);
                  g.at(rank, owner)[token - owner * cap] = static_cast<uint16_t>(r);
                });
  c.g.sync();
}

// ---------------------------------------------------------------------------------------------------------------
// The row.

template <typename KeyT, bool kCluster>
__device__ void write_row(Ctx<KeyT, kCluster>& c, bool valid) {
  Shared& sh = *c.sh;
  const SelectCtaParams& p = c.a->p;
  const int words = (c.len + 31) >> 5;
  const int per = (words + kThreads - 1) / kThreads;
  const int w0 = min(words, static_cast<int>(threadIdx.x) * per), w1 = min(words, w0 + per);
  int local = 0;
  if (valid)
    for (int w = w0; w < w1; ++w) local += __popc(c.kept()[w]);
  int place, total;
  BlockScan(sh.scan).ExclusiveSum(local, place, total);
  if (threadIdx.x == 0) sh.kept_total = total;
  c.g.sync();
  int64_t before = 0, all = 0;
  for (int r = 0; r < c.g.size; ++r) {
    const int kept = c.g.at(&sh, r)->kept_total;
    all += kept;
    if (r < c.g.rank) before += kept;
  }
  int64_t* out = p.out + c.row * p.out_stride;
  const bool ok = valid && all <= p.out_len;  // the same in every CTA of the row
  const int64_t start = ok ? p.out_len - all : p.out_len;
  for (int64_t j = static_cast<int64_t>(c.g.rank) * kThreads + threadIdx.x; j < start;
       j += static_cast<int64_t>(c.g.size) * kThreads)
    out[j] = -1;
  if (!ok) return;
  int64_t at = start + before + place;
  for (int w = w0; w < w1; ++w) {
    unsigned bits = c.kept()[w];
    while (bits != 0) {
      const int j = __ffs(bits) - 1;
      bits &= bits - 1u;
      out[at++] = c.first + (w << 5) + j;
    }
  }
}

template <typename KeyT, bool kCluster>
__device__ void select_row(const SelectKernelArgs& a, Shared& sh, Group<kCluster> g,
                           int64_t row) {
  const SelectCtaParams& p = a.p;
  Ctx<KeyT, kCluster> c;
  c.a = &a;
  c.sh = &sh;
  c.g = g;
  c.row = row;
  c.first = g.rank * static_cast<int>(a.cap);
  c.len = static_cast<int>(max(int64_t{0}, min(a.cap, p.n - c.first)));
  c.rank_at = static_cast<int>(a.layout.rank);  // a cluster's ranks; one CTA's are placed by ranks_single

  grid_dependency_wait();  // a PDL chain's predecessor (the scoring kernel) wrote the scores
  prologue(c);
  exchange_facts(c);
  if (p.nonfinite != nullptr && g.rank == 0 && threadIdx.x == 0) p.nonfinite[row] = sh.row_nonfinite != 0;
  // The row's budgets; one that contradicts the host's numbers (outside [0, spec keep], or above the modality's
  // count) makes the row all -1. Kept in shared memory: every thread reads the same values (the branches below are
  // uniform), and nothing of them stays live in registers across the modalities.
  bool fits = true;
  if (static_cast<int>(threadIdx.x) < p.num_modalities) {
    const int m = threadIdx.x;
    const int64_t k = p.keeps != nullptr ? static_cast<int64_t>(p.keeps[row * p.num_modalities + m])
                                         : p.modalities[m].keep;
    fits = k >= 0 && k <= p.modalities[m].keep && k <= sh.row_count[m];
    sh.row_keep[m] = static_cast<int>(k);
  }
  const bool valid = __syncthreads_and(fits);
#pragma unroll 1
  for (int m = 0; m < p.num_modalities && valid; ++m) {
    const int k = sh.row_keep[m];
    if (k == 0) continue;
    if (k == sh.row_count[m]) {
      take_all(c, static_cast<unsigned>(m));
      continue;
    }
    if constexpr (sizeof(KeyT) == 4) {
      if (p.modalities[m].coverage) {
        if constexpr (kCluster) {
          ranks_cluster(c, static_cast<unsigned>(m));
        } else {
          ranks_single(c, static_cast<unsigned>(m));
        }
        const double weight = p.modalities[m].coverage_weight;
        for (int t = threadIdx.x; t < a.table; t += kThreads) c.table()[t] = bonus(weight, static_cast<unsigned>(t));
        __syncthreads();
        select_best(c, static_cast<unsigned>(m), k, CoverageSource{c.key(), c.rank(), c.table(), a.table, weight});
        continue;
      }
    }
    select_best(c, static_cast<unsigned>(m), k, TopKSource<KeyT>{c.key()});
  }
  write_row(c, valid);
  g.sync();  // no CTA leaves while another may still read its shared memory
}

template <typename KeyT, bool kCluster>
__global__ void __launch_bounds__(kThreads, 1) select_cta_kernel(const SelectKernelArgs a) {
  __shared__ Shared sh;
  if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const Group<true> g{static_cast<int>(cluster.block_rank()), static_cast<int>(cluster.num_blocks())};
    select_row<KeyT, true>(a, sh, g, blockIdx.x / g.size);
#else
    __trap();  // clusters need sm_90: the launcher never launches this kernel below it
#endif
  } else {
    select_row<KeyT, false>(a, sh, Group<false>{0, 1}, blockIdx.x);
  }
}

}  // namespace cta
}  // namespace macer
