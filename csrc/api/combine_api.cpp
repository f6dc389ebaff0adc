// C ABI of the combine reduction: argument checks, then the CUDA kernel or the host loop.
#include <cstdint>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/combine.hpp"
#include "common/device_check.hpp"

namespace {

using prime_kernels::common::CombineArgs;
using prime_kernels::common::DispatchArgs;

// The row ops' shared checks (op: "combine" / "dispatch_rows"; in_name: their input rows, "slots" / "src").
int check_row_layout(const char* op, int64_t hidden, int64_t ld_in, int64_t ld_out) {
  PK_CHECK_ARG(hidden % 8 == 0 && ld_in % 8 == 0 && ld_out % 8 == 0,
               "%s: hidden (%lld) and the row strides (%lld, %lld) must be multiples of 8", op,
               static_cast<long long>(hidden), static_cast<long long>(ld_in), static_cast<long long>(ld_out));
  PK_CHECK_ARG(ld_in >= hidden && ld_out >= hidden, "%s: a row stride is smaller than hidden", op);
  return PK_OK;
}

// The pool side (combine's slots, dispatch's out) may be null when it has no rows: no valid route names it.
int check_row_pointers(const char* op, const char* in_name, const void* in, const int32_t* route_to_pool,
                       const void* out, bool pool_is_empty, bool pool_is_in, bool on_device) {
  const void* pool = pool_is_in ? in : out;
  const void* other = pool_is_in ? out : in;
  PK_CHECK_ARG(other && route_to_pool && (pool || pool_is_empty), "%s: a pointer is null", op);
  if (on_device)
    PK_CHECK_ARG((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16 == 0,
                 "%s: %s and out must be 16-byte aligned", op, in_name);
  return PK_OK;
}

// Fails with what an earlier kernel found invalid on the device (and clears it), before this call launches anything.

// The host loops run only on valid routes (the same rule as the kernels, which skip and note an invalid one).
int check_routes_on_host(const char* op, const char* rows_name, const int32_t* route_to_pool, int64_t count,
                         int64_t num_rows) {
  const int64_t bad = prime_kernels::common::invalid_route(route_to_pool, count, num_rows);
  PK_CHECK_ARG(bad < 0, "%s: route_to_pool[%lld] = %d is outside [-1, %lld) (%s rows)", op, static_cast<long long>(bad),
               bad < 0 ? 0 : route_to_pool[bad], static_cast<long long>(num_rows), rows_name);
  return PK_OK;
}

int check_combine(const CombineArgs& a, bool on_device) {
  PK_CHECK_ARG(a.num_tokens >= 0 && a.top_k >= 1 && a.hidden >= 0 && a.num_rows >= 0,
               "combine: need num_tokens >= 0, top_k >= 1, hidden >= 0, slot rows >= 0 (got %lld, %lld, %lld, %lld)",
               static_cast<long long>(a.num_tokens), static_cast<long long>(a.top_k),
               static_cast<long long>(a.hidden), static_cast<long long>(a.num_rows));
  if (const int rc = check_row_layout("combine", a.hidden, a.ld_slots, a.ld_out); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return PK_OK;
  return check_row_pointers("combine", "slots", a.slots, a.route_to_pool, a.out, a.num_rows == 0, true, on_device);
}

int check_dispatch(const DispatchArgs& a, bool on_device) {
  PK_CHECK_ARG(a.num_tokens >= 0 && a.top_k >= 1 && a.hidden >= 0 && a.num_rows >= 0,
               "dispatch_rows: need num_tokens >= 0, top_k >= 1, hidden >= 0, num_rows >= 0 (got %lld, %lld, %lld, "
               "%lld)",
               static_cast<long long>(a.num_tokens), static_cast<long long>(a.top_k),
               static_cast<long long>(a.hidden), static_cast<long long>(a.num_rows));
  if (const int rc = check_row_layout("dispatch_rows", a.hidden, a.ld_src, a.ld_out); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return PK_OK;
  return check_row_pointers("dispatch_rows", "src", a.src, a.route_to_pool, a.out, a.num_rows == 0, false,
                            on_device);
}

}  // namespace

extern "C" {

int pk_combine_bf16_cuda(const void* slots, int64_t ld_slots, int64_t num_slot_rows, const int32_t* route_to_pool,
                         const float* weights, int64_t num_tokens, int64_t top_k, int64_t hidden, void* out,
                         int64_t ld_out, void* cuda_stream) {
  const CombineArgs a{slots, ld_slots, route_to_pool, weights, num_tokens, top_k, hidden, out, ld_out, num_slot_rows};
  if (const int rc = prime_kernels::api::check_device_findings("combine"); rc != PK_OK) return rc;
  if (const int rc = check_combine(a, true); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return prime_kernels::api::ok();
  const cudaError_t err = prime_kernels::common::launch_combine(a, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return prime_kernels::api::fail_cuda(err, "combine launch");
  return prime_kernels::api::ok();
}

int pk_combine_bf16_cpu(const void* slots, int64_t ld_slots, int64_t num_slot_rows, const int32_t* route_to_pool,
                        const float* weights, int64_t num_tokens, int64_t top_k, int64_t hidden, void* out,
                        int64_t ld_out) {
  const CombineArgs a{slots, ld_slots, route_to_pool, weights, num_tokens, top_k, hidden, out, ld_out, num_slot_rows};
  if (const int rc = check_combine(a, false); rc != PK_OK) return rc;
  if (a.num_tokens > 0 && a.hidden > 0)
    if (const int rc = check_routes_on_host("combine", "slot", route_to_pool, num_tokens * top_k, num_slot_rows);
        rc != PK_OK)
      return rc;
  prime_kernels::common::combine_host(a);
  return prime_kernels::api::ok();
}

int pk_dispatch_rows_bf16_cuda(const void* src, int64_t ld_src, const int32_t* route_to_pool, int64_t num_tokens,
                               int64_t top_k, int64_t hidden, void* out, int64_t ld_out, int64_t num_rows,
                               void* cuda_stream) {
  const DispatchArgs a{src, ld_src, route_to_pool, num_tokens, top_k, hidden, out, ld_out, num_rows};
  if (const int rc = prime_kernels::api::check_device_findings("dispatch_rows"); rc != PK_OK) return rc;
  if (const int rc = check_dispatch(a, true); rc != PK_OK) return rc;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return prime_kernels::api::ok();
  const cudaError_t err = prime_kernels::common::launch_dispatch_rows(a, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return prime_kernels::api::fail_cuda(err, "dispatch_rows launch");
  return prime_kernels::api::ok();
}

int pk_dispatch_rows_bf16_cpu(const void* src, int64_t ld_src, const int32_t* route_to_pool, int64_t num_tokens,
                              int64_t top_k, int64_t hidden, void* out, int64_t ld_out, int64_t num_rows) {
  const DispatchArgs a{src, ld_src, route_to_pool, num_tokens, top_k, hidden, out, ld_out, num_rows};
  if (const int rc = check_dispatch(a, false); rc != PK_OK) return rc;
  if (a.num_tokens == 0 || a.hidden == 0) return prime_kernels::api::ok();
  if (const int rc = check_routes_on_host("dispatch_rows", "out", route_to_pool, num_tokens * top_k, num_rows);
      rc != PK_OK)
    return rc;
  prime_kernels::common::dispatch_rows_host(a);
  return prime_kernels::api::ok();
}

}  // extern "C"
