#!/usr/bin/env python3
"""One launch each of our m-grouped l1_fwd (30B shape) and torch._grouped_mm on the same tensors, for
ncu --clock-control none (see run_gpu.sh). Not a benchmark."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_and_bench import ROOT, Lib, routing_counts  # noqa: E402

lib = Lib(os.path.join(ROOT, ".devbuild", "libpk_gemm_dev.so"))
T, E, topk, H, I = 16384, 128, 8, 2048, 768
P = T * topk
counts, _ = routing_counts(T, E, topk, "uniform", seed=7)
ends = torch.cumsum(counts, 0).to(torch.int32)
offs = torch.cat([torch.zeros(1, device="cuda", dtype=torch.int32), ends])
x = torch.randn(P, H, device="cuda").to(torch.bfloat16)
w13 = (torch.randn(E, 2 * I, H, device="cuda") * 0.02).to(torch.bfloat16)
out = torch.empty(P, 2 * I, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
lib.m_grouped(x, w13, out, offs, True, None)
torch._grouped_mm(x, w13.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16)
torch.cuda.synchronize()
print("probe done")
