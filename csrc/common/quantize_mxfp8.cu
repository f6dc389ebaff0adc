#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstring>

#include "common/device_check.hpp"
#include "common/quantize_mxfp8.hpp"

namespace prime_kernels::common {

namespace {

constexpr int kMxfp8Threads = 256;
constexpr int kMxfp8WarpsPerBlock = kMxfp8Threads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint8_t kE4m3Nan = 0x7f;
constexpr int kE8m0Nan = 0xff;
constexpr int kE8m0Bias = 127;

__host__ __device__ __forceinline__ uint32_t mx_float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

// Unbiased scale exponent from the magnitude bits of a non-NaN amax. Read off the bits rather than a log2 so
// that an amax a few ulps above 448 * 2^k gets k + 1 (what cvt.rp to ue8m0 gives), not a log2 rounded down to k.
__host__ __device__ __forceinline__ int mx_scale_exponent(uint32_t amax_bits, bool rceil) {
  const uint32_t u = amax_bits & 0x7fffffffu;
  if (u >= 0x7f800000u) return 127;  // infinity
  const uint32_t field = u >> 23;
  // Zero or subnormal: amax < 2^-126, so E <= -134 before the clamp.
  if (field == 0) return -127;
  int e = static_cast<int>(field) - 127 - 8;
  if (rceil && (u & 0x7fffffu) > 0x600000u) e += 1;  // mantissa s > 1.75: 448 * 2^(p-8) < amax
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

__host__ __device__ __forceinline__ float mx_float_from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// 2^k, k in [-126, 127], as a normal fp32.
__host__ __device__ __forceinline__ float mx_pow2(int k) {
  return mx_float_from_bits(static_cast<uint32_t>(k + 127) << 23);
}

__host__ __device__ __forceinline__ float mx_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// x * 2^-e for e in [-127, 127]. One factor of 2^127 or 2^-127 would be out of range or subnormal (flushed under
// -ftz, turning inf * 0 into NaN), so the power is split into two normal halves. Each product is exact unless it
// falls below 2^-126, and such values are zero in e4m3 whatever their rounding.
__host__ __device__ __forceinline__ float mx_scale_down(float x, int e) {
  const int a = -e / 2;
  const int b = -e - a;
  return mx_mul_rn(mx_mul_rn(x, mx_pow2(a)), mx_pow2(b));
}

// The e4m3 byte of x in a block of exponent e: satfinite sends finite overflow and infinities to +-448, the rest
// rounds to nearest even (cvt.rn.satfinite on sm_89+, the same rounding emulated elsewhere and on the host).
__host__ __device__ __forceinline__ uint8_t mx_e4m3(float x, int e) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(mx_scale_down(x, e), __NV_SATFINITE, __NV_E4M3));
}

// Byte position of scale (padded row pr, block column j) in the blocked layout with `per_row` blocks per row.
__host__ __device__ __forceinline__ int64_t mx_blocked_pos(int64_t pr, int64_t j, int64_t per_row) {
  const int64_t tiles_per_row = (per_row + 3) / 4;
  return ((pr >> 7) * tiles_per_row + (j >> 2)) * 512 + (pr & 31) * 16 + ((pr & 127) >> 5) * 4 + (j & 3);
}

// First group whose end lies past `at`, or g == num_groups; empty groups (end == previous end) fail the same test.
__host__ __device__ __forceinline__ int mx_find_group(int64_t at, const int32_t* ends, int32_t num_groups) {
  int lo = 0, hi = num_groups;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(ends[mid]) > at) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Byte position of block (r, j) (j counts blocks of 32 along the row) in the blocked scale buffer, or -1 where
// it has none (a row or column past the last group).
__host__ __device__ __forceinline__ int64_t mx_scale_pos(int64_t r, int64_t j, int64_t rows, int64_t per_row,
                                                         Mxfp8GroupAxis axis, const int32_t* ends,
                                                         const int32_t* starts, int32_t num_groups) {
  if (axis == Mxfp8GroupAxis::kRows) {
    const int g = mx_find_group(r, ends, num_groups);
    if (g == num_groups) return -1;
    const int64_t first = g == 0 ? 0 : ends[g - 1];
    return mx_blocked_pos(static_cast<int64_t>(starts[g]) + (r - first), j, per_row);
  }
  if (axis == Mxfp8GroupAxis::kCols) {
    const int64_t c = j * kMxfp8Block;
    const int g = mx_find_group(c, ends, num_groups);
    if (g == num_groups) return -1;
    const int64_t first = g == 0 ? 0 : ends[g - 1];
    const int64_t group_blocks = (static_cast<int64_t>(ends[g]) - first) / kMxfp8Block;
    const int64_t padded_rows = (rows + 127) / 128 * 128;
    return padded_rows * starts[g] + mx_blocked_pos(r, (c - first) / kMxfp8Block, group_blocks);
  }
  return mx_blocked_pos(r, j, per_row);
}

// group_starts[g] = the padded extent of the groups before g (QuantizeMxfp8Args): 128-row tiles for groups of rows,
// 4-column tiles of scales for groups along the blocked axis. Shared by the device kernel and the host loop.
// Returns the extent of all groups (in the same unit).
__host__ __device__ inline int64_t group_starts_from_ends(const int32_t* group_ends, int32_t num_groups,
                                                          Mxfp8GroupAxis axis, int32_t* out) {
  int32_t prev = 0, acc = 0;
  for (int32_t g = 0; g < num_groups; ++g) {
    out[g] = acc;
    const int32_t n = group_ends[g] - prev;
    acc += axis == Mxfp8GroupAxis::kRows ? (n + 127) / 128 * 128 : (n / kMxfp8Block + 3) / 4 * 4;
    prev = group_ends[g];
  }
  return acc;
}

// The first end that breaks the rule of check_mxfp8_group_ends_host (its index), or -1 when they all keep it; a
// valid set's padded extent in bytes goes to *bytes. The sums run in 64 bits so that no end can wrap them back
// into range.
__host__ __device__ inline int32_t first_bad_group_end(const int32_t* ends, int32_t num_groups, Mxfp8GroupAxis axis,
                                                       int64_t rows, int64_t cols, int64_t* bytes) {
  const int64_t bound = axis == Mxfp8GroupAxis::kRows ? rows : cols;
  int64_t prev = 0, extent = 0;
  for (int32_t g = 0; g < num_groups; ++g) {
    const int64_t end = ends[g];
    if (end < prev || end > bound) return g;
    if (axis == Mxfp8GroupAxis::kCols && end % kMxfp8Block != 0) return g;
    const int64_t n = end - prev;
    extent += axis == Mxfp8GroupAxis::kRows ? (n + 127) / 128 * 128 : (n / kMxfp8Block + 3) / 4 * 4;
    prev = end;
  }
  const int64_t per_row = cols / kMxfp8Block;
  *bytes = axis == Mxfp8GroupAxis::kRows ? extent * ((per_row + 3) / 4 * 4) : (rows + 127) / 128 * 128 * extent;
  return -1;
}

#ifdef __CUDACC__
__device__ __forceinline__ float mx_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float mx_load(const float* p) { return *p; }

template <typename T>
__global__ void __launch_bounds__(kMxfp8Threads)
quantize_mxfp8_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t x_sr, int64_t x_sc,
                      uint8_t* __restrict__ q, int64_t q_sr, int64_t q_sc, uint8_t* __restrict__ scale,
                      bool blocked, int64_t scale_ld, Mxfp8GroupAxis axis, const int32_t* __restrict__ group_ends,
                      const int32_t* __restrict__ group_starts, int32_t num_groups, bool rceil) {
  // The group-start kernel marks ends it found invalid: then nothing is written, neither values nor scales.
  if (axis != Mxfp8GroupAxis::kNone && group_starts[0] < 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t per_row = cols / kMxfp8Block;
  const int64_t total = rows * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kMxfp8WarpsPerBlock;
  // w is uniform across the warp, so every lane takes the same trips and the shuffles see the full warp.
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kMxfp8WarpsPerBlock + (threadIdx.x >> 5); w < total;
       w += stride) {
    const int64_t r = w / per_row;
    const int64_t j = w - r * per_row;
    const int64_t c = j * kMxfp8Block + lane;
    const float v = mx_load(x + r * x_sr + c * x_sc);

    const bool nan_block = __any_sync(kFullMask, v != v);
    // For non-NaN floats the magnitude bits order as the magnitudes do, so an integer max is the amax.
    uint32_t mag = __float_as_uint(v) & 0x7fffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mag = max(mag, __shfl_xor_sync(kFullMask, mag, o));

    uint8_t qbyte;
    int sbyte;
    if (nan_block) {
      qbyte = kE4m3Nan;
      sbyte = kE8m0Nan;
    } else {
      const int e = mx_scale_exponent(mag, rceil);
      qbyte = mx_e4m3(v, e);
      sbyte = e + kE8m0Bias;
    }
    q[r * q_sr + c * q_sc] = qbyte;

    if (lane == 0) {
      if (!blocked) {
        scale[r * scale_ld + j] = static_cast<uint8_t>(sbyte);
      } else {
        const int64_t pos = mx_scale_pos(r, j, rows, per_row, axis, group_ends, group_starts, num_groups);
        if (pos >= 0) scale[pos] = static_cast<uint8_t>(sbyte);
      }
    }
  }
}

// Serial on one thread: the number of groups is the number of experts, and this keeps the prefix exact and
// ordered without a scan.
__global__ void mxfp8_blocked_group_starts_kernel(const int32_t* __restrict__ group_ends, int32_t num_groups,
                                                  Mxfp8GroupAxis axis, int64_t rows, int64_t cols,
                                                  int64_t scale_bytes, int32_t* __restrict__ out,
                                                  DeviceCheckRecord* check) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t bytes = 0;
  const int32_t bad = first_bad_group_end(group_ends, num_groups, axis, rows, cols, &bytes);
  if (bad >= 0) {
    report_device_check(check, kCheckMxfp8GroupEnds, group_ends[bad], axis == Mxfp8GroupAxis::kRows ? rows : cols);
    out[0] = -1;
    return;
  }
  if (bytes > scale_bytes) {
    report_device_check(check, kCheckMxfp8GroupEnds, bytes, scale_bytes);
    out[0] = -1;
    return;
  }
  group_starts_from_ends(group_ends, num_groups, axis, out);
}
#endif  // __CUDACC__

}  // namespace

const char* check_quantize_mxfp8_args(const QuantizeMxfp8Args& a) {
  if (a.rows < 0 || a.cols < 0) return "rows and cols must be non-negative";
  if (a.cols % kMxfp8Block != 0) return "cols (the blocked axis) must be a multiple of 32";
  if (a.x_type != Mxfp8InputType::kBf16 && a.x_type != Mxfp8InputType::kFp32) return "x must be bf16 or fp32";
  if (a.group_axis != Mxfp8GroupAxis::kNone && a.group_axis != Mxfp8GroupAxis::kRows &&
      a.group_axis != Mxfp8GroupAxis::kCols)
    return "unknown group axis";
  if (a.rows == 0 || a.cols == 0) return nullptr;
  if (a.x == nullptr || a.q == nullptr || a.scale == nullptr) return "x, q and scale must be set";
  const bool grouped = a.group_axis != Mxfp8GroupAxis::kNone;
  if (a.scale_layout == Mxfp8ScaleLayout::kPlain) {
    if (grouped) return "groups need the blocked scale layout";
    if (a.scale_ld < a.cols / kMxfp8Block) return "scale_ld must be at least cols / 32";
  } else if (a.scale_layout == Mxfp8ScaleLayout::kBlocked) {
    if (grouped && (a.group_ends == nullptr || a.group_starts == nullptr || a.num_groups <= 0))
      return "groups need group_ends, group_starts and num_groups > 0";
  } else {
    return "unknown scale layout";
  }
  return nullptr;
}

cudaError_t launch_quantize_mxfp8(const QuantizeMxfp8Args& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  const int64_t warps = a.rows * (a.cols / kMxfp8Block);
  int64_t blocks = (warps + kMxfp8WarpsPerBlock - 1) / kMxfp8WarpsPerBlock;
  if (blocks > (int64_t{1} << 20)) blocks = int64_t{1} << 20;  // the loop covers the rest
  const bool blocked = a.scale_layout == Mxfp8ScaleLayout::kBlocked;
  const unsigned grid = static_cast<unsigned>(blocks);
  if (a.x_type == Mxfp8InputType::kBf16) {
    quantize_mxfp8_kernel<__nv_bfloat16><<<grid, kMxfp8Threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(a.x), a.rows, a.cols, a.x_stride_row, a.x_stride_col, a.q,
        a.q_stride_row, a.q_stride_col, a.scale, blocked, a.scale_ld, a.group_axis, a.group_ends, a.group_starts,
        a.num_groups, a.rceil);
  } else {
    quantize_mxfp8_kernel<float><<<grid, kMxfp8Threads, 0, stream>>>(
        static_cast<const float*>(a.x), a.rows, a.cols, a.x_stride_row, a.x_stride_col, a.q, a.q_stride_row,
        a.q_stride_col, a.scale, blocked, a.scale_ld, a.group_axis, a.group_ends, a.group_starts, a.num_groups,
        a.rceil);
  }
  return cudaGetLastError();
}

cudaError_t launch_mxfp8_blocked_group_starts(const QuantizeMxfp8Args& a, int32_t* out, DeviceCheckRecord* check,
                                              cudaStream_t stream) {
  if (a.num_groups <= 0 || a.group_axis == Mxfp8GroupAxis::kNone) return cudaSuccess;
  mxfp8_blocked_group_starts_kernel<<<1, 32, 0, stream>>>(a.group_ends, a.num_groups, a.group_axis, a.rows, a.cols,
                                                          a.scale_bytes, out, check);
  return cudaGetLastError();
}

const char* check_mxfp8_group_ends_host(const QuantizeMxfp8Args& a) {
  if (a.group_axis == Mxfp8GroupAxis::kNone) return nullptr;
  int64_t bytes = 0;
  if (first_bad_group_end(a.group_ends, a.num_groups, a.group_axis, a.rows, a.cols, &bytes) >= 0)
    return a.group_axis == Mxfp8GroupAxis::kRows
               ? "group ends must be non-decreasing within [0, rows]"
               : "group ends must be non-decreasing within [0, cols], each a multiple of 32";
  if (bytes > a.scale_bytes) return "the scale buffer is smaller than the groups' padded blocked layout";
  return nullptr;
}

void mxfp8_blocked_group_starts_host(const int32_t* group_ends, int32_t num_groups, Mxfp8GroupAxis axis,
                                     int32_t* out) {
  group_starts_from_ends(group_ends, num_groups, axis, out);
}

void quantize_mxfp8_host(const QuantizeMxfp8Args& a) {
  const int64_t per_row = a.cols / kMxfp8Block;
  const bool blocked = a.scale_layout == Mxfp8ScaleLayout::kBlocked;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t j = 0; j < per_row; ++j) {
      float v[kMxfp8Block];
      bool nan_block = false;
      uint32_t mag = 0;
      for (int i = 0; i < kMxfp8Block; ++i) {
        const int64_t off = r * a.x_stride_row + (j * kMxfp8Block + i) * a.x_stride_col;
        v[i] = a.x_type == Mxfp8InputType::kBf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(a.x)[off])
                                                 : static_cast<const float*>(a.x)[off];
        nan_block = nan_block || v[i] != v[i];
        const uint32_t m = mx_float_bits(v[i]) & 0x7fffffffu;
        mag = m > mag ? m : mag;
      }
      const int e = nan_block ? 0 : mx_scale_exponent(mag, a.rceil);
      for (int i = 0; i < kMxfp8Block; ++i)
        a.q[r * a.q_stride_row + (j * kMxfp8Block + i) * a.q_stride_col] = nan_block ? kE4m3Nan : mx_e4m3(v[i], e);
      const auto sbyte = static_cast<uint8_t>(nan_block ? kE8m0Nan : e + kE8m0Bias);
      if (!blocked) {
        a.scale[r * a.scale_ld + j] = sbyte;
      } else {
        const int64_t pos = mx_scale_pos(r, j, a.rows, per_row, a.group_axis, a.group_ends, a.group_starts,
                                         a.num_groups);
        if (pos >= 0) a.scale[pos] = sbyte;
      }
    }
  }
}

int mxfp8_scale_exponent_host(float amax, bool rceil) {
  const uint32_t u = mx_float_bits(amax) & 0x7fffffffu;
  if (u > 0x7f800000u) return kE8m0Nan - kE8m0Bias;  // NaN: the byte 0xFF
  return mx_scale_exponent(u, rceil);
}

}  // namespace prime_kernels::common
