#!/usr/bin/env python3
"""Which kernels of two builds have the same SASS: for each kernel of wheel NEW, whether its instructions equal those
of wheel OLD with every immediate masked (branch targets and parameter offsets move when anything else in the
library changes size). A kernel that compares equal runs the same instructions as the build it is compared with, so
that build's GPU results hold for it. Needs cuobjdump on PATH (pip package nvidia-cuda-cuobjdump).

    python3 ci/sass_compare.py OLD.whl NEW.whl [MORE_OLD.whl ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CORE = "prime_kernels/libprime_kernels_core.so"


def kernels(wheel: str) -> dict[str, list[str]]:
    """Mangled kernel name -> its instructions with immediates masked."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(CORE, tmp)
        sass = subprocess.run(["cuobjdump", "-sass", str(Path(tmp) / CORE)], capture_output=True, text=True,
                              check=True).stdout
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if name and m:
            out[name].append(re.sub(r"0x[0-9a-f]+", "IMM", m.group(1)))
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    *olds, new = argv
    ref = [(Path(o).name, kernels(o)) for o in olds]
    for name, ins in sorted(kernels(new).items()):
        same = [label for label, k in ref if k.get(name) == ins]
        pretty = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip() or name
        print(f"{'same as ' + ', '.join(same) if same else 'differs':40s}  {pretty[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
