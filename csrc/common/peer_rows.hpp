// prime-kernels: row moves between a rank's pool and its peers' buffers (expert parallelism over peer memory): for
// each pool row m with src_route[m] >= 0, the peer row is peers[src_rank[m]] + (src_route[m] / route_divisor) * ld
// (route_divisor = top_k: the route's token row, e.g. dy; 1: the route's own row, e.g. a combine slot or a weight).
//   gather:  pool[m] = that peer row (zeros when src_route[m] < 0: a plan's padding row);
//   scatter: that peer row = pool[m] (padding rows go nowhere).
// One warp per row, 16-byte moves when row_bytes and every stride allow, else 4-byte ones. The peers' memory may be
// another GPU's (torch symmetric memory); ordering against the peers is the barriers' (ep_signal.hpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/ep_signal.hpp"

namespace prime_kernels::common {

struct PeerRowsArgs {
  void* pool;                     // [num_rows, row_bytes], row stride ld_pool bytes
  int64_t ld_pool;
  void* peers[kEpMaxRanks];       // every rank's buffer, row stride ld_peer bytes
  int64_t ld_peer;
  int32_t num_ranks;
  int64_t num_rows;
  int64_t row_bytes;              // a multiple of 4
  int64_t peer_rows;              // rows of each peer buffer: a larger index is skipped (and not read)
  const int32_t* src_route;       // [num_rows]
  const int32_t* src_rank;        // [num_rows]
  int32_t route_divisor;          // >= 1
  bool gather;
};

cudaError_t launch_peer_rows(const PeerRowsArgs& args, cudaStream_t stream);

}  // namespace prime_kernels::common
