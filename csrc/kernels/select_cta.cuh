// One-CTA selection: topk_indices, coverage_select and stage_select for n up to a few ten thousand tokens, one
// launch each, everything in shared memory. One thread block of kThreads threads per row (per sample of a stage).
//
// For each selected modality of a row (a standalone op is one "modality" holding every token):
//  * top-K: key_i = descending 64-bit key of the score as float64 (exact for every input dtype), ~0 for tokens of
//    other labels ("never").
//  * coverage: (1) a bitonic sort of the modality's m 64-bit keys chunk | descending float32 score bits | token
//    index, written compactly (a block scan gives each member its place among the members) -- all distinct, so
//    the sort needs no stability and gives the chunk order (chunk asc, score desc, index asc); the network's
//    comparators all put the smaller key first, so the padding to a power of two is virtual and never stored;
//    (2) each member's rank t inside its chunk (position minus the chunk's first position, by binary search) and
//    its value v = s + sqrt(lambda_c / (1 + t)) with IEEE float64 operations, the numbers the reference compares;
//    key_i = descending key of v. float32 score bits are exact for fp32/fp16/bf16 scores only: float64 scores take
//    the multi-CTA path (the launcher's caller routes them). Chunk ids that do not fit the key's chunk field
//    (>= 2^(32 - index bits), never produced by temporal_chunks) switch the row to an O(n^2 / threads) rank count.
//  * the k best keys by a radix select (8 passes of 8-bit digits, block histogram in shared memory with
//    warp-aggregated atomics): threshold T and the number `need` of tokens with key == T to take. Among those ties
//    the higher score wins (a second radix select over the score keys, coverage only, run only when the tie group is
//    split), then the lower index (a block scan in index order). Picks go into a bitmap. Tokens keyed kNever (other
//    labels, padding) are never picked. A NaN score or value has kNanKey64 (common.cuh): after every number, so a
//    row of NaN scores keeps its first K members, as the reference does.
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
constexpr uint64_t kNever = ~0ull;  // above every key descending_key64 gives (common.cuh), NaN's included

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
  // Defined results even when no bin can hold the need-th key (k above n, which the launcher refuses): the previous
  // pass's values stay. With k above the candidates (keys below kNever) T is kNever: select_k reports a shortfall.
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
// i / 32). key(i) == kNever for tokens that must not be picked; 1 <= k. Returns whether k tokens were picked, the
// same on every thread: false only when fewer than k keys are below kNever (no member has that key: the caller
// checked the member count, so this is a guard), and then only the keys below kNever are picked.
template <class Key, class Secondary>
__device__ bool select_k(const Key& key, const Secondary& secondary, bool by_score, int n, int k, unsigned* picked,
                         Shared& sh) {
  radix_select(key, n, k, sh);
  const uint64_t t1 = sh.prefix;
  const int need1 = sh.need, count1 = sh.count;
  // A threshold of kNever means k is above the candidates: the tokens below it are all taken and the kNever group --
  // other labels, padding -- never.
  const bool complete = t1 != kNever;
  // Only a split tie group needs the score: all of it (need1 == count1) or none is taken whatever the scores.
  const bool split = complete && by_score && need1 < count1;
  uint64_t t2 = 0;
  int need2 = need1;
  __syncthreads();  // everyone has read sh before a second select rewrites it
  if (split) {
    radix_select([&](int i) { return key(i) == t1 ? secondary(i) : kNever; }, n, need1, sh);
    t2 = sh.prefix;
    need2 = sh.need;
  }
  // The last tie group (key == t1, and score key == t2 when split) goes to the lower indices: rank by a scan.
  auto tied = [&](int i) { return complete && key(i) == t1 && (!split || secondary(i) == t2); };
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
  return complete;
}

__device__ __forceinline__ int bit_width(unsigned x) { return x == 0 ? 1 : 32 - __clz(x); }

// Steps of the coverage sort's bitonic network (coverage_keys) that stay inside aligned blocks of 64 positions, run
// by one warp per block in registers: lane l holds positions 64 b + l (x0) and 64 b + 32 + l (x1) and finds its
// partners by shuffles. `full_top` > 0: every step of the block sizes 2 .. full_top (<= 64), i.e. the sort of each
// block; else the half-cleaners of stride `stride_top` (<= 32) down to 1 that end a larger size's merge. Positions
// >= m are read as the network's virtual +inf (~0) and never stored. Barriers at m = 864: 15 (was 55); m = 28672:
// 55 (was 120). The caller synchronises after it.
__device__ void sort64_in_registers(uint64_t* keys, int m, int full_top, int stride_top) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  // Half-cleaner of stride s: positions p, p + s; in registers s = 32 pairs x0 with x1, s < 32 lane with lane ^ s.
  auto half_cleaners = [&](uint64_t& x0, uint64_t& x1, int top) {
    for (int s = top; s > 0; s >>= 1) {
      if (s == 32) {
        const uint64_t lo = min(x0, x1);
        x1 = max(x0, x1);
        x0 = lo;
      } else {
        const bool lower = (lane & s) == 0;
        const uint64_t y0 = __shfl_xor_sync(0xffffffffu, x0, s), y1 = __shfl_xor_sync(0xffffffffu, x1, s);
        x0 = lower ? min(x0, y0) : max(x0, y0);
        x1 = lower ? min(x1, y1) : max(x1, y1);
      }
    }
  };
  const int blocks = (m + 63) / 64;  // a block of virtual keys only has nothing to sort
  for (int blk = static_cast<int>(threadIdx.x >> 5); blk < blocks; blk += kThreads / 32) {  // warp-uniform
    const int p0 = blk * 64 + lane, p1 = p0 + 32;
    uint64_t x0 = p0 < m ? keys[p0] : kNever, x1 = p1 < m ? keys[p1] : kNever;
    if (full_top > 0) {
      for (int size = 2; size <= full_top; size <<= 1) {
        if (size == 64) {  // the mirror of position l is 63 - l: x1 of lane l ^ 31 for x0, and the reverse
          const uint64_t y1 = __shfl_xor_sync(0xffffffffu, x1, 31), y0 = __shfl_xor_sync(0xffffffffu, x0, 31);
          x0 = min(x0, y1);
          x1 = max(x1, y0);
        } else {  // blocks of size <= 32 within each half: the mirror of lane l is l ^ (size - 1)
          const bool lower = (lane & (size >> 1)) == 0;
          const uint64_t y0 = __shfl_xor_sync(0xffffffffu, x0, size - 1);
          const uint64_t y1 = __shfl_xor_sync(0xffffffffu, x1, size - 1);
          x0 = lower ? min(x0, y0) : max(x0, y0);
          x1 = lower ? min(x1, y1) : max(x1, y1);
        }
        half_cleaners(x0, x1, size >> 2);
      }
    } else {
      half_cleaners(x0, x1, stride_top);
    }
    if (p0 < m) keys[p0] = x0;
    if (p1 < m) keys[p1] = x1;
  }
}

// Coverage keys: keys[i] = descending key of the greedy value of member i (kNever for others), from its rank inside
// its chunk. keys has n entries (n <= kThreads * kMaxSortItems). The m members are sorted alone: thread t owns the
// tokens [lo, hi) (owned()) and writes the key of its j-th member at keys[before + j], `before` being the members
// below lo (the caller's block scan), so keys[0, m) holds the members' sort keys in index order and the network's
// width comes from m, not n (864 video tokens of a 20k row: 55 steps of width 1024 instead of 120 of width 32768).
// The key's index field still holds the token index (width from n), so the value keys land by token index.
__device__ void coverage_keys(const Row& row, int64_t label, double weight, int lo, int hi, int before, int m,
                              uint64_t* keys, Shared& sh) {
  const int n = row.n;
  const int ib = bit_width(static_cast<unsigned>(n - 1));  // index field width, <= 15
  const int cb = 32 - ib;                                   // chunk field width, >= 17
  if (threadIdx.x == 0) sh.flag = 0;
  __syncthreads();
  for (int i = lo; i < hi; ++i) {
    if (!row.member(i, label)) continue;
    const int64_t c = row.chunk(i);
    if (c < 0 || c >= (int64_t{1} << cb)) sh.flag = 1;  // benign race: every writer stores 1
    // The shift leaves the low 32 + ib bits zero whatever c is, so the index field survives an overflowing chunk id.
    keys[before++] = (static_cast<uint64_t>(c) << (32 + ib)) |
                     (static_cast<uint64_t>(descending_key32(static_cast<float>(row.score(i)))) << ib) |
                     static_cast<uint64_t>(i);
  }
  __syncthreads();
  const bool overflow = sh.flag != 0;
  if (!overflow) {
    // Bitonic sort, ascending, in the form where every comparator puts the smaller key at its lower position: for
    // each block size `size` = 2, 4, ..., m_pad (the power of two >= m), position i of a block against its mirror,
    // then half-cleaners i against i + stride. The network sorts m_pad keys; the m_pad - m missing ones are virtual
    // +inf keys at positions >= m. A comparator (i < j) leaves +inf at j, so a virtual key never moves below m and
    // every comparator with j >= m is a no-op: it is skipped (in registers: run against a virtual ~0, which it
    // leaves in place), and only the m real keys are stored. (A real key may equal ~0, e.g. a NaN score (kNanKey32) in
    // the last chunk at the last index: it sorts last and is still a member.) The steps whose comparators stay inside
    // aligned blocks of 64 positions -- every step of the sizes <= 64, and the half-cleaners of stride <= 32 of the
    // larger sizes -- run in registers (sort64_in_registers), one barrier per run of them instead of one per step.
    int m_pad = 1;
    while (m_pad < m) m_pad <<= 1;
    auto compare = [&](int i, int j) {  // i < j
      if (j >= m) return;
      const uint64_t a = keys[i], b = keys[j];
      if (a > b) {
        keys[i] = b;
        keys[j] = a;
      }
    };
    sort64_in_registers(keys, m, m_pad < 64 ? m_pad : 64, 0);
    __syncthreads();
    for (int size = 128; size <= m_pad; size <<= 1) {
      const int half = size >> 1;
      for (int q = threadIdx.x; q < m_pad / 2; q += kThreads) {
        const int r = q & (half - 1);
        const int i = 2 * (q - r) + r;  // block q / half starts at 2 * (q - r); i is its position r
        compare(i, i + size - 1 - 2 * r);
      }
      __syncthreads();
      for (int stride = half >> 1; stride >= 64; stride >>= 1) {
        for (int q = threadIdx.x; q < m_pad / 2; q += kThreads) {
          const int i = 2 * q - (q & (stride - 1));
          compare(i, i + stride);
        }
        __syncthreads();
      }
      sort64_in_registers(keys, m, 0, 32);
      __syncthreads();
    }
  }
  // Each thread finds (token, rank in chunk) of its positions p < m, packed into 32 bits (both < n <= 2^15) and held
  // in registers across the barrier; then the keys array is reused, by token index, for the value keys.
  unsigned packed[kMaxSortItems];
  const uint64_t index_mask = (1ull << ib) - 1;
#pragma unroll
  for (int r = 0; r < kMaxSortItems; ++r) packed[r] = ~0u;
#pragma unroll
  for (int r = 0; r < kMaxSortItems; ++r) {
    const int p = static_cast<int>(threadIdx.x) + r * kThreads;
    if (p >= m) break;  // (break, not continue: with continue ptxas keeps an 8-byte stack frame on sm_90)
    const uint64_t x = keys[p];
    const int token = static_cast<int>(x & index_mask);
    unsigned t = 0;
    if (!overflow) {
      const uint64_t c = x >> (32 + ib);
      int lo_p = 0, hi_p = p;  // first position of chunk c: keys are sorted, so binary search
      while (lo_p < hi_p) {
        const int mid = (lo_p + hi_p) >> 1;
        if ((keys[mid] >> (32 + ib)) < c) lo_p = mid + 1; else hi_p = mid;
      }
      t = static_cast<unsigned>(p - lo_p);
    } else {  // rare path: count the chunk's members ahead of the token directly
      const int64_t c = row.chunk(token);
      const float s = static_cast<float>(row.score(token));
      for (int j = 0; j < n; ++j) {
        if (j == token || !row.member(j, label) || row.chunk(j) != c) continue;
        const float sj = static_cast<float>(row.score(j));
        t += sj > s || (sj == s && j < token);
      }
    }
    packed[r] = (t << 16) | static_cast<unsigned>(token);
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
// fewer tokens -- or fewer candidates, see select_k -- than its budget, or len_b > out_len) is filled with -1.
__device__ void select_row(const Row& row, const SelectCtaParams& p, const int32_t* keeps, int64_t* out,
                           bool* nonfinite, uint64_t* keys, unsigned* picked, Shared& sh) {
  const int n = row.n;
  const int words = (n + 31) / 32;
  for (int w = threadIdx.x; w < words; w += kThreads) picked[w] = 0;
  if (nonfinite != nullptr) {  // the stage's flag: a non-finite score at a token of a selected label
    int lo, hi;
    owned(n, lo, hi);
    bool bad = false;
    for (int i = lo; i < hi; ++i) {
      bool staged = row.labels == nullptr;
      for (int m = 0; m < p.num_modalities && !staged; ++m) staged = row.label(i) == p.modalities[m].label;
      bad |= staged && !isfinite(row.score(i));
    }
    bad = __syncthreads_or(bad);  // also the barrier after the bitmap's reset
    if (threadIdx.x == 0) *nonfinite = bad;
  }
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
    // The modality's members, counted over the blocked ownership of owned(): `before` (the members below this
    // thread's first token) is where coverage_keys writes this thread's first member key. Without labels every
    // token is a member.
    int lo, hi;
    owned(n, lo, hi);
    int before = lo, count = n;
    if (row.labels != nullptr) {  // the modality must hold at least `keep` tokens
      int local = 0;
      for (int i = lo; i < hi; ++i) local += row.label(i) == mod.label;
      BlockScan(sh.scan).ExclusiveSum(local, before, count);
      __syncthreads();  // the scan's storage is reused next
      if (count < keep) {  // uniform: every thread has the block's count
        valid = false;
        break;
      }
    }
    if (keep == 0) continue;  // (count == 0 implies keep == 0 here: an absent modality costs one scan)
    auto score_key = [&](int i) { return descending_key64(row.score(i)); };
    if (mod.coverage) {
      coverage_keys(row, mod.label, mod.coverage_weight, lo, hi, before, count, keys, sh);
    } else {
      for (int i = threadIdx.x; i < n; i += kThreads) keys[i] = row.member(i, mod.label) ? score_key(i) : kNever;
      __syncthreads();
    }
    // Fewer than keep picks (cannot happen once count >= keep; a guard): the row's len_b would
    // disagree with the host's, so the row is flagged (all -1) rather than silently short.
    if (!select_k([&](int i) { return keys[i]; }, score_key, mod.coverage != 0, n, static_cast<int>(keep), picked,
                  sh)) {
      valid = false;
      break;
    }
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
  // A stage's chain may launch this kernel before its predecessor ends (csrc/kernels/launch.cuh): wait for it
  // before the first global access; then let the successor be scheduled.
  grid_dependency_wait();
  launch_dependents();
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
  bool* nonfinite = p.nonfinite != nullptr ? p.nonfinite + b : nullptr;
  select_row(row, p, keeps, p.out + b * p.out_stride, nonfinite, keys, picked, sh);
}

}  // namespace cta
}  // namespace macer
