// prime-kernels: the arrivals that order expert parallelism over peer memory (torch symmetric memory across the
// GPUs of one NVLink domain, or the one-GPU emulator's per-rank buffers). Host and device share these structs.
//
// Each rank owns one EpSignals in memory every peer can write. A call is bracketed by two barriers, each one launch
// on the rank's stream:
//   enter: the rank's epoch (its count of calls) goes up by one; the rank's staged rows and routing (written before,
//          in stream order) are published; then it waits until every peer has entered this epoch. Only after that
//          does anything read a peer's rows or write into a peer's buffers.
//   exit:  after the rank's kernels have pushed their rows into the peers' buffers: publishes that, then waits
//          until every peer has done the same. The rank's combine then reads only its own buffers. It may be two
//          launches, arrive then wait, with work between them that touches no peer's buffers and none of the
//          rank's own that peers write (a backward's weight gradients): that work then fills the time in which
//          slower peers finish their pushes, instead of the rank idling at the barrier.
// Why nothing races across calls: a peer writes into this rank's buffers for epoch e + 1 only after this rank entered
// e + 1, which in stream order follows this rank's exit and combine of e; and this rank's staged rows of e are
// overwritten only after its exit of e, which waits for every peer's exit of e, which follows every read of them.
// Arrivals are epochs, never reset: a peer already in a later epoch satisfies a wait for an earlier one, and no
// reset can race a peer's arrival.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "common/watchdog.cuh"

namespace prime_kernels::common {

constexpr int kEpMaxRanks = 8;

enum EpBarrierKind : int32_t { kEpEnter = 0, kEpExit = 1 };
// What one launch of a barrier does: both halves, or one (kEpExit only: an enter's wait must directly follow its
// arrival, since nothing may touch a peer before it).
enum EpBarrierPhase : int32_t { kEpArriveAndWait = 0, kEpArriveOnly = 1, kEpWaitOnly = 2 };

struct EpSignals {
  uint64_t epoch;                          // calls this rank has entered; written by its own barriers only
  uint64_t arrived[2][kEpMaxRanks];        // [kind][peer]: the latest epoch in which that peer arrived
};

struct EpBarrierArgs {
  EpSignals* signals[kEpMaxRanks];  // every rank's signals, in rank order (peer pointers)
  int32_t num_ranks;
  int32_t kind;                     // EpBarrierKind
  int32_t phase;                    // EpBarrierPhase
  // The ranks this launch plays, one CTA each: {rank} on a GPU of its own; every rank in the one-GPU emulator.
  int32_t played[kEpMaxRanks];
  int32_t num_played;
};

// One launch of num_played CTAs. Each (unless phase is kEpArriveOnly) waits (bounded by guard.timeout_ns, then records the rank, the peer, the epoch
// expected and the one observed, and traps) for the other CTAs' arrivals when several ranks are played: they are
// few (<= 8) and tiny, so they run at once on any GPU that is not entirely held by kernels that never end.
cudaError_t launch_ep_barrier(const EpBarrierArgs& args, const WaitGuard& guard, cudaStream_t stream);

}  // namespace prime_kernels::common
