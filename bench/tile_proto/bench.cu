// proto192 bench, round 2 (VT): do variable-height tiles remove the cost of the MoE tail m-blocks?
//
// MoE routing gives each expert ~1024 +- 32 rows, so nearly every expert ends in a partial m-block that costs about
// as much as a full one (it streams the expert's whole B slice). VT (vt_gemm.cuh) lets a tail of <= 64 rows ride in
// a 128 + r row tile with the expert's last full m-block.
//
// 1. Ragged correctness test: BASE (our kernel), V3 / V3s / V2 (round 1) and VT (both tile orders) on groups of
//    0, 1..63, 64, 65, 127..129, 192, 193, 1000, 1040, 1088, 1089, 1152 rows and 37 trailing rows in no group,
//    N and K not multiples of the tile; NaN-poisoned outputs; bitwise vs BASE on every group row, float64 CPU on
//    sampled rows, trailing rows untouched.
// 2. Timed: G = 128 groups of MoE-like sizes (1024 + round(32 z), fixed seed, clamped to [900, 1150]) at
//    N=1536 K=2048 and N=3072 K=4096 (K-major B): BASE unpadded, BASE on padded groups (every group padded to a
//    multiple of 128 rows with zero rows, as the fused forward does today), VT natural order, VT tall-last order,
//    BASE on equal groups of 1024 rows (no tails: the floor). TFLOP/s and pJ/FLOP count useful FLOPs only.
//
//    Extra: VT-e = VT on the equal groups (every tile 128 rows): VT's own floor, to separate the VT kernel's
//    efficiency on regular tiles from the tail effect.
//
// --equal768: round 1 instead (does a larger CTA tile than our 128 x 256 cooperative tile cut time and energy per
// FLOP?): its ragged test (BASE, V3, V3s, V2 on groups of 0, 1, 63, 69, 192, 200, 257, 500, 130 rows; every group
// row vs float64 CPU), then BASE, V3 (192 x 256, 3 consumer warpgroups, m64n256, TMA issued by consumer thread 0),
// V3s (192 x 256, 512 threads, producer warpgroup, m64n128 x 2), V2 (256 x 192, 2 consumer warpgroups, m64n192 x 2)
// timed on 128 equal groups of 768 rows at N=1536 K=2048 and N=3072 K=4096. See big_tile_gemm.cuh.
//
// Usage: ./bench [--equal768] [steady_seconds (1.5)] [rounds (3)]
// Exit code 0 = all checks passed, 1 = a CUDA / launch error or bad arguments, 2 = a correctness check failed,
// 3 = a kernel hang.
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "big_tile_gemm.cuh"
#include "vt_gemm.cuh"
#include "sm90/gemm_heuristics.hpp"
#include "sm90/grouped_gemm.hpp"
#include "sm90/host_utils.hpp"

using bf16 = __nv_bfloat16;

#define CK(call)                                                                                              \
  do {                                                                                                        \
    const cudaError_t e_ = (call);                                                                            \
    if (e_ != cudaSuccess) {                                                                                  \
      std::fprintf(stderr, "CUDA error %s (%d) at %s:%d: %s\n", cudaGetErrorString(e_), (int)e_, __FILE__,    \
                   __LINE__, #call);                                                                          \
      std::exit(1);                                                                                           \
    }                                                                                                         \
  } while (0)

static double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Waits for the stream with a deadline (a hung kernel is reported by name instead of blocking forever).
static void sync_or_die(cudaStream_t s, const char* what, double timeout_s = 30.0) {
  const double t0 = now_s();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "CUDA error %s while waiting for %s\n", cudaGetErrorString(e), what);
      std::exit(1);
    }
    if (now_s() - t0 > timeout_s) {
      std::fprintf(stderr, "HANG: %s did not finish within %.0f s\n", what, timeout_s);
      std::fflush(stderr);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// ------------------------------------------------------------------------------------------------
// NVML through dlopen (no link-time dependency)
// ------------------------------------------------------------------------------------------------
struct Nvml {
  typedef int (*InitFn)();
  typedef int (*HandleByPciFn)(const char*, void**);
  typedef int (*EnergyFn)(void*, unsigned long long*);
  typedef int (*ClockFn)(void*, int, unsigned int*);
  typedef int (*UIntFn)(void*, unsigned int*);
  void* lib = nullptr;
  void* dev = nullptr;
  EnergyFn energy = nullptr;
  ClockFn clock = nullptr;
  UIntFn power_limit = nullptr;
  bool ok = false;
  void init(int cuda_dev) {
    lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::printf("NVML: dlopen(libnvidia-ml.so.1) failed: energy not measured\n");
      return;
    }
    auto init_fn = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    auto by_pci = reinterpret_cast<HandleByPciFn>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    energy = reinterpret_cast<EnergyFn>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    clock = reinterpret_cast<ClockFn>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    power_limit = reinterpret_cast<UIntFn>(dlsym(lib, "nvmlDeviceGetEnforcedPowerLimit"));
    if (init_fn == nullptr || by_pci == nullptr || energy == nullptr) {
      std::printf("NVML: missing symbols: energy not measured\n");
      return;
    }
    int r = init_fn();
    if (r != 0) {
      std::printf("NVML: nvmlInit_v2 returned %d: energy not measured\n", r);
      return;
    }
    char bus[64] = {0};
    CK(cudaDeviceGetPCIBusId(bus, sizeof(bus), cuda_dev));
    r = by_pci(bus, &dev);
    if (r != 0) {
      std::printf("NVML: no handle for PCI bus id %s (%d): energy not measured\n", bus, r);
      return;
    }
    unsigned long long mj = 0;
    r = energy(dev, &mj);
    if (r != 0) {
      std::printf("NVML: nvmlDeviceGetTotalEnergyConsumption returned %d: energy not measured\n", r);
      return;
    }
    ok = true;
    unsigned int lim = 0;
    if (power_limit != nullptr && power_limit(dev, &lim) == 0)
      std::printf("NVML: ok (PCI %s), enforced power limit %.0f W\n", bus, lim / 1000.0);
    else
      std::printf("NVML: ok (PCI %s)\n", bus);
  }
};
static Nvml g_nvml;

// Polls the energy counter (and now and then the SM clock) in a thread while a steady run goes on.
struct EnergyPoller {
  struct Sample {
    double t;
    unsigned long long mj;
  };
  std::vector<Sample> edges;  // first sample and every change of the counter
  double clock_sum = 0;
  int clock_n = 0;
  std::atomic<bool> stop{false};
  std::thread th;
  void start() {
    if (!g_nvml.ok) return;
    edges.reserve(4096);
    th = std::thread([this]() {
      unsigned long long last = ~0ull;
      int i = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        unsigned long long mj = 0;
        const double t = now_s();
        if (g_nvml.energy(g_nvml.dev, &mj) == 0 && mj != last) {
          edges.push_back({t, mj});
          last = mj;
        }
        if (g_nvml.clock != nullptr && (i++ % 25) == 12) {
          unsigned int mhz = 0;
          if (g_nvml.clock(g_nvml.dev, 1 /* NVML_CLOCK_SM */, &mhz) == 0) {
            clock_sum += mhz;
            ++clock_n;
          }
        }
        std::this_thread::sleep_for(std::chrono::microseconds(1000));
      }
    });
  }
  void finish() {
    stop.store(true);
    if (th.joinable()) th.join();
  }
  // Average power (W) between the first counter change at least `lead` s after t_begin and the last change at
  // least `tail` s before t_end (the GPU is busy the whole time in between); NaN if too short.
  double power_w(double t_begin, double t_end, double lead = 0.2, double tail = 0.02) const {
    const Sample* a = nullptr;
    const Sample* b = nullptr;
    for (const Sample& s : edges) {
      if (a == nullptr && s.t >= t_begin + lead) a = &s;
      if (s.t <= t_end - tail) b = &s;
    }
    if (a == nullptr || b == nullptr || b->t - a->t < 0.25) return NAN;
    return (double)(b->mj - a->mj) / 1000.0 / (b->t - a->t);
  }
  double mean_clock() const { return clock_n > 0 ? clock_sum / clock_n : NAN; }
};

// ------------------------------------------------------------------------------------------------
// Device helpers: random fill, comparison
// ------------------------------------------------------------------------------------------------
__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// x[i] = N(0, 1) * scale (Box-Muller on a counter hash), as bf16
__global__ void fill_normal_bf16(bf16* x, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint64_t h = splitmix64(seed * 0x100000001B3ull + i);
    const float u1 = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = ((float)(h & 0xFFFFFFull) + 0.5f) * (1.0f / 16777216.0f);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    x[i] = __float2bfloat16_rn(z * scale);
  }
}

struct CmpStats {
  double sum_sq_diff;
  double sum_sq_ref;
  unsigned int max_abs_bits;  // float bits of max |x - ref| over finite pairs
  unsigned int pad;
  unsigned long long n_diff;          // bitwise different
  unsigned long long n_nonfinite_x;   // NaN / inf in x (the sentinel is NaN: unwritten elements)
  unsigned long long n_nonfinite_ref;
  unsigned long long n_cmp;           // elements compared
};
// Per-thread accumulation of ref vs x, then a warp reduction and one set of atomics per warp into a CmpStats
struct CmpAcc {
  double ssd = 0, ssr = 0;
  float mx = 0.f;
  unsigned long long nd = 0, nfx = 0, nfr = 0, nc = 0;
  __device__ __forceinline__ void add(const bf16 rv, const bf16 xv) {
    const float r = __bfloat162float(rv);
    const float v = __bfloat162float(xv);
    nd += __bfloat16_as_ushort(rv) != __bfloat16_as_ushort(xv);
    ++nc;
    const bool fr = isfinite(r), fx = isfinite(v);
    nfr += !fr;
    nfx += !fx;
    if (fr && fx) {
      const double d = (double)v - (double)r;
      ssd += d * d;
      ssr += (double)r * r;
      mx = fmaxf(mx, fabsf(v - r));
    }
  }
  __device__ __forceinline__ void flush(CmpStats* st) {
    for (int o = 16; o > 0; o >>= 1) {
      ssd += __shfl_xor_sync(0xffffffffu, ssd, o);
      ssr += __shfl_xor_sync(0xffffffffu, ssr, o);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      nd += __shfl_xor_sync(0xffffffffu, nd, o);
      nfx += __shfl_xor_sync(0xffffffffu, nfx, o);
      nfr += __shfl_xor_sync(0xffffffffu, nfr, o);
      nc += __shfl_xor_sync(0xffffffffu, nc, o);
    }
    if ((threadIdx.x & 31) == 0) {
      atomicAdd(&st->sum_sq_diff, ssd);
      atomicAdd(&st->sum_sq_ref, ssr);
      atomicMax(&st->max_abs_bits, __float_as_uint(mx));
      atomicAdd(&st->n_diff, nd);
      atomicAdd(&st->n_nonfinite_x, nfx);
      atomicAdd(&st->n_nonfinite_ref, nfr);
      atomicAdd(&st->n_cmp, nc);
    }
  }
};

// ref[i] vs x[i], i < n
__global__ void compare_bf16(const bf16* __restrict__ ref, const bf16* __restrict__ x, size_t n, CmpStats* st) {
  CmpAcc acc;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    acc.add(ref[i], x[i]);
  acc.flush(st);
}

// ref[j, :] vs x[map[j], :] for the rows j < rows with map[j] >= 0 (one block per row at a time)
__global__ void compare_rows_bf16(const bf16* __restrict__ ref, const bf16* __restrict__ x,
                                  const int32_t* __restrict__ map, int rows, int N, CmpStats* st) {
  CmpAcc acc;
  for (int j = blockIdx.x; j < rows; j += gridDim.x) {
    const int xr = map[j];
    if (xr < 0) continue;
    for (int n = threadIdx.x; n < N; n += blockDim.x) acc.add(ref[(size_t)j * N + n], x[(size_t)xr * N + n]);
  }
  acc.flush(st);
}

// Runs launch(stats) on s into zeroed device stats and returns them
template <class F>
static CmpStats run_compare(cudaStream_t s, const char* what, F launch) {
  CmpStats* d_st = nullptr;
  CK(cudaMalloc(&d_st, sizeof(CmpStats)));
  CK(cudaMemsetAsync(d_st, 0, sizeof(CmpStats), s));
  launch(d_st);
  CK(cudaGetLastError());
  CmpStats h{};
  CK(cudaMemcpyAsync(&h, d_st, sizeof(CmpStats), cudaMemcpyDeviceToHost, s));
  sync_or_die(s, what);
  CK(cudaFree(d_st));
  return h;
}

static CmpStats compare_on_device(const bf16* ref, const bf16* x, size_t n, cudaStream_t s) {
  return run_compare(s, "compare_bf16", [&](CmpStats* st) { compare_bf16<<<1024, 256, 0, s>>>(ref, x, n, st); });
}

static CmpStats compare_rows_on_device(const bf16* ref, const bf16* x, const int32_t* d_map, int rows, int N,
                                       cudaStream_t s) {
  return run_compare(s, "compare_rows_bf16",
                     [&](CmpStats* st) { compare_rows_bf16<<<2048, 256, 0, s>>>(ref, x, d_map, rows, N, st); });
}

static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static float max_abs_of(const CmpStats& c) {
  float mx;
  std::memcpy(&mx, &c.max_abs_bits, 4);
  return mx;
}

// ------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------
struct Problem {
  int G, M, N, K;
  const bf16* a;
  const bf16* b;
  const int32_t* offs;  // device [G + 1]
};

// A problem on the device: A [M, K] and B [G, N, K] filled N(0, 1) * 0.1 (seeds seed, seed + 1), the offsets
// uploaded, n_outs [M, N] outputs allocated (not cleared)
struct DevProblem {
  Problem pr{};
  bf16 *a = nullptr, *b = nullptr;
  int32_t* offs = nullptr;
  std::vector<bf16*> outs;
  void init(const std::vector<int32_t>& h_offs, int M, int N, int K, uint64_t seed, int fill_blocks, int n_outs,
            cudaStream_t s) {
    const int G = (int)h_offs.size() - 1;
    CK(cudaMalloc(&a, (size_t)M * K * 2));
    CK(cudaMalloc(&b, (size_t)G * N * K * 2));
    CK(cudaMalloc(&offs, (G + 1) * 4));
    CK(cudaMemcpy(offs, h_offs.data(), (G + 1) * 4, cudaMemcpyHostToDevice));
    fill_normal_bf16<<<fill_blocks, 256, 0, s>>>(a, (size_t)M * K, seed, 0.1f);
    CK(cudaGetLastError());
    fill_normal_bf16<<<fill_blocks, 256, 0, s>>>(b, (size_t)G * N * K, seed + 1, 0.1f);
    CK(cudaGetLastError());
    outs.assign(n_outs, nullptr);
    for (auto& o : outs) CK(cudaMalloc(&o, (size_t)M * N * 2));
    pr = Problem{G, M, N, K, a, b, offs};
  }
  void release() {
    for (auto& o : outs) CK(cudaFree(o));
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(offs));
  }
};

// kVt = false: big_tile_gemm_kernel<C> (A box kBlockM rows); true: vt_gemm_kernel<C> (A box 64 rows, tile_order)
template <class C, bool kVt = false>
struct BigTile {
  CUtensorMap ma, mb, md;
  proto192::BigTileParams p;
  int grid = 0;
  void init(const Problem& pr, bf16* d, int sms, int tile_order = 0) {
    char err[512] = {0};
    using deep_gemm::sm90::host::make_map;
    if (pr.K < 8 || pr.K % 8 != 0 || pr.N % 8 != 0 || pr.G < 1 || pr.G > deep_gemm::sm90::kMaxGroups) {
      std::fprintf(stderr, "BigTile: unsupported problem (K >= 8, K and N multiples of 8, 1 <= G <= 1024)\n");
      std::exit(1);
    }
    {
      const uint64_t dims[2] = {(uint64_t)pr.K, (uint64_t)pr.M};
      const uint64_t strides[1] = {(uint64_t)pr.K * 2};
      const uint32_t box[2] = {64, (uint32_t)(kVt ? 64 : C::kBlockM)};
      if (make_map(&ma, pr.a, 2, dims, strides, box, err, sizeof(err))) {
        std::fprintf(stderr, "tensor map A: %s\n", err);
        std::exit(1);
      }
    }
    {
      const uint64_t dims[3] = {(uint64_t)pr.K, (uint64_t)pr.N, (uint64_t)pr.G};
      const uint64_t strides[2] = {(uint64_t)pr.K * 2, (uint64_t)pr.N * pr.K * 2};
      const uint32_t box[3] = {64, (uint32_t)C::kBlockN, 1};
      if (make_map(&mb, pr.b, 3, dims, strides, box, err, sizeof(err))) {
        std::fprintf(stderr, "tensor map B: %s\n", err);
        std::exit(1);
      }
    }
    {
      const uint64_t dims[2] = {(uint64_t)pr.N, (uint64_t)pr.M};
      const uint64_t strides[1] = {(uint64_t)pr.N * 2};
      const uint32_t box[2] = {64, 64};
      if (make_map(&md, d, 2, dims, strides, box, err, sizeof(err))) {
        std::fprintf(stderr, "tensor map D: %s\n", err);
        std::exit(1);
      }
    }
    p = proto192::BigTileParams{};
    p.group_offsets = pr.offs;
    p.d = d;
    p.ldd = pr.N;
    p.m_total = pr.M;
    p.n = pr.N;
    p.k = pr.K;
    p.num_groups = pr.G;
    p.l2_hints = deep_gemm::sm90::host::l2_hints_from_env("PK_GEMM_L2HINT", 9);  // as the baseline
    p.tile_order = tile_order;
    const int64_t n_blocks = (pr.N + C::kBlockN - 1) / C::kBlockN;
    const int64_t min_m = kVt ? 128 : C::kBlockM;  // VT: every tile but the tall ones has 128 rows
    const int64_t max_units = ((int64_t)(pr.M + min_m - 1) / min_m + pr.G) * n_blocks;
    grid = (int)std::min<int64_t>(sms, std::max<int64_t>(max_units, 1));
    if constexpr (kVt)
      CK(cudaFuncSetAttribute(proto192::vt_gemm_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              C::kSmemBytes));
    else
      CK(cudaFuncSetAttribute(proto192::big_tile_gemm_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              C::kSmemBytes));
  }
  void launch(cudaStream_t s) const {
    if constexpr (kVt)
      proto192::vt_gemm_kernel<C><<<grid, C::kThreads, C::kSmemBytes, s>>>(ma, mb, md, p);
    else
      proto192::big_tile_gemm_kernel<C><<<grid, C::kThreads, C::kSmemBytes, s>>>(ma, mb, md, p);
    CK(cudaGetLastError());
  }
};
using VtTile = BigTile<proto192::CfgVT, true>;

static void launch_baseline(const Problem& pr, bf16* d, cudaStream_t s) {
  char err[512] = {0};
  const int rc = deep_gemm::sm90::m_grouped_bf16_gemm(pr.a, pr.K, pr.b, true, pr.K, (int64_t)pr.N * pr.K, d, pr.N,
                                                      pr.offs, pr.G, pr.M, pr.N, pr.K, nullptr, s, err, sizeof(err));
  if (rc != 0) {
    std::fprintf(stderr, "m_grouped_bf16_gemm failed (rc %d): %s\n", rc, err);
    std::exit(1);
  }
}

static std::string base_tile_name(const Problem& pr) {
  const deep_gemm::sm90::GroupedGemmConfig bc = deep_gemm::sm90::m_grouped_gemm_config(pr.M, pr.N, pr.K, pr.G);
  char t[64];
  std::snprintf(t, sizeof(t), "%dx%d s%d%s", bc.block_m, bc.block_n, bc.num_stages, bc.async_epilogue ? " async" : "");
  return t;
}

struct Variant {
  std::string name;
  std::string tile;
  bf16* d = nullptr;
  std::function<void(cudaStream_t)> launch;
};

// Round 1's variants on pr: BASE, V3, V3s, V2 writing outs[0..3] (k must outlive the returned launchers)
struct Round1Kernels {
  BigTile<proto192::CfgV3> v3;
  BigTile<proto192::CfgV3s> v3s;
  BigTile<proto192::CfgV2> v2;
};
static std::vector<Variant> round1_variants(const Problem& pr, const std::vector<bf16*>& outs, int sms,
                                            Round1Kernels& k) {
  k.v3.init(pr, outs[1], sms);
  k.v3s.init(pr, outs[2], sms);
  k.v2.init(pr, outs[3], sms);
  return {Variant{"BASE", base_tile_name(pr), outs[0], [pr, d = outs[0]](cudaStream_t st) { launch_baseline(pr, d, st); }},
          Variant{"V3", "192x256 s3 384t", outs[1], [v = &k.v3](cudaStream_t st) { v->launch(st); }},
          Variant{"V3s", "192x256 s3 512t n128x2", outs[2], [v = &k.v3s](cudaStream_t st) { v->launch(st); }},
          Variant{"V2", "256x192 s3 384t", outs[3], [v = &k.v2](cudaStream_t st) { v->launch(st); }}};
}

// host mirror of the VT tile split (vt_gemm.cuh): m-tiles of a group and whether it has a tall tile
static int64_t vt_tiles_of(const std::vector<int>& sizes, int N, int64_t* tall_tiles = nullptr) {
  const int64_t nb = (N + 255) / 256;
  int64_t t = 0, tall = 0;
  for (int c : sizes) {
    t += proto192::vt_m_tiles(c) * nb;
    tall += proto192::vt_has_tall(c) ? nb : 0;
  }
  if (tall_tiles != nullptr) *tall_tiles = tall;
  return t;
}

// CPU float64 reference: out[i][n] = sum_k A_row_i[k] * B_i[n, k], for sampled rows i (arows[i]: the row's K bf16
// values; bslices[i]: its group's [N, K] slice of B, bf16 bits).
static void cpu_rows(const std::vector<const uint16_t*>& arows, const std::vector<const uint16_t*>& bslices, int N,
                     int K, std::vector<double>& out) {
  out.assign(arows.size() * (size_t)N, 0.0);
  std::vector<double> arow(K);
  for (size_t i = 0; i < arows.size(); ++i) {
    for (int k = 0; k < K; ++k) arow[k] = bf2f(arows[i][k]);
    for (int n = 0; n < N; ++n) {
      const uint16_t* br = bslices[i] + (size_t)n * K;
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += arow[k] * (double)bf2f(br[k]);
      out[i * (size_t)N + n] = acc;
    }
  }
}

// Appends rows row0 + l (group g) for the distinct l of loc with 0 <= l < c (c: the group's rows)
static void add_sample_rows(std::vector<int> loc, int c, int row0, int g, std::vector<int>& rows,
                            std::vector<int>& row_group) {
  std::sort(loc.begin(), loc.end());
  loc.erase(std::unique(loc.begin(), loc.end()), loc.end());
  for (int l : loc)
    if (l >= 0 && l < c) {
      rows.push_back(row0 + l);
      row_group.push_back(g);
    }
}

// bf16 output against the float64 reference: |d - ref| <= 2^-7 |ref| + 1e-3 (bf16 rounding plus fp32 accumulation)
struct RefErr {
  double max_abs = 0, max_rel = 0;
  long bad = 0;
};
static void ref_check(RefErr& e, float v, double ref) {
  const double d = std::fabs((double)v - ref);
  if (!(d <= 0.0078125 * std::fabs(ref) + 1e-3)) ++e.bad;  // NaN counts as bad
  if (std::isfinite(d)) {
    e.max_abs = std::max(e.max_abs, d);
    e.max_rel = std::max(e.max_rel, d / (std::fabs(ref) + 1e-3));
  }
}

// ------------------------------------------------------------------------------------------------
// Ragged correctness test: empty groups, groups of 1..63 rows, tails that become tall tiles (129, 192, 1040, 1088)
// and tails that do not (65, 193, 1000, 1089), exact multiples (128, 256, 1152), 37 trailing rows in no group
// (the last group's tall tile runs past the end of A: TMA zero fill), N and K not multiples of the tile.
// Every output starts NaN. VT must equal BASE bitwise on every group row.
// round1 (--equal768): round 1's test instead: BASE, V3, V3s, V2 on groups of 0, 1, 63, 69, 192, 200, 257, 500, 0,
// 130 rows (partial m-blocks of every round-1 tile), every group row vs float64 CPU; no VT.
// ------------------------------------------------------------------------------------------------
static bool ragged_test(int sms, cudaStream_t s, bool round1) {
  const std::vector<int> sizes =
      round1 ? std::vector<int>{0, 1, 63, 69, 192, 200, 257, 500, 0, 130}
             : std::vector<int>{0,   1,   17,  63,   64,   65,   127,  128,  129, 0,   192,
                                193, 256, 1000, 1040, 1088, 1089, 1152, 200, 500, 130, 1040};
  const int G = (int)sizes.size();
  std::vector<int32_t> offs(G + 1, 0);
  for (int g = 0; g < G; ++g) offs[g + 1] = offs[g] + sizes[g];
  const int M = offs[G] + 37;  // 37 trailing rows in no group
  const int N = 456, K = 328;
  const int kNumVar = round1 ? 4 : 6;
  DevProblem dp;
  dp.init(offs, M, N, K, 11, 256, kNumVar, s);
  const Problem& pr = dp.pr;
  const std::vector<bf16*>& outs = dp.outs;
  Round1Kernels r1;
  VtTile vtn, vtt;
  std::vector<Variant> vs = round1_variants(pr, outs, sms, r1);
  if (!round1) {
    vtn.init(pr, outs[4], sms, 0);
    vtt.init(pr, outs[5], sms, 1);
    vs.push_back(Variant{"VT-nat", "128|128+r x256 natural", outs[4], [&vtn](cudaStream_t st) { vtn.launch(st); }});
    vs.push_back(Variant{"VT-tl", "128|128+r x256 tall-last", outs[5], [&vtt](cudaStream_t st) { vtt.launch(st); }});
  }
  for (auto& v : vs) {
    CK(cudaMemsetAsync(v.d, 0xFF, (size_t)M * N * 2, s));  // NaN sentinel
    v.launch(s);
    sync_or_die(s, (std::string("ragged test, ") + v.name).c_str());
  }
  std::vector<uint16_t> a_h((size_t)M * K), b_h((size_t)G * N * K);
  CK(cudaMemcpy(a_h.data(), dp.a, a_h.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b_h.data(), dp.b, b_h.size() * 2, cudaMemcpyDeviceToHost));
  // sampled rows (round 1: every group row): the edges of every 64-row slice around the tiles' seams, the tails,
  // the middle
  std::vector<int> rows, row_group;
  for (int g = 0; g < G; ++g) {
    const int c = sizes[g];
    std::vector<int> loc = {0, 1, 31, 63, 64, 65, 127, 128, 129, 150, 191, 192, c / 2, c - 66, c - 65, c - 64,
                            c - 63, c - 2, c - 1};
    if (round1) {
      loc.resize(c);
      for (int l = 0; l < c; ++l) loc[l] = l;
    }
    add_sample_rows(loc, c, offs[g], g, rows, row_group);
  }
  std::vector<const uint16_t*> arows, bslices;
  for (size_t i = 0; i < rows.size(); ++i) {
    arows.push_back(a_h.data() + (size_t)rows[i] * K);
    bslices.push_back(b_h.data() + (size_t)row_group[i] * N * K);
  }
  std::vector<double> ref;
  cpu_rows(arows, bslices, N, K, ref);
  std::vector<uint16_t> base_h((size_t)M * N), d_h((size_t)M * N);
  CK(cudaMemcpy(base_h.data(), outs[0], base_h.size() * 2, cudaMemcpyDeviceToHost));
  bool ok = true;
  int64_t tall_tiles = 0;
  const int64_t vt_tiles = vt_tiles_of(sizes, N, &tall_tiles);
  if (round1)
    std::printf("ragged test: G=%d (sizes incl. 0, 1, 63, 257), M=%d (37 rows in no group), N=%d, K=%d\n", G, M, N, K);
  else
    std::printf("ragged test: G=%d (sizes 0, 1..63, 64, 65, 127..129, 192, 193, 1000, 1040, 1088, 1089, 1152, ...), "
                "M=%d (37 rows in no group), N=%d, K=%d; VT: %lld tiles, %lld tall; %zu sampled rows vs float64\n",
                G, M, N, K, (long long)vt_tiles, (long long)tall_tiles, rows.size());
  for (int vi = 0; vi < kNumVar; ++vi) {
    const Variant& v = vs[vi];
    CK(cudaMemcpy(d_h.data(), v.d, d_h.size() * 2, cudaMemcpyDeviceToHost));
    RefErr e;
    for (size_t i = 0; i < rows.size(); ++i)
      for (int n = 0; n < N; ++n) ref_check(e, bf2f(d_h[(size_t)rows[i] * N + n]), ref[i * (size_t)N + n]);
    long neq_base = 0, nonfinite = 0, outside_written = 0;
    for (int r = 0; r < offs[G]; ++r)
      for (int n = 0; n < N; ++n) {
        const size_t idx = (size_t)r * N + n;
        neq_base += d_h[idx] != base_h[idx];
        nonfinite += !std::isfinite(bf2f(d_h[idx]));
      }
    for (int r = offs[G]; r < M; ++r)
      for (int n = 0; n < N; ++n) outside_written += d_h[(size_t)r * N + n] != 0xFFFF;
    const bool is_vt = vi >= 4;  // VT must equal BASE bitwise; round-1 variants are reported only
    const bool pass = e.bad == 0 && outside_written == 0 && nonfinite == 0 && (!is_vt || neq_base == 0);
    ok = ok && pass;
    std::printf("  %-6s vs cpu: max abs %.3e, max rel %.3e, out of tol %ld | != BASE: %ld%s | NaN in groups: %ld | "
                "rows outside groups written: %ld  %s\n",
                v.name.c_str(), e.max_abs, e.max_rel, e.bad, neq_base, is_vt ? " (must be 0)" : "", nonfinite,
                outside_written, pass ? "PASS" : "FAIL");
  }
  dp.release();
  return ok;
}

// ------------------------------------------------------------------------------------------------
// Timed problems: MoE-like (round 2), equal groups of 768 rows (round 1, --equal768)
// ------------------------------------------------------------------------------------------------
struct Meas {
  double burst_ms = NAN, steady_ms = NAN, watts = NAN, j_call = NAN, mhz = NAN;
};

static double median(std::vector<double> v) {
  std::vector<double> f;
  for (double x : v)
    if (std::isfinite(x)) f.push_back(x);
  if (f.empty()) return NAN;
  std::sort(f.begin(), f.end());
  const size_t n = f.size();
  return n % 2 ? f[n / 2] : 0.5 * (f[n / 2 - 1] + f[n / 2]);
}

static Meas measure(const Variant& v, cudaStream_t s, double steady_s) {
  Meas m;
  constexpr int kWarm = 5, kTimed = 20;
  cudaEvent_t ev[2 * kTimed];
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < kWarm; ++i) v.launch(s);
  for (int i = 0; i < kTimed; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    v.launch(s);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  sync_or_die(s, (v.name + " burst").c_str());
  std::vector<double> t(kTimed);
  for (int i = 0; i < kTimed; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t[i] = ms;
  }
  m.burst_ms = median(t);
  // steady: back-to-back launches for ~steady_s, energy counter polled meanwhile
  const int n = (int)std::min(200000.0, std::max(3.0, std::ceil(steady_s * 1000.0 / m.burst_ms)));
  EnergyPoller poll;
  poll.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const double t0 = now_s();
  CK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < n; ++i) v.launch(s);
  CK(cudaEventRecord(ev[1], s));
  sync_or_die(s, (v.name + " steady").c_str(), 60.0);
  const double t1 = now_s();
  poll.finish();
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
  m.steady_ms = ms / n;
  m.watts = poll.power_w(t0, t1);
  m.j_call = m.watts * m.steady_ms / 1000.0;
  m.mhz = poll.mean_clock();
  for (auto& e : ev) CK(cudaEventDestroy(e));
  return m;
}

// Interleaved rounds (the variant order rotates every round), each measurement printed; ms[variant][round]
static std::vector<std::vector<Meas>> time_rounds(const std::vector<const Variant*>& vs, cudaStream_t s, int rounds,
                                                  double steady_s, int name_width) {
  const int nv = (int)vs.size();
  std::vector<std::vector<Meas>> ms(nv);
  for (int r = 0; r < rounds; ++r) {
    for (int j = 0; j < nv; ++j) {
      const int vi = (j + r) % nv;
      ms[vi].push_back(measure(*vs[vi], s, steady_s));
      const Meas& m = ms[vi].back();
      std::printf("  round %d %-*s burst %.4f ms steady %.4f ms %.1f W %.3f J/call %.0f MHz\n", r, name_width,
                  vs[vi]->name.c_str(), m.burst_ms, m.steady_ms, m.watts, m.j_call, m.mhz);
      std::fflush(stdout);
    }
  }
  return ms;
}

// every field's median over the rounds
static Meas median_of(const std::vector<Meas>& ms) {
  std::vector<double> bu, st, w, j, mhz;
  for (const Meas& m : ms) {
    bu.push_back(m.burst_ms);
    st.push_back(m.steady_ms);
    w.push_back(m.watts);
    j.push_back(m.j_call);
    mhz.push_back(m.mhz);
  }
  Meas r;
  r.burst_ms = median(bu);
  r.steady_ms = median(st);
  r.watts = median(w);
  r.j_call = median(j);
  r.mhz = median(mhz);
  return r;
}

// c_g = 1024 + round(32 z_g), z_g standard normal (Box-Muller on splitmix64 of a fixed seed), clamped to [900, 1150]
static std::vector<int> moe_counts(int G, uint64_t seed) {
  std::vector<int> c(G);
  for (int g = 0; g < G; ++g) {
    const uint64_t h = splitmix64(seed * 0x100000001B3ull + (uint64_t)g);
    const double u1 = ((double)(h >> 40) + 0.5) / 16777216.0;
    const double u2 = ((double)(h & 0xFFFFFFull) + 0.5) / 16777216.0;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    c[g] = std::min(1150, std::max(900, 1024 + (int)std::lround(32.0 * z)));
  }
  return c;
}

struct TimedVariant {
  Variant v;
  std::string layout;
  int64_t tiles = 0;
  double useful_flops = 0;
  size_t out_rows = 0;
  std::vector<int32_t> map;  // row j of the unpadded layout -> row of this variant's output (-1: not comparable)
  std::string note;
};

static bool run_moe_shape(const std::vector<int>& counts, int N, int K, int sms, cudaStream_t s, int rounds,
                          double steady_s) {
  const int G = (int)counts.size();
  constexpr int kEqualRows = 1024;
  // layouts: U = unpadded (the routed rows as they are), P = every group padded to a multiple of 128 rows with
  // zero rows (the offsets are padded), E = equal groups of 1024 rows
  std::vector<int32_t> offs_u(G + 1, 0), offs_p(G + 1, 0), offs_e(G + 1, 0);
  int n_tall = 0;
  int64_t base_mblocks = 0;
  for (int g = 0; g < G; ++g) {
    const int c = counts[g];
    offs_u[g + 1] = offs_u[g] + c;
    offs_p[g + 1] = offs_p[g] + (c + 127) / 128 * 128;
    offs_e[g + 1] = offs_e[g] + kEqualRows;
    n_tall += proto192::vt_has_tall(c) ? 1 : 0;
    base_mblocks += (c + 127) / 128;
  }
  const int M_u = offs_u[G], M_p = offs_p[G], M_e = offs_e[G];
  const int M_a = std::max(M_u, M_e);
  const double flops_u = 2.0 * M_u * (double)N * K, flops_e = 2.0 * M_e * (double)N * K;
  int64_t vt_tall_tiles = 0;
  const int64_t vt_tiles = vt_tiles_of(counts, N, &vt_tall_tiles);
  const int cmin = *std::min_element(counts.begin(), counts.end());
  const int cmax = *std::max_element(counts.begin(), counts.end());
  std::printf("\n=== MoE shape G=%d, N=%d, K=%d (K-major B): %.1f useful GFLOP per call\n", G, N, K, flops_u * 1e-9);
  std::printf("  rows: total %d (min %d, max %d per group; equal layout %d x %d = %d, padded layout %d), groups with "
              "1 <= r <= 64 (tall tiles): %d of %d, BASE 128-row m-blocks: %lld (equal groups: %d), VT m-tiles: %lld "
              "(%lld tiles, %lld tall)\n",
              M_u, cmin, cmax, G, kEqualRows, M_e, M_p, n_tall, G, (long long)base_mblocks, G * kEqualRows / 128,
              (long long)(vt_tiles / ((N + 255) / 256)), (long long)vt_tiles, (long long)vt_tall_tiles);
  bf16 *a_u, *a_p, *b;
  int32_t *d_offs_u, *d_offs_p, *d_offs_e;
  CK(cudaMalloc(&a_u, (size_t)M_a * K * 2));
  CK(cudaMalloc(&a_p, (size_t)M_p * K * 2));
  CK(cudaMalloc(&b, (size_t)G * N * K * 2));
  CK(cudaMalloc(&d_offs_u, (G + 1) * 4));
  CK(cudaMalloc(&d_offs_p, (G + 1) * 4));
  CK(cudaMalloc(&d_offs_e, (G + 1) * 4));
  CK(cudaMemcpy(d_offs_u, offs_u.data(), (G + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_offs_p, offs_p.data(), (G + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_offs_e, offs_e.data(), (G + 1) * 4, cudaMemcpyHostToDevice));
  fill_normal_bf16<<<4096, 256, 0, s>>>(a_u, (size_t)M_a * K, 1, 0.1f);
  CK(cudaGetLastError());
  fill_normal_bf16<<<4096, 256, 0, s>>>(b, (size_t)G * N * K, 2, 0.1f);
  CK(cudaGetLastError());
  CK(cudaMemsetAsync(a_p, 0, (size_t)M_p * K * 2, s));
  for (int g = 0; g < G; ++g)
    CK(cudaMemcpyAsync(a_p + (size_t)offs_p[g] * K, a_u + (size_t)offs_u[g] * K, (size_t)counts[g] * K * 2,
                       cudaMemcpyDeviceToDevice, s));
  sync_or_die(s, "fill");

  const Problem pu{G, M_u, N, K, a_u, b, d_offs_u};
  const Problem pp{G, M_p, N, K, a_p, b, d_offs_p};
  const Problem pe{G, M_e, N, K, a_u, b, d_offs_e};  // the first M_e rows of A
  constexpr int kNumVar = 6;
  std::vector<TimedVariant> tv(kNumVar);
  std::vector<bf16*> outs(kNumVar, nullptr);
  const size_t out_rows[kNumVar] = {(size_t)M_u, (size_t)M_p, (size_t)M_u, (size_t)M_u, (size_t)M_e, (size_t)M_e};
  for (int i = 0; i < kNumVar; ++i) CK(cudaMalloc(&outs[i], out_rows[i] * N * 2));
  VtTile vtn, vtt, vte;
  vtn.init(pu, outs[2], sms, 0);
  vtt.init(pu, outs[3], sms, 1);
  vte.init(pe, outs[5], sms, 0);
  const deep_gemm::sm90::GroupedGemmConfig bc = deep_gemm::sm90::m_grouped_gemm_config(M_u, N, K, G);
  const int64_t bnb = (N + bc.block_n - 1) / bc.block_n;
  int64_t base_tiles_u = 0, base_tiles_p = 0;
  for (int g = 0; g < G; ++g) {
    base_tiles_u += (counts[g] + bc.block_m - 1) / bc.block_m * bnb;
    base_tiles_p += ((offs_p[g + 1] - offs_p[g]) + bc.block_m - 1) / bc.block_m * bnb;
  }
  const int64_t base_tiles_e = (int64_t)G * ((kEqualRows + bc.block_m - 1) / bc.block_m) * bnb;
  // maps of the unpadded rows
  std::vector<int32_t> map_id(M_u), map_p(M_u), map_e(M_u, -1);
  int n_cmp_e = 0;
  for (int g = 0; g < G; ++g)
    for (int r = offs_u[g]; r < offs_u[g + 1]; ++r) {
      map_id[r] = r;
      map_p[r] = offs_p[g] + (r - offs_u[g]);
      if (r < M_e && r / kEqualRows == g) {  // row r is in group g in both layouts: same A row, same B slice
        map_e[r] = r;
        ++n_cmp_e;
      }
    }
  tv[0] = {Variant{"BASE-u", base_tile_name(pu), outs[0], [pu, d = outs[0]](cudaStream_t st) { launch_baseline(pu, d, st); }},
           "unpadded", base_tiles_u, flops_u, out_rows[0], map_id, ""};
  tv[1] = {Variant{"BASE-p", base_tile_name(pp), outs[1], [pp, d = outs[1]](cudaStream_t st) { launch_baseline(pp, d, st); }},
           "padded128", base_tiles_p, flops_u, out_rows[1], map_p, "useful rows only (padding rows not counted)"};
  tv[2] = {Variant{"VT-nat", "128|128+r x256 nat", outs[2], [&vtn](cudaStream_t st) { vtn.launch(st); }},
           "unpadded", vt_tiles, flops_u, out_rows[2], map_id, ""};
  tv[3] = {Variant{"VT-tl", "128|128+r x256 t-last", outs[3], [&vtt](cudaStream_t st) { vtt.launch(st); }},
           "unpadded", vt_tiles, flops_u, out_rows[3], map_id, ""};
  tv[4] = {Variant{"BASE-e", base_tile_name(pe), outs[4], [pe, d = outs[4]](cudaStream_t st) { launch_baseline(pe, d, st); }},
           "equal1024", base_tiles_e, flops_e, out_rows[4], map_e,
           "other FLOPs (M=" + std::to_string(M_e) + "); compared: rows in the same group in both layouts only"};
  // extra (not in the brief's list): VT's own floor. On equal groups of 1024 rows every VT tile has 128 rows
  // (warpgroup 2 idle), so VT-e vs BASE-e is the VT kernel's efficiency on regular tiles, separating it from the
  // tail effect in VT-nat / VT-tl vs BASE-u.
  tv[5] = {Variant{"VT-e", "128 x256 (no tails)", outs[5], [&vte](cudaStream_t st) { vte.launch(st); }}, "equal1024",
           (int64_t)G * (kEqualRows / 128) * ((N + 255) / 256), flops_e, out_rows[5], map_e,
           "extra: VT on the equal layout; compared as BASE-e"};

  // ---- correctness: every output starts as NaN; each vs BASE-u on the comparable useful rows (bitwise), the full
  //      output finite (every row of every layout is in a group), sampled rows vs float64
  for (auto& t : tv) {
    CK(cudaMemsetAsync(t.v.d, 0xFF, t.out_rows * N * 2, s));
    t.v.launch(s);
    sync_or_die(s, (t.v.name + " first run").c_str());
  }
  // sampled unpadded rows: group 0, the first group with a tall tile, the first with a tail of > 64 rows, the last
  std::vector<int> sg = {0};
  for (int g = 0; g < G; ++g)
    if (proto192::vt_has_tall(counts[g])) {
      sg.push_back(g);
      break;
    }
  for (int g = 0; g < G; ++g)
    if ((counts[g] & 127) > 64) {
      sg.push_back(g);
      break;
    }
  sg.push_back(G - 1);
  std::sort(sg.begin(), sg.end());
  sg.erase(std::unique(sg.begin(), sg.end()), sg.end());
  std::vector<int> rows, row_group;
  for (int g : sg) {
    const int c = counts[g], q = c >> 7;
    add_sample_rows({0, 191, 128 * (q - 1), 128 * q - 1, 128 * q, c - 1}, c, offs_u[g], g, rows, row_group);
  }
  std::vector<std::vector<uint16_t>> a_rows_h(rows.size(), std::vector<uint16_t>(K));
  std::vector<std::vector<uint16_t>> b_slices_h(sg.size(), std::vector<uint16_t>((size_t)N * K));
  std::vector<const uint16_t*> arows, bslices;
  for (size_t j = 0; j < sg.size(); ++j)
    CK(cudaMemcpy(b_slices_h[j].data(), b + (size_t)sg[j] * N * K, (size_t)N * K * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < rows.size(); ++i) {
    CK(cudaMemcpy(a_rows_h[i].data(), a_u + (size_t)rows[i] * K, (size_t)K * 2, cudaMemcpyDeviceToHost));
    arows.push_back(a_rows_h[i].data());
    bslices.push_back(b_slices_h[std::find(sg.begin(), sg.end(), row_group[i]) - sg.begin()].data());
  }
  std::vector<double> ref;
  cpu_rows(arows, bslices, N, K, ref);
  bool ok = true;
  std::vector<float> maxdiff(kNumVar, NAN);
  std::vector<unsigned long long> ndiff(kNumVar, 0), ncmp_rows(kNumVar, 0);
  std::vector<uint16_t> row_h(N);
  for (int vi = 0; vi < kNumVar; ++vi) {
    const TimedVariant& t = tv[vi];
    int32_t* d_map;
    CK(cudaMalloc(&d_map, (size_t)M_u * 4));
    CK(cudaMemcpy(d_map, t.map.data(), (size_t)M_u * 4, cudaMemcpyHostToDevice));
    const CmpStats c = compare_rows_on_device(tv[0].v.d, t.v.d, d_map, M_u, N, s);
    CK(cudaFree(d_map));
    const CmpStats whole = compare_on_device(t.v.d, t.v.d, t.out_rows * N, s);  // NaN / unwritten anywhere
    RefErr e;
    int n_ref_rows = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int xr = t.map[rows[i]];
      if (xr < 0) continue;
      ++n_ref_rows;
      CK(cudaMemcpy(row_h.data(), t.v.d + (size_t)xr * N, (size_t)N * 2, cudaMemcpyDeviceToHost));
      for (int n = 0; n < N; ++n) ref_check(e, bf2f(row_h[n]), ref[i * (size_t)N + n]);
    }
    maxdiff[vi] = max_abs_of(c);
    ndiff[vi] = c.n_diff;
    ncmp_rows[vi] = c.n_cmp / (unsigned long long)N;
    const bool pass = e.bad == 0 && whole.n_nonfinite_x == 0 && c.n_nonfinite_x == 0 && c.n_diff == 0;
    ok = ok && pass;
    std::printf("  check %-6s: vs cpu (%d rows) max abs %.3e max rel %.3e out of tol %ld | vs BASE-u: %llu rows "
                "compared, bitwise diff %llu, max abs %.3e | NaN/unwritten in output %llu  %s%s%s\n",
                t.v.name.c_str(), n_ref_rows, e.max_abs, e.max_rel, e.bad, ncmp_rows[vi], (unsigned long long)c.n_diff,
                maxdiff[vi], (unsigned long long)whole.n_nonfinite_x, pass ? "PASS" : "FAIL",
                t.note.empty() ? "" : "  (", t.note.empty() ? "" : (t.note + ")").c_str());
  }

  // ---- timing: interleaved rounds (the variant order rotates every round)
  std::vector<const Variant*> tvv;
  for (const TimedVariant& t : tv) tvv.push_back(&t.v);
  const std::vector<std::vector<Meas>> ms = time_rounds(tvv, s, rounds, steady_s, 6);
  std::printf("\n  %-15s %-6s %-9s %-20s %6s %6s %9s %9s %7s %7s %8s %8s %6s %7s %7s %10s %s\n", "shape", "var",
              "layout", "tile", "tiles", "waves", "burst ms", "steady ms", "W", "J/call", "uTFLOP/s", "pJ/uFLOP", "MHz",
              "t/BASEu", "J/BASEu", "maxdiff", "bitwise diff (rows compared)");
  char shape[64];
  std::snprintf(shape, sizeof(shape), "G%d N%d K%d", G, N, K);
  double st0 = NAN, j0 = NAN;
  for (int vi = 0; vi < kNumVar; ++vi) {
    const Meas md = median_of(ms[vi]);
    const TimedVariant& t = tv[vi];
    const double sm = md.steady_ms, jm = md.j_call;
    if (vi == 0) {
      st0 = sm;
      j0 = jm;
    }
    std::printf("  %-15s %-6s %-9s %-20s %6lld %6.2f %9.4f %9.4f %7.1f %7.3f %8.1f %8.3f %6.0f %7.3f %7.3f %10.3e "
                "%llu (%llu)\n",
                shape, t.v.name.c_str(), t.layout.c_str(), t.v.tile.c_str(), (long long)t.tiles,
                (double)t.tiles / sms, md.burst_ms, sm, t.useful_flops / (sm * 1e-3) * 1e-12, md.watts, jm,
                jm / t.useful_flops * 1e12, md.mhz, sm / st0, jm / j0, maxdiff[vi], ndiff[vi], ncmp_rows[vi]);
  }
  std::printf("  (uTFLOP/s, pJ/uFLOP: useful FLOPs = 2 x rows in groups (not padding) x N x K; BASE-e has %d rows, "
              "the others %d; t/BASEu, J/BASEu: per call, not per FLOP)\n",
              M_e, M_u);
  std::fflush(stdout);
  for (auto& o : outs) CK(cudaFree(o));
  CK(cudaFree(a_u));
  CK(cudaFree(a_p));
  CK(cudaFree(b));
  CK(cudaFree(d_offs_u));
  CK(cudaFree(d_offs_p));
  CK(cudaFree(d_offs_e));
  return ok;
}

// Round 1 (--equal768): G equal groups of rows_per_group rows; BASE, V3, V3s, V2. Checks: every output starts NaN;
// sampled rows vs float64 CPU, the whole output vs BASE (relative Frobenius < 1e-2, no NaN / unwritten).
static bool run_equal_shape(int G, int rows_per_group, int N, int K, int sms, cudaStream_t s, int rounds,
                            double steady_s) {
  const int M = G * rows_per_group;
  const double flops = 2.0 * M * (double)N * K;
  std::printf("\n=== shape G=%d x %d rows (M=%d), N=%d, K=%d: %.1f GFLOP per call\n", G, rows_per_group, M, N, K,
              flops * 1e-9);
  std::vector<int32_t> offs(G + 1);
  for (int g = 0; g <= G; ++g) offs[g] = rows_per_group * g;
  DevProblem dp;
  dp.init(offs, M, N, K, 1, 4096, 4, s);
  const bf16* a = dp.a;
  const bf16* b = dp.b;
  Round1Kernels r1;
  const std::vector<Variant> vs = round1_variants(dp.pr, dp.outs, sms, r1);
  const deep_gemm::sm90::GroupedGemmConfig bc = deep_gemm::sm90::m_grouped_gemm_config(M, N, K, G);
  const int block_m[4] = {bc.block_m, proto192::CfgV3::kBlockM, proto192::CfgV3s::kBlockM, proto192::CfgV2::kBlockM};
  const int block_n[4] = {bc.block_n, proto192::CfgV3::kBlockN, proto192::CfgV3s::kBlockN, proto192::CfgV2::kBlockN};

  // ---- correctness: every output starts as NaN; BASE vs float64 CPU rows, others vs BASE (all) and CPU (rows)
  for (auto& v : vs) {
    CK(cudaMemsetAsync(v.d, 0xFF, (size_t)M * N * 2, s));
    v.launch(s);
    sync_or_die(s, (v.name + " first run").c_str());
  }
  const std::vector<int> groups = {0, 0, 37, 64, 101, G - 1};
  const std::vector<int> in_group = {0, rows_per_group - 1, 191, 255, 400, rows_per_group - 1};
  std::vector<int> rows, row_group;
  for (size_t i = 0; i < groups.size(); ++i) {
    const int g = std::min(groups[i], G - 1);
    rows.push_back(g * rows_per_group + std::min(in_group[i], rows_per_group - 1));
    row_group.push_back(g);
  }
  // host copies of the sampled A rows and of the B slices of their groups
  std::vector<std::vector<uint16_t>> a_rows_h(rows.size(), std::vector<uint16_t>(K));
  std::vector<std::vector<uint16_t>> b_slices_h;
  std::vector<int> slice_group;
  std::vector<const uint16_t*> arows, bslices;
  for (size_t i = 0; i < rows.size(); ++i) {
    CK(cudaMemcpy(a_rows_h[i].data(), a + (size_t)rows[i] * K, (size_t)K * 2, cudaMemcpyDeviceToHost));
    arows.push_back(a_rows_h[i].data());
  }
  b_slices_h.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    size_t j = 0;
    while (j < slice_group.size() && slice_group[j] != row_group[i]) ++j;
    if (j == slice_group.size()) {
      slice_group.push_back(row_group[i]);
      b_slices_h.emplace_back((size_t)N * K);
      CK(cudaMemcpy(b_slices_h.back().data(), b + (size_t)row_group[i] * N * K, (size_t)N * K * 2,
                    cudaMemcpyDeviceToHost));
    }
    bslices.push_back(b_slices_h[j].data());
  }
  std::vector<double> ref;
  cpu_rows(arows, bslices, N, K, ref);
  std::vector<double> maxdiff(vs.size(), 0.0), relfro(vs.size(), 0.0);
  bool ok = true;
  std::vector<uint16_t> row_h(N);
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    const Variant& v = vs[vi];
    RefErr e;
    for (size_t i = 0; i < rows.size(); ++i) {
      CK(cudaMemcpy(row_h.data(), v.d + (size_t)rows[i] * N, (size_t)N * 2, cudaMemcpyDeviceToHost));
      for (int n = 0; n < N; ++n) ref_check(e, bf2f(row_h[n]), ref[i * (size_t)N + n]);
    }
    const CmpStats c = compare_on_device(vs[0].d, v.d, (size_t)M * N, s);
    maxdiff[vi] = max_abs_of(c);
    relfro[vi] = c.sum_sq_ref > 0 ? std::sqrt(c.sum_sq_diff / c.sum_sq_ref) : NAN;
    const bool pass = e.bad == 0 && c.n_nonfinite_x == 0 && c.n_nonfinite_ref == 0 && relfro[vi] < 1e-2;
    ok = ok && pass;
    std::printf("  check %-4s: vs cpu (%zu rows) max abs %.3e max rel %.3e out of tol %ld | vs BASE: max abs %.3e, "
                "rel frob %.3e, bitwise diff %llu of %zu, NaN/unwritten %llu  %s\n",
                v.name.c_str(), rows.size(), e.max_abs, e.max_rel, e.bad, maxdiff[vi], relfro[vi],
                (unsigned long long)c.n_diff, (size_t)M * N, (unsigned long long)c.n_nonfinite_x,
                pass ? "PASS" : "FAIL");
  }

  // ---- timing: interleaved rounds (the variant order rotates every round)
  std::vector<const Variant*> vp;
  for (const Variant& v : vs) vp.push_back(&v);
  const std::vector<std::vector<Meas>> ms = time_rounds(vp, s, rounds, steady_s, 4);
  std::printf("\n  %-22s %-4s %-24s %6s %9s %9s %8s %7s %8s %8s %6s %10s %9s\n", "shape", "var", "tile", "waves",
              "burst ms", "steady ms", "TFLOP/s", "W", "J/call", "pJ/FLOP", "MHz", "maxdiff", "rel frob");
  char shape[64];
  std::snprintf(shape, sizeof(shape), "%dx%d N%d K%d", G, rows_per_group, N, K);
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    const Meas md = median_of(ms[vi]);
    const double tiles =
        (double)G * std::ceil((double)rows_per_group / block_m[vi]) * std::ceil((double)N / block_n[vi]);
    const double waves = tiles / sms;
    std::printf("  %-22s %-4s %-24s %6.2f %9.4f %9.4f %8.1f %7.1f %8.3f %8.3f %6.0f %10.3e %9.2e\n", shape,
                vs[vi].name.c_str(), vs[vi].tile.c_str(), waves, md.burst_ms, md.steady_ms,
                flops / (md.steady_ms * 1e-3) * 1e-12, md.watts, md.j_call, md.j_call / flops * 1e12, md.mhz,
                maxdiff[vi], relfro[vi]);
  }
  std::fflush(stdout);
  dp.release();
  return ok;
}

static int usage(const char* argv0, int rc) {
  std::fprintf(rc == 0 ? stdout : stderr,
               "usage: %s [--equal768] [steady_seconds (1.5)] [rounds (3)]\n"
               "  default: round 2 (VT, MoE-like ragged groups); --equal768: round 1 (BASE, V3, V3s, V2 on 128 equal "
               "groups of 768 rows)\n",
               argv0);
  return rc;
}

int main(int argc, char** argv) {
  bool equal768 = false;
  std::vector<const char*> pos;  // positional: steady_seconds, rounds
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--equal768") == 0)
      equal768 = true;
    else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0)
      return usage(argv[0], 0);
    else if (std::strncmp(argv[i], "--", 2) == 0 || pos.size() == 2)
      return usage(argv[0], 1);
    else
      pos.push_back(argv[i]);
  }
  const double steady_s = pos.size() > 0 ? std::atof(pos[0]) : 1.5;
  const int rounds = pos.size() > 1 ? std::max(1, std::atoi(pos[1])) : 3;
  const double t_start = now_s();
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int drv = 0, rt = 0;
  CK(cudaDriverGetVersion(&drv));
  CK(cudaRuntimeGetVersion(&rt));
  std::printf("device: %s, sm_%d%d, %d SMs, %.0f GB, driver %d, runtime %d\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.totalGlobalMem / 1e9, drv, rt);
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr, "needs an sm_90 GPU\n");
    return 1;
  }
#ifdef PROTO_DEBUG
  std::printf("DEBUG build: proto kernels' mbarrier waits bounded (%u polls)\n", (unsigned)PROTO_SPIN_BOUND);
#endif
  std::printf("kernels: V3 %d thr %d B smem | V3s %d thr %d B | V2 %d thr %d B | VT %d thr %d B; L2 hints %d\n",
              proto192::CfgV3::kThreads, proto192::CfgV3::kSmemBytes, proto192::CfgV3s::kThreads,
              proto192::CfgV3s::kSmemBytes, proto192::CfgV2::kThreads, proto192::CfgV2::kSmemBytes,
              proto192::CfgVT::kThreads, proto192::CfgVT::kSmemBytes,
              deep_gemm::sm90::host::l2_hints_from_env("PK_GEMM_L2HINT", 9));
  g_nvml.init(dev);
  const int sms = prop.multiProcessorCount;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  bool ok = ragged_test(sms, s, equal768);
  if (equal768) {  // round 1
    ok = run_equal_shape(128, 768, 1536, 2048, sms, s, rounds, steady_s) && ok;
    ok = run_equal_shape(128, 768, 3072, 4096, sms, s, rounds, steady_s) && ok;
  } else {  // round 2
    const std::vector<int> counts = moe_counts(128, 20240601);
    ok = run_moe_shape(counts, 1536, 2048, sms, s, rounds, steady_s) && ok;
    ok = run_moe_shape(counts, 3072, 4096, sms, s, rounds, steady_s) && ok;
  }
  CK(cudaStreamDestroy(s));
  std::printf("\n%s (%.1f s)\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED", now_s() - t_start);
  return ok ? 0 : 2;
}
