// prime-kernels: host side of the sm90a blockwise-FP8 m-grouped GEMM (argument checks, config, TMA maps, launch).
#include "grouped_gemm_fp8.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "host_utils.hpp"
#include "m_blocks.hpp"
#include "m_grouped_gemm_fp8.cuh"

namespace prime_kernels {
namespace sm90 {
using namespace host;

static_assert(kFp8MaxGroups == kMaxGroups, "the argument check's group bound is the kernel's shared-memory bound");

int m_grouped_fp8_gemm_nt(const MGroupedFp8GemmArgs& args, cudaStream_t stream, char* err, size_t err_len) {
  clear_err(err, err_len);
  const char* fn = "m_grouped_fp8_gemm_nt";
  if (int r = check_m_grouped_fp8_args(args, err, err_len)) return r;
  if (args.m_total == 0) return kGemmOk;
  const GroupedGemmConfig cfg =
      args.config ? *args.config : m_grouped_fp8_gemm_config(args.m_total, args.n, args.k, args.num_groups);
  int sms = 0;
  if (int r = device_sms(&sms, err, err_len)) return r;
  if (cfg.num_sms > 0 && cfg.num_sms < sms) sms = cfg.num_sms;

  constexpr int kBlockN = 128, kStages = 5;
  const int64_t m_total = args.m_total, n = args.n, k = args.k, k_blocks = k / 128;
  CUtensorMap ma, mb, msa, md;
  {  // A: 128 rows x 128 bytes of K per box, 128-byte swizzle (the layout K-major wgmma reads)
    const uint64_t dims[2] = {(uint64_t)k, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)args.lda};
    const uint32_t box[2] = {128, 128};
    if (int r = make_map(&ma, args.a, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_UINT8)) return r;
  }
  {  // B: one group's 128 rows x 128 bytes of K per box
    const int64_t gs = args.num_groups > 1 ? args.b_group_stride : n * args.ldb;
    const uint64_t dims[3] = {(uint64_t)k, (uint64_t)n, (uint64_t)args.num_groups};
    const uint64_t strides[2] = {(uint64_t)args.ldb, (uint64_t)gs};
    const uint32_t box[3] = {128, (uint32_t)kBlockN, 1};
    if (int r = make_map(&mb, args.b, 3, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_UINT8)) return r;
  }
  {  // sa: the 128 scales of one tile's rows for one k-block (512 contiguous bytes, no swizzle)
    const uint64_t dims[2] = {(uint64_t)m_total, (uint64_t)k_blocks};
    const uint64_t strides[1] = {(uint64_t)args.ld_sa * 4};
    const uint32_t box[2] = {128, 1};
    if (int r = make_map(&msa, args.sa, 2, dims, strides, box, err, err_len, CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                         CU_TENSOR_MAP_SWIZZLE_NONE))
      return r;
  }
  {  // D: the BF16 kernel's output map (64 x 64 boxes, clipped at [m_total, n])
    const uint64_t dims[2] = {(uint64_t)n, (uint64_t)m_total};
    const uint64_t strides[1] = {(uint64_t)args.ldd * 2};
    const uint32_t box[2] = {64, 64};
    if (int r = make_map(&md, args.d, 2, dims, strides, box, err, err_len)) return r;
  }
  MGroupedFp8Params p{};
  p.l2_hints = kGemmL2Hints;
  p.check = common::device_check_record();
  p.d = reinterpret_cast<__nv_bfloat16*>(args.d);
  p.ldd = args.ldd;
  p.sb = args.sb;
  p.sb_group_stride = args.num_groups > 1 ? args.sb_group_stride : 0;
  p.sb_n_stride = args.sb_n_stride;
  p.group_offsets = args.group_offsets;
  p.m_total = (int32_t)m_total;
  p.n = (int32_t)n;
  p.k = (int32_t)k;
  p.num_groups = args.num_groups;
  const int64_t max_units = max_m_blocks(m_total, args.num_groups) * ((n + kBlockN - 1) / kBlockN);

  constexpr auto kernel = &m_grouped_fp8_gemm_kernel<kBlockN, kStages>;
  constexpr int smem = MGroupedFp8Layout<kBlockN, kStages>::kSmemBytes;
  cudaError_t e = set_max_dynamic_smem<kernel>(smem);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s: cudaFuncSetAttribute: %s", fn, cudaGetErrorString(e));
  e = launch_persistent<kernel>(kNumThreads, smem, max_units, sms, stream, ma, mb, msa, md, p);
  if (e != cudaSuccess) return fail(kGemmCudaError, err, err_len, "%s launch: %s", fn, cudaGetErrorString(e));
  return check_launch(fn, err, err_len);
}

}  // namespace sm90
}  // namespace prime_kernels
