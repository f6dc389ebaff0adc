// prime-kernels: the tensor maps of the sm90a m-grouped FP8 operands, shared by the FP8 GEMM launchers
// (grouped_gemm_fp8.cu) and the fused FP8 forward's (mega_moe_fp8.cu). Host C++.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

namespace prime_kernels {
namespace sm90 {

// A e4m3 [m_total, k] (row stride lda bytes) and B e4m3 [num_groups, n, k] (row stride ldb bytes, b_group_stride
// between groups) in boxes of 128 (B: b_box_rows) rows x 128 bytes with the 128-byte swizzle (the layout K-major
// wgmma reads), and A's K-block-major scales sa [k / a_scale_block][ld_sa] in boxes of one tile's rows from the
// 16-byte boundary before them (MGroupedFp8Layout::kSaBoxRows, no swizzle). status.hpp's codes; err gets the reason.
int make_m_grouped_fp8_operand_maps(CUtensorMap* ma, CUtensorMap* mb, CUtensorMap* msa, const void* a, int64_t lda,
                                    const float* sa, int64_t ld_sa, const void* b, int64_t ldb,
                                    int64_t b_group_stride, int num_groups, int64_t m_total, int64_t n, int64_t k,
                                    char* err, size_t err_len, uint32_t b_box_rows = 128,
                                    int64_t a_scale_block = 128);

}  // namespace sm90
}  // namespace prime_kernels
