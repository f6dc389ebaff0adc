"""The experts' share of a training step for bench/train_step.py: hooks on every experts module that stamp its forward
and backward windows (CUDA events on a GPU, the host clock on the CPU)."""

from __future__ import annotations

import time
from typing import Callable

import torch


class _Stamp:
    """A point in time on the device's stream (a CUDA event) or on the host clock (CPU, which runs synchronously)."""

    def __init__(self, cuda: bool):
        self.event = None
        self.t = 0.0
        if cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_until(self, end: "_Stamp") -> float:
        if self.event is not None:
            return self.event.elapsed_time(end.event)
        return (end.t - self.t) * 1e3


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward stamps the timer: on an experts module's output it marks the start of the experts'
    backward, on its input the end (autograd reaches the input's gradient after every node inside the experts)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, timer: "ExpertsTimer", edge: str) -> torch.Tensor:
        ctx.timer, ctx.edge = timer, edge
        # Under non-reentrant activation checkpointing, unpacking a saved tensor recomputes the layer's forward.
        # Saving an empty one and unpacking it before stamping makes that recompute happen before the experts'
        # backward window opens (it is counted by the recomputed forward's own hooks instead).
        ctx.save_for_backward(x.new_empty(0))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors  # noqa: B018 - see forward
        ctx.timer.backward_edge(ctx.edge)
        return grad, None, None


class ExpertsTimer:
    """Hooks on every experts module that stamp its forward and backward windows while enabled."""

    def __init__(self, model: torch.nn.Module, cuda: bool, is_experts_module: Callable[[torch.nn.Module], bool]):
        self.cuda = cuda
        self.enabled = False
        self.modules = [m for _, m in model.named_modules() if is_experts_module(m)]
        self.handles = []
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))
        self.reset()

    def reset(self) -> None:
        self.fwd: list[tuple[_Stamp, _Stamp]] = []
        self.bwd: list[tuple[_Stamp, _Stamp]] = []
        self._fwd_open: list[_Stamp] = []
        self._bwd_open: list[_Stamp] = []

    def _pre(self, module, args):
        if not self.enabled:
            return None
        self._fwd_open.append(_Stamp(self.cuda))
        return (_BackwardMark.apply(args[0], self, "end"), *args[1:])

    def _post(self, module, args, output):
        if not self.enabled:
            return None
        self.fwd.append((self._fwd_open.pop(), _Stamp(self.cuda)))
        return _BackwardMark.apply(output, self, "start")

    def backward_edge(self, edge: str) -> None:
        if not self.enabled:
            return
        if edge == "start":
            self._bwd_open.append(_Stamp(self.cuda))
        elif self._bwd_open:
            self.bwd.append((self._bwd_open.pop(), _Stamp(self.cuda)))

    def summary(self) -> dict:
        """Milliseconds in the experts' forwards and backwards since reset() (call after synchronizing)."""
        fwd = sum(a.ms_until(b) for a, b in self.fwd)
        bwd = sum(a.ms_until(b) for a, b in self.bwd)
        return {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_windows": len(self.fwd), "bwd_windows": len(self.bwd)}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
