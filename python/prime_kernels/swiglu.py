"""SwiGLU over pool rows, forward and backward (the grouped pipeline's epilogues as kernels).

``swiglu_fwd(h [rows, 2I], num_rows, clamp)`` -> s = bf16(silu(min(g, c)) * clamp(u, -c, c)).
``swiglu_bwd(h, da [rows, I], pool_src_route, topk_weights, num_rows, clamp)`` -> (dh [rows, 2I],
a [rows, I], dt [rows]) with w = topk_weights.flatten()[pool_src_route] (0 for padding rows),
dt = sum(da * s), dh = bf16 of the SwiGLU backward of w * da, a = bf16(w * s), s in fp32 (the rounding
points B3-B6 and B9 of prime_kernels.mega.reference). Only rows below ``num_rows`` (a one-element int32
device tensor, so no host sync; at most the rows of h) are written. ``clamp < 0`` means no clamp.
``pool_src_route`` holds -1 (padding) or a route id < topk_weights.numel(): on CUDA the kernel reads any other
id as weight 0 and the next call into the library raises it (see :mod:`prime_kernels.grouped_gemm`); on the CPU it
raises at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu_fwd", "swiglu_bwd"]


def _parts(h: torch.Tensor, clamp: float):
    I = h.shape[1] // 2
    g, u = h[:, :I].float(), h[:, I:].float()
    if clamp >= 0:
        return g, u, torch.clamp(g, max=clamp), torch.clamp(u, min=-clamp, max=clamp)
    return g, u, g, u


def swiglu_fwd_reference(h, num_rows, clamp=-1.0):
    n = int(num_rows.reshape(-1)[0])
    _, _, gc, uc = _parts(h[:n], clamp)
    out = torch.zeros(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    out[:n] = (F.silu(gc) * uc).to(h.dtype)
    return out


def swiglu_bwd_reference(h, da, pool_src_route, topk_weights, num_rows, clamp=-1.0):
    n = int(num_rows.reshape(-1)[0])
    rows, I = h.shape[0], h.shape[1] // 2
    g, u, gc, uc = _parts(h[:n], clamp)
    src = pool_src_route[:n].long()
    bad = (src < -1) | (src >= topk_weights.numel())
    if bool(bad.any()):
        raise RuntimeError(f"pool_src_route holds {int(src[bad][0])}, outside [-1, {topk_weights.numel()})")
    w = torch.where(src >= 0, topk_weights.reshape(-1).float()[src.clamp(min=0)], torch.zeros((), device=h.device))
    sig = torch.sigmoid(gc)
    silu = gc * sig
    s = silu * uc
    d = da[:n].float()
    ds = w[:, None] * d
    dg = ds * uc * sig * (1 + gc * (1 - sig))
    du = ds * silu
    if clamp >= 0:
        dg = dg * (g < clamp)
        du = du * ((u > -clamp) & (u < clamp))
    dh = torch.zeros(rows, 2 * I, dtype=h.dtype, device=h.device)
    a = torch.zeros(rows, I, dtype=h.dtype, device=h.device)
    dt = torch.zeros(rows, dtype=torch.float32, device=h.device)
    dh[:n] = torch.cat([dg, du], 1).to(h.dtype)
    a[:n] = (w[:, None] * s).to(h.dtype)
    dt[:n] = torch.where(src >= 0, (d * s).sum(-1), torch.zeros((), device=h.device))
    return dh, a, dt


def swiglu_fwd(h: torch.Tensor, num_rows: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    return torch.ops.prime_kernels.swiglu_fwd(h, num_rows, -1.0 if clamp is None else float(clamp))


def swiglu_bwd(h, da, pool_src_route, topk_weights, num_rows, clamp: float | None = None):
    return torch.ops.prime_kernels.swiglu_bwd(h, da, pool_src_route, topk_weights, num_rows,
                                          -1.0 if clamp is None else float(clamp))


def _register() -> None:
    lib = "prime_kernels::"
    torch.library.register_kernel(lib + "swiglu_fwd", "cpu", swiglu_fwd_reference)
    torch.library.register_kernel(lib + "swiglu_bwd", "cpu", swiglu_bwd_reference)

    @torch.library.register_fake(lib + "swiglu_fwd")
    def _(h, num_rows, clamp=-1.0):
        return h.new_empty(h.shape[0], h.shape[1] // 2)

    @torch.library.register_fake(lib + "swiglu_bwd")
    def _(h, da, pool_src_route, topk_weights, num_rows, clamp=-1.0):
        return (h.new_empty(h.shape), h.new_empty(h.shape[0], h.shape[1] // 2),
                h.new_empty(h.shape[0], dtype=torch.float32))
