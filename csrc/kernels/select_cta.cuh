// One-CTA selection: topk_indices, coverage_select and stage_select for n up to a few ten thousand tokens, one
// launch each, everything in shared memory. One thread block of kThreads threads per row (per sample of a stage).
//
// For each selected modality of a row (a standalone op is one "modality" holding every token):
//  * top-K: key_i = descending 64-bit key of the score as float64 (exact for every input dtype), ~0 for tokens of
//    other labels ("never").
//  * coverage: (1) a bitonic sort of the n 64-bit keys chunk | descending float32 score bits | index -- all
//    distinct, so the sort needs no stability and gives the chunk order (chunk asc, score desc, index asc); the
//    network's comparators all put the smaller key first, so the padding to a power of two is virtual and never
//    stored; (2) each token's rank t inside its chunk (position minus the chunk's first position, by binary
//    search) and its value v = s + sqrt(lambda_c / (1 + t)) with IEEE float64 operations, the numbers the reference
//    compares;
//    key_i = descending key of v. float32 score bits are exact for fp32/fp16/bf16 scores only: float64 scores take
//    the multi-CTA path (the launcher's caller routes them). Chunk ids that do not fit the key's chunk field
//    (>= 2^(32 - index bits), never produced by temporal_chunks) switch the row to an O(n^2 / threads) rank count.
//  * the k best keys by a radix select (8 passes of 8-bit digits, block histogram in shared memory with
//    warp-aggregated atomics): threshold T and the number `need` of tokens with key == T to take. Among those ties
//    the higher score wins (a second radix select over the score keys, coverage only, run only when the tie group is
//    split), then the lower index (a block scan in index order). Picks go into a bitmap.
// Finally every token that is picked, or whose label is >= 0 and not selected at all, is written in ascending index
// order with a block scan, right-aligned in the row's output (-1 before it). Nothing is sorted by index: the bitmap
// is already in index order. Per-row budgets come from an optional int32 [B, M] table; padding (label -1) is never
// a candidate and never kept.
#pragma once

#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace macer {
namespace cta {

constexpr int kThreads = 1024;
// Coverage: sorted positions per thread whose (token, rank) pairs are held in registers across a barrier, so
// coverage takes n <= kThreads * kMaxSortItems = 28672 (sm_90's shared memory allows 28.4k 64-bit keys). The pairs
// are packed as rank << 16 | token, and the key's index field has bit_width(n - 1) <= 15 bits.
constexpr int kMaxSortItems = 28;
static_assert(kThreads * kMaxSortItems <= 32768, "coverage packs token and rank in 16 bits and indices in 15");
constexpr uint64_t kNever = ~0ull;

__device__ __forceinline__ uint32_t descending_key32(float x) {
  if (x == 0.0f) x = 0.0f;  // -0.0 -> +0.0: the reference compares them equal
  const uint32_t bits = __float_as_uint(x);
  return ~((bits >> 31) ? ~bits : (bits | 0x80000000u));
}

__device__ __forceinline__ uint64_t descending_key64(double x) {
  if (x == 0.0) x = 0.0;
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(x));
  return ~((bits >> 63) ? ~bits : (bits | (1ull << 63)));
}

using BlockScan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;

struct Shared {
  unsigned hist[256];
  uint64_t prefix;
  int need, count, flag;
  typename BlockScan::TempStorage scan;
};

// Row view: token i of row b reads scores[b * s0 + i * s1] (elements), likewise labels and chunk ids.
struct Row {
  const void* scores;
  const void* labels;
  const void* chunks;
  int scores_dtype, labels_dtype, chunk_dtype;
  int64_t s0, s1, l0, l1, c0, c1;
  int n;
  __device__ double score(int i) const { return load_double(scores, scores_dtype, s0 + i * s1); }
  __device__ int64_t label(int i) const { return load_int(labels, labels_dtype, l0 + i * l1); }
  __device__ int64_t chunk(int i) const { return load_int(chunks, chunk_dtype, c0 + i * c1); }
  __device__ bool member(int i, int64_t want) const { return labels == nullptr || label(i) == want; }
};

// Blocked ownership for the scans: thread t owns [lo, hi), ceil(n / kThreads) tokens, in index order.
__device__ __forceinline__ void owned(int n, int& lo, int& hi) {
  const int per = (n + kThreads - 1) / kThreads;
  lo = min(n, static_cast<int>(threadIdx.x) * per);
  hi = min(n, lo + per);
}

// Radix select: with key(i) ascending = better and 1 <= k <= #{key < kNever}, finds T (sh.prefix) such that the k
// best are every token with key < T plus sh.need of the sh.count tokens with key == T. Ends synchronised.
template <class Key>
__device__ void radix_select(const Key& key, int n, int k, Shared& sh) {
  const int lane = threadIdx.x & 31;
  uint64_t prefix = 0;
  int need = k;
  // Defined results even when no bin can hold the need-th key (k above the candidates: only NaN scores whose key
  // equals kNever get there); the row's output count then disagrees with k.
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.need = k;
    sh.count = 0;
  }
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    // Uniform trip count per warp, so __match_any_sync sees every lane: equal digits (ties, the common case for the
    // high bytes) cost one shared atomic per warp instead of 32 serialised ones.
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + static_cast<int>(threadIdx.x);
      unsigned digit = 256;
      if (i < n) {
        const uint64_t x = key(i);
        if (shift == 56 || ((x ^ prefix) >> (shift + 8)) == 0) digit = static_cast<unsigned>(x >> shift) & 255u;
      }
      const unsigned same = __match_any_sync(0xffffffffu, digit);
      if (digit != 256 && lane == __ffs(same) - 1) atomicAdd(&sh.hist[digit], static_cast<unsigned>(__popc(same)));
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0: the digit whose bin holds the need-th best, lane l owns bins 8l..8l+7
      unsigned c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += (c[j] = sh.hist[lane * 8 + j]);
      unsigned incl = sum;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
      }
      const unsigned excl = incl - sum, want = static_cast<unsigned>(need);
      const unsigned hit = __ballot_sync(0xffffffffu, excl < want && want <= incl);
      if (lane == __ffs(hit) - 1) {
        unsigned run = excl;
        for (int j = 0; j < 8; ++j) {
          if (run + c[j] >= want) {
            sh.prefix = prefix | (static_cast<uint64_t>(lane * 8 + j) << shift);
            sh.need = static_cast<int>(want - run);
            sh.count = static_cast<int>(c[j]);
            break;
          }
          run += c[j];
        }
      }
    }
    __syncthreads();
    prefix = sh.prefix;
    need = sh.need;
  }
}

// Mark the k best tokens by (key asc, then secondary asc if `by_score`, then index asc) in `picked` (bit i of word
// i / 32). key(i) == kNever for tokens that must not be picked; 1 <= k <= #{key < kNever}.
template <class Key, class Secondary>
__device__ void select_k(const Key& key, const Secondary& secondary, bool by_score, int n, int k, unsigned* picked,
                         Shared& sh) {
  radix_select(key, n, k, sh);
  const uint64_t t1 = sh.prefix;
  const int need1 = sh.need, count1 = sh.count;
  // Only a split tie group needs the score: all of it (need1 == count1) or none is taken whatever the scores.
  const bool split = by_score && need1 < count1;
  uint64_t t2 = 0;
  int need2 = need1;
  __syncthreads();  // everyone has read sh before a second select rewrites it
  if (split) {
    radix_select([&](int i) { return key(i) == t1 ? secondary(i) : kNever; }, n, need1, sh);
    t2 = sh.prefix;
    need2 = sh.need;
  }
  // The last tie group (key == t1, and score key == t2 when split) goes to the lower indices: rank by a scan.
  auto tied = [&](int i) { return key(i) == t1 && (!split || secondary(i) == t2); };
  int lo, hi;
  owned(n, lo, hi);
  int local = 0;
  for (int i = lo; i < hi; ++i) local += tied(i);
  int rank;
  BlockScan(sh.scan).ExclusiveSum(local, rank);
  for (int i = lo; i < hi; ++i) {
    const uint64_t x = key(i);
    bool take = x < t1 || (split && x == t1 && secondary(i) < t2);
    if (tied(i)) take = rank++ < need2;
    if (take) atomicOr(&picked[i >> 5], 1u << (i & 31));
  }
  __syncthreads();
}

__device__ __forceinline__ int bit_width(unsigned x) { return x == 0 ? 1 : 32 - __clz(x); }

// Coverage keys: keys[i] = descending key of the greedy value of member i (kNever for others), from its rank inside
// its chunk. keys has n entries (n <= kThreads * kMaxSortItems).
__device__ void coverage_keys(const Row& row, int64_t label, double weight, uint64_t* keys, Shared& sh) {
  const int n = row.n;
  const int ib = bit_width(static_cast<unsigned>(n - 1));  // index field width, <= 15
  const int cb = 32 - ib;                                   // chunk field width, >= 17
  if (threadIdx.x == 0) sh.flag = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += kThreads) {
    uint64_t x = kNever;
    if (row.member(p, label)) {
      const int64_t c = row.chunk(p);
      if (c < 0 || c >= (int64_t{1} << cb)) sh.flag = 1;  // benign race: every writer stores 1
      x = (static_cast<uint64_t>(c) << (32 + ib)) |
          (static_cast<uint64_t>(descending_key32(static_cast<float>(row.score(p)))) << ib) |
          static_cast<uint64_t>(p);
    }
    keys[p] = x;
  }
  __syncthreads();
  const bool overflow = sh.flag != 0;
  if (!overflow) {
    // Bitonic sort, ascending, in the form where every comparator puts the smaller key at its lower position: for
    // each block size `size` = 2, 4, ..., n_pad (the power of two >= n), position i of a block against its mirror,
    // then half-cleaners i against i + stride. The network sorts n_pad keys; the n_pad - n missing ones are virtual
    // +inf keys at positions >= n. A comparator (i < j) leaves +inf at j, so a virtual key never moves below n and
    // every comparator with j >= n is a no-op: it is skipped, and only the n real keys are stored.
    int n_pad = 1;
    while (n_pad < n) n_pad <<= 1;
    auto compare = [&](int i, int j) {  // i < j
      if (j >= n) return;
      const uint64_t a = keys[i], b = keys[j];
      if (a > b) {
        keys[i] = b;
        keys[j] = a;
      }
    };
    for (int size = 2; size <= n_pad; size <<= 1) {
      const int half = size >> 1;
      for (int q = threadIdx.x; q < n_pad / 2; q += kThreads) {
        const int r = q & (half - 1);
        const int i = 2 * (q - r) + r;  // block q / half starts at 2 * (q - r); i is its position r
        compare(i, i + size - 1 - 2 * r);
      }
      __syncthreads();
      for (int stride = half >> 1; stride > 0; stride >>= 1) {
        for (int q = threadIdx.x; q < n_pad / 2; q += kThreads) {
          const int i = 2 * q - (q & (stride - 1));
          compare(i, i + stride);
        }
        __syncthreads();
      }
    }
  }
  // Each thread finds (token, rank in chunk) of its positions, packed into 32 bits (both < n <= 2^15) and held in
  // registers across the barrier; then the keys array is reused, by token index, for the value keys.
  unsigned packed[kMaxSortItems];
  const uint64_t index_mask = (1ull << ib) - 1;
#pragma unroll
  for (int r = 0; r < kMaxSortItems; ++r) {
    const int p = static_cast<int>(threadIdx.x) + r * kThreads;
    packed[r] = ~0u;
    if (p >= n) continue;
    if (!overflow) {
      const uint64_t x = keys[p];
      if (x == kNever) continue;
      const uint64_t c = x >> (32 + ib);
      int lo = 0, hi = p;  // first position of chunk c: keys are sorted, so binary search
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((keys[mid] >> (32 + ib)) < c) lo = mid + 1; else hi = mid;
      }
      packed[r] = (static_cast<unsigned>(p - lo) << 16) | static_cast<unsigned>(x & index_mask);
    } else if (row.member(p, label)) {  // rare path: count the chunk's tokens ahead of p directly
      const int64_t c = row.chunk(p);
      const float s = static_cast<float>(row.score(p));
      unsigned t = 0;
      for (int j = 0; j < n; ++j) {
        if (j == p || !row.member(j, label) || row.chunk(j) != c) continue;
        const float sj = static_cast<float>(row.score(j));
        t += sj > s || (sj == s && j < p);
      }
      packed[r] = (t << 16) | static_cast<unsigned>(p);
    }
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += kThreads) keys[p] = kNever;
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kMaxSortItems; ++r) {
    if (packed[r] == ~0u) continue;
    const int i = static_cast<int>(packed[r] & 0xffffu);
    const double t = static_cast<double>(packed[r] >> 16);
    keys[i] = descending_key64(__dadd_rn(row.score(i), __dsqrt_rn(__ddiv_rn(weight, __dadd_rn(1.0, t)))));
  }
  __syncthreads();
}

// One row: the selections of every modality into `picked`, then the kept positions (picked, or of a label >= 0 that
// no modality selects) in ascending order, right-aligned: the row's len_b positions fill out[out_len - len_b,
// out_len) and out[0, out_len - len_b) is -1 (the left padding of a batch). `keeps` is this row's budgets (nullptr:
// the spec's). A row whose data contradicts the host's numbers (a budget outside [0, spec keep], a modality with
// fewer tokens than its budget, or len_b > out_len) is filled with -1 instead: such indices fault in any gather.
__device__ void select_row(const Row& row, const SelectCtaParams& p, const int32_t* keeps, int64_t* out,
                           uint64_t* keys, unsigned* picked, Shared& sh) {
  const int n = row.n;
  const int words = (n + 31) / 32;
  for (int w = threadIdx.x; w < words; w += kThreads) picked[w] = 0;
  __syncthreads();
  bool valid = true;
  for (int m = 0; m < p.num_modalities; ++m) {
    const SelectCtaModality mod = p.modalities[m];
    // Every thread reads the same entry: `keep` is block-uniform, so the branches below that depend on it (and
    // contain barriers) are taken by the whole block.
    const int64_t keep = keeps != nullptr ? static_cast<int64_t>(keeps[m]) : mod.keep;
    if (keep < 0 || keep > mod.keep) {
      valid = false;
      break;
    }
    if (row.labels != nullptr) {  // the modality must hold at least `keep` tokens
      int local = 0;
      for (int i = threadIdx.x; i < n; i += kThreads) local += row.label(i) == mod.label;
      int before, count;
      BlockScan(sh.scan).ExclusiveSum(local, before, count);
      __syncthreads();  // the scan's storage is reused next
      if (count < keep) {  // uniform: every thread has the block's count
        valid = false;
        break;
      }
    }
    if (keep == 0) continue;
    auto score_key = [&](int i) { return descending_key64(row.score(i)); };
    if (mod.coverage) {
      coverage_keys(row, mod.label, mod.coverage_weight, keys, sh);
    } else {
      for (int i = threadIdx.x; i < n; i += kThreads) keys[i] = row.member(i, mod.label) ? score_key(i) : kNever;
      __syncthreads();
    }
    select_k([&](int i) { return keys[i]; }, score_key, mod.coverage != 0, n, static_cast<int>(keep), picked, sh);
  }
  auto kept = [&](int i) {
    if ((picked[i >> 5] >> (i & 31)) & 1u) return true;
    if (row.labels == nullptr) return false;
    const int64_t label = row.label(i);
    if (label < 0) return false;  // padding
    for (int m = 0; m < p.num_modalities; ++m)
      if (p.modalities[m].label == label) return false;
    return true;
  };
  int lo, hi;
  owned(n, lo, hi);
  int local = 0;
  if (valid)
    for (int i = lo; i < hi; ++i) local += kept(i);
  int pos, total;
  BlockScan(sh.scan).ExclusiveSum(local, pos, total);
  if (valid && total <= p.out_len) {  // total and valid are block-uniform
    const int64_t start = p.out_len - total;
    for (int64_t j = threadIdx.x; j < start; j += kThreads) out[j] = -1;
    for (int i = lo; i < hi; ++i)
      if (kept(i)) out[start + pos++] = i;  // start + pos < start + total = out_len
  } else {
    for (int64_t j = threadIdx.x; j < p.out_len; j += kThreads) out[j] = -1;
  }
}

__global__ void __launch_bounds__(kThreads, 1) select_cta_kernel(const SelectCtaParams p) {
  extern __shared__ uint64_t dynamic_smem[];
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  Row row;
  row.scores = p.scores;
  row.labels = p.labels;
  row.chunks = p.chunk_ids;
  row.s0 = b * p.scores_stride[0];
  row.l0 = b * p.labels_stride[0];
  row.c0 = b * p.chunk_stride[0];
  row.scores_dtype = p.scores_dtype;
  row.labels_dtype = p.labels_dtype;
  row.chunk_dtype = p.chunk_dtype;
  row.s1 = p.scores_stride[1];
  row.l1 = p.labels_stride[1];
  row.c1 = p.chunk_stride[1];
  row.n = static_cast<int>(p.n);
  uint64_t* keys = dynamic_smem;
  unsigned* picked = reinterpret_cast<unsigned*>(keys + p.key_capacity);
  const int32_t* keeps = p.keeps != nullptr ? p.keeps + b * p.num_modalities : nullptr;
  select_row(row, p, keeps, p.out + b * p.out_stride, keys, picked, sh);
}

}  // namespace cta
}  // namespace macer
