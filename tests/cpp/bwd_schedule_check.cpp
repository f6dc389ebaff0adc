// Host check of the fused backward's task sequence (csrc/sm90/mega_moe_bwd_schedule.hpp), run by
// tests/test_bwd_schedule.py: for random layers and routings, every output tile is one task, every task's wait is
// released exactly by tasks of lower index, and claim-in-order execution completes with any subset of the CTAs
// started. Prints "ok <cases>" or the first failure, and exits non-zero on a failure.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "sm90/mega_moe_bwd_schedule.hpp"

using namespace prime_kernels::sm90;

namespace {

struct Case {
  BwdTileShape shape;
  std::vector<int32_t> mb_first, row_first, step_first;
  BwdSchedule sched;
};

#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);   \
      std::printf(__VA_ARGS__);                          \
      std::printf("\n");                                 \
      std::exit(1);                                      \
    }                                                    \
  } while (0)

Case make_case(std::mt19937& rng, int num_experts, int hidden, int inter, int lag, int arrivals, int routing) {
  Case c;
  const int blocks[2] = {128, 256};
  c.shape = BwdTileShape{blocks[rng() % 2], blocks[rng() % 2], blocks[rng() % 2], blocks[rng() % 2], hidden, inter,
                         static_cast<int>(rng() % 4 != 0)};
  c.mb_first.assign(num_experts + 1, 0);
  c.row_first.assign(num_experts + 1, 0);
  std::uniform_int_distribution<int> small(0, 4), big(0, 40);
  for (int e = 0; e < num_experts; ++e) {
    int mbs = 0;
    if (routing == 0) mbs = small(rng);                          // uniform-ish, some empty
    else if (routing == 1) mbs = e == 0 ? 1 + big(rng) : 0;      // one hot expert, the rest empty
    else if (routing == 2) mbs = (e % 3 == 0) ? big(rng) : small(rng) / 4;  // skewed
    else mbs = 0;                                                // every expert empty
    c.mb_first[e + 1] = c.mb_first[e] + mbs;
    c.row_first[e + 1] = c.row_first[e] + mbs * kBwdBlockM;
  }
  c.step_first.assign(num_experts + lag + 1, 0);
  c.sched = BwdSchedule{c.shape, num_experts, lag, arrivals, c.mb_first.data(), c.row_first.data(), nullptr};
  bwd_fill_steps(c.sched, c.step_first.data());
  c.sched.step_first = c.step_first.data();
  return c;
}

void check_coverage_and_waits(const Case& c) {
  const BwdSchedule& s = c.sched;
  const BwdTileShape& sh = c.shape;
  const int n = s.num_tasks();
  const int total_mb = c.mb_first.back();
  std::vector<int> l2_seen(total_mb * sh.l2_per_mb(), 0), l1_seen(total_mb * sh.l1_per_mb(), 0);
  std::vector<int> w2_seen(s.num_experts * sh.w2_tiles(), 0), w13_seen(s.num_experts * sh.w13_tiles(), 0);
  if (!sh.with_wgrad) CHECK(sh.w2_tiles() == 0 && sh.w13_tiles() == 0, "dgrad-only sequence with gradient tiles");
  // the last index of an L2-dgrad task per m-block and per expert, and their counts
  std::vector<int> last_l2_mb(total_mb, -1), last_l2_e(s.num_experts, -1);
  std::vector<int> cnt_l2_mb(total_mb, 0), cnt_l2_e(s.num_experts, 0);
  std::vector<BwdTask> tasks(n);
  for (int u = 0; u < n; ++u) {
    const BwdTask t = s.locate(u);
    tasks[u] = t;
    CHECK(t.expert >= 0 && t.expert < s.num_experts, "task %d: expert %d", u, t.expert);
    const int e = t.expert;
    if (t.kind == kBwdL2Dgrad || t.kind == kBwdL1Dgrad) {
      CHECK(t.mb >= c.mb_first[e] && t.mb < c.mb_first[e + 1], "task %d: m-block %d outside expert %d", u, t.mb, e);
      CHECK(t.row0 == c.row_first[e] + (t.mb - c.mb_first[e]) * kBwdBlockM, "task %d: row0 %d", u, t.row0);
      const int bn = t.kind == kBwdL2Dgrad ? sh.l2_block_n : sh.l1_block_n;
      const int cols = t.kind == kBwdL2Dgrad ? sh.inter : sh.hidden;
      CHECK(t.col0 % bn == 0 && t.col0 >= 0 && t.col0 < cols, "task %d: col0 %d", u, t.col0);
      if (t.kind == kBwdL2Dgrad) {
        ++l2_seen[t.mb * sh.l2_per_mb() + t.col0 / bn];
        last_l2_mb[t.mb] = u;
        last_l2_e[e] = u;
        ++cnt_l2_mb[t.mb];
        ++cnt_l2_e[e];
      } else {
        ++l1_seen[t.mb * sh.l1_per_mb() + t.col0 / bn];
      }
    } else {
      CHECK(t.mb == -1, "task %d: weight-gradient tile with m-block %d", u, t.mb);
      const bool w2 = t.kind == kBwdWgradW2;
      CHECK(w2 || t.kind == kBwdWgradW13, "task %d: kind %d", u, t.kind);
      const int rows = w2 ? sh.hidden : 2 * sh.inter, cols = w2 ? sh.inter : sh.hidden;
      CHECK(t.row0 % sh.wgrad_block_m == 0 && t.row0 >= 0 && t.row0 < rows, "task %d: row0 %d", u, t.row0);
      CHECK(t.col0 % sh.wgrad_block_n == 0 && t.col0 >= 0 && t.col0 < cols, "task %d: col0 %d", u, t.col0);
      const int cb = w2 ? sh.w2_col_blocks() : sh.w13_col_blocks();
      const int idx = (t.row0 / sh.wgrad_block_m) * cb + t.col0 / sh.wgrad_block_n;
      ++(w2 ? w2_seen[e * sh.w2_tiles() + idx] : w13_seen[e * sh.w13_tiles() + idx]);
    }
  }
  for (int v : l2_seen) CHECK(v == 1, "an L2-dgrad tile is covered %d times", v);
  for (int v : l1_seen) CHECK(v == 1, "an L1-dgrad tile is covered %d times", v);
  for (int v : w2_seen) CHECK(v == 1, "a dW2 tile is covered %d times", v);
  for (int v : w13_seen) CHECK(v == 1, "a dW13 tile is covered %d times", v);
  for (int u = 0; u < n; ++u) {
    const BwdWait w = s.wait_of(tasks[u]);
    if (w.counter == kBwdWaitNone) {
      CHECK(tasks[u].kind == kBwdL2Dgrad || s.m_blocks(tasks[u].expert) == 0, "task %d waits for nothing", u);
      continue;
    }
    CHECK(tasks[u].kind != kBwdL2Dgrad, "an L2-dgrad task %d waits", u);
    const bool mb = w.counter == kBwdWaitMBlock;
    const int last = mb ? last_l2_mb[w.index] : last_l2_e[w.index];
    const int cnt = mb ? cnt_l2_mb[w.index] : cnt_l2_e[w.index];
    CHECK(last >= 0 && last < u, "task %d waits for a task at %d (not lower)", u, last);
    CHECK(cnt * s.arrivals == w.target, "task %d waits for %d, its releasers give %d", u, w.target, cnt * s.arrivals);
  }
}

// Claim-in-order execution: num_ctas CTAs, a random subset of them started (at least one); a started CTA holds at
// most two claimed tasks (it claims the next as it starts the current) and finishes them in claim order once
// their waits are released. A random fair scheduler steps started CTAs; nothing to do anywhere = a hang.
void check_progress(const Case& c, std::mt19937& rng, int num_ctas) {
  const BwdSchedule& s = c.sched;
  const int n = s.num_tasks();
  const int total_mb = c.mb_first.back();
  std::vector<int> done_mb(total_mb, 0), done_e(s.num_experts, 0);
  std::vector<std::vector<int>> held(num_ctas);
  std::vector<char> started(num_ctas, 0);
  std::bernoulli_distribution coin(0.5);
  int any = 0;
  for (int i = 0; i < num_ctas; ++i) any += (started[i] = coin(rng));
  if (!any) started[rng() % num_ctas] = 1;
  int next = 0, finished = 0;
  auto ready = [&](int u) {
    const BwdWait w = s.wait_of(s.locate(u));
    if (w.counter == kBwdWaitNone) return true;
    return (w.counter == kBwdWaitMBlock ? done_mb[w.index] : done_e[w.index]) >= w.target;
  };
  while (finished < n) {
    bool progressed = false;
    for (int tries = 0; tries < 4 * num_ctas && !progressed; ++tries) {
      const int i = rng() % num_ctas;
      if (!started[i]) continue;
      auto& h = held[i];
      if (h.size() < 2 && next < n) {
        h.push_back(next++);
        progressed = true;
      } else if (!h.empty() && ready(h.front())) {
        const BwdTask t = s.locate(h.front());
        if (t.kind == kBwdL2Dgrad) {
          done_mb[t.mb] += s.arrivals;
          done_e[t.expert] += s.arrivals;
        }
        h.erase(h.begin());
        ++finished;
        progressed = true;
      }
    }
    if (!progressed) {  // a systematic sweep before calling it a hang
      for (int i = 0; i < num_ctas && !progressed; ++i) {
        if (!started[i]) continue;
        auto& h = held[i];
        if ((h.size() < 2 && next < n) || (!h.empty() && ready(h.front()))) progressed = true;
      }
      CHECK(progressed, "hang: %d of %d tasks finished, %d claimed", finished, n, next);
    }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(12345);
  const int shapes[][2] = {{256, 128}, {1024, 512}, {2048, 768}, {4096, 1536}, {7168, 2048}};
  const int experts[] = {1, 2, 8, 16, 64, 128, 256};
  int cases = 0;
  for (int e : experts)
    for (const auto& hi : shapes)
      for (int lag : {0, 1, 6})
        for (int routing = 0; routing < 4; ++routing)
          for (int arrivals : {1, 2}) {
            Case c = make_case(rng, e, hi[0], hi[1], lag, arrivals, routing);
            check_coverage_and_waits(c);
            if (c.sched.num_tasks() <= 20000) check_progress(c, rng, 1 + static_cast<int>(rng() % 140));
            ++cases;
          }
  std::printf("ok %d cases\n", cases);
  return 0;
}
