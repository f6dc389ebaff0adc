"""The collectives of the layer's expert parallelism, on a torch.distributed process group or a
:class:`~prime_kernels.mega.loopback.LoopbackGroup` (R virtual ranks of one process): every call site of the mega
package goes through these, so both kinds of group run the same code."""

from __future__ import annotations

import torch

from . import loopback


def _is_loopback(group) -> bool:
    return isinstance(group, loopback.LoopbackGroup)


def world_size(group) -> int:
    if group is None:
        return 1
    return group.size() if _is_loopback(group) else torch.distributed.get_world_size(group)


def rank(group) -> int:
    if group is None:
        return 0
    return group.rank() if _is_loopback(group) else torch.distributed.get_rank(group)


def all_gather(out_list: list[torch.Tensor], tensor: torch.Tensor, group) -> None:
    if _is_loopback(group):
        group.all_gather(out_list, tensor)
    else:
        torch.distributed.all_gather(out_list, tensor, group=group)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      group) -> None:
    if _is_loopback(group):
        group.all_to_all_single(out, inp, out_splits, in_splits)
    else:
        torch.distributed.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def resolve(group_name: str):
    """The group a custom op was handed by name: a loopback group, a process group, or None for ""."""
    if not group_name:
        return None
    found = loopback.resolve(group_name)
    if found is not None:
        return found
    from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: PLC0415

    return _resolve_process_group(group_name)
