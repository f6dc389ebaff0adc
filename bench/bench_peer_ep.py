#!/usr/bin/env python3
"""What expert parallelism over peer memory costs on one GPU: R virtual ranks of the emulator against EP = 1.

    python3 bench/bench_peer_ep.py --shapes qwen3-30b-a3b,qwen3-235b-a22b --tokens 4096 --ranks 2,4,8

For each shape, T (tokens per rank) and R, the same work two ways on the one GPU:

* ``ep1``: the layer's kernels on one rank over all R * T tokens with all E experts: the fused forward
  (``prime_kernels.mega._fused.forward``) and the bf16 backward as the layer runs it (the grouped pipeline);
* ``emulated``: :class:`prime_kernels.mega._peer_ep.EmulatedGroup` of R ranks, each with its T tokens and E / R
  experts: staging, the enter and exit barriers, each rank's plan from every rank's routing, the fused forward of
  all ranks in one launch (dispatch reading the ranks' staged rows, L2 rows pushed to their source ranks' slots), the
  combines; the backward's row gathers and scatters between the ranks around each rank's backward (the same
  pipeline on its pool).

Both are timed as wall-clock ms per forward + backward (synchronised before and after a batch of iterations), host
work included; ``fwd`` columns time the forward alone. The ratio emulated / ep1 is the path's overhead on one card
(its plans, barriers, row moves, R smaller kernels where EP = 1 runs one), not a multi-GPU speed. The outputs are
compared bit for bit (``bitwise``: y, dX, d topk_weights, dW13, dW2), as the tests do.

Results: a table on stdout and a JSON (``--out``, default bench/results/peer_ep_<gpu>_<date>.json) with the run's
header and one row per (shape, T, R, routing).

Under torchrun (one GPU per rank, the ranks NVLink peers) it times :class:`prime_kernels.mega._peer_ep.PeerGroup`
instead, T tokens per rank, every rank's experts its E / R:

    torchrun --nproc-per-node 8 bench/bench_peer_ep.py --shapes qwen3-30b-a3b --tokens 16384

per rank: ``ms`` (forward + backward), ``local_ms`` (the same call with the exchange left out: every peer pointer on
the rank's own buffers and no barriers, the same plan and kernels), ``moves_ms`` (the exchange's row moves alone: the
pool's x and dy rows gathered from their ranks, the L2 and dX rows scattered back, by ``peer_rows``), and
``hidden`` = 1 - (ms - local_ms) / moves_ms, the share of the moves the call hides under its compute; the row
reports every rank's values and the slowest rank's ``ms``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,qwen3-235b-a22b", help=f"comma list from {sorted(bc.SHAPES)}")
    p.add_argument("--tokens", default="4096", help="comma list of tokens per rank")
    p.add_argument("--ranks", default="2,4,8", help="comma list of virtual rank counts (each must divide E)")
    p.add_argument("--routings", default="uniform", help="comma list from uniform,zipf")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=8.0, help="stop starting new configurations after this")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _split(s: str) -> list[str]:
    return [v for v in s.split(",") if v]


def _timed(fn, warmup: int, iters: int) -> float:
    return bc.wall_ms(fn, torch.device("cuda"), warmup, iters)


def run_config(shape: str, T: int, R: int, routing: str, args, device) -> dict:
    from prime_kernels.mega import _backend, _fused
    from prime_kernels.mega._peer_ep import EmulatedGroup
    from prime_kernels.routing import pool_capacity

    E, H, I, K = bc.shape_dims(shape)
    if E % R:
        raise ValueError(f"{R} ranks do not divide {E} experts")
    El = E // R
    w13, w2 = bc.make_weights(E, H, I, args.seed, device)
    parts = [bc.make_tokens(T, E, H, K, routing, args.seed + T, device, rank=r) for r in range(R)]
    x, idx, w, dy = (torch.cat([p[i] for p in parts]) for i in range(4))
    w = w.float()
    cap = pool_capacity(R * T, K, E, 128)

    def ep1_fwd():
        return _fused.forward(x, idx, w, w13, w2, num_experts=E, block_m=128, capacity=cap)

    def ep1_once():
        outs = ep1_fwd()
        return outs[0], _backend.backward("grouped", dy, x, idx, w, w13, w2, *outs[1:7], precision="bf16",
                                          activation_clamp=None, group=None, num_experts=E, recompute=False,
                                          need_wgrad=True)

    group = EmulatedGroup(R, num_experts=E, hidden=H, top_k=K, max_tokens=T, device=device)
    xs = [p[0] for p in parts]
    idxs = [p[1] for p in parts]
    ws = [p[2].float() for p in parts]
    dys = [p[3] for p in parts]
    w13s = [w13[r * El:(r + 1) * El].contiguous() for r in range(R)]
    w2s = [w2[r * El:(r + 1) * El].contiguous() for r in range(R)]

    def emu_fwd():
        return group.forward(xs, idxs, ws, w13s, w2s)

    def emu_once():
        outs = emu_fwd()
        return outs, group.backward(dys, idxs, ws, [o[1] for o in outs], w13s, w2s)

    y1, (dx1, dt1, dw13_1, dw2_1) = ep1_once()
    outs, grads = emu_once()
    bitwise = True
    for r in range(R):
        sl, es = slice(r * T, (r + 1) * T), slice(r * El, (r + 1) * El)
        dx, dt, dw13, dw2 = grads[r]
        bitwise &= (torch.equal(outs[r][0], y1[sl]) and torch.equal(dx, dx1[sl]) and torch.equal(dt, dt1[sl].float())
                    and torch.equal(dw13, dw13_1[es]) and torch.equal(dw2, dw2_1[es]))
    del outs, grads, y1, dx1, dt1, dw13_1, dw2_1
    row = {"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K, "tokens_per_rank": T,
           "ranks": R, "routing": routing, "precision": "bf16", "bitwise": bool(bitwise)}
    row["ep1_fwd_ms"] = round(_timed(ep1_fwd, args.warmup, args.iters), 4)
    row["emulated_fwd_ms"] = round(_timed(emu_fwd, args.warmup, args.iters), 4)
    row["ep1_ms"] = round(_timed(ep1_once, args.warmup, args.iters), 4)
    row["emulated_ms"] = round(_timed(emu_once, args.warmup, args.iters), 4)
    row["fwd_overhead"] = round(row["emulated_fwd_ms"] / row["ep1_fwd_ms"], 4)
    row["overhead"] = round(row["emulated_ms"] / row["ep1_ms"], 4)
    return row


def run_torchrun(args) -> int:
    """The multi-GPU mode (see the module docstring): one row per (shape, T, routing), rank 0 writes the results."""
    import os

    import torch.distributed as dist

    from prime_kernels.mega import _nvlink_domain
    from prime_kernels.mega._peer_ep import PeerGroup

    _nvlink_domain.disable_multicast_env()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, R = dist.get_rank(), dist.get_world_size()
    header = bc.run_header(device, 0.0)
    header.pop("peak_bf16_tflops")
    header["num_gpus"] = R
    rows = []
    for shape in _split(args.shapes):
        E, H, I, K = bc.shape_dims(shape)
        w13, w2 = bc.make_weights(E, H, I, args.seed, device, rank=rank, ep=R)
        for T in (int(t) for t in _split(args.tokens)):
            pg = PeerGroup(dist.group.WORLD, num_experts=E, hidden=H, top_k=K, max_tokens=T, device=device)
            for routing in _split(args.routings):
                x, idx, w, dy = bc.make_tokens(T, E, H, K, routing, args.seed + T, device, rank=rank)
                w = w.float()

                def call(exchange=True, pg=pg, x=x, idx=idx, w=w, dy=dy):
                    y, saved = pg.forward(x, idx, w, w13, w2, exchange=exchange)
                    return pg.backward(dy, idx, w, saved, w13, w2, exchange=exchange)

                _y, saved = pg.forward(x, idx, w, w13, w2)
                bufs = pg.buffers
                xs, slots = [b.x for b in bufs], [b.slots for b in bufs]
                pool = torch.empty_like(saved.x_pool)

                def moves():
                    for gather, peers, div in ((True, xs, K), (False, slots, 1), (True, xs, K), (False, slots, 1)):
                        torch.ops.prime_kernels.peer_rows_(pool, peers, saved.src_route, saved.src_rank, div, gather)

                dist.barrier()
                ms = _timed(call, args.warmup, args.iters)
                dist.barrier()
                local_ms = _timed(lambda: call(False), args.warmup, args.iters)
                dist.barrier()
                moves_ms = _timed(moves, args.warmup, args.iters)
                dist.barrier()
                hidden = 1.0 - (ms - local_ms) / moves_ms if moves_ms > 0 else None
                every = bc.gather_values(ms, device)
                row = {"shape": shape, "num_experts": E, "hidden": H, "intermediate": I, "top_k": K,
                       "tokens_per_rank": T, "ranks": R, "routing": routing, "precision": "bf16",
                       "ms_per_rank": every, "slowest_ms": max(every),
                       "local_ms_per_rank": bc.gather_values(local_ms, device),
                       "moves_ms_per_rank": bc.gather_values(moves_ms, device),
                       "hidden_per_rank": bc.gather_values(hidden if hidden is not None else float("nan"), device)}
                rows.append(row)
                if rank == 0:
                    print(f"[peer_ep] {shape} T={T}/rank R={R} {routing}: slowest rank {row['slowest_ms']:.3f} ms "
                          f"(ranks {', '.join(f'{v:.3f}' for v in every)}); exchange left out "
                          f"{max(row['local_ms_per_rank']):.3f} ms; moves alone {max(row['moves_ms_per_rank']):.3f} "
                          f"ms; hidden {', '.join(f'{v:.0%}' for v in row['hidden_per_rank'])}", flush=True)
            del pg  # its symmetric memory goes before the next size's
    if rank == 0:
        doc = {**header, "script": "bench/bench_peer_ep.py (torchrun)", "args": vars(args),
               "timing": "wall-clock ms per forward + backward over --iters after --warmup, per rank", "rows": rows}
        path = Path(args.out) if args.out else bc.default_results_path("peer_ep_multi", header)
        bc.write_results(doc, path)
        print(f"[peer_ep] wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return run_torchrun(args)
    if not torch.cuda.is_available():
        print("[peer_ep] needs a CUDA GPU (the emulator runs CUDA kernels)")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    header = bc.run_header(device, 0.0)
    header.pop("peak_bf16_tflops")
    rows, start = [], time.time()
    for shape in _split(args.shapes):
        for T in (int(t) for t in _split(args.tokens)):
            for R in (int(r) for r in _split(args.ranks)):
                for routing in _split(args.routings):
                    if time.time() - start > args.max_minutes * 60:
                        print(f"[peer_ep] out of time before {shape} T={T} R={R} {routing}", flush=True)
                        break
                    row = run_config(shape, T, R, routing, args, device)
                    rows.append(row)
                    print(f"[peer_ep] {shape} T={T}/rank R={R} {routing}: fwd ep1 {row['ep1_fwd_ms']:.3f} ms, "
                          f"emulated {row['emulated_fwd_ms']:.3f} ms ({row['fwd_overhead']:.2f}x); fwd+bwd ep1 "
                          f"{row['ep1_ms']:.3f} ms, emulated {row['emulated_ms']:.3f} ms ({row['overhead']:.2f}x); "
                          f"bitwise {row['bitwise']}", flush=True)
    doc = {**header, "script": "bench/bench_peer_ep.py", "args": vars(args),
           "timing": "wall-clock ms per call over --iters after --warmup, host work included", "rows": rows}
    path = Path(args.out) if args.out else bc.default_results_path("peer_ep", header)
    bc.write_results(doc, path)
    print(f"[peer_ep] wrote {path}")
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
