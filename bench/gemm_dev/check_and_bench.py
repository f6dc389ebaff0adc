#!/usr/bin/env python3
"""Dev harness for the sm90 BF16 grouped GEMMs (issue 3).

Loads .devbuild/libpk_gemm_dev.so (bench/gemm_dev/build.sh) with ctypes, checks correctness against
float64 on fresh random data with NaN-poisoned outputs, and times the six MoE passes against
torch._grouped_mm on the same tensors. Usage:
    python bench/gemm_dev/check_and_bench.py [--check] [--bench] [--lib PATH] [--out DIR]
"""
import argparse
import ctypes
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Lib:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        c = ctypes
        self.lib.pkdev_m_grouped.argtypes = [
            c.c_void_p, c.c_longlong, c.c_void_p, c.c_int, c.c_longlong, c.c_longlong, c.c_void_p,
            c.c_longlong, c.c_void_p, c.c_int, c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int,
            c.c_int, c.c_int, c.c_void_p, c.c_char_p, c.c_size_t]
        self.lib.pkdev_m_grouped.restype = c.c_int
        self.lib.pkdev_k_grouped.argtypes = [
            c.c_void_p, c.c_longlong, c.c_void_p, c.c_longlong, c.c_void_p, c.c_int, c.c_int, c.c_void_p,
            c.c_int, c.c_longlong, c.c_longlong, c.c_longlong, c.c_int, c.c_int, c.c_int, c.c_void_p,
            c.c_char_p, c.c_size_t]
        self.lib.pkdev_k_grouped.restype = c.c_int
        self.lib.pkdev_m_grouped_gather.argtypes = [
            c.c_void_p, c.c_longlong, c.c_longlong, c.c_void_p, c.c_void_p, c.c_int, c.c_longlong, c.c_longlong,
            c.c_void_p, c.c_longlong, c.c_void_p, c.c_int, c.c_longlong, c.c_longlong, c.c_longlong, c.c_int,
            c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_char_p, c.c_size_t]
        self.lib.pkdev_m_grouped_gather.restype = c.c_int
        self.lib.pkdev_m_grouped_swiglu.argtypes = [
            c.c_void_p, c.c_longlong, c.c_longlong, c.c_void_p, c.c_void_p, c.c_longlong, c.c_longlong, c.c_longlong,
            c.c_void_p, c.c_longlong, c.c_void_p, c.c_longlong, c.c_void_p, c.c_int, c.c_longlong, c.c_longlong,
            c.c_float, c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_char_p, c.c_size_t]
        self.lib.pkdev_m_grouped_swiglu.restype = c.c_int
        self.err = ctypes.create_string_buffer(512)

    def _check(self, rc):
        if rc != 0:
            raise RuntimeError(f"rc={rc}: {self.err.value.decode()}")

    def m_grouped(self, a, b, d, offs, b_k_major, cfg=None):
        """a [M, K]; b [E, N, K] (k-major) or [E, K, N]; d [M, N]; offs int32 [E+1] (starts, with end)."""
        M, K = a.shape
        N = d.shape[1]
        E = b.shape[0]
        bn, st, ae, cl = cfg if cfg else (0, 0, 0, 1)
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.pkdev_m_grouped(
            a.data_ptr(), a.stride(0), b.data_ptr(), int(b_k_major), b.stride(1), b.stride(0), d.data_ptr(),
            d.stride(0), offs.data_ptr(), E, M, N, K, bn, st, ae, cl, stream, self.err, len(self.err)))

    def m_grouped_gather(self, a, idx, b, d, offs, b_k_major, cfg=None, gather_mode=0):
        """a [R, K] source rows; idx int32 [M] (pool row -> row of a); d [M, N]. gather_mode 0 default,
        1 cp.async, 2 per-row TMA."""
        R, K = a.shape
        M, N = d.shape
        E = b.shape[0]
        bn, st, ae = cfg[:3] if cfg else (0, 0, 0)
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.pkdev_m_grouped_gather(
            a.data_ptr(), a.stride(0), R, idx.data_ptr(), b.data_ptr(), int(b_k_major), b.stride(1), b.stride(0),
            d.data_ptr(), d.stride(0), offs.data_ptr(), E, M, N, K, bn, st, ae, gather_mode, stream, self.err,
            len(self.err)))

    def m_grouped_swiglu(self, a, idx, w13, s, h, offs, clamp=0.0, cfg=None, gather_mode=0):
        """a [R, K] (idx int32 [M] or None: plain, R = M); w13 [E, 2I, K]; s [M, I]; h [M, 2I] or None."""
        R, K = a.shape
        M, I = s.shape
        E = w13.shape[0]
        bn, st = cfg[:2] if cfg else (0, 0)
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.pkdev_m_grouped_swiglu(
            a.data_ptr(), a.stride(0), R, idx.data_ptr() if idx is not None else None, w13.data_ptr(), w13.stride(1),
            w13.stride(0), I, s.data_ptr(), s.stride(0), h.data_ptr() if h is not None else None,
            h.stride(0) if h is not None else 0, offs.data_ptr(), E, M, K, clamp, bn, st, gather_mode, stream,
            self.err, len(self.err)))

    def k_grouped(self, a, b, c, offs, accumulate=False, cfg=None):
        """a [P, M], b [P, N], c [E, M, N] fp32 or bf16; offs int32 [E+1]."""
        P, M = a.shape
        N = b.shape[1]
        E = c.shape[0]
        bn, st, ae = cfg[:3] if cfg else (0, 0, 0)
        if c.dtype != torch.bfloat16 and ae:
            bn, st, ae = bn, (6 if bn == 128 else 4), 0
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self.lib.pkdev_k_grouped(
            a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), c.data_ptr(), int(c.dtype == torch.bfloat16),
            int(accumulate), offs.data_ptr(), E, P, M, N, bn, st, ae, stream, self.err, len(self.err)))


def offsets_from_sizes(sizes, base=0):
    offs = [base]
    for s in sizes:
        offs.append(offs[-1] + s)
    return offs


def rel_err(out, ref):
    out = out.double()
    ref = ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


CONFIGS = [None, (128, 6, 0, 1), (256, 4, 0, 1), (128, 5, 1, 1), (256, 3, 1, 1),
           (128, 6, 0, 2), (256, 4, 0, 2), (128, 5, 1, 2), (256, 3, 1, 2)]
K_CONFIGS = [c for c in CONFIGS if c is None or c[3] == 1]


def check_m_grouped(lib, sizes, N, K, b_k_major, cfg, lead=0, tail=5, gen=None):
    dev = "cuda"
    E = len(sizes)
    offs = offsets_from_sizes(sizes, base=lead)
    M = offs[-1] + tail
    a = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
    if b_k_major:
        b = torch.randn(E, N, K, device=dev, generator=gen).to(torch.bfloat16)
    else:
        b = torch.randn(E, K, N, device=dev, generator=gen).to(torch.bfloat16)
    d = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
    offs_t = torch.tensor(offs, device=dev, dtype=torch.int32)
    lib.m_grouped(a, b, d, offs_t, b_k_major, cfg)
    torch.cuda.synchronize()
    ref = torch.full((M, N), float("nan"), device=dev, dtype=torch.float64)
    for g in range(E):
        s, e = offs[g], offs[g + 1]
        if e > s:
            bg = b[g].double()
            ref[s:e] = a[s:e].double() @ (bg.t() if b_k_major else bg)
    inside = torch.zeros(M, dtype=torch.bool, device=dev)
    inside[offs[0]:offs[-1]] = True
    untouched = bool(torch.isnan(d[~inside].float()).all().item()) if (~inside).any() else True
    err = rel_err(d[inside], ref[inside]) if inside.any() else 0.0
    return err, untouched


def check_m_grouped_gather(lib, sizes, N, K, b_k_major, cfg, lead=2, tail=3, gen=None, gather_mode=0):
    dev = "cuda"
    E = len(sizes)
    offs = offsets_from_sizes(sizes, base=lead)
    M = offs[-1] + tail
    R = max(M // 3, 5)
    a = torch.randn(R, K, device=dev, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, R, (M,), device=dev, generator=gen, dtype=torch.int32)
    idx[::7] = -1
    idx[3::11] = R + 5  # out of range: zeros
    b = (torch.randn(E, N, K, device=dev, generator=gen) if b_k_major else
         torch.randn(E, K, N, device=dev, generator=gen)).to(torch.bfloat16)
    d = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
    offs_t = torch.tensor(offs, device=dev, dtype=torch.int32)
    lib.m_grouped_gather(a, idx, b, d, offs_t, b_k_major, cfg, gather_mode)
    torch.cuda.synchronize()
    valid = (idx >= 0) & (idx < R)
    ag = torch.where(valid[:, None], a[idx.clamp(0, R - 1).long()].double(), torch.zeros((), device=dev, dtype=torch.float64))
    ref = torch.full((M, N), float("nan"), device=dev, dtype=torch.float64)
    for g in range(E):
        s_, e_ = offs[g], offs[g + 1]
        if e_ > s_:
            bg = b[g].double()
            ref[s_:e_] = ag[s_:e_] @ (bg.t() if b_k_major else bg)
    inside = torch.zeros(M, dtype=torch.bool, device=dev)
    inside[offs[0]:offs[-1]] = True
    untouched = bool(torch.isnan(d[~inside].float()).all().item())
    err = rel_err(d[inside], ref[inside]) if inside.any() else 0.0
    return err, untouched


def check_swiglu(lib, sizes, I, K, gather, with_h, clamp, cfg, lead=2, tail=3, gen=None, gather_mode=0):
    dev = "cuda"
    E = len(sizes)
    offs = offsets_from_sizes(sizes, base=lead)
    M = offs[-1] + tail
    if gather:
        R = max(M // 3, 5)
        a = torch.randn(R, K, device=dev, generator=gen).to(torch.bfloat16)
        idx = torch.randint(0, R, (M,), device=dev, generator=gen, dtype=torch.int32)
        idx[::7] = -1
        idx[3::11] = R + 5
        valid = (idx >= 0) & (idx < R)
        ag = torch.where(valid[:, None], a[idx.clamp(0, R - 1).long()].double(),
                         torch.zeros((), device=dev, dtype=torch.float64))
    else:
        a = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
        idx = None
        ag = a.double()
    w13 = (torch.randn(E, 2 * I, K, device=dev, generator=gen) / math.sqrt(K) * 2).to(torch.bfloat16)
    s = torch.full((M, I), float("nan"), device=dev, dtype=torch.bfloat16)
    h = torch.full((M, 2 * I), float("nan"), device=dev, dtype=torch.bfloat16) if with_h else None
    offs_t = torch.tensor(offs, device=dev, dtype=torch.int32)
    lib.m_grouped_swiglu(a, idx, w13, s, h, offs_t, clamp, cfg, gather_mode)
    torch.cuda.synchronize()
    href = torch.full((M, 2 * I), float("nan"), device=dev, dtype=torch.float64)
    for g in range(E):
        s_, e_ = offs[g], offs[g + 1]
        if e_ > s_:
            href[s_:e_] = ag[s_:e_] @ w13[g].double().t()
    gate, up = href[:, :I], href[:, I:]
    if clamp > 0:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    sref = gate * torch.sigmoid(gate) * up
    inside = torch.zeros(M, dtype=torch.bool, device=dev)
    inside[offs[0]:offs[-1]] = True
    untouched = bool(torch.isnan(s[~inside].float()).all().item())
    err = rel_err(s[inside], sref[inside]) if inside.any() else 0.0
    if with_h:
        untouched = untouched and bool(torch.isnan(h[~inside].float()).all().item())
        if inside.any():
            err = max(err, rel_err(h[inside], href[inside]))
    return err, untouched


def check_k_grouped(lib, sizes, M, N, mode, cfg, gen=None):
    dev = "cuda"
    E = len(sizes)
    offs = offsets_from_sizes(sizes)
    P = offs[-1] + 3  # a few trailing rows that belong to no expert
    a = torch.randn(P, M, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(P, N, device=dev, generator=gen).to(torch.bfloat16)
    offs_t = torch.tensor(offs, device=dev, dtype=torch.int32)
    ref = torch.zeros(E, M, N, device=dev, dtype=torch.float64)
    for g in range(E):
        s, e = offs[g], offs[g + 1]
        if e > s:
            ref[g] = a[s:e].double().t() @ b[s:e].double()
    if mode == "f32":
        c = torch.full((E, M, N), float("nan"), device=dev, dtype=torch.float32)
        lib.k_grouped(a, b, c, offs_t, False, cfg)
    elif mode == "bf16":
        c = torch.full((E, M, N), float("nan"), device=dev, dtype=torch.bfloat16)
        lib.k_grouped(a, b, c, offs_t, False, cfg)
    else:  # accumulate
        init = torch.randn(E, M, N, device=dev, generator=gen)
        c = init.clone()
        lib.k_grouped(a, b, c, offs_t, True, cfg)
        ref = ref + init.double()
    torch.cuda.synchronize()
    return rel_err(c, ref), True


def zipf_sizes(total, E, alpha, gen):
    w = torch.tensor([1.0 / (r + 1) ** alpha for r in range(E)])
    w = w[torch.randperm(E, generator=gen)]
    cnt = torch.multinomial(w / w.sum(), total, replacement=True, generator=gen)
    return torch.bincount(cnt, minlength=E).tolist()


def run_checks(lib, log):
    gen_cpu = torch.Generator().manual_seed(1234)
    gen = torch.Generator(device="cuda").manual_seed(4321)
    special = [0, 1, 7, 127, 128, 1000, 0, 300]
    cases = [
        ("E1", [1000]),
        ("E1small", [7]),
        ("E8_special", special),
        ("E8_allempty_but_one", [0, 0, 0, 129, 0, 0, 0, 0]),
        ("E128_rand", torch.randint(0, 300, (128,), generator=gen_cpu).tolist()),
        ("E256_skew", zipf_sizes(20000, 256, 1.1, gen_cpu)),
    ]
    shapes = [(320, 192), (192, 448), (128, 256), (64, 64), (256, 1024)]  # (N, K)
    results = []
    worst = 0.0
    fails = 0
    for name, sizes in cases:
        for si, (N, K) in enumerate(shapes):
            if name in ("E128_rand", "E256_skew") and si >= 3:
                continue
            for b_k_major in (True, False):
                for cfg in CONFIGS:
                    try:
                        err, untouched = check_m_grouped(lib, sizes, N, K, b_k_major, cfg, lead=3, gen=gen)
                    except Exception as ex:  # noqa
                        err, untouched = float("nan"), False
                        print("EXC", name, ex)
                    ok = (err <= 1e-2) and untouched
                    fails += not ok
                    worst = max(worst, err) if err == err else float("inf")
                    r = dict(kind="m_grouped", layout="nt" if b_k_major else "nn", case=name, N=N, K=K, cfg=cfg,
                             err=err, untouched=untouched, ok=ok)
                    results.append(r)
                    if not ok:
                        print("FAIL", r, flush=True)
    gcfgs = [None, (128, 6, 0, 1), (256, 4, 0, 1), (128, 5, 1, 1), (256, 3, 1, 1)]
    for name, sizes in cases:
        for (N, K) in [(320, 192), (256, 1024), (128, 200)]:
            for b_k_major in (True, False):
                for cfg, gm in ([(c, 1) for c in gcfgs] + [(c, 2) for c in gcfgs] + [(c, 3) for c in gcfgs[:2]] +
                                [(c, 4) for c in gcfgs[:3]] + [(c, 5) for c in gcfgs] + [(c, 6) for c in gcfgs[3:]]):
                    try:
                        err, untouched = check_m_grouped_gather(lib, sizes, N, K, b_k_major, cfg, gen=gen,
                                                                gather_mode=gm)
                    except Exception as ex:  # noqa
                        err, untouched = float("nan"), False
                        print("EXC gather", name, ex)
                    ok = (err <= 1e-2) and untouched
                    fails += not ok
                    worst = max(worst, err) if err == err else float("inf")
                    r = dict(kind="m_grouped_gather", layout="nt" if b_k_major else "nn", case=name, N=N, K=K,
                             cfg=cfg, gather_mode=gm, err=err, untouched=untouched, ok=ok)
                    results.append(r)
                    if not ok:
                        print("FAIL", r, flush=True)
    for name, sizes in cases:
        for (I, K) in [(192, 320), (256, 1024), (64, 64)]:
            for gather, gm in ((False, 0), (True, 1), (True, 2), (True, 3), (True, 4), (True, 5)):
                for with_h, clamp in ((True, 0.0), (False, 0.0), (True, 1.5)):
                    for cfg in (None, (128, 5)):
                        try:
                            err, untouched = check_swiglu(lib, sizes, I, K, gather, with_h, clamp, cfg, gen=gen,
                                                          gather_mode=gm)
                        except Exception as ex:  # noqa
                            err, untouched = float("nan"), False
                            print("EXC swiglu", name, ex)
                        ok = (err <= 1e-2) and untouched
                        fails += not ok
                        worst = max(worst, err) if err == err else float("inf")
                        r = dict(kind="m_grouped_swiglu", case=name, I=I, K=K, gather=gm, h=with_h, clamp=clamp,
                                 cfg=cfg, err=err, untouched=untouched, ok=ok)
                        results.append(r)
                        if not ok:
                            print("FAIL", r, flush=True)
    kcases = [
        ("E1", [1000]),
        ("E8_special", special),
        ("E128_rand", torch.randint(0, 300, (128,), generator=gen_cpu).tolist()),
        ("E256_skew", zipf_sizes(20000, 256, 1.1, gen_cpu)),
    ]
    kshapes = [(192, 320), (128, 64), (256, 448)]  # (M, N)
    for name, sizes in kcases:
        for si, (M, N) in enumerate(kshapes):
            if name in ("E128_rand", "E256_skew") and si >= 2:
                continue
            for mode in ("f32", "bf16", "acc"):
                for cfg in K_CONFIGS:
                    try:
                        err, _ = check_k_grouped(lib, sizes, M, N, mode, cfg, gen=gen)
                    except Exception as ex:  # noqa
                        err = float("nan")
                        print("EXC", name, ex)
                    ok = err <= 1e-2
                    fails += not ok
                    worst = max(worst, err) if err == err else float("inf")
                    r = dict(kind="k_grouped", mode=mode, case=name, M=M, N=N, cfg=cfg, err=err, ok=ok)
                    results.append(r)
                    if not ok:
                        print("FAIL", r, flush=True)
    # argument validation
    try:
        a = torch.randn(16, 60, device="cuda").to(torch.bfloat16)
        b = torch.randn(1, 64, 60, device="cuda").to(torch.bfloat16)
        d = torch.empty(16, 64, device="cuda", dtype=torch.bfloat16)
        lib.m_grouped(a, b, d, torch.tensor([0, 16], device="cuda", dtype=torch.int32), True)
        print("FAIL: K=60 accepted")
        fails += 1
    except RuntimeError as ex:
        print("validation ok:", ex)
    errs = [r["err"] for r in results]
    print(f"CHECKS: {len(results)} cases, {fails} failures, worst rel err {max(errs):.3e}, "
          f"median {sorted(errs)[len(errs) // 2]:.3e}", flush=True)
    with open(log, "w") as f:
        json.dump(results, f, indent=1)
    return fails


def time_fn(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def time_interleaved(cands, warmup=3, reps=11):
    """Times every candidate once per round, round after round, so clock drift hits all alike; medians."""
    names = list(cands)
    ts = {n: [] for n in names}
    for r in range(warmup + reps):
        for n in names:
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            cands[n]()
            e.record()
            e.synchronize()
            if r >= warmup:
                ts[n].append(s.elapsed_time(e))
    return {n: sorted(v)[len(v) // 2] for n, v in ts.items()}


def routing_counts(T, E, topk, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "uniform":
        logits = torch.randn(T, E, device="cuda", generator=g)
        idx = torch.topk(torch.softmax(logits, -1), topk, dim=-1).indices
    else:
        gc = torch.Generator().manual_seed(seed)
        w = torch.tensor([1.0 / (r + 1) ** 1.1 for r in range(E)])
        w = w[torch.randperm(E, generator=gc)].cuda()
        idx = torch.multinomial((w / w.sum()).expand(T, E).contiguous(), topk, replacement=False, generator=g)
    flat = idx.flatten()
    order = torch.sort(flat, stable=True).indices
    pool_token = (order // topk).to(torch.int32)  # pool row (expert-sorted route) -> token
    return torch.bincount(flat, minlength=E), pool_token


def run_bench(lib, out_jsonl, configs_to_try):
    torch.manual_seed(0)
    T, E, topk = 16384, 128, 8
    P = T * topk
    rows = []
    shapes = {"30B": (2048, 768), "235B": (4096, 1536)}
    peak_a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    peak_b = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    ms = time_fn(lambda: peak_a @ peak_b)
    print(f"peak bf16 matmul 8192^3: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s", flush=True)
    del peak_a, peak_b
    for sname, (H, I) in shapes.items():
        x = torch.randn(P, H, device="cuda").to(torch.bfloat16)
        dy = torch.randn(P, H, device="cuda").to(torch.bfloat16)
        dh = torch.randn(P, 2 * I, device="cuda").to(torch.bfloat16)
        s = torch.randn(P, I, device="cuda").to(torch.bfloat16)
        w13 = (torch.randn(E, 2 * I, H, device="cuda") * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device="cuda") * 0.02).to(torch.bfloat16)
        for routing in ("uniform", "zipf"):
            counts, pool_token = routing_counts(T, E, topk, routing, seed=7)
            assert int(counts.sum()) == P
            ends = torch.cumsum(counts, 0).to(torch.int32)
            offs = torch.cat([torch.zeros(1, device="cuda", dtype=torch.int32), ends])
            passes = [
                # name, kind, a, b, b_k_major/None, out shape, torch fn, flops
                ("l1_fwd", "m", x, w13, True, (P, 2 * I), lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16), 2 * P * H * 2 * I),
                ("l2_fwd", "m", s, w2, True, (P, H), lambda: torch._grouped_mm(s, w2.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16), 2 * P * I * H),
                ("l2_dgrad", "m", dy, w2, False, (P, I), lambda: torch._grouped_mm(dy, w2, offs=ends, out_dtype=torch.bfloat16), 2 * P * H * I),
                ("l1_dgrad", "m", dh, w13, False, (P, H), lambda: torch._grouped_mm(dh, w13, offs=ends, out_dtype=torch.bfloat16), 2 * P * 2 * I * H),
                ("l2_wgrad", "k", dy, s, None, (E, H, I), lambda: torch._grouped_mm(dy.t(), s, offs=ends, out_dtype=torch.bfloat16), 2 * P * H * I),
                ("l1_wgrad", "k", dh, x, None, (E, 2 * I, H), lambda: torch._grouped_mm(dh.t(), x, offs=ends, out_dtype=torch.bfloat16), 2 * P * 2 * I * H),
            ]
            for pname, kind, a, b, bkm, oshape, tfn, flops in passes:
                out = torch.empty(oshape, device="cuda", dtype=torch.bfloat16)
                try:
                    ref = tfn()
                except Exception as ex:  # noqa
                    ref, tfn = None, None
                    print("torch failed", pname, ex, flush=True)
                cands = {}
                if tfn is not None:
                    cands["torch"] = tfn
                cfgs = [None] + [c for c in configs_to_try if kind == "m" or c[3] == 1]
                errs = {}
                for cfg in cfgs:
                    if kind == "m":
                        fn = lambda cfg=cfg: lib.m_grouped(a, b, out, offs, bkm, cfg)
                    else:
                        fn = lambda cfg=cfg: lib.k_grouped(a, b, out, offs, False, cfg)
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    errs[str(cfg)] = rel_err(out, ref) if ref is not None else float("nan")
                    cands[str(cfg)] = fn
                if kind == "k":
                    out32 = torch.empty(oshape, device="cuda", dtype=torch.float32)
                    cands["f32out"] = lambda: lib.k_grouped(a, b, out32, offs, False, None)
                med = time_interleaved(cands)
                for name, ms in med.items():
                    if name == "torch":
                        continue
                    rows.append(dict(op=pname if name != "f32out" else pname + "_f32out", backend="deep_gemm",
                                     cfg=name, shape=sname, tokens=T, routing=routing, ms=ms,
                                     tflops=flops / ms / 1e9, err_vs_torch=errs.get(name, float("nan"))))
                    print(f"  {sname:5s} {routing:7s} {pname:9s} cfg={name:15s} ours {ms:7.3f} ms "
                          f"{flops / ms / 1e9:6.1f} TF  err {errs.get(name, float('nan')):.2e}", flush=True)
                t_ms = med.get("torch", float("nan"))
                print(f"  {sname:5s} {routing:7s} {pname:9s} torch {t_ms:7.3f} ms {flops / t_ms / 1e9:6.1f} TF", flush=True)
                rows.append(dict(op=pname, backend="torch", shape=sname, tokens=T, routing=routing, ms=t_ms,
                                 tflops=flops / t_ms / 1e9))
                rows[-1]["ours_ms"] = med["None"]
                rows[-1]["best_cfg"] = min((v, k) for k, v in med.items() if k not in ("torch", "f32out"))
                del out, ref
                if kind == "k":
                    del out32
            # l1_fwd with the token gather fused into the A load (x [T, H] read through pool_token), against
            # torch's index_select + grouped mm and our plain kernel on a materialized pool copy, same tensors.
            # Gather modes: 1 = cp.async rows, 2 = one 2-D TMA box per row; plus mode 1/2 with the 4-stage config.
            xt = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            xp = xt.index_select(0, pool_token)
            outg = torch.empty(P, 2 * I, device="cuda", dtype=torch.bfloat16)
            tg = lambda: torch._grouped_mm(xt.index_select(0, pool_token), w13.transpose(-2, -1), offs=ends,
                                           out_dtype=torch.bfloat16)
            refg = tg()
            flops = 2 * P * H * 2 * I
            gc = {"plain": lambda: lib.m_grouped(xp, w13, outg, offs, True, None)}
            for gm in (1, 4, 5, 6):
                gc[f"g{gm}"] = lambda gm=gm: lib.m_grouped_gather(xt, pool_token, w13, outg, offs, True, None, gm)
            for gm in (1, 4, 5):
                gc[f"g{gm}_256x4"] = lambda gm=gm: lib.m_grouped_gather(xt, pool_token, w13, outg, offs, True,
                                                                        (256, 4, 0, 1), gm)
            errg = {}
            for nm, fn in gc.items():
                outg.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                errg[nm] = rel_err(outg, refg)
            med = time_interleaved({"torch": tg, **gc})
            print(f"  {sname:5s} {routing:7s} l1_fwd_gather torch(index_select+mm) {med['torch']:7.3f} ms; " +
                  "; ".join(f"{nm} {med[nm]:7.3f} ms (err {errg[nm]:.1e})" for nm in gc), flush=True)
            for nm in gc:
                rows.append(dict(op="l1_fwd_gather" if nm != "plain" else "l1_fwd_pool_plain", backend="deep_gemm",
                                 cfg=nm, shape=sname, tokens=T, routing=routing, ms=med[nm],
                                 tflops=flops / med[nm] / 1e9, err_vs_torch=errg[nm]))
            rows.append(dict(op="l1_fwd_gather", backend="torch_gather", shape=sname, tokens=T, routing=routing,
                             ms=med["torch"], tflops=flops / med["torch"] / 1e9))
            del xp
            # fused L1: gathered A, w13 natural layout, SwiGLU epilogue (s, and h for the backward) against torch's
            # index_select + grouped mm + silu * up on the same tensors
            s_out = torch.empty(P, I, device="cuda", dtype=torch.bfloat16)
            h_out = torch.empty(P, 2 * I, device="cuda", dtype=torch.bfloat16)

            def t_sw():
                hh = torch._grouped_mm(xt.index_select(0, pool_token), w13.transpose(-2, -1), offs=ends,
                                       out_dtype=torch.bfloat16)
                return torch.nn.functional.silu(hh[:, :I]) * hh[:, I:]
            sc = {}
            for gm in (1, 4, 5):
                sc[f"fused_h_g{gm}"] = lambda gm=gm: lib.m_grouped_swiglu(xt, pool_token, w13, s_out, h_out, offs,
                                                                          gather_mode=gm)
                sc[f"fused_g{gm}"] = lambda gm=gm: lib.m_grouped_swiglu(xt, pool_token, w13, s_out, None, offs,
                                                                        gather_mode=gm)
            sref = t_sw()
            errs_sw = {}
            for nm, fn in sc.items():
                s_out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                errs_sw[nm] = rel_err(s_out, sref)
            med = time_interleaved({"torch": t_sw, **sc})
            print(f"  {sname:5s} {routing:7s} l1_swiglu_gather torch(index_select+mm+silu*up) {med['torch']:7.3f} ms; " +
                  "; ".join(f"{nm} {med[nm]:7.3f} ms (err {errs_sw[nm]:.1e})" for nm in sc), flush=True)
            for nm in sc:
                rows.append(dict(op="l1_swiglu_gather" + ("_h" if "_h" in nm else ""), backend="deep_gemm",
                                 cfg=nm, shape=sname, tokens=T, routing=routing, ms=med[nm],
                                 tflops=flops / med[nm] / 1e9, err_vs_torch=errs_sw[nm]))
            rows.append(dict(op="l1_swiglu_gather", backend="torch_gather_swiglu", shape=sname, tokens=T,
                             routing=routing, ms=med["torch"], tflops=flops / med["torch"] / 1e9))
            del s_out, h_out, sref
            del xt, outg, refg
        del x, dy, dh, s, w13, w2
        torch.cuda.empty_cache()
    with open(out_jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    # summary table: heuristic config vs torch
    print("\nshape routing  pass       torch_ms  ours_ms  torch_TF ours_TF  speedup")
    sp = []
    for r in rows:
        if r["backend"] != "torch":
            continue
        o = r["ours_ms"]
        flops_tf = r["tflops"] * r["ms"]
        sp.append(r["ms"] / o)
        print(f"{r['shape']:5s} {r['routing']:8s} {r['op']:9s} {r['ms']:8.3f} {o:8.3f} {r['tflops']:8.1f} "
              f"{flops_tf / o:7.1f}  {r['ms'] / o:6.3f}x   best {r['best_cfg'][1]} {r['ms'] / r['best_cfg'][0]:.3f}x")
    gm = math.exp(sum(math.log(x) for x in sp) / len(sp))
    print(f"geomean speedup {gm:.3f}x, min {min(sp):.3f}x over {len(sp)} passes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.path.join(ROOT, ".devbuild", "libpk_gemm_dev.so"))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--all-configs", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    lib = Lib(args.lib)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    rc = 0
    if args.check:
        rc = run_checks(lib, os.path.join(args.out, "checks.json"))
    if args.bench:
        cfgs = CONFIGS[1:] if args.all_configs else [(256, 4, 0, 1), (256, 3, 1, 1)]
        run_bench(lib, os.path.join(args.out, "bench.jsonl"), cfgs)
    sys.exit(1 if rc else 0)


if __name__ == "__main__":
    main()
