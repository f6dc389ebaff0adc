// C ABI of the expert-parallel barriers over peer memory (csrc/common/ep_signal.hpp).
#include <cstdint>

#include "api/prime_kernels_api.h"
#include "api/errors.hpp"
#include "common/ep_signal.hpp"
#include "common/peer_rows.hpp"
#include "common/watchdog.hpp"

extern "C" {

int64_t pk_ep_signals_bytes(void) { return static_cast<int64_t>(sizeof(prime_kernels::common::EpSignals)); }

int pk_ep_barrier(void* const* signals, int num_ranks, int kind, int phase, const int32_t* played, int num_played,
                  void* cuda_stream) {
  using prime_kernels::common::kEpMaxRanks;
  if (const int rc = prime_kernels::api::check_device_findings("ep_barrier"); rc != PK_OK) return rc;
  PK_CHECK_ARG(signals != nullptr && played != nullptr, "ep_barrier: null signals or played");
  PK_CHECK_ARG(num_ranks >= 1 && num_ranks <= kEpMaxRanks, "ep_barrier: num_ranks = %d, must be in [1, %d]", num_ranks,
               kEpMaxRanks);
  PK_CHECK_ARG(kind == prime_kernels::common::kEpEnter || kind == prime_kernels::common::kEpExit,
               "ep_barrier: kind = %d, must be 0 (enter) or 1 (exit)", kind);
  PK_CHECK_ARG(phase == prime_kernels::common::kEpArriveAndWait ||
                   (kind == prime_kernels::common::kEpExit && (phase == prime_kernels::common::kEpArriveOnly ||
                                                               phase == prime_kernels::common::kEpWaitOnly)),
               "ep_barrier: phase = %d, must be 0 (arrive and wait), or for an exit 1 (arrive only) or 2 (wait only)",
               phase);
  PK_CHECK_ARG(num_played >= 1 && num_played <= num_ranks, "ep_barrier: num_played = %d, must be in [1, %d]",
               num_played, num_ranks);
  prime_kernels::common::EpBarrierArgs args{};
  args.num_ranks = num_ranks;
  args.kind = kind;
  args.phase = phase;
  args.num_played = num_played;
  for (int r = 0; r < num_ranks; ++r) {
    PK_CHECK_ARG(signals[r] != nullptr && reinterpret_cast<uintptr_t>(signals[r]) % 8 == 0,
                 "ep_barrier: signals[%d] is null or not 8-byte aligned", r);
    args.signals[r] = static_cast<prime_kernels::common::EpSignals*>(signals[r]);
  }
  unsigned seen = 0;
  for (int i = 0; i < num_played; ++i) {
    PK_CHECK_ARG(played[i] >= 0 && played[i] < num_ranks && !(seen >> played[i] & 1u),
                 "ep_barrier: played[%d] = %d is not a rank of the group or is played twice", i, played[i]);
    seen |= 1u << played[i];
    args.played[i] = played[i];
  }
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK)
    return rc;
  prime_kernels::WaitGuard guard{};
  if (const cudaError_t e = prime_kernels::peer_wait_guard_for_current_device(&guard); e != cudaSuccess)
    return prime_kernels::api::fail_cuda(e, "ep_barrier: allocating the wait record");
  if (const cudaError_t e = prime_kernels::common::launch_ep_barrier(args, guard, static_cast<cudaStream_t>(cuda_stream));
      e != cudaSuccess)
    return prime_kernels::api::fail_cuda(e, "ep_barrier: launch");
  return prime_kernels::api::ok();
}

int pk_peer_rows(void* pool, int64_t ld_pool, void* const* peers, int num_ranks, int64_t ld_peer, int64_t peer_rows,
                 int64_t num_rows, int64_t row_bytes, const int32_t* src_route, const int32_t* src_rank,
                 int route_divisor, int gather, void* cuda_stream) {
  using prime_kernels::common::kEpMaxRanks;
  if (const int rc = prime_kernels::api::check_device_findings("peer_rows"); rc != PK_OK) return rc;
  PK_CHECK_ARG(num_ranks >= 1 && num_ranks <= kEpMaxRanks, "peer_rows: num_ranks = %d, must be in [1, %d]", num_ranks,
               kEpMaxRanks);
  PK_CHECK_ARG(num_rows >= 0 && peer_rows >= 0 && row_bytes >= 0 && row_bytes % 4 == 0 && route_divisor >= 1,
               "peer_rows: bad sizes (num_rows %lld, peer_rows %lld, row_bytes %lld: a multiple of 4, route_divisor "
               "%d)", static_cast<long long>(num_rows), static_cast<long long>(peer_rows),
               static_cast<long long>(row_bytes), route_divisor);
  PK_CHECK_ARG(ld_pool >= row_bytes && ld_peer >= row_bytes && ld_pool % 4 == 0 && ld_peer % 4 == 0,
               "peer_rows: the row strides (%lld, %lld bytes) must be multiples of 4 and >= row_bytes",
               static_cast<long long>(ld_pool), static_cast<long long>(ld_peer));
  if (num_rows == 0 || row_bytes == 0) return prime_kernels::api::ok();
  PK_CHECK_ARG(pool != nullptr && peers != nullptr && src_route != nullptr && src_rank != nullptr,
               "peer_rows: a pointer is null");
  prime_kernels::common::PeerRowsArgs a{};
  a.pool = pool;
  a.ld_pool = ld_pool;
  for (int r = 0; r < num_ranks; ++r) {
    PK_CHECK_ARG(peers[r] != nullptr && reinterpret_cast<uintptr_t>(peers[r]) % 4 == 0,
                 "peer_rows: peers[%d] is null or not 4-byte aligned", r);
    a.peers[r] = peers[r];
  }
  a.ld_peer = ld_peer;
  a.num_ranks = num_ranks;
  a.num_rows = num_rows;
  a.row_bytes = row_bytes;
  a.peer_rows = peer_rows;
  a.src_route = src_route;
  a.src_rank = src_rank;
  a.route_divisor = route_divisor;
  a.gather = gather != 0;
  if (const int rc = prime_kernels::api::check_current_device(prime_kernels::api::ArchFamily::kAny); rc != PK_OK)
    return rc;
  if (const cudaError_t e = prime_kernels::common::launch_peer_rows(a, static_cast<cudaStream_t>(cuda_stream));
      e != cudaSuccess)
    return prime_kernels::api::fail_cuda(e, "peer_rows: launch");
  return prime_kernels::api::ok();
}

}  // extern "C"
