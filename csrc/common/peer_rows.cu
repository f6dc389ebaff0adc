// prime-kernels: row moves between a pool and the peers' buffers (peer_rows.hpp).
#include "common/peer_rows.hpp"

namespace prime_kernels::common {
namespace {

constexpr int kWarpsPerBlock = 8;

template <typename Word>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) peer_rows_kernel(const __grid_constant__ PeerRowsArgs a) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t words = a.row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t m = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); m < a.num_rows;
       m += step) {
    const int32_t route = __ldg(a.src_route + m);
    Word* pool = reinterpret_cast<Word*>(static_cast<char*>(a.pool) + m * a.ld_pool);
    const int64_t row = route >= 0 ? route / a.route_divisor : -1;
    const int32_t rank = route >= 0 ? __ldg(a.src_rank + m) : -1;
    const bool live = row >= 0 && row < a.peer_rows && rank >= 0 && rank < a.num_ranks;
    if (a.gather) {
      if (live) {
        const Word* src = reinterpret_cast<const Word*>(static_cast<const char*>(a.peers[rank]) + row * a.ld_peer);
        for (int64_t i = lane; i < words; i += 32) pool[i] = src[i];
      } else {
        for (int64_t i = lane; i < words; i += 32) pool[i] = Word{};
      }
    } else if (live) {
      Word* dst = reinterpret_cast<Word*>(static_cast<char*>(a.peers[rank]) + row * a.ld_peer);
      for (int64_t i = lane; i < words; i += 32) dst[i] = pool[i];
    }
  }
}

}  // namespace

cudaError_t launch_peer_rows(const PeerRowsArgs& a, cudaStream_t stream) {
  if (a.num_rows == 0 || a.row_bytes == 0) return cudaSuccess;
  bool wide = a.row_bytes % 16 == 0 && a.ld_pool % 16 == 0 && a.ld_peer % 16 == 0 &&
              reinterpret_cast<uintptr_t>(a.pool) % 16 == 0;
  for (int r = 0; r < a.num_ranks; ++r) wide = wide && reinterpret_cast<uintptr_t>(a.peers[r]) % 16 == 0;
  const int64_t blocks64 = (a.num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65535 ? blocks64 : 65535);
  if (wide)
    peer_rows_kernel<uint4><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(a);
  else
    peer_rows_kernel<uint32_t><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace prime_kernels::common
