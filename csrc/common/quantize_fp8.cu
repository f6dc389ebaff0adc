#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/dispatch_rows_fp8.cuh"
#include "common/quantize_fp8.hpp"
#include "common/quantize_tokens_fp8.cuh"

namespace prime_kernels::common {

namespace {
// Q1-Q3 of one block of `n` values on the host: returns its scale, and the e4m3 bytes of vals[i] in out[i].
float quantize_block_host(const float* vals, int n, bool pow2_scales, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(vals[i]));
  const float s = fp8_block_scale(amax, pow2_scales);
  for (int i = 0; i < n; ++i) out[i] = e4m3_bits_host(fp32_div_rn(vals[i], s));
  return s;
}
}  // namespace

cudaError_t launch_dispatch_rows_fp8(const DispatchRowsFp8Args& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.hidden == 0) return cudaSuccess;
  const auto* src = static_cast<const __nv_bfloat16*>(a.src);
  auto* q = static_cast<uint8_t*>(a.q);
  // the whole 128-column blocks, then (hidden = 64 mod 128) the 64-wide last one by its own kernel
  const int64_t whole = a.hidden / kFp8Block * kFp8Block;
  if (whole > 0) {
    const int64_t chunks = (whole / 8 + kDispatchFp8Threads - 1) / kDispatchFp8Threads;
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min<int64_t>(a.num_tokens, 65535)));
    dispatch_rows_fp8_kernel<<<grid, kDispatchFp8Threads, 0, stream>>>(
        src, a.ld_src, a.route_to_pool, a.num_tokens, static_cast<int>(a.top_k), whole, q, a.ld_q, a.sa, a.ld_sa,
        a.num_rows, a.pow2_scales, device_check_record());
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess || whole == a.hidden) return e;
  }
  const int64_t ctas = (a.num_tokens + kDispatchFp8TailRows - 1) / kDispatchFp8TailRows;
  dispatch_rows_fp8_tail_kernel<<<static_cast<unsigned>(std::min<int64_t>(ctas, 65535)), kDispatchFp8Threads, 0,
                                  stream>>>(
      src + whole, a.ld_src, a.route_to_pool, a.num_tokens, static_cast<int>(a.top_k), q + whole, a.ld_q,
      a.sa + (whole / kFp8Block) * a.ld_sa, a.num_rows, a.pow2_scales, device_check_record());
  return cudaGetLastError();
}

void dispatch_rows_fp8_host(const DispatchRowsFp8Args& a) {
  const auto* src = static_cast<const __nv_bfloat16*>(a.src);
  auto* q = static_cast<uint8_t*>(a.q);
  std::vector<float> row(a.hidden);
  std::vector<uint8_t> qrow(a.hidden);
  std::vector<float> scales((a.hidden + kFp8Block - 1) / kFp8Block);
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    for (int64_t h = 0; h < a.hidden; ++h) row[h] = __bfloat162float(src[t * a.ld_src + h]);
    for (size_t j = 0; j < scales.size(); ++j)  // the last block: the columns that exist
      scales[j] = quantize_block_host(row.data() + j * kFp8Block,
                                      static_cast<int>(std::min<int64_t>(kFp8Block, a.hidden - j * kFp8Block)),
                                      a.pow2_scales, qrow.data() + j * kFp8Block);
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int32_t p = a.route_to_pool[t * a.top_k + k];
      if (p < 0) continue;
      std::memcpy(q + p * a.ld_q, qrow.data(), static_cast<size_t>(a.hidden));
      for (size_t j = 0; j < scales.size(); ++j) a.sa[j * a.ld_sa + p] = scales[j];
    }
  }
}

cudaError_t launch_quantize_tokens_fp8(const QuantizeTokensFp8Args& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((a.rows + kFp8Block - 1) / kFp8Block),
                  static_cast<unsigned>((a.cols + kQuantTokensCols - 1) / kQuantTokensCols));
  auto* kernel = a.v_scale != nullptr ? quantize_tokens_fp8_kernel<true> : quantize_tokens_fp8_kernel<false>;
  kernel<<<grid, kQuantTokensThreads, 0, stream>>>(
      a.v, a.ld_v, a.rows, a.cols, a.expert_offsets, a.expert_counts, a.num_experts, static_cast<uint8_t*>(a.q),
      a.ld_q, a.scale, a.ld_scale, a.pow2_scales, a.src_route, static_cast<int>(a.top_k),
      static_cast<int>(a.num_tokens * a.top_k), a.v_scale, a.v_scale_row_stride, a.v_scale_block_stride,
      device_check_record());
  return cudaGetLastError();
}

void quantize_tokens_fp8_host(const QuantizeTokensFp8Args& a) {
  auto* q = static_cast<uint8_t*>(a.q);
  // element (row, c) of v as the kernel reads it: bf16, or bf16(e4m3 * the row's block scale)
  auto value = [&](int64_t row, int64_t c) -> float {
    if (a.v_scale == nullptr) return __bfloat162float(static_cast<const __nv_bfloat16*>(a.v)[row * a.ld_v + c]);
    const float s = a.v_scale[row * a.v_scale_row_stride + (c / kFp8Block) * a.v_scale_block_stride];
    const float f = e4m3_value_host(static_cast<const uint8_t*>(a.v)[row * a.ld_v + c]);
    return __bfloat162float(__float2bfloat16_rn(f * s));
  };
  // live[r]: row r is one of an expert's first counts[e] rows; every other row is read as zero
  std::vector<char> live(a.rows, 0);
  for (int e = 0; e < a.num_experts; ++e)
    std::fill(live.begin() + a.expert_offsets[e], live.begin() + a.expert_offsets[e] + a.expert_counts[e], 1);
  // the row of v that pool row r reads (gathering: its route's token; the caller checked the routes' bound)
  auto src_row = [&](int64_t r) -> int64_t { return a.src_route == nullptr ? r : a.src_route[r] / a.top_k; };
  if (a.src_route != nullptr)
    for (int64_t r = 0; r < a.rows; ++r) live[r] = live[r] && a.src_route[r] >= 0;
  std::vector<float> block(kFp8Block);
  std::vector<uint8_t> qblock(kFp8Block);
  for (int64_t r0 = 0; r0 < a.rows; r0 += kFp8Block) {
    const int n = static_cast<int>(std::min<int64_t>(kFp8Block, a.rows - r0));
    for (int64_t c = 0; c < a.cols; ++c) {
      for (int i = 0; i < n; ++i)
        block[i] = live[r0 + i] ? value(src_row(r0 + i), c) : 0.0f;
      a.scale[(r0 / kFp8Block) * a.ld_scale + c] = quantize_block_host(block.data(), n, a.pow2_scales,
                                                                       qblock.data());
      std::memcpy(q + c * a.ld_q + r0, qblock.data(), static_cast<size_t>(n));
    }
  }
}

}  // namespace prime_kernels::common
