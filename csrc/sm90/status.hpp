// prime-kernels: the status codes and error message of the sm90 host launchers (grouped_gemm.hpp, mega_moe.hpp),
// apart from the launchers themselves so that a caller that only maps a status needs no GEMM declarations.
// Plain host C++ (no CUDA headers needed).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdio>

namespace prime_kernels {
namespace sm90 {

// What every launcher returns; on failure it also writes a message to its err buffer.
enum LaunchStatus : int {
  kGemmOk = 0,
  kGemmInvalidArgument = 1,
  kGemmNotAvailable = 2,
  kGemmCudaError = 3,
};

namespace host {

// Writes the printf-style message to err (NUL-terminated, truncated to err_len; err may be null) and returns
// `code`, so that a check reads `return fail(kGemmInvalidArgument, err, err_len, "...", ...)`.
inline int fail(int code, char* err, size_t err_len, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
  }
  return code;
}

// An empty message: a launcher clears err first, so a success leaves no stale text behind.
inline void clear_err(char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) err[0] = '\0';
}

}  // namespace host
}  // namespace sm90
}  // namespace prime_kernels
