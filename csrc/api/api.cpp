// Library-wide C ABI: version, errors, what was built, and whether a device can run it.
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "build_config.h"
#include "common/device_check.hpp"
#include "common/watchdog.hpp"

namespace prime_kernels::api {

namespace {
thread_local std::string g_last_error;

bool built(const char* arch) {
  const std::string list = std::string(",") + PK_BUILT_ARCHS_CSV + ",";
  return list.find(std::string(",") + arch + ",") != std::string::npos;
}

// Which built arch, if any, runs on compute capability major.minor. "a" targets run only on their
// exact capability; "f" targets on every member of the family.
const char* matching_arch(int major, int minor, ArchFamily family) {
  if (major == 9 && minor == 0 && family != ArchFamily::kSm100 && built("90a")) return "90a";
  if (major == 10 && family != ArchFamily::kSm90) {
    if (minor == 0 && built("100a")) return "100a";
    if (minor == 3 && built("103a")) return "103a";
    if (built("100f")) return "100f";
  }
  return nullptr;
}

const char* suggested_arch(int major, int minor) {
  if (major == 9 && minor == 0) return "90a";
  if (major == 10 && minor == 0) return "100a";
  if (major == 10 && minor == 3) return "103a";
  if (major == 10) return "100f";
  return nullptr;
}
}  // namespace

int fail(int code, const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  g_last_error = buf;
  return code;
}

int ok() {
  g_last_error.clear();
  return PK_OK;
}

int fail_cuda(cudaError_t err, const char* what) {
  return fail(PK_ERR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

int from_status(int status, const char* message) {
  switch (status) {
    case 0: return ok();
    case 1: return fail(PK_ERR_INVALID_ARGUMENT, "%s", message);
    case 2: return fail(PK_ERR_NOT_AVAILABLE, "%s", message);
    case 3: return fail(PK_ERR_CUDA, "%s", message);
    default: return fail(PK_ERR_INTERNAL, "%s", message);
  }
}

int check_device(int device, ArchFamily family) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for later callers
    return fail(PK_ERR_NOT_AVAILABLE, "no CUDA device (%s)",
                err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0");
  }
  if (device < 0 || device >= count)
    return fail(PK_ERR_INVALID_ARGUMENT, "CUDA device %d does not exist (%d devices)", device, count);
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (matching_arch(major, minor, family) != nullptr) return ok();
  const char* want = suggested_arch(major, minor);
  if (want == nullptr)
    return fail(PK_ERR_NOT_AVAILABLE,
                "device sm_%d%d is not supported: prime-kernels targets sm_90 (Hopper) and sm_100 "
                "(Blackwell) only", major, minor);
  const bool family_ok = (family == ArchFamily::kAny) || (family == ArchFamily::kSm90 && major == 9) ||
                         (family == ArchFamily::kSm100 && major == 10);
  if (!family_ok)
    return fail(PK_ERR_NOT_AVAILABLE, "this kernel is for %s; the device is sm_%d%d",
                family == ArchFamily::kSm90 ? "sm_90a (Hopper)" : "sm_100 (Blackwell)", major, minor);
  return fail(PK_ERR_NOT_AVAILABLE,
              "device sm_%d%d needs a rebuild with PRIME_KERNELS_CUDA_ARCHS=%s (this build has %s)",
              major, minor, want, PK_BUILT_ARCHS_CSV);
}

int check_device_findings(const char* op) {
  // After a wait timed out, the context is lost: say why before anything else can fail with a vaguer error.
  char found[1024];
  if (wait_record_message(found, sizeof(found))) return fail(PK_ERR_CUDA, "%s: %s", op, found);
  if (common::take_device_checks(found, sizeof(found)))
    return fail(PK_ERR_INVALID_ARGUMENT,
                "%s: not run, since an earlier launch found invalid values on the device (its outputs are not what "
                "was asked for): %s",
                op, found);
  return ok();
}

int check_current_device(ArchFamily family) {
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return fail_cuda(err, "cudaGetDevice");
  return check_device(device, family);
}

}  // namespace prime_kernels::api

extern "C" {

int pk_abi_version(void) { return PK_ABI_VERSION; }

const char* pk_last_error(void) { return prime_kernels::api::g_last_error.c_str(); }

const char* pk_built_archs(void) { return PK_BUILT_ARCHS_CSV; }

int pk_check_device(int device_index) {
  return prime_kernels::api::check_device(device_index, prime_kernels::api::ArchFamily::kAny);
}

}  // extern "C"

extern "C" const char* pk_compiled_kernels(void) { return PK_COMPILED_KERNELS_CSV; }
