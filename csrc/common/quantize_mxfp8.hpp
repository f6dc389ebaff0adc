// MXFP8 quantization (e4m3 values, one e8m0 scale per 32 elements along a row), the bits of
// python/prime_kernels/mxfp8.py quantize_mxfp8_reference (docs/mxfp8.md), with the scales written either as a plain
// [rows, cols/32] matrix or directly in the 128 x 4 blocked layout torch._scaled_grouped_mm reads on sm_100
// (optionally per row group, each group padded to 128 rows: the 2d-3d grouped GEMM's A operand).
//
// Rounding, per block of 32: amax = max |x| (fp32); the scale exponent E from amax's bits,
//   rceil: E = p - 8 + (s > 1.75), floor: E = p - 8, where amax = s * 2^p, s in [1, 2);
//   E clamped to [-127, 127]; amax == 0 (or subnormal) -> -127; amax == inf -> 127; stored as the byte E + 127.
// q = e4m3(x * 2^-E), the product exact, round to nearest even with saturation to +-448 (infinities included).
// A block holding a NaN: scale byte 0xFF and every q of the block 0x7F.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/device_check.hpp"

namespace prime_kernels::common {

constexpr int kMxfp8Block = 32;

enum class Mxfp8InputType : int { kBf16 = 0, kFp32 = 1 };
enum class Mxfp8ScaleLayout : int { kPlain = 0, kBlocked = 1 };
enum class Mxfp8GroupAxis : int { kNone = 0, kRows = 1, kCols = 2 };

struct QuantizeMxfp8Args {
  const void* x = nullptr;  // bf16 or fp32, element (r, c) at x[r * x_stride_row + c * x_stride_col]
  Mxfp8InputType x_type = Mxfp8InputType::kBf16;
  int64_t rows = 0;
  int64_t cols = 0;  // the blocked axis: a multiple of 32
  int64_t x_stride_row = 0;
  int64_t x_stride_col = 1;  // 1 for coalesced reads; any stride is correct

  uint8_t* q = nullptr;  // e4m3 bytes, element (r, c) at q[r * q_stride_row + c * q_stride_col]
  int64_t q_stride_row = 0;
  int64_t q_stride_col = 1;

  // e8m0 bytes. kPlain: block (r, j) at scale[r * scale_ld + j]. kBlocked: the 128 x 4 tile layout of a
  // [padded rows, cols/32] matrix (tiles of 512 bytes, row-tile major; inside a tile (r % 32) * 16 +
  // ((r % 128) / 32) * 4 + j % 4). Padding bytes are not written: zero-fill the buffer first, as torch does.
  uint8_t* scale = nullptr;
  Mxfp8ScaleLayout scale_layout = Mxfp8ScaleLayout::kPlain;
  int64_t scale_ld = 0;
  // The scale buffer's size in bytes. Where the groups live on the device its needed size is only known there:
  // the group-start kernel checks the padded extent against it (an overflow makes the call write nothing).
  int64_t scale_bytes = 0;

  // kBlocked only, optional: groups, each blocked on its own (device int32 [num_groups] arrays; host arrays for
  // quantize_mxfp8_host). group_ends[g] is where group g ends (the offsets torch takes), group_starts[g] where its
  // scales start (launch_mxfp8_blocked_group_starts computes them from the ends, on the device: no host sync).
  //   kRows (2d-3d A operand): groups of rows; group g's scales at padded row group_starts[g] =
  //     sum_{h<g} round_up(m_h, 128). Rows past the last end get q but no scale.
  //   kCols (2d-2d operands, groups along the blocked axis; every end a multiple of 32): group g's [rows, k_g/32]
  //     scales blocked on their own at byte round_up(rows, 128) * group_starts[g], group_starts[g] =
  //     sum_{h<g} round_up(k_h / 32, 4).
  //   kNone: row r's scales at padded row r.
  Mxfp8GroupAxis group_axis = Mxfp8GroupAxis::kNone;
  const int32_t* group_ends = nullptr;
  const int32_t* group_starts = nullptr;
  int32_t num_groups = 0;

  bool rceil = true;  // false: the OCP floor rule
};

// nullptr when the arguments are usable, else what is wrong (host-side checks only; group ends live on the device
// and are not read here: launch_mxfp8_blocked_group_starts checks them there).
const char* check_quantize_mxfp8_args(const QuantizeMxfp8Args& args);

// nullptr when host-resident group ends are non-decreasing within [0, rows] (kRows) or [0, cols] with every end a
// multiple of 32 (kCols), and the padded extent they give fits in scale_bytes; else what is wrong. For the host
// loop, whose group arrays are host memory; on the device the group-start kernel applies the same rule.
const char* check_mxfp8_group_ends_host(const QuantizeMxfp8Args& args);

// One warp per block of 32; the arguments must have passed check_quantize_mxfp8_args.
cudaError_t launch_quantize_mxfp8(const QuantizeMxfp8Args& args, cudaStream_t stream);

// group_starts for QuantizeMxfp8Args from group_ends, on the device (one thread: there are as many groups as
// experts), so that no host synchronisation sits between the routing and the quantization. It also applies
// check_mxfp8_group_ends_host's rule to the ends (bounds from args: rows, cols, scale_bytes): on a violation it
// notes a device finding (kCheckMxfp8GroupEnds) and writes -1 as the first start, which makes the following
// launch_quantize_mxfp8 of the same arguments write nothing at all. `check`: the process's record (the caller's, so
// that this file links without the API's translation units).
cudaError_t launch_mxfp8_blocked_group_starts(const QuantizeMxfp8Args& args, int32_t* out, DeviceCheckRecord* check,
                                              cudaStream_t stream);
void mxfp8_blocked_group_starts_host(const int32_t* group_ends, int32_t num_groups, Mxfp8GroupAxis axis,
                                     int32_t* out);

// Same bits on the CPU; every pointer in args (group arrays included) is host memory.
void quantize_mxfp8_host(const QuantizeMxfp8Args& args);

// The unbiased scale exponent of a block from its amax's fp32 bits (sign ignored); exposed for host-side tests.
int mxfp8_scale_exponent_host(float amax, bool rceil);

}  // namespace prime_kernels::common
