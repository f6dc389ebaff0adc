// prime-kernels: the bound on a pool's m-blocks, shared by the grouped GEMMs' tile lists and the fused forward's
// per-m-block counters. Plain host C++.
#pragma once

#include <cstdint>

namespace prime_kernels {
namespace sm90 {

// 128-row m-blocks (never across a group) that any grouping of m_total rows into num_groups groups can have:
// the tile-list bound of the grouped kernels and the length of the fused forward's per-m-block counter arrays.
inline int64_t max_m_blocks(int64_t m_total, int num_groups) {
  return (m_total > 0 ? (m_total + 127) / 128 : 0) + (num_groups > 0 ? num_groups : 0);
}

}  // namespace sm90
}  // namespace prime_kernels
