// prime-kernels: what kernels leave behind for the host, in one place: the wait record and the wait timeout
// (csrc/common/watchdog.cuh), the device-check findings (csrc/common/device_check.hpp), and their C ABI.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/device_check.hpp"
#include "common/watchdog.hpp"

namespace prime_kernels {
namespace {
// A few seconds: a healthy wait lasts microseconds (one tile's work); seconds leave room for a GPU shared with
// other processes, and still end a hung job long before a trainer's collective timeouts do.
constexpr double kDefaultWaitTimeoutSeconds = 5.0;
constexpr double kMaxWaitTimeoutSeconds = 3600.0;
// Waits for another rank (common/ep_signal.hpp) include that rank's lateness: a rank that is seconds behind (a
// slower data loader, a longer step before the layer) must still succeed, so these get their own, longer bound.
constexpr double kDefaultPeerWaitTimeoutSeconds = 60.0;

// Everything kernels write for the host, in one pinned, mapped allocation per process (under unified addressing
// the one pointer serves every device): the wait record and the device-check findings.
struct MappedRecords {
  WaitRecord wait;
  common::DeviceCheckRecord checks;
};
std::atomic<MappedRecords*> g_records{nullptr};
std::atomic<uint64_t> g_timeout_ns{static_cast<uint64_t>(kDefaultWaitTimeoutSeconds * 1e9)};
std::atomic<uint64_t> g_peer_timeout_ns{static_cast<uint64_t>(kDefaultPeerWaitTimeoutSeconds * 1e9)};

// The records, allocated on first use; null if the allocation failed (kernels then check their values as before
// but record nothing, and a timed-out wait traps without a record).
MappedRecords* mapped_records() {
  MappedRecords* r = g_records.load(std::memory_order_acquire);
  if (r != nullptr) return r;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  r = g_records.load(std::memory_order_acquire);
  if (r != nullptr) return r;
  // Pinned memory is not stream-ordered: allowed (relaxed capture mode for this call) while a stream is being
  // captured, so a first launch inside a CUDA graph capture still gets its records.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, sizeof(MappedRecords), cudaHostAllocMapped | cudaHostAllocPortable);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not the calling launch's error to report
    return nullptr;
  }
  std::memset(p, 0, sizeof(MappedRecords));
  r = static_cast<MappedRecords*>(p);
  g_records.store(r, std::memory_order_release);
  return r;
}

// Stores a bound of (0, kMaxWaitTimeoutSeconds] seconds into `bound`; PK_ERR_INVALID_ARGUMENT naming `what` otherwise.
int set_timeout(std::atomic<uint64_t>& bound, double seconds, const char* what) {
  if (!(seconds > 0.0) || !(seconds <= kMaxWaitTimeoutSeconds))
    return api::fail(PK_ERR_INVALID_ARGUMENT, "%s = %g s, must be in (0, %g]", what, seconds, kMaxWaitTimeoutSeconds);
  bound.store(static_cast<uint64_t>(std::llround(seconds * 1e9)), std::memory_order_relaxed);
  return api::ok();
}

const char* kernel_name(int32_t kernel) {
  switch (kernel) {
    case kWaitKernelMegaFwd: return "mega_moe_fwd_kernel";
    case kWaitKernelProbe: return "wait_probe_kernel";
    case kWaitKernelMegaBwd: return "mega_moe_bwd_kernel";
    case kWaitKernelMegaFwdFp8: return "mega_moe_fwd_fp8_kernel";
    case kWaitKernelEpBarrier: return "ep_barrier_kernel";
    case kWaitKernelMegaBwdFp8: return "mega_moe_bwd_fp8_kernel";
    default: return "unknown kernel";
  }
}

const char* wait_name(int32_t wait) {
  switch (wait) {
    case kWaitMegaFwdDispatch: return "L1 tile waits for its m-block's dispatched rows";
    case kWaitMegaFwdL1: return "L2 tile waits for its m-block's L1 tiles";
    case kWaitProbe: return "probe counter";
    case kWaitMegaBwdL2Dgrad: return "L1-dgrad tile waits for its m-block's L2-dgrad tiles";
    case kWaitMegaBwdExpert: return "weight-gradient tile waits for its expert's L2-dgrad tiles";
    case kWaitEpEnter: return "entering the call";
    case kWaitEpExit: return "after pushing its rows";
    default: return "unknown wait";
  }
}
}  // namespace

cudaError_t wait_guard_for_current_device(WaitGuard* guard) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  MappedRecords* r = mapped_records();
  if (r == nullptr) return cudaErrorMemoryAllocation;
  guard->record = &r->wait;  // a portable mapped allocation has the same address on the device
  guard->timeout_ns = g_timeout_ns.load(std::memory_order_relaxed);
  guard->device = device;
  return cudaSuccess;
}

cudaError_t peer_wait_guard_for_current_device(WaitGuard* guard) {
  const cudaError_t e = wait_guard_for_current_device(guard);
  guard->timeout_ns = g_peer_timeout_ns.load(std::memory_order_relaxed);
  return e;
}

bool wait_record_message(char* out, size_t out_len) {
  const MappedRecords* records = g_records.load(std::memory_order_acquire);
  if (records == nullptr) return false;
  const volatile WaitRecord* r = &records->wait;
  if (r->state != 2) return false;
  if (r->kernel == kWaitKernelEpBarrier) {
    std::snprintf(out, out_len,
                  "expert-parallel rank %d (CUDA device %d) waited %.2f s for rank %d, %s (expected its epoch >= "
                  "%lld, observed %lld), and trapped: the CUDA context is lost, restart the process. The peer did not "
                  "reach the same call: every rank of the group must call the layer the same number of times, in "
                  "the same order (set_peer_wait_timeout raises the bound for ranks that are legitimately late)",
                  r->cta, r->device, static_cast<double>(r->waited_ns) * 1e-9, r->index, wait_name(r->wait),
                  static_cast<long long>(r->expected), static_cast<long long>(r->observed));
    return true;
  }
  std::snprintf(out, out_len,
                "a wait inside %s timed out on CUDA device %d after %.2f s (%s; CTA %d, thread %d, index %d: "
                "expected a value >= %lld, observed %lld). The kernel trapped and the CUDA context is lost: "
                "restart the process. A wait this long means a bug or corrupted inputs; please report it",
                kernel_name(r->kernel), r->device, static_cast<double>(r->waited_ns) * 1e-9, wait_name(r->wait),
                r->cta, r->thread, r->index, static_cast<long long>(r->expected), static_cast<long long>(r->observed));
  return true;
}

namespace common {
DeviceCheckRecord* device_check_record() {
  MappedRecords* r = mapped_records();
  return r != nullptr ? &r->checks : nullptr;
}

// The findings recorded so far, formatted into out, and cleared; false (out untouched) if there are none. Never
// allocates or touches the device.
bool take_device_checks(char* out, size_t out_len) {
  MappedRecords* records = g_records.load(std::memory_order_acquire);
  if (records == nullptr) return false;
  volatile DeviceCheckRecord* r = &records->checks;
  static const char* const kWhat[kNumDeviceChecks] = {
      "an m-grouped GEMM's group_offsets are not non-decreasing within [0, m_total]; that GEMM wrote nothing",
      "a k-grouped GEMM's group_offsets are not non-decreasing within [0, rows]; that GEMM wrote nothing",
      "a gathered GEMM's a_row_index names a row outside A (only -1 and [0, rows) are valid); that row was read as "
      "zeros",
      "a SwiGLU backward's pool_src_route names a route without a weight (only -1 and [0, routes) are valid); that "
      "row got weight 0",
      "combine's route_to_pool names a row outside the slots (only -1 and [0, rows) are valid); that route was "
      "skipped",
      "dispatch_rows' route_to_pool names a row outside out (only -1 and [0, rows) are valid); nothing was written "
      "for that route",
      "the fused forward's expert_offsets are not a routing plan (offsets[0] must be 0, non-decreasing, the last "
      "<= the pool rows); that forward wrote nothing",
      "the fused forward's pool_src_route names a route past num_tokens * top_k (only values < 0 and [0, routes) "
      "are valid); that pool row was computed from zeros",
      "the FP8 k-grouped GEMM's group_offsets are not non-decreasing within [0, rows] with every entry a multiple "
      "of 128 or rows (experts start on whole 128-row scale blocks); that GEMM wrote nothing",
      "dispatch_rows_fp8's route_to_pool names a row outside q (only -1 and [0, rows) are valid); nothing was "
      "written for that route",
      "quantize_tokens_fp8's expert_offsets / expert_counts are not a pool layout (offsets non-decreasing within "
      "[0, rows], each a multiple of 128 or rows; 0 <= counts[e] <= the expert's rows); that call wrote nothing",
      "the FP8 L2 dgrad's group_offsets are not non-decreasing within [0, m_total] with every entry a multiple of "
      "128 or m_total (each tile's rows are one 128-row qT block); that call wrote nothing",
      "a gathering quantize_tokens_fp8's pool_src_route names a route past num_tokens * top_k on a live pool row "
      "(only values < 0 and [0, routes) are valid); that row was quantized as zeros",
      "quantize_mxfp8's group ends are not non-decreasing within [0, rows] (row groups) or [0, cols] with every "
      "end a multiple of 32 (column groups), or their padded blocked scales do not fit in the scale buffer; that "
      "call wrote nothing",
  };
  size_t used = 0;
  bool any = false;
  for (int k = 0; k < kNumDeviceChecks; ++k) {
    const int32_t state = r->flag[k];
    if (state == 0) continue;
    const long long value = r->value[k], bound = r->bound[k];
    r->flag[k] = 0;
    if (used + 2 < out_len) {
      if (any) used += std::snprintf(out + used, out_len - used, "; ");
      if (used < out_len) used += std::snprintf(out + used, out_len - used, "%s", kWhat[k]);
      if (state == 2 && used < out_len)
        used += std::snprintf(out + used, out_len - used, " (e.g. %lld against a size of %lld)", value, bound);
    }
    any = true;
  }
  if (any && out_len > 0) out[out_len - 1] = '\0';
  return any;
}

}  // namespace common

}  // namespace prime_kernels

extern "C" {

int pk_set_wait_timeout(double seconds) {
  return prime_kernels::set_timeout(prime_kernels::g_timeout_ns, seconds, "wait timeout");
}

int pk_set_peer_wait_timeout(double seconds) {
  return prime_kernels::set_timeout(prime_kernels::g_peer_timeout_ns, seconds, "peer wait timeout");
}

double pk_get_peer_wait_timeout(void) {
  return static_cast<double>(prime_kernels::g_peer_timeout_ns.load(std::memory_order_relaxed)) * 1e-9;
}

int pk_device_check(void) { return prime_kernels::api::check_device_findings("device check"); }

double pk_get_wait_timeout(void) {
  return static_cast<double>(prime_kernels::g_timeout_ns.load(std::memory_order_relaxed)) * 1e-9;
}

int pk_wait_timeout_probe(double timeout_s, void* cuda_stream) {
  if (!(timeout_s > 0.0) || !(timeout_s <= prime_kernels::kMaxWaitTimeoutSeconds))
    return prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT, "wait_timeout_probe: timeout = %g s, must be in (0, %g]",
                                timeout_s, prime_kernels::kMaxWaitTimeoutSeconds);
  if (const int rc = prime_kernels::api::check_device_findings("wait_timeout_probe"); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK) return rc;
  prime_kernels::WaitGuard guard{};
  if (const cudaError_t e = prime_kernels::wait_guard_for_current_device(&guard); e != cudaSuccess)
    return prime_kernels::api::fail_cuda(e, "wait_timeout_probe: allocating the wait record");
  guard.timeout_ns = static_cast<uint64_t>(std::llround(timeout_s * 1e9));
  if (const cudaError_t e = prime_kernels::launch_wait_probe(guard, static_cast<cudaStream_t>(cuda_stream));
      e != cudaSuccess)
    return prime_kernels::api::fail_cuda(e, "wait_timeout_probe: launch");
  return prime_kernels::api::ok();
}

}  // extern "C"
