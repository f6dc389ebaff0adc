"""Bounded waits: the timeout of every kernel wait on another CTA's work, and the errors kernels leave behind.

A persistent kernel of ours that waits for another CTA's work longer than the timeout records what it waited
for and traps (the CUDA context is then lost); every later call into the library raises a ``RuntimeError``
carrying that record. Invalid inputs a kernel can only see on the device (for example ``expert_offsets`` that are
not a routing plan) are not read, and the next call raises a ``RuntimeError`` saying so.
"""

from __future__ import annotations

import ctypes
import math

from . import _lib


def _core() -> ctypes.CDLL:
    core = _lib.load().core
    if core is None:
        raise RuntimeError(f"prime_kernels: the native core is not loaded: {_lib.load().reason}")
    if not getattr(core, "_pk_watchdog_declared", False):
        core.pk_set_wait_timeout.argtypes = [ctypes.c_double]
        core.pk_set_wait_timeout.restype = ctypes.c_int
        core.pk_get_wait_timeout.argtypes = []
        core.pk_get_wait_timeout.restype = ctypes.c_double
        core.pk_device_check.argtypes = []
        core.pk_device_check.restype = ctypes.c_int
        core.pk_set_peer_wait_timeout.argtypes = [ctypes.c_double]
        core.pk_set_peer_wait_timeout.restype = ctypes.c_int
        core.pk_get_peer_wait_timeout.argtypes = []
        core.pk_get_peer_wait_timeout.restype = ctypes.c_double
        core.pk_wait_timeout_probe.argtypes = [ctypes.c_double, ctypes.c_void_p]
        core.pk_wait_timeout_probe.restype = ctypes.c_int
        core._pk_watchdog_declared = True
    return core


def _raise(core: ctypes.CDLL, what: str) -> None:
    raise RuntimeError(f"prime_kernels.{what}: {core.pk_last_error().decode()}")


def _set_bound(name: str, seconds: float) -> None:
    """Checks ``seconds`` and hands it to the core's pk_<name>; ValueError with the reason otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise ValueError(f"{name}: seconds must be a finite number, got {seconds!r}")
    core = _core()
    if getattr(core, f"pk_{name}")(float(seconds)) != 0:
        raise ValueError(f"prime_kernels.{name}: {core.pk_last_error().decode()}")


def set_wait_timeout(seconds: float) -> None:
    """Sets the bound (seconds, in (0, 3600]; default 5) on every kernel wait for another CTA's work, for the
    kernels launched after this call."""
    _set_bound("set_wait_timeout", seconds)


def wait_timeout() -> float:
    """The bound, in seconds, on every kernel wait for another CTA's work."""
    return float(_core().pk_get_wait_timeout())


def set_peer_wait_timeout(seconds: float) -> None:
    """Sets the bound (seconds, in (0, 3600]; default 60) on every wait for another rank of an expert-parallel group
    over peer memory (a rank waits for its peers to enter a call and to finish pushing their rows; a peer that is
    late by up to this long still succeeds), for the launches after this call."""
    _set_bound("set_peer_wait_timeout", seconds)


def peer_wait_timeout() -> float:
    """The bound, in seconds, on every wait for another rank."""
    return float(_core().pk_get_peer_wait_timeout())


def check_device_errors() -> None:
    """Raises ``RuntimeError`` if a kernel wait timed out (the CUDA context is lost) or a kernel found invalid
    values on the device since the last check (bad group_offsets or expert_offsets, indices out of range: that
    launch wrote nothing or read them as masked; the finding is then cleared). Cheap (a read of host memory), never
    synchronises: synchronise first to include the launches still running."""
    core = _core()
    if core.pk_device_check() != 0:
        _raise(core, "check_device_errors")


def _wait_timeout_probe(timeout_s: float) -> None:
    """Test aid: launches a kernel whose wait can never end, on the current stream, bounded by ``timeout_s``.
    It traps once the bound has passed: the CUDA context of this process is lost afterwards."""
    import torch

    core = _core()
    stream = torch.cuda.current_stream().cuda_stream
    if core.pk_wait_timeout_probe(float(timeout_s), ctypes.c_void_p(stream)) != 0:
        _raise(core, "wait_timeout_probe")
