"""The expert-parallel path's default chunk count (``ep_chunks=None``), from what every rank knows alike (the
shapes, the group size, the options), so that every rank picks the same count without a collective.

Chunking (:mod:`prime_kernels.mega._ep_chunks`) lets chunk c + 1's exchange run under chunk c's GEMMs, so it can hide
at most the GEMM time a rank has, less the first chunk's: ``gemm * (1 - 1 / c)`` for c chunks, whatever the link.
It costs every extra chunk its own pool (the rows' copies into and out of it, its plan, its launches):
``(c - 1) * EXTRA_GLUE_PER_CHUNK * gemm``. So c chunks can pay only where ``1 - 1 / c > (c - 1) *
EXTRA_GLUE_PER_CHUNK``; the count is the c with the largest such margin, or 1 where none has one.
"""

from __future__ import annotations

# GPU time of the kernels an extra chunk adds, per rank, over the rank's GEMM time, the smallest seen (per-rank kernel
# times from bench_ep_loopback.py's traces; copies within one card's memory, so no link time: a link adds exchange
# time, which the GEMMs would hide, not glue), Qwen3-30B-A3B with 2 chunks:
#   H200, 2 ranks x 16384 tokens: 11.8 ms more for 5.5 ms of GEMMs (2.2); 8 x 4096: 5.9 ms for 1.7 ms (3.6)
#     (bench/results/ep_loopback_h200_2026-12-06_58bbb4d_*.json);
#   H100, 2 x 16384, the full-pool tensors no longer zero-filled: 11.2 ms for 6.2 ms (1.8)
#     (bench/results/ep_loopback_h100_2026-12-06_0e39c64_30b_t16k_r2.json).
# Every chunked row of those runs was slower than one chunk, with and without a 100 GB/s link modelled. The extra
# glue is the chunk pools' copies (each chunk's rows of x, h, dy, w * s and dh copied into and out of full-pool rows)
# and each chunk's own exchange bookkeeping; 2 chunks pay only below 0.5.
EXTRA_GLUE_PER_CHUNK = 1.8

_CANDIDATES = (2, 4, 8)


def chunks_that_pay(extra_glue_per_chunk: float = EXTRA_GLUE_PER_CHUNK) -> int:
    """The chunk count with the largest bound on the time saved, ``(1 - 1 / c) - (c - 1) * extra_glue_per_chunk``
    GEMM times (1, saving nothing, when no count saves more)."""
    best, best_saving = 1, 0.0
    for c in _CANDIDATES:
        saving = (1 - 1 / c) - (c - 1) * extra_glue_per_chunk
        if saving > best_saving:
            best, best_saving = c, saving
    return best


def default_ep_chunks(*, ep_size: int, backend: str, precision: str) -> int:
    """1 where nothing is chunked (one rank, FP8, a backend other than the grouped one), else
    :func:`chunks_that_pay`."""
    if ep_size <= 1 or precision != "bf16" or backend not in ("auto", "grouped"):
        return 1
    return chunks_that_pay()
