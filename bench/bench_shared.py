"""Shared experts inside the routed experts' launches against the second pass, same run, same inputs.

For each shape (Qwen3-30B-A3B and -235B-A22B routed experts) with S shared experts of intermediate Is (default: the
routed I, and 4 I as Qwen2-MoE's), times mega_moe's forward and forward + backward (backend "auto", bf16 and fp8):
  inside   the shared experts as extra groups of the grouped pipeline's launches (prime_kernels.mega._shared_grouped),
  second   the routed layer (the fused forward, the grouped backward) then a second pass for the shared experts,
  torch    torch's grouped-mm layer plus one dense SwiGLU MLP per shared expert (bench_common's baseline).
"inside" needs status()["mega_moe_shared.<precision>.sm90"] available; "second" is the same call with the path's
reason forced (bench only). Every row records its outputs' distance from the "second" row's.

    python3 bench/bench_shared.py [--tokens 16384] [--shapes qwen3-30b-a3b,qwen3-235b-a22b] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402


def _layer(kind, precision, x, idx, w, w13, w2, sw13, sw2):
    from prime_kernels.mega import _shared_ops, mega_moe

    if kind == "torch":
        return bc.torch_moe(x, idx, w, w13, w2) + bc.torch_shared_experts(x, sw13, sw2)
    if kind == "second":
        saved = _shared_ops.reason
        _shared_ops.reason = lambda *a, **k: "forced off by the benchmark"
        try:
            return mega_moe(x, idx, w, w13, w2, shared_w13=sw13, shared_w2=sw2, num_experts=w13.shape[0],
                            precision=precision)
        finally:
            _shared_ops.reason = saved
    return mega_moe(x, idx, w, w13, w2, shared_w13=sw13, shared_w2=sw2, num_experts=w13.shape[0],
                    precision=precision)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b")
    p.add_argument("--shared", default="1x1,1x4", help="S x m pairs: S shared experts of intermediate m * I")
    p.add_argument("--precisions", default="bf16,fp8", help="mega_moe's precision for the inside and second rows")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (the reference backend)")
    p.add_argument("--bf16-max-groups", type=int, default=None,
                   help="measure bf16 inside the routed launches up to this many shared groups (the layer's own "
                        "limit, _shared_ops.BF16_MAX_SHARED_GROUPS, is where it was measured faster)")
    args = p.parse_args()
    from prime_kernels.mega import _shared_ops

    if args.bf16_max_groups is not None:
        _shared_ops.BF16_MAX_SHARED_GROUPS = args.bf16_max_groups

    dev = torch.device(args.device)
    header = bc.run_header(dev, bc.bf16_peak_tflops(dev) if dev.type == "cuda" else 0.0)
    rows = []
    for shape in args.shapes.split(","):
        E, H, I, K = bc.shape_dims(shape)
        for pair, precision in ((pr, pc) for pr in args.shared.split(",") for pc in args.precisions.split(",")):
            S, m = (int(v) for v in pair.split("x"))
            x, idx, w, dy = bc.make_tokens(args.tokens, E, H, K, "uniform", 0, dev)
            w13, w2 = bc.make_weights(E, H, I, 1, dev)
            sw13, sw2 = bc.make_shared_weights(S, H, m * I, 2, dev)
            why = _shared_ops.reason(x, w13, sw13, backend="auto", precision=precision, ep_size=1, accumulators=False,
                                     return_plan=False, activation_clamp=None)
            base = None
            # the torch row (a bf16 layer) once per shape and pair, beside the bf16 rows
            kinds = ("second", "inside", "torch") if precision == "bf16" else ("second", "inside")
            for kind in kinds:
                row = dict(shape=shape, tokens=args.tokens, shared=S, shared_inter=m * I, kind=kind,
                           precision=precision if kind != "torch" else "bf16")
                if kind == "inside" and why is not None:
                    rows.append({**row, "skipped": why})
                    print(f"[bench] {shape} S={S} Is={m * I} {precision} inside: skipped ({why})")
                    continue
                leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2, sw13, sw2)]

                def fwd(leaves=leaves, kind=kind, precision=precision):
                    with torch.no_grad():
                        return _layer(kind, precision, leaves[0], idx, *leaves[1:])

                def fwdbwd(leaves=leaves, kind=kind, precision=precision):
                    y = _layer(kind, precision, leaves[0], idx, *leaves[1:])
                    y.backward(dy)
                    return y

                row["fwd_ms"] = round(bc.time_ms(fwd, dev, args.warmup, args.iters), 4)
                row["fwdbwd_ms"] = round(bc.time_ms(fwdbwd, dev, args.warmup, args.iters), 4)
                for t in leaves:
                    t.grad = None
                y = fwdbwd()
                outs = [y.detach()] + [t.grad for t in leaves]
                if base is None:
                    base = outs
                else:
                    row["max_rel_err_vs_second"] = max(bc.rel_err(a, b) for a, b in zip(outs, base))
                rows.append(row)
                err = row.get("max_rel_err_vs_second")
                print(f"[bench] {shape} S={S} Is={m * I} {row['precision']} {kind}: fwd {row['fwd_ms']} ms, "
                      f"fwd+bwd {row['fwdbwd_ms']} ms" + (f", rel err vs second {err:.2e}" if err is not None else ""))
    doc = {**header, "rows": rows}
    path = Path(args.out) if args.out else bc.default_results_path("shared", header)
    print(bc.write_results(doc, path))


if __name__ == "__main__":
    main()
