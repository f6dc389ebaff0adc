"""prime-rl's FP8 call sequence (prime_kernels.mega.staged_fp8) against the layer API's FP8 pipelines and torch's BF16
layer, in one run.

Per shape and token count (uniform routing, 128 experts, top-8):
  torch bf16    bench_common.torch_moe, forward and forward+backward (autograd, weight gradients included);
  layer fp8     prime_kernels.mega_moe(precision="fp8"), the same;
  staged fp8    forward: fp8_mega_moe + column_quant (the pools and x_t a backward needs); backward:
                fp8_mega_moe_backward + fp8_mega_moe_weight_grads into fp32 accumulators, on the current stream;
                column_quant and the backward's parts are also timed alone.
The caller's cast of x to 1 x 128 e4m3 and the staging copies are outside every staged time (prime-rl does them
in its own ops). Backward = (forward + backward) - forward for the autograd rows. CUDA events, median of --iters
after warm-ups. --smoke: a tiny shape on the CPU, to check that the script runs.

    python bench/bench_staged_fp8.py [--shapes qwen3-30b-a3b,qwen3-235b-a22b] [--tokens 4096,16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import bench_common
import prime_kernels
from prime_kernels.mega import fp8 as pk_fp8, staged_fp8


def _staged(x, idx, w, w13, w2, dy, E, device):
    T, K = idx.shape
    H, I = x.shape[1], w2.shape[2]
    buf = staged_fp8.FP8SymmBuffer(None, E, T, K, H, device=device)
    q = pk_fp8.quantize_along_k(x, pow2_scales=True)
    buf.x[:T].copy_(q.data)
    buf.x_sf[:T].copy_(q.scale)
    buf.topk_idx[:T].copy_(idx)
    buf.topk_weights[:T].copy_(w)
    buf.dy[:T].copy_(dy)
    C = staged_fp8.pool_capacity(T, K, E)
    h, h_sf = staged_fp8.FP8Pools.l2_operand(C, I, device=device)
    wq = staged_fp8.fp8_weights_for_mega_moe(w13, w2, pow2_scales=True)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    gx = torch.empty_like(y)
    gw = torch.empty(T, K, dtype=torch.float32, device=device)
    dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=device)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=device)
    state = {}

    def fwd():
        pools = staged_fp8.FP8Pools.allocate(C, H, I, E, h, h_sf)
        staged_fp8.fp8_mega_moe(y, wq[0:2], wq[2:4], pools, buf, pow2_scales=True)
        x_t = staged_fp8.allocate_column_quant(C, H, device=device)
        staged_fp8.column_quant(pools.x, pools.x_sf, pools.counts, *x_t, pow2_scales=True)
        state.update(pools=pools, x_t=x_t)

    def column():
        p = state["pools"]
        staged_fp8.column_quant(p.x, p.x_sf, p.counts, *state["x_t"], pow2_scales=True)

    def data_grads():
        bufs = staged_fp8.FP8BackwardBuffers(C, H, I, device=device)
        staged_fp8.fp8_mega_moe_backward(gx, gw, wq[4:6], wq[6:8], state["pools"], bufs, buf, pow2_scales=True)
        state["bufs"] = bufs

    def weight_grads():
        staged_fp8.fp8_mega_moe_weight_grads(state["pools"].counts, state["bufs"], state["x_t"], dw13, dw2)

    def bwd():
        data_grads()
        weight_grads()

    return fwd, bwd, column, data_grads, weight_grads


def _autograd(layer, x, idx, w, w13, w2, dy):
    xs = x.detach().requires_grad_()
    ws = w.detach().requires_grad_()
    a = w13.detach().requires_grad_()
    b = w2.detach().requires_grad_()

    def fwd():
        with torch.no_grad():
            layer(xs, idx, ws, a, b)

    def fwd_bwd():
        y = layer(xs, idx, ws, a, b)
        torch.autograd.backward(y, dy)
        for t in (xs, ws, a, b):
            t.grad = None

    return fwd, fwd_bwd


def run(shapes, tokens, iters, device) -> list[dict]:
    rows = []
    for shape in shapes:
        E, H, I, K = bench_common.shape_dims(shape)
        w13, w2 = bench_common.make_weights(E, H, I, 1, device)
        for T in tokens:
            x, idx, w, dy = bench_common.make_tokens(T, E, H, K, "uniform", 2, device)
            timed = {}
            layers = [("torch bf16", bench_common.torch_moe)]
            if torch.device(device).type == "cuda":  # the layer API's FP8 pipelines run on CUDA tensors only
                layers.append(("layer fp8", lambda *a: prime_kernels.mega_moe(*a, precision="fp8")))
            for name, layer in layers:
                f, fb = _autograd(layer, x, idx, w, w13, w2, dy)
                timed[name] = (bench_common.time_ms(f, device, iters=iters), bench_common.time_ms(fb, device, iters=iters))
            fwd, bwd, column, data_grads, weight_grads = _staged(x, idx, w, w13, w2, dy, E, device)
            fwd_ms = bench_common.time_ms(fwd, device, iters=iters)
            parts = {"column_quant": bench_common.time_ms(column, device, iters=iters),
                     "fp8_mega_moe_backward": bench_common.time_ms(data_grads, device, iters=iters),
                     "fp8_mega_moe_weight_grads": bench_common.time_ms(weight_grads, device, iters=iters)}
            bwd_ms = bench_common.time_ms(bwd, device, iters=iters)
            torch_f, torch_fb = timed["torch bf16"]
            for name, (f, fb) in timed.items():
                rows.append(dict(shape=shape, tokens=T, variant=name, fwd_ms=f, bwd_ms=fb - f,
                                 fwd_x_torch=torch_f / f, bwd_x_torch=(torch_fb - torch_f) / (fb - f)))
            rows.append(dict(shape=shape, tokens=T, variant="staged fp8", fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                             fwd_x_torch=torch_f / fwd_ms, bwd_x_torch=(torch_fb - torch_f) / bwd_ms, parts_ms=parts))
            for r in rows[-len(layers) - 1:]:
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU")
    args = ap.parse_args(argv)
    if args.smoke:
        device, shapes, tokens, iters = "cpu", ["e8-h128-i128-k2"], [40], 1
    else:
        device = "cuda"
        shapes, tokens, iters = args.shapes.split(","), [int(t) for t in args.tokens.split(",")], args.iters
    rows = run(shapes, tokens, iters, device)
    if args.out:
        header = bench_common.run_header(device, 0.0)
        bench_common.write_results({**header, "script": "bench/bench_staged_fp8.py", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
