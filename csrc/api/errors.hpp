// Thread-local error message and a printf-style setter, shared by every API entry point.
#pragma once

#include <cuda_runtime_api.h>

#include "api/prime_kernels_api.h"

namespace prime_kernels::api {

// Stores the message and returns `code`, so a check reads `return fail(PK_ERR_..., "...", ...)`.
int fail(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int ok();
int fail_cuda(cudaError_t err, const char* what);
// A launcher's status (0 ok, 1 invalid argument, 2 not available, 3 CUDA error, else internal) and its message,
// as this ABI's code and last error.
int from_status(int status, const char* message);

enum class ArchFamily { kAny, kSm90, kSm100 };

// PK_OK, or what an earlier launch left behind, as the error of `op`: a wait that timed out (the CUDA context is
// lost: PK_ERR_CUDA) or invalid values a kernel found on the device (common/device_check.hpp, reported once:
// PK_ERR_INVALID_ARGUMENT). Every entry point that launches calls it first; it reads host memory only.
int check_device_findings(const char* op);

// PK_OK when `device` can run kernels of `family` from this build; otherwise the reason.
int check_device(int device, ArchFamily family);
// check_device on the calling thread's current CUDA device.
int check_current_device(ArchFamily family);

}  // namespace prime_kernels::api

#define PK_CHECK_ARG(cond, ...)                                        \
  do {                                                                 \
    if (!(cond)) return ::prime_kernels::api::fail(PK_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)
