// prime-kernels: host helpers shared by the sm90 launch files and the sm100 fused forward's (tensor maps, device checks,
// the fused forwards' common argument checks; status.hpp has the errors).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/mega_fwd_args.hpp"
#include "status.hpp"

namespace prime_kernels {
namespace sm90 {
namespace host {

constexpr int64_t kMaxDim = (int64_t(1) << 31) - 1;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The bf16 neighbours of a clamp c > 0: the largest bf16 value below c and the smallest above it (for a c that is a
// bf16 value, its bit pattern - 1 and + 1), which the mask-preserving rounding of the saved h uses.
inline void bf16_clamp_neighbours(float c, float* below, float* above) {
  uint32_t fb;
  std::memcpy(&fb, &c, 4);
  const uint32_t rounded = (fb + 0x7fffu + ((fb >> 16) & 1u)) & 0xffff0000u;  // round to nearest even
  float rf;
  std::memcpy(&rf, &rounded, 4);
  auto with_bits = [](uint32_t b) {
    float v;
    std::memcpy(&v, &b, 4);
    return v;
  };
  *below = rf < c ? rf : with_bits(rounded - 0x10000u);
  *above = rf > c ? rf : with_bits(rounded + 0x10000u);
}

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// Tensor map (bf16 with the 128-byte swizzle unless told otherwise), zero fill out of bounds. dims/strides
// innermost first; strides in bytes for dims 1.. (rank - 1 entries).
inline int make_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                    const uint32_t* box, char* err, size_t err_len,
                    CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                    CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  auto enc = tensor_map_encoder();
  if (enc == nullptr)
    return fail(kGemmCudaError, err, err_len, "cuTensorMapEncodeTiled not available from the driver");
  uint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = enc(map, dtype, rank, const_cast<void*>(base), dims, strides,
                         box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return fail(kGemmCudaError, err, err_len, "cuTensorMapEncodeTiled failed (CUresult %d)", (int)r);
  return kGemmOk;
}

// Checks that the current device is an sm_<major><minor> (minor < 0: any minor) and returns its multiprocessor count;
// otherwise kGemmNotAvailable with "<what> needs an <arch> device (found sm_XY)".
inline int device_sms_of(int major_want, int minor_want, const char* what, const char* arch, int* sms, char* err,
                         size_t err_len) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "cudaGetDevice: %s", cudaGetErrorString(e));
  int major = 0, minor = 0;
  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "cudaDeviceGetAttribute: %s", cudaGetErrorString(e));
  if (major != major_want || (minor_want >= 0 && minor != minor_want))
    return fail(kGemmNotAvailable, err, err_len, "%s needs an %s device (found sm_%d%d)", what, arch, major, minor);
  return kGemmOk;
}

// Checks that the current device is sm_90 and returns its multiprocessor count.
inline int device_sms(int* sms, char* err, size_t err_len) {
  return device_sms_of(9, 0, "the sm90 grouped GEMM", "sm_90", sms, err, err_len);
}

inline int check_launch(const char* what, char* err, size_t err_len) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s launch: %s", what, cudaGetErrorString(e));
  return kGemmOk;
}


// cudaFuncSetAttribute(kMaxDynamicSharedMemorySize) for kKernel on the current device, once per device: it is
// a driver call on every launch path otherwise (host time the GPU waits for in short, synchronised loops).
template <auto kKernel>
inline cudaError_t set_max_dynamic_smem(int smem) {
  static std::atomic<uint64_t> done_mask{0};  // bit d: device d done (devices >= 64 are set every call)
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit != 0 && (done_mask.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) done_mask.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

// Launches a persistent kernel of `threads`-thread CTAs (set_max_dynamic_smem first): one CTA per SM and at
// most max_units CTAs (at least one).
template <auto kKernel, typename... Args>
inline cudaError_t launch_persistent(int threads, int smem, int64_t max_units, int sms, cudaStream_t stream,
                                     const Args&... args) {
  cudaLaunchConfig_t lc = {};
  lc.blockDim = dim3(threads, 1, 1);
  lc.dynamicSmemBytes = smem;
  lc.stream = stream;
  const int64_t units = max_units < sms ? (max_units > 0 ? max_units : 1) : sms;
  lc.gridDim = dim3(static_cast<unsigned>(units), 1, 1);
  return cudaLaunchKernelEx(&lc, kKernel, args...);
}

// set_max_dynamic_smem, launch_persistent and check_launch in turn, each failure as kGemmCudaError with its message
// (fn names the entry point): the launch of the m-grouped FP8 kernels.
template <auto kKernel, typename... Args>
inline int launch_persistent_checked(const char* fn, int threads, int smem, int64_t max_units, int sms,
                                     cudaStream_t stream, char* err, size_t err_len, const Args&... args) {
  cudaError_t e = set_max_dynamic_smem<kKernel>(smem);
  if (e != cudaSuccess)
    return fail(kGemmCudaError, err, err_len, "%s: cudaFuncSetAttribute: %s", fn, cudaGetErrorString(e));
  e = launch_persistent<kKernel>(threads, smem, max_units, sms, stream, args...);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s launch: %s", fn, cudaGetErrorString(e));
  return check_launch(fn, err, err_len);
}

// The checks of the BF16 fused forwards' common fields (common/mega_fwd_args.hpp) that the sm90 and sm100 launchers
// make alike, fn naming the entry point in the message. First the counts and sizes (max_experts: the launcher's
// bound on num_experts):
inline int check_mega_fwd_sizes(const common::MegaFwdCommonArgs& a, int max_experts, const char* fn, char* err,
                                size_t err_len) {
  if (a.num_experts < 1 || a.num_experts > max_experts)
    return fail(kGemmInvalidArgument, err, err_len, "%s: num_experts = %d, must be in [1, %d]", fn, a.num_experts,
                max_experts);
  if (a.top_k < 1) return fail(kGemmInvalidArgument, err, err_len, "%s: top_k = %d, must be >= 1", fn, a.top_k);
  if (a.m_total < 0 || a.m_total > kMaxDim || a.hidden < 64 || a.hidden % 64 != 0 || a.hidden > 65536 ||
      a.inter < 64 || a.inter % 64 != 0 || 2 * a.inter > kMaxDim)
    return fail(kGemmInvalidArgument, err, err_len,
                "%s: bad sizes m_total=%lld hidden=%lld inter=%lld (hidden and inter multiples of 64)", fn,
                (long long)a.m_total, (long long)a.hidden, (long long)a.inter);
  return kGemmOk;
}
// Then, once there are pool rows, the device pointers: the plan, the weights and the outputs present (and
// own_missing false: the launcher's own required pointer present), all 16-byte aligned.
inline int check_mega_fwd_pointers(const common::MegaFwdCommonArgs& a, bool own_missing, const char* fn, char* err,
                                   size_t err_len) {
  if (a.pool_src_route == nullptr || a.expert_offsets == nullptr || own_missing || a.w13 == nullptr ||
      a.w2 == nullptr || a.x_pool == nullptr || a.s == nullptr || a.o == nullptr)
    return fail(kGemmInvalidArgument, err, err_len, "%s: null pointer argument", fn);
  if (!aligned16(a.w13) || !aligned16(a.w2) || !aligned16(a.x_pool) || !aligned16(a.s) || !aligned16(a.o) ||
      (a.h != nullptr && !aligned16(a.h)))
    return fail(kGemmInvalidArgument, err, err_len, "%s: w13, w2, x_pool, s, h and o must be 16-byte aligned", fn);
  return kGemmOk;
}

}  // namespace host
}  // namespace sm90
}  // namespace prime_kernels
