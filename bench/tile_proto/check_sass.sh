#!/usr/bin/env bash
# Per-kernel SASS summary of ./bench (prototype kernels + the baseline 128x256 s3 async kernel): highest register
# index used, HGMMA shapes, local-memory instructions (LDL/STL), setmaxnreg.
cd "$(dirname "$0")"
CUOBJ=$(command -v cuobjdump || echo ../../.venv-test/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump)
"$CUOBJ" -sass "${1:-bench}" | python3 -c '
import re, sys
txt = sys.stdin.read()
for f in re.split(r"\n\s*Function : ", txt)[1:]:
    name = f.split("\n", 1)[0].strip()
    if "proto192" not in name and "m_grouped_bf16_gemm_kernelILi256ELi3ELb1ELb1ELb0ELb0ELb0ELb0ELb0E" not in name:
        continue
    regs = [int(x) for x in re.findall(r"\bR(\d+)\b", f)]
    hg = re.findall(r"HGMMA\.\S+", f)
    m = re.search(r"((?:big_tile|vt)_gemm_kernelINS_\d+BigTileCfgI(?:Li\d+E)+|m_grouped_bf16_gemm_kernelI(?:L[ib]\d+E)+)", name)
    print("%-75s max R%-3d HGMMA x%d %s LDL/STL %d %s" % (m.group(1) if m else name[:60], max(regs), len(hg),
          sorted(set(hg)), len(re.findall(r"\b(?:LDL|STL)\b", f)), " ".join(re.findall(r"USETMAXREG\.\S+ [^;]*", f))))
'
