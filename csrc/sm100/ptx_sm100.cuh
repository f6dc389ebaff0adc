// prime-kernels: thin inline-PTX wrappers for the sm_100a (Blackwell) kernels of csrc/sm100.
//
// Every instruction the sm100 kernels need beyond plain C++ is reached through here: the mbarriers, TMA tile loads
// and bulk groups that sm90 uses too (common/ptx_async.cuh), and what only sm_100a has: the TMA tile gather4 form,
// the TMA tile store, and the tcgen05 family (tensor-memory allocation, the MMA with shared-memory descriptors, its
// commit to an mbarrier, tensor-memory loads, the fences). Written from the PTX ISA (tcgen05 needs PTX 8.6 and the
// "a" target: -gencode arch=compute_100a,code=sm_100a). Our own wrappers rather than CuTe's: the kernels use a
// dozen instructions, and this keeps the wheel free of a CUTLASS pin.
//
// Nothing here has run: no Blackwell GPU is available to this project. The encodings follow the ISA's tables; the
// SASS test (tests/test_sm100_sass.py) checks only that they assemble to the expected instruction families.
//
// Debug builds (PK_DEBUG_SPIN_BOUND, CMake PRIME_KERNELS_DEBUG_SPIN=ON): every mbarrier wait traps after that many
// polls instead of hanging, as in csrc/sm90/ptx.cuh.
#pragma once

#include <cstdint>
#include <cstdio>

#include "common/ptx_async.cuh"

namespace prime_kernels {
namespace sm100 {
namespace ptx {

// The arch-neutral wrappers (mbarriers, TMA tile loads, bulk groups): common/ptx_async.cuh.
using namespace common::ptx;

// ------------------------------------------------------------------------------------------------
// mbarrier
// ------------------------------------------------------------------------------------------------
// Blocks until the phase with the given parity has completed (bounded only in debug builds: these waits are on
// this CTA's own warps and its own asynchronous copies and MMAs, never on another CTA).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef PK_DEBUG_SPIN_BOUND
  uint64_t polls = 0;
  while (!mbar_try_wait(bar, parity)) {
    if (++polls > (uint64_t)(PK_DEBUG_SPIN_BOUND)) {
      printf("pk: sm100 mbarrier wait timed out (block %d thread %d parity %u)\n", blockIdx.x, threadIdx.x, parity);
      __trap();
    }
  }
#else
  while (!mbar_try_wait(bar, parity)) {
  }
#endif
}

// ------------------------------------------------------------------------------------------------
// TMA (cp.async.bulk.tensor), completion through an mbarrier's transaction count
// ------------------------------------------------------------------------------------------------
// Four rows of a 2-D tensor, rows r0..r3 (any order, any distance) at column c0, into four consecutive box rows
// of dst; a row index past the tensor reads as zeros. The map's box is {columns, 1}.
__device__ __forceinline__ void tma_gather4(void* dst, const void* desc, uint64_t* bar, int32_t c0, int32_t r0,
                                            int32_t r1, int32_t r2, int32_t r3) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6, %7}], [%2];" ::"r"(smem_addr(dst)),
      "l"(desc), "r"(smem_addr(bar)), "r"(c0), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// Shared -> global: a box of the map at (c0, c1) from src (laid out as the map's swizzle dictates), in this
// thread's current bulk group. Elements past the tensor's extent are not written; nothing else clips.
__device__ __forceinline__ void tma_store_2d(const void* desc, const void* src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];" ::"l"(desc),
               "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

// ------------------------------------------------------------------------------------------------
// tcgen05: tensor memory
// ------------------------------------------------------------------------------------------------
// Whole warp. Allocates ncols (a power of two, 32..512) columns of tensor memory and writes their address to
// *dst (shared memory). Blocks while another CTA on the SM holds them, so a kernel allocates at most what lets
// every CTA that can be resident on an SM allocate at once.
__device__ __forceinline__ void tmem_alloc(uint32_t* dst, uint32_t ncols) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(smem_addr(dst)), "r"(ncols)
               : "memory");
}
// Whole warp: no further allocation by this CTA, so other CTAs waiting on the SM's tensor memory can proceed.
__device__ __forceinline__ void tmem_relinquish_alloc_permit() {
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;" ::: "memory");
}
// Whole warp (the allocating one); every read of the columns must be complete (tcgen05.wait::ld, then a barrier).
__device__ __forceinline__ void tmem_dealloc(uint32_t taddr, uint32_t ncols) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" ::"r"(taddr), "r"(ncols) : "memory");
}

// Orders tcgen05 operations across a thread synchronisation (mbarrier wait, bar.sync): "before" on the side that
// signals, "after" on the side that waits.
__device__ __forceinline__ void tcgen05_fence_before() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tcgen05_fence_after() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// ------------------------------------------------------------------------------------------------
// tcgen05: MMA (one thread issues; D in tensor memory, A and B in shared memory)
// ------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a K-major bf16 operand stored the way a TMA load with the 128-byte swizzle
// leaves it: rows of 64 elements (128 bytes), 8-row groups of 1024 bytes one after the other. The start address
// must lie in a 1024-byte aligned group (base offset 0); a K step of 16 elements inside the 128-byte row advances
// the start by 32 bytes, since the swizzle is a function of the address bits the hardware applies on access.
//   bits 0-13 start >> 4, 16-29 leading byte offset >> 4 (unused by swizzled K-major layouts: 1),
//   32-45 stride byte offset >> 4 (1024: next 8-row group), 46-48 the constant 0b001, 61-63 swizzle (2: 128-byte).
__device__ __forceinline__ uint64_t smem_desc_kmajor_sw128(uint32_t smem_byte_addr) {
  uint64_t d = static_cast<uint64_t>((smem_byte_addr >> 4) & 0x3fffu);
  d |= static_cast<uint64_t>(1u) << 16;
  d |= static_cast<uint64_t>(1024u >> 4) << 32;
  d |= static_cast<uint64_t>(1u) << 46;
  d |= static_cast<uint64_t>(2u) << 61;
  return d;
}

// Instruction descriptor of kind::f16 with bf16 A and B, fp32 D, both operands K-major, dense:
//   bits 4-5 D type (1: f32), 7-9 A type (1: bf16), 10-12 B type (1: bf16), 15 / 16 transpose A / B (0: K-major),
//   17-22 N >> 3, 24-28 M >> 4.
template <int kM, int kN>
__device__ __forceinline__ constexpr uint32_t idesc_bf16_f32() {
  static_assert(kM == 64 || kM == 128, "cta_group::1 MMA has M = 64 or 128");
  static_assert(kN % 16 == 0 && kN >= 16 && kN <= 256, "N must be a multiple of 16 in [16, 256]");
  return (1u << 4) | (1u << 7) | (1u << 10) | (static_cast<uint32_t>(kN >> 3) << 17) |
         (static_cast<uint32_t>(kM >> 4) << 24);
}

// D[tmem] (+)= A[smem] * B[smem]^T for one K = 16 step; accumulate = false overwrites D.
__device__ __forceinline__ void mma_bf16_ss(uint32_t d_tmem, uint64_t a_desc, uint64_t b_desc, uint32_t idesc,
                                            bool accumulate) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %4, 0;\n\t"
      "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n\t}" ::"r"(d_tmem),
      "l"(a_desc), "l"(b_desc), "r"(idesc), "r"(static_cast<uint32_t>(accumulate))
      : "memory");
}

// Arrives once on bar when every tcgen05 operation this thread issued before it has completed (the MMAs' reads
// of shared memory and writes of tensor memory included).
__device__ __forceinline__ void mma_commit(uint64_t* bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

// ------------------------------------------------------------------------------------------------
// tcgen05: tensor memory -> registers
// ------------------------------------------------------------------------------------------------
// Whole warp: thread t reads lane (taddr's lane + t), 32 consecutive 32-bit columns from taddr's column. A warp
// may only address the 32 lanes of its quarter, (warp id % 4) * 32. The registers are valid after tmem_wait_ld.
__device__ __forceinline__ void tmem_ld_32x32b_x32(uint32_t taddr, uint32_t (&r)[32]) {
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%32];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]), "=r"(r[8]),
        "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15]), "=r"(r[16]),
        "=r"(r[17]), "=r"(r[18]), "=r"(r[19]), "=r"(r[20]), "=r"(r[21]), "=r"(r[22]), "=r"(r[23]), "=r"(r[24]),
        "=r"(r[25]), "=r"(r[26]), "=r"(r[27]), "=r"(r[28]), "=r"(r[29]), "=r"(r[30]), "=r"(r[31])
      : "r"(taddr)
      : "memory");
}
__device__ __forceinline__ void tmem_wait_ld() { asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory"); }

// ------------------------------------------------------------------------------------------------
// Plain memory
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void st_shared_v4(void* p, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr(p)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(p))
               : "memory");
  return v;
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

}  // namespace ptx
}  // namespace sm100
}  // namespace prime_kernels
