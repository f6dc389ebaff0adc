// prime-kernels: the per-device wait records, the wait timeout, and their C ABI (csrc/common/watchdog.cuh).
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "api/deep_gemm_api.h"
#include "api/errors.hpp"
#include "common/watchdog.hpp"

namespace deep_gemm {
namespace {
constexpr int kMaxDevices = 64;
// A few seconds: a healthy wait lasts microseconds (one tile's work); seconds leave room for a GPU shared with
// other processes, and still end a hung job long before a trainer's collective timeouts do.
constexpr double kDefaultWaitTimeoutSeconds = 5.0;
constexpr double kMaxWaitTimeoutSeconds = 3600.0;

// One host-mapped allocation per device: the wait record, then the input flags.
struct MappedFlags {
  WaitRecord wait;
  int32_t input[kNumInputChecks];
};
struct DeviceWatch {
  MappedFlags* host = nullptr;  // pinned, mapped
  MappedFlags* device = nullptr;
  int32_t* words = nullptr;  // [0]: the claim word; [1]: the probe's counter (both stay zero unless a wait fails)
};
std::mutex g_mutex;
DeviceWatch g_devices[kMaxDevices];
std::atomic<uint64_t> g_timeout_ns{static_cast<uint64_t>(kDefaultWaitTimeoutSeconds * 1e9)};

cudaError_t watch_for_current_device(DeviceWatch** out) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceWatch& w = g_devices[device];
  if (w.host == nullptr) {
    void* host = nullptr;
    void* dev = nullptr;
    void* words = nullptr;
    cudaError_t e = cudaHostAlloc(&host, sizeof(MappedFlags), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&dev, host, 0);
    if (e == cudaSuccess) e = cudaMalloc(&words, 2 * sizeof(int32_t));
    if (e == cudaSuccess) e = cudaMemset(words, 0, 2 * sizeof(int32_t));
    if (e != cudaSuccess) {
      if (host != nullptr) cudaFreeHost(host);
      if (words != nullptr) cudaFree(words);
      return e;
    }
    std::memset(host, 0, sizeof(MappedFlags));
    w.host = static_cast<MappedFlags*>(host);
    w.device = static_cast<MappedFlags*>(dev);
    w.words = static_cast<int32_t*>(words);
  }
  *out = &w;
  return cudaSuccess;
}

const char* kernel_name(int32_t kernel) {
  switch (kernel) {
    case kWaitKernelMegaFwd: return "mega_moe_fwd_kernel";
    case kWaitKernelProbe: return "wait_probe_kernel";
    default: return "unknown kernel";
  }
}

const char* wait_name(int32_t wait) {
  switch (wait) {
    case kWaitMegaFwdDispatch: return "L1 tile waits for its m-block's dispatched rows";
    case kWaitMegaFwdL1: return "L2 tile waits for its m-block's L1 tiles";
    case kWaitProbe: return "probe counter";
    default: return "unknown wait";
  }
}
}  // namespace

cudaError_t wait_guard_for_current_device(WaitGuard* guard) {
  DeviceWatch* w = nullptr;
  if (cudaError_t e = watch_for_current_device(&w); e != cudaSuccess) return e;
  guard->record = &w->device->wait;
  guard->claim = w->words;
  guard->timeout_ns = g_timeout_ns.load(std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t wait_probe_counter_for_current_device(int32_t** counter) {
  DeviceWatch* w = nullptr;
  if (cudaError_t e = watch_for_current_device(&w); e != cudaSuccess) return e;
  *counter = w->words + 1;
  return cudaSuccess;
}

bool wait_record_message(char* out, size_t out_len) {
  for (int d = 0; d < kMaxDevices; ++d) {
    const MappedFlags* flags = g_devices[d].host;  // set once, never freed: read without the lock
    if (flags == nullptr) continue;
    const volatile WaitRecord* r = &flags->wait;
    if (r->state != 2) continue;
    std::snprintf(out, out_len,
                  "a wait inside %s timed out on CUDA device %d after %.2f s (%s; CTA %d, thread %d, index %d: "
                  "expected a value >= %lld, observed %lld). The kernel trapped and the CUDA context is lost: "
                  "restart the process. A wait this long means a bug or corrupted inputs; please report it",
                  kernel_name(r->kernel), d, static_cast<double>(r->waited_ns) * 1e-9, wait_name(r->wait), r->cta,
                  r->thread, r->index, static_cast<long long>(r->expected), static_cast<long long>(r->observed));
    return true;
  }
  return false;
}

cudaError_t input_flags_for_current_device(int32_t** flags) {
  DeviceWatch* w = nullptr;
  if (cudaError_t e = watch_for_current_device(&w); e != cudaSuccess) return e;
  *flags = w->device->input;
  return cudaSuccess;
}

bool input_error_message(char* out, size_t out_len) {
  for (int d = 0; d < kMaxDevices; ++d) {
    MappedFlags* flags = g_devices[d].host;
    if (flags == nullptr) continue;
    volatile int32_t* input = flags->input;
    if (input[kInputMegaFwdOffsets] != 0) {
      input[kInputMegaFwdOffsets] = 0;
      std::snprintf(out, out_len,
                    "an earlier mega_moe_fused_fwd call on CUDA device %d was given expert_offsets that are not a "
                    "routing plan (offsets[0] must be 0, non-decreasing, the last <= the pool rows); the kernel "
                    "wrote nothing, so that call's outputs are not valid",
                    d);
      return true;
    }
    if (input[kInputMegaFwdRoutes] != 0) {
      input[kInputMegaFwdRoutes] = 0;
      std::snprintf(out, out_len,
                    "an earlier mega_moe_fused_fwd call on CUDA device %d was given a pool_src_route that names "
                    "routes >= num_tokens * top_k; those pool rows were computed from zeros, so that call's outputs "
                    "are not valid",
                    d);
      return true;
    }
  }
  return false;
}

}  // namespace deep_gemm

extern "C" {

int pk_set_wait_timeout(double seconds) {
  if (!(seconds > 0.0) || !(seconds <= deep_gemm::kMaxWaitTimeoutSeconds))
    return deep_gemm::api::fail(PK_ERR_INVALID_ARGUMENT, "wait timeout = %g s, must be in (0, %g]", seconds,
                                deep_gemm::kMaxWaitTimeoutSeconds);
  deep_gemm::g_timeout_ns.store(static_cast<uint64_t>(std::llround(seconds * 1e9)), std::memory_order_relaxed);
  return deep_gemm::api::ok();
}

double pk_get_wait_timeout(void) {
  return static_cast<double>(deep_gemm::g_timeout_ns.load(std::memory_order_relaxed)) * 1e-9;
}

int pk_check_wait_record(void) {
  char message[768];
  if (deep_gemm::wait_record_message(message, sizeof(message)))
    return deep_gemm::api::fail(PK_ERR_CUDA, "%s", message);
  if (deep_gemm::input_error_message(message, sizeof(message)))
    return deep_gemm::api::fail(PK_ERR_INVALID_ARGUMENT, "%s", message);
  return deep_gemm::api::ok();
}

int pk_wait_timeout_probe(double timeout_s, void* cuda_stream) {
  if (!(timeout_s > 0.0) || !(timeout_s <= deep_gemm::kMaxWaitTimeoutSeconds))
    return deep_gemm::api::fail(PK_ERR_INVALID_ARGUMENT, "wait_timeout_probe: timeout = %g s, must be in (0, %g]",
                                timeout_s, deep_gemm::kMaxWaitTimeoutSeconds);
  if (const int rc = deep_gemm::api::check_current_device(deep_gemm::api::ArchFamily::kAny); rc != PK_OK) return rc;
  deep_gemm::WaitGuard guard{};
  int32_t* counter = nullptr;
  cudaError_t e = deep_gemm::wait_guard_for_current_device(&guard);
  if (e == cudaSuccess) e = deep_gemm::wait_probe_counter_for_current_device(&counter);
  if (e != cudaSuccess) return deep_gemm::api::fail_cuda(e, "wait_timeout_probe: allocating the wait record");
  guard.timeout_ns = static_cast<uint64_t>(std::llround(timeout_s * 1e9));
  e = deep_gemm::launch_wait_probe(guard, counter, static_cast<cudaStream_t>(cuda_stream));
  if (e != cudaSuccess) return deep_gemm::api::fail_cuda(e, "wait_timeout_probe: launch");
  return deep_gemm::api::ok();
}

}  // extern "C"
