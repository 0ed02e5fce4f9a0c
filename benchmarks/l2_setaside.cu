// L2 set-aside microbenchmark (kernel-plan 8.8, issue 37): does data written under an L2 persisting window (or with
// an evict_last hint) survive a large evict_first stream, and how much of it is read back from L2?
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/l2_setaside.cu -o l2_setaside    # benchmarks/gpu_check.sh builds it
//   ./l2_setaside [--sizes 20,30,45] [--stream-mb 100] [--reps 5] [--csv FILE]
//
// Why: the S-A scoring kernels write the fp32 logits (45 MB at N = 100k, 7B shapes) and read them back after K
// (102 MB) has streamed through a 60 MiB L2; the H200 run measured an L2 hit rate of 3 % on that read with evict_last
// hints alone. S-B keeps most logits on chip and spills the rest under a persisting access-policy window. This
// program measures, for X MB written then read back after `--stream-mb` MB of evict_first reads:
//
//   mode          what the write and the read carry                     the persisting set-aside
//   cold          nothing (L2 flushed before the read)                  0       -> the DRAM read time
//   warm          nothing, no stream in between                         0       -> the all-L2 read time
//   evict_last    st.global.L2::evict_last                              0 / max
//   window        an access-policy window over X (hitRatio 1, persisting) 0 / max
//
// Each read-back is timed with CUDA events (median of --reps); "est_hit" = (t_cold - t) / (t_cold - t_warm), the share
// of the read served by L2 under a two-speed model (clamped to [0, 1]). For the hardware counter, run it under Nsight
// Compute: ncu --kernel-name read_back --metrics lts__t_sector_hit_rate.pct ./l2_setaside (gpu_check.sh's optional
// step). The set-aside limit is restored to 0 and the persisting lines reset (cudaCtxResetPersistingL2Cache) at exit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK(call)                                                                                            \
  do {                                                                                                         \
    cudaError_t err_ = (call);                                                                                 \
    if (err_ != cudaSuccess) {                                                                                 \
      std::fprintf(stderr, "l2_setaside: %s failed: %s (%s)\n", #call, cudaGetErrorName(err_),                \
                   cudaGetErrorString(err_));                                                                  \
      std::exit(2);                                                                                            \
    }                                                                                                          \
  } while (0)

namespace {

__device__ __forceinline__ uint64_t policy_evict_last() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t policy_evict_first() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// X written with 16-byte stores; hint 1: L2::evict_last.
__global__ void write_x(float4* x, size_t n4, int hint, float value) {
  const uint64_t policy = policy_evict_last();
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float4 v = make_float4(value, value + 1.0f, value + 2.0f, static_cast<float>(i));
    if (hint) {
      asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(x + i), "f"(v.x), "f"(v.y),
                   "f"(v.z), "f"(v.w), "l"(policy)
                   : "memory");
    } else {
      x[i] = v;
    }
  }
}

// The competing traffic: the K stream of the scoring kernels, read once with L2::evict_first and no L1 allocation.
__global__ void stream_first(const uint4* s, size_t n4, unsigned* sink) {
  const uint64_t policy = policy_evict_first();
  unsigned acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(s + i), "l"(policy));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // keeps the loads alive
}

// The read-back being measured (the reduce's read of the logits): 16-byte loads, no L1 allocation.
__global__ void read_back(const float4* x, size_t n4, float* sink) {
  float acc = 0.0f;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(x + i));
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == -1.0f) sink[blockIdx.x] = acc;
}

struct Options {
  std::vector<double> sizes_mb = {20, 30, 45};
  double stream_mb = 100;
  int reps = 5;
  std::string csv;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "l2_setaside: %s needs a value\n", a.c_str());
        std::exit(1);
      }
      return argv[++i];
    };
    if (a == "--sizes") {
      o.sizes_mb.clear();
      std::string s = value();
      size_t pos = 0;
      while (pos <= s.size()) {
        const size_t comma = s.find(',', pos);
        o.sizes_mb.push_back(std::atof(s.substr(pos, comma - pos).c_str()));
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else if (a == "--stream-mb") {
      o.stream_mb = std::atof(value().c_str());
    } else if (a == "--reps") {
      o.reps = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--csv") {
      o.csv = value();
    } else if (a == "--help" || a == "-h") {
      std::printf("usage: l2_setaside [--sizes 20,30,45] [--stream-mb 100] [--reps 5] [--csv FILE]\n");
      std::exit(0);
    } else {
      std::fprintf(stderr, "l2_setaside: unknown argument %s\n", a.c_str());
      std::exit(1);
    }
  }
  for (double s : o.sizes_mb) {
    if (!(s > 0)) {
      std::fprintf(stderr, "l2_setaside: --sizes must be positive MB values\n");
      std::exit(1);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  int device = 0;
  CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, device));
  const size_t max_persist = static_cast<size_t>(prop.persistingL2CacheMaxSize);
  const size_t max_window = static_cast<size_t>(prop.accessPolicyMaxWindowSize);
  std::printf("device: %s, %d SMs, L2 %.1f MiB, persisting set-aside max %.1f MiB, access-policy window max %.1f MiB\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0, max_persist / 1048576.0,
              max_window / 1048576.0);

  const double max_x = *std::max_element(opt.sizes_mb.begin(), opt.sizes_mb.end());
  const size_t x_bytes = static_cast<size_t>(max_x * 1e6) / 16 * 16;
  const size_t s_bytes = static_cast<size_t>(opt.stream_mb * 1e6) / 16 * 16;
  const size_t flush_bytes = std::max<size_t>(4 * static_cast<size_t>(prop.l2CacheSize), 256u << 20);
  float4* x = nullptr;
  uint4* s = nullptr;
  uint4* flush = nullptr;
  void* sink = nullptr;
  CHECK(cudaMalloc(&x, x_bytes));
  CHECK(cudaMalloc(&s, s_bytes));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaMemset(s, 1, s_bytes));
  CHECK(cudaMemset(flush, 2, flush_bytes));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int blocks = prop.multiProcessorCount * 8, threads = 256;

  auto set_limit = [&](size_t bytes) {
    CHECK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, bytes));
    CHECK(cudaCtxResetPersistingL2Cache());
  };
  auto set_window = [&](void* base, size_t bytes) {
    cudaStreamAttrValue v{};
    v.accessPolicyWindow.base_ptr = base;
    v.accessPolicyWindow.num_bytes = bytes;
    v.accessPolicyWindow.hitRatio = bytes ? 1.0f : 0.0f;
    v.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    v.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    CHECK(cudaStreamSetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &v));
  };
  // The time of one read-back of n bytes of X after `prepare` (every step on `stream`), median of reps.
  auto measure = [&](size_t n, auto prepare) {
    std::vector<float> times;
    for (int r = 0; r < opt.reps; ++r) {
      CHECK(cudaCtxResetPersistingL2Cache());
      prepare();
      CHECK(cudaEventRecord(e0, stream));
      read_back<<<blocks, threads, 0, stream>>>(x, n / 16, static_cast<float*>(sink));
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      times.push_back(ms * 1000.0f);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  auto write = [&](size_t n, int hint) {
    write_x<<<blocks, threads, 0, stream>>>(x, n / 16, hint, 1.0f);
    CHECK(cudaGetLastError());
  };
  auto stream_k = [&]() {
    stream_first<<<blocks, threads, 0, stream>>>(s, s_bytes / 16, static_cast<unsigned*>(sink));
    CHECK(cudaGetLastError());
  };
  auto flush_l2 = [&]() {
    stream_first<<<blocks, threads, 0, stream>>>(flush, flush_bytes / 16, static_cast<unsigned*>(sink));
    CHECK(cudaGetLastError());
  };

  FILE* csv = opt.csv.empty() ? nullptr : std::fopen(opt.csv.c_str(), "w");
  if (csv) std::fprintf(csv, "mode,limit_mb,x_mb,stream_mb,read_us,read_gbs,est_hit\n");
  std::printf("%-12s %9s %7s %9s %9s %9s %8s\n", "mode", "limit_MB", "X_MB", "stream_MB", "read_us", "GB/s", "est_hit");
  for (double mb : opt.sizes_mb) {
    const size_t n = static_cast<size_t>(mb * 1e6) / 16 * 16;
    set_limit(0);
    set_window(nullptr, 0);
    const float cold = measure(n, [&] {
      write(n, 0);
      flush_l2();
    });
    const float warm = measure(n, [&] { write(n, 0); });
    auto row = [&](const char* mode, size_t limit, float us) {
      const double hit =
          cold > warm ? std::min(1.0, std::max(0.0, static_cast<double>(cold - us) / (cold - warm))) : 0.0;
      const double gbs = n / (us * 1e-6) / 1e9;
      std::printf("%-12s %9.1f %7.1f %9.1f %9.2f %9.1f %8.2f\n", mode, limit / 1e6, n / 1e6, opt.stream_mb, us, gbs,
                  hit);
      if (csv) {
        std::fprintf(csv, "%s,%.1f,%.1f,%.1f,%.3f,%.1f,%.3f\n", mode, limit / 1e6, n / 1e6, opt.stream_mb, us, gbs,
                     hit);
      }
    };
    row("cold", 0, cold);
    row("warm", 0, warm);
    for (size_t limit : {static_cast<size_t>(0), max_persist}) {
      set_limit(limit);
      set_window(nullptr, 0);
      row("evict_last", limit, measure(n, [&] {
            write(n, 1);
            stream_k();
          }));
      const size_t win = std::min(n, max_window);
      row("window", limit, measure(n, [&] {
            set_window(x, win);
            write(n, 0);
            set_window(nullptr, 0);
            stream_k();
            set_window(x, win);
          }));
      set_window(nullptr, 0);
    }
  }
  set_limit(0);
  if (csv) std::fclose(csv);
  CHECK(cudaFree(x));
  CHECK(cudaFree(s));
  CHECK(cudaFree(flush));
  CHECK(cudaFree(sink));
  std::printf("l2_setaside done\n");
  return 0;
}
