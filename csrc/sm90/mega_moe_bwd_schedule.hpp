// prime-kernels: the task sequence of the fused Mega MoE backward (sm90), shared by the kernel and a host test.
//
// The backward of one layer, per pool row m of expert e (the forward's routing plan; rows grouped by expert, every
// expert padded to whole 128-row m-blocks):
//   da[m]   = dy_pool[m] @ w2_e                      (L2 dgrad, K = H)    -> dh[m] (SwiGLU backward), w * s[m], the
//                                                                            d topk_weights partials of m
//   dx[m]   = dh[m] @ w13_e                          (L1 dgrad, K = 2I)   -> the route's dX slot
//   dW2_e  += dy_pool_e^T @ (w * s)_e                (K = the rows of e)
//   dW13_e += dh_e^T @ x_pool_e                      (K = the rows of e)
// and the combine of the dX slots afterwards. Four task kinds: an L2-dgrad tile (one m-block, l2_block_n columns
// of I), an L1-dgrad tile (one m-block, l1_block_n columns of H), a dW2 tile and a dW13 tile (wgrad_block_m rows x
// wgrad_block_n columns of the expert's weight gradient, the expert's whole K).
//
// The sequence, in steps k = 0, 1, ..., E + lag - 1:
//   step k: the L2-dgrad tiles of expert k (if k < E), then, for f = k - lag (if f >= 0), the L1-dgrad tiles of
//           expert f, its dW2 tiles and its dW13 tiles.
// Within an expert the dgrad tiles go m-block fastest within bands of kBwdMBand m-blocks (the forward's order),
// the weight-gradient tiles row block major. The lag lets the L2-dgrad tiles of `lag` more experts run before the
// first tiles that wait for an expert's L2 dgrad, so that (with every CTA running) those waits are short, while the
// expert's dy_pool, w * s and dh rows are still in L2 when its weight-gradient tiles read them.
//
// Dependencies (counters the kernel releases; `arrivals` per finished tile, e.g. one per consumer warpgroup):
//   * an L1-dgrad tile of m-block mb waits until l2_done_mb[mb] == l2_per_mb * arrivals (every dh column of mb);
//   * a dW2 or dW13 tile of expert e waits until l2_done_expert[e] == (m-blocks of e) * l2_per_mb * arrivals;
//   * an L2-dgrad tile waits for nothing in this sequence (its dy rows are dispatched before the kernel).
// Every task waits only for tasks of a lower index: the L2-dgrad tiles of expert f are in step f, its other tiles
// in step f + lag >= f, after them. With tasks claimed from a counter in index order and every CTA finishing its
// claimed tasks in claim order, the lowest unfinished task can always run, whichever CTAs are resident (the
// forward's argument, csrc/sm90/mega_moe_fwd.cuh). tests/test_bwd_schedule.py checks both properties, and the
// coverage of every output tile, on the host.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PK_BWD_HD __host__ __device__ __forceinline__
#else
#define PK_BWD_HD inline
#endif

namespace prime_kernels {
namespace sm90 {

constexpr int kBwdBlockM = 128;  // pool rows per m-block (the plan's padding unit)
constexpr int kBwdMBand = 16;    // m-blocks per band of the dgrad tile order

enum BwdTaskKind : int32_t { kBwdL2Dgrad = 0, kBwdL1Dgrad = 1, kBwdWgradW2 = 2, kBwdWgradW13 = 3 };

struct BwdTask {
  int32_t kind;    // BwdTaskKind
  int32_t expert;
  int32_t mb;      // dgrad tiles: the global m-block; weight-gradient tiles: -1
  int32_t row0;    // dgrad tiles: the first pool row; weight-gradient tiles: the first row of the gradient tile
  int32_t col0;    // the first output column (I for L2 dgrad, H for L1 dgrad, of the gradient for the others)
};

// What a task waits for before its loads: counter[index] >= target (counter < 0: nothing).
struct BwdWait {
  int32_t counter;  // kBwdWaitNone, kBwdWaitMBlock (l2_done_mb) or kBwdWaitExpert (l2_done_expert)
  int32_t index;
  int32_t target;
};
enum BwdWaitCounter : int32_t { kBwdWaitNone = -1, kBwdWaitMBlock = 0, kBwdWaitExpert = 1 };

PK_BWD_HD int bwd_ceil_div(int a, int b) { return (a + b - 1) / b; }

// Tile sizes and the per-m-block / per-expert tile counts of one layer.
struct BwdTileShape {
  int l2_block_n, l1_block_n, wgrad_block_m, wgrad_block_n;
  int hidden, inter;
  int with_wgrad;  // 0: the sequence holds the dgrad tiles only (the weight gradients are computed elsewhere)
  PK_BWD_HD int l2_per_mb() const { return bwd_ceil_div(inter, l2_block_n); }
  PK_BWD_HD int l1_per_mb() const { return bwd_ceil_div(hidden, l1_block_n); }
  // dW2_e [H, I] and dW13_e [2I, H]
  PK_BWD_HD int w2_row_blocks() const { return bwd_ceil_div(hidden, wgrad_block_m); }
  PK_BWD_HD int w2_col_blocks() const { return bwd_ceil_div(inter, wgrad_block_n); }
  PK_BWD_HD int w13_row_blocks() const { return bwd_ceil_div(2 * inter, wgrad_block_m); }
  PK_BWD_HD int w13_col_blocks() const { return bwd_ceil_div(hidden, wgrad_block_n); }
  PK_BWD_HD int w2_tiles() const { return with_wgrad ? w2_row_blocks() * w2_col_blocks() : 0; }
  PK_BWD_HD int w13_tiles() const { return with_wgrad ? w13_row_blocks() * w13_col_blocks() : 0; }
};

// The m-block order of the dgrad tiles within an expert: column block major, m-block fastest within bands of
// kBwdMBand m-blocks (the tiles of a band share its A rows in L2, the concurrent ones the B columns).
PK_BWD_HD void bwd_band_tile(int local, int m_blocks, int n_blocks, int& nb, int& mb) {
  const int band = local / (kBwdMBand * n_blocks);
  const int m0 = band * kBwdMBand;
  const int band_rows = m_blocks - m0 < kBwdMBand ? m_blocks - m0 : kBwdMBand;
  const int rem = local - band * kBwdMBand * n_blocks;
  nb = rem / band_rows;
  mb = m0 + (rem - nb * band_rows);
}

// The sequence over arrays the caller owns (shared memory in the kernel):
//   mb_first[e]     first m-block of expert e, e = 0..E (mb_first[E] = all m-blocks);
//   row_first[e]    first pool row of expert e (the plan's offsets);
//   step_first[k]   first task of step k, k = 0..E + lag (step_first[E + lag] = all tasks): bwd_fill_steps.
struct BwdSchedule {
  BwdTileShape shape;
  int num_experts;
  int lag;
  int arrivals;  // counter releases per finished L2-dgrad tile
  const int32_t* mb_first;
  const int32_t* row_first;
  const int32_t* step_first;

  PK_BWD_HD int m_blocks(int e) const { return mb_first[e + 1] - mb_first[e]; }
  PK_BWD_HD int l2_tasks(int e) const { return m_blocks(e) * shape.l2_per_mb(); }
  PK_BWD_HD int late_tasks(int e) const {  // the tasks of expert e in step e + lag
    return m_blocks(e) * shape.l1_per_mb() + shape.w2_tiles() + shape.w13_tiles();
  }
  PK_BWD_HD int step_tasks(int k) const {
    return (k < num_experts ? l2_tasks(k) : 0) + (k >= lag && k - lag < num_experts ? late_tasks(k - lag) : 0);
  }
  PK_BWD_HD int num_tasks() const { return step_first[num_experts + lag]; }

  // The task at index u (0 <= u < num_tasks()): binary search of the steps, then the step's own layout.
  PK_BWD_HD BwdTask locate(int u) const {
    int lo = 0, hi = num_experts + lag - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (step_first[mid] <= u) lo = mid; else hi = mid - 1;
    }
    const int k = lo;
    int local = u - step_first[k];
    BwdTask t;
    if (k < num_experts && local < l2_tasks(k)) {
      int nb, mbe;
      bwd_band_tile(local, m_blocks(k), shape.l2_per_mb(), nb, mbe);
      t.kind = kBwdL2Dgrad;
      t.expert = k;
      t.mb = mb_first[k] + mbe;
      t.row0 = row_first[k] + mbe * kBwdBlockM;
      t.col0 = nb * shape.l2_block_n;
      return t;
    }
    if (k < num_experts) local -= l2_tasks(k);
    const int f = k - lag;
    t.expert = f;
    const int l1 = m_blocks(f) * shape.l1_per_mb();
    if (local < l1) {
      int nb, mbe;
      bwd_band_tile(local, m_blocks(f), shape.l1_per_mb(), nb, mbe);
      t.kind = kBwdL1Dgrad;
      t.mb = mb_first[f] + mbe;
      t.row0 = row_first[f] + mbe * kBwdBlockM;
      t.col0 = nb * shape.l1_block_n;
      return t;
    }
    local -= l1;
    t.mb = -1;
    if (local < shape.w2_tiles()) {
      t.kind = kBwdWgradW2;
      t.row0 = (local / shape.w2_col_blocks()) * shape.wgrad_block_m;
      t.col0 = (local % shape.w2_col_blocks()) * shape.wgrad_block_n;
      return t;
    }
    local -= shape.w2_tiles();
    t.kind = kBwdWgradW13;
    t.row0 = (local / shape.w13_col_blocks()) * shape.wgrad_block_m;
    t.col0 = (local % shape.w13_col_blocks()) * shape.wgrad_block_n;
    return t;
  }

  PK_BWD_HD BwdWait wait_of(const BwdTask& t) const {
    BwdWait w{kBwdWaitNone, 0, 0};
    if (t.kind == kBwdL1Dgrad) {
      w = BwdWait{kBwdWaitMBlock, t.mb, shape.l2_per_mb() * arrivals};
    } else if (t.kind == kBwdWgradW2 || t.kind == kBwdWgradW13) {
      // an expert with no rows has nothing to wait for: its gradient tiles are zeros
      if (m_blocks(t.expert) > 0) w = BwdWait{kBwdWaitExpert, t.expert, l2_tasks(t.expert) * arrivals};
    }
    return w;
  }
};

// The fused kernels' sequence: 128 x 128 tiles of every kind (weight-gradient tiles only with with_wgrad), one
// release per L2-dgrad tile, over the caller's tables.
PK_BWD_HD BwdSchedule bwd_schedule_128(int hidden, int inter, int with_wgrad, int num_experts, int lag,
                                       const int32_t* mb_first, const int32_t* row_first, const int32_t* step_first) {
  BwdSchedule s;
  s.shape = BwdTileShape{128, 128, 128, 128, hidden, inter, with_wgrad};
  s.num_experts = num_experts;
  s.lag = lag;
  s.arrivals = 1;
  s.mb_first = mb_first;
  s.row_first = row_first;
  s.step_first = step_first;
  return s;
}

// step_first[0..E + lag] for a schedule whose mb_first is filled (serially; the kernel uses a warp scan of the same
// step_tasks values).
PK_BWD_HD void bwd_fill_steps(const BwdSchedule& s, int32_t* step_first) {
  int32_t running = 0;
  for (int k = 0; k < s.num_experts + s.lag; ++k) {
    step_first[k] = running;
    running += s.step_tasks(k);
  }
  step_first[s.num_experts + s.lag] = running;
}

}  // namespace sm90
}  // namespace prime_kernels
