// Host-only test of the VT tile walk (vt_locate, vt_gemm.cuh): runs without a GPU.
// For random and edge-case group sizes, both tile orders and several grid sizes, every CTA walks its tiles
// u = cta, cta + grid, ... with its own cursor (as the kernel's roles do); checks that the tiles cover every
// (group row, n-block) exactly once, heights are 128 (or less at a group's end) except the tall tiles (128 + r,
// 1 <= r <= 64, the group's last m-tile), that tall-last puts every tall tile after every regular one, and that
// the tile count matches the host formula. Build + run: ./build.sh builds it as vt_host_test.
#include <cstdio>
#include <random>
#include <vector>

#include "vt_gemm.cuh"

using namespace proto192;

static int check(const std::vector<int>& sizes, int n_blocks, int tail_rows, int grid, bool tall_last, long& ntiles) {
  constexpr int kBlockN = 256;
  const int G = (int)sizes.size();
  std::vector<int32_t> offs(G + 1, 0), s_tile(G + 1, 0);
  for (int g = 0; g < G; ++g) offs[g + 1] = offs[g] + sizes[g];
  const int M = offs[G] + tail_rows;
  int T = 0;
  for (int g = 0; g < G; ++g) {
    s_tile[g + 1] = s_tile[g] + vt_main_tiles(sizes[g], tall_last, n_blocks);
    T += vt_has_tall(sizes[g]) ? 1 : 0;
  }
  const int total_main = s_tile[G];
  const int total = total_main + (tall_last ? T * n_blocks : 0);
  std::vector<int> cover((size_t)M * n_blocks, 0);
  int errors = 0;
  auto err = [&](const char* what, int u) {
    if (errors++ < 10) std::printf("  ERROR %s at tile %d (G=%d, nb=%d, grid=%d, tall_last=%d)\n", what, u, G, n_blocks,
                                   grid, (int)tall_last);
  };
  int last_regular = -1, first_tall = 1 << 30;
  for (int cta = 0; cta < grid; ++cta) {
    VtCursor cur{0, 0, 0};
    for (int u = cta; u < total; u += grid) {
      const VtWork w = vt_locate<kBlockN>(u, cur, offs.data(), s_tile.data(), G, n_blocks, total_main);
      // the kernel locates each tile twice (before and after the mainloop): must be idempotent
      const VtWork w2 = vt_locate<kBlockN>(u, cur, offs.data(), s_tile.data(), G, n_blocks, total_main);
      if (w.row0 != w2.row0 || w.row_end != w2.row_end || w.g != w2.g || w.n0 != w2.n0) err("not idempotent", u);
      if (w.g < 0 || w.g >= G) {
        err("group out of range", u);
        continue;
      }
      const int start = offs[w.g], end = offs[w.g + 1], c = end - start;
      const int h = w.row_end - w.row0;
      if (w.row0 < start || w.row_end > end || h < 1 || h > 192) err("rows out of the group / bad height", u);
      if ((w.row0 - start) % 128 != 0) err("row0 not on a 128-row boundary", u);
      if (w.n0 % kBlockN != 0 || w.n0 / kBlockN >= n_blocks) err("bad n0", u);
      const bool is_tall = h > 128;
      if (is_tall && !(vt_has_tall(c) && w.row_end == end && h - 128 == (c & 127))) err("unexpected tall tile", u);
      if (!is_tall && w.row_end != end && h != 128) err("short tile not at the group's end", u);
      if (!is_tall && w.row_end == end && vt_has_tall(c)) err("group with a tall tile ends in a regular tile", u);
      const int n_sl = std::min(3, (h + 63) / 64);
      if (n_sl < 1 || (h > 128) != (n_sl == 3)) err("slice count", u);
      if (is_tall) first_tall = std::min(first_tall, u);
      else last_regular = std::max(last_regular, u);
      for (int r = w.row0; r < w.row_end; ++r) ++cover[(size_t)r * n_blocks + w.n0 / kBlockN];
      ++ntiles;
    }
  }
  if (tall_last && T > 0 && first_tall < last_regular) err("tall-last: a tall tile before a regular one", first_tall);
  for (int g = 0; g < G; ++g)
    for (int r = offs[g]; r < offs[g + 1]; ++r)
      for (int nb = 0; nb < n_blocks; ++nb)
        if (cover[(size_t)r * n_blocks + nb] != 1) {
          err("row not covered exactly once", r);
          g = G;
          break;
        }
  long expect = 0;
  for (int c : sizes) expect += (long)vt_m_tiles(c) * n_blocks;
  if (expect != total) err("tile count", total);
  return errors;
}

int main() {
  int errors = 0;
  long tiles = 0, cases = 0;
  std::vector<std::vector<int>> fixed = {
      {0, 1, 17, 63, 64, 65, 127, 128, 129, 0, 192, 193, 256, 1000, 1040, 1088, 1089, 1152, 200, 500, 130, 1040},
      {129}, {192}, {193}, {64}, {0}, {0, 0}, {1040, 0, 0}, {0, 0, 1088}, {2048 + 64}, {2048 + 65}, {16 * 128 * 3 + 5}};
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::vector<int> s(1 + rng() % 140);
    for (int& c : s) {
      const int k = rng() % 4;
      c = k == 0 ? (int)(rng() % 300) : k == 1 ? 900 + (int)(rng() % 251) : k == 2 ? 0 : (int)(rng() % 5000);
    }
    fixed.push_back(s);
  }
  for (const auto& s : fixed)
    for (int nb : {1, 2, 6, 12})
      for (int grid : {1, 7, 132})
        for (int tl = 0; tl < 2; ++tl) {
          errors += check(s, nb, 37, grid, tl != 0, tiles);
          ++cases;
        }
  std::printf("vt_host_test: %ld cases, %ld tiles walked, %d errors: %s\n", cases, tiles, errors,
              errors ? "FAIL" : "PASS");
  return errors ? 1 : 0;
}
