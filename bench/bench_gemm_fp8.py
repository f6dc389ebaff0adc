"""Blockwise-FP8 grouped-GEMM benchmark: prime_kernels' e4m3 m-grouped and k-grouped GEMMs against torch's rowwise
FP8 grouped GEMM (torch._scaled_grouped_mm) and our BF16 GEMMs, on the same routing.

The MoE layer's GEMM passes (128 experts, T tokens, top-8, P = T*8 routed rows) at the Qwen3-30B-A3B and
Qwen3-235B-A22B shapes: four m-grouped passes (L1 and L2 forward, L2 and L1 dgrad) and the two k-grouped
weight-gradient passes. Useful TFLOP/s count the routed rows only (2 * P * N * K); the FP8 and BF16 peaks are
measured in the same run (an 8192^3 torch._scaled_mm with rowwise scales and an 8192^3 bf16 matmul). Operands are
random, quantized once outside the timing (the recipe's layouts, prime_kernels.mega.fp8); times are CUDA events, the
median of --reps after 5 warm-ups. A torch row that cannot run on this build says why.

    python bench/bench_gemm_fp8.py [--tokens 16384] [--routing uniform] [--reps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import bench_common
import prime_kernels
import prime_kernels.grouped_gemm
from prime_kernels.mega import fp8 as recipe

SHAPES = ("qwen3-30b-a3b", "qwen3-235b-a22b")  # bench_common.SHAPES names
E4M3_MAX = 448.0  # torch's rowwise baseline quantizes with it too


def quant_rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's rowwise recipe: one fp32 scale per row along ``dim``'s complement (amax over ``dim``)."""
    s = (x.float().abs().amax(dim) / E4M3_MAX).clamp_min(1e-12)
    return (x.float() / s.unsqueeze(dim)).to(torch.float8_e4m3fn), s


def timed(fn, reps: int) -> float | str:
    try:
        return bench_common.time_ms(fn, "cuda", warmup=5, iters=reps)
    except Exception as e:  # noqa: BLE001 - a baseline this torch build lacks is reported, not fatal
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def pass_rows(shape, name, kind, P, N, K, timings) -> list[dict]:
    """One row per backend of one GEMM pass: ms and useful TFLOP/s (2 P N K over the routed rows), or why skipped."""
    flops = 2 * P * N * K
    return [{"shape": shape, "pass": name, "kind": kind, "P": P, "N": N, "K": K, "backend": backend,
             **({"ms": ms, "tflops": flops / ms / 1e9} if isinstance(ms, float) else {"skipped": ms})}
            for backend, ms in timings]


def m_pass_rows(name, shape, P, N, K, counts, reps) -> list[dict]:
    E = counts.numel()
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offs[1:] = counts.cumsum(0)
    x = torch.randn(P, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    qa, qb = recipe.quantize_along_k(x), recipe.quantize_weight(w)  # the library's recipe (1x128, 128x128)
    a, sa = qa.data, prime_kernels.grouped_gemm.k_block_major_scales(qa.scale)
    b, sb = qb.data, qb.scale
    ours = timed(lambda: prime_kernels.m_grouped_fp8_gemm_nt(a, sa, b, sb, offs), reps)
    bf16 = timed(lambda: prime_kernels.m_grouped_bf16_gemm_nt(x, w, offs), reps)
    ta, tsa = quant_rowwise(x, 1)
    tb, tsb = quant_rowwise(w, 2)  # [E, N, K] with scales [E, N]
    tb_t = tb.transpose(1, 2)  # [E, K, N], K-major as torch wants it
    ends = offs[1:].contiguous()
    torch_fp8 = timed(lambda: torch._scaled_grouped_mm(ta, tb_t, tsa, tsb, offs=ends, out_dtype=torch.bfloat16), reps)
    return pass_rows(shape, name, "m_grouped", P, N, K,
                     (("ours_fp8", ours), ("torch_fp8_rowwise", torch_fp8), ("ours_bf16", bf16)))


def k_pass_rows(name, shape, P, M, N, counts, reps) -> list[dict]:
    E = counts.numel()
    padded = (counts + 127) // 128 * 128
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offs[1:] = padded.cumsum(0)
    p_pad = int(offs[-1])
    a_rows = torch.randn(p_pad, M, device="cuda", dtype=torch.bfloat16)
    b_rows = torch.randn(p_pad, N, device="cuda", dtype=torch.bfloat16)
    qa = recipe.quantize_along_tokens(a_rows).t()  # data [M, P], scale [M, P/128]
    qb = recipe.quantize_along_tokens(b_rows).t()
    a, sa = qa.data, prime_kernels.grouped_gemm.k_block_major_scales(qa.scale)  # t() made both contiguous
    b, sb = qb.data, prime_kernels.grouped_gemm.k_block_major_scales(qb.scale)
    ours = timed(lambda: prime_kernels.k_grouped_fp8_gemm_tn(a, sa, b, sb, offs, out_dtype=torch.float32), reps)
    bf16 = timed(lambda: prime_kernels.k_grouped_bf16_gemm_tn(a_rows, b_rows, offs), reps)
    return pass_rows(shape, name, "k_grouped", P, N, M, (("ours_fp8", ours), ("ours_bf16", bf16)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--routing", default="uniform")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    header = bench_common.run_header("cuda", bench_common.bf16_peak_tflops("cuda"))
    header["peak_fp8_tflops"] = round(bench_common.fp8_peak_tflops("cuda"), 2)
    rows = []
    for shape in a.shapes.split(","):
        E, H, I, K = bench_common.SHAPES[shape]
        idx, _ = bench_common.make_routing(a.tokens, E, K, a.routing, a.seed, "cuda")
        counts = torch.bincount(idx.flatten(), minlength=E).to(torch.int32)
        P = int(counts.sum())
        for name, N, Kd in (("l1_fwd", 2 * I, H), ("l2_fwd", H, I), ("l2_dgrad", I, H), ("l1_dgrad", H, 2 * I)):
            rows += m_pass_rows(name, shape, P, N, Kd, counts, a.reps)
        rows += k_pass_rows("dw13", shape, P, 2 * I, H, counts, a.reps)
        rows += k_pass_rows("dw2", shape, P, H, I, counts, a.reps)
    for r in rows:
        r.update(tokens=a.tokens, routing=a.routing)
        fig = f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r else f"skipped: {r['skipped']}"
        print(f"[bench] {r['shape']:16s} {r['pass']:9s} {r['backend']:18s} {fig}")
    doc = {**header, "options": vars(a), "rows": rows}
    out = bench_common.write_results(doc, Path(a.out) if a.out else
                                     bench_common.default_results_path("gemm_fp8", header))
    print(f"[bench] peak fp8 {header['peak_fp8_tflops']} bf16 {header['peak_bf16_tflops']} TFLOP/s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
