"""Fetch what the torch shim is built against, without installing torch: the pinned torch wheel
(ci/constraints.txt) is downloaded with pip in hash-checking mode, the hashes being those of
third_party/PROVENANCE.md, and only torch/include/ and the libraries the shim links (libtorch_cpu.so and the
libraries it needs at link time) are unpacked.

usage: python ci/fetch_torch_headers.py DEST     prints DEST/torch, a folder with include/ and lib/

The wheel for the running CPython is taken (its headers and libtorch_cpu are those of every other CPython's
wheel of that release). pip's configuration (index, mirrors, caches) applies; a wheel already in DEST is reused
after its hash is checked again.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("torch/lib/libtorch_cpu.so", "torch/lib/libc10.so", "torch/lib/libgomp.so.1")


def pinned_torch() -> str:
    for line in (ROOT / "ci" / "constraints.txt").read_text().splitlines():
        m = re.match(r"^torch==(\S+)", line.strip())
        if m:
            return m.group(1)
    raise SystemExit("ci/constraints.txt pins no torch")


def listed_hashes(version: str) -> dict[str, str]:
    """file name -> sha256 of the torch wheels of `version` in third_party/PROVENANCE.md."""
    out = {}
    for line in (ROOT / "third_party" / "PROVENANCE.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.split("|")]
        if len(cells) >= 6 and cells[3].startswith(f"torch-{version}-") and re.fullmatch(r"[0-9a-f]{64}", cells[4]):
            out[cells[3]] = cells[4]
    if not out:
        raise SystemExit(f"third_party/PROVENANCE.md lists no sha256 for a torch {version} wheel")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    dest = Path(sys.argv[1]).resolve()
    version = pinned_torch()
    hashes = listed_hashes(version)
    download = dest / "download"
    download.mkdir(parents=True, exist_ok=True)
    req = dest / "torch-requirement.txt"
    req.write_text(f"torch=={version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(hashes.values())) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", "--require-hashes", "-r", str(req), "-d", str(download)],
                   check=True, stdout=sys.stderr)
    wheels = [w for w in download.glob(f"torch-{version}-*.whl") if w.name in hashes]
    if len(wheels) != 1:
        raise SystemExit(f"expected one listed torch {version} wheel in {download}, found {[w.name for w in wheels]}")
    wheel = wheels[0]
    got = sha256(wheel)
    if got != hashes[wheel.name]:
        raise SystemExit(f"{wheel.name}: sha256 {got}, third_party/PROVENANCE.md says {hashes[wheel.name]}")
    print(f"prime-kernels: {wheel.name} sha256 {got} (as listed in third_party/PROVENANCE.md)", file=sys.stderr)
    done = dest / "torch" / ".unpacked"
    if not (done.exists() and done.read_text() == wheel.name):
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.startswith("torch/include/") or n in LINKED]
            missing = [n for n in LINKED if n not in members]
            if missing:
                raise SystemExit(f"{wheel.name} has no {', '.join(missing)}")
            z.extractall(dest, members)
        done.write_text(wheel.name)
    print(dest / "torch")


if __name__ == "__main__":
    main()
