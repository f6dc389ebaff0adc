"""The expert-parallel path's default chunk count (``ep_chunks=None``), from the shapes alone so that every rank
picks the same count without a collective."""

from __future__ import annotations


def default_ep_chunks(*, ep_size: int, backend: str, precision: str, max_tokens_per_rank: int, top_k: int,
                      hidden: int, w13) -> int:
    """1 where nothing is chunked (one rank, FP8, the reference), else the count the rule below picks."""
    if ep_size <= 1 or precision != "bf16" or backend not in ("auto", "grouped"):
        return 1
    return 1
