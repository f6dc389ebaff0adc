"""README.md's status table, build_info()["verified"] and the status entries agree with the one table of what has
run on hardware (prime_kernels._verification), so none of them can drift from it."""

from __future__ import annotations

import prime_kernels
from prime_kernels import _status, _verification as ver
from conftest import REPO


def test_readme_holds_the_table_verbatim():
    readme = (REPO / "README.md").read_text()
    assert ver.markdown_table() in readme, (
        "README.md's status table differs from prime_kernels._verification.ROWS: paste the output of "
        "`python -m prime_kernels._verification` over it (or change ROWS)")
    assert readme.count("| kernel (`status()` key) |") == 1


def test_every_status_entry_has_exactly_one_row():
    rows_of = {}
    for row in ver.ROWS:
        for key in row.keys:
            assert key in _status.KERNELS, f"{key} (row {row.what!r}) is no status entry"
            rows_of.setdefault(key, []).append(row.what)
    assert {k for k, v in rows_of.items() if len(v) > 1} == set()
    assert set(_status.KERNELS) - set(rows_of) == set(), "status entries without a row in _verification.ROWS"


def test_each_row_agrees_with_its_status_entries():
    """Not written where the entry says missing; never "verified" where the entry says it has not run (unverified);
    verified where it was verified and is withheld; written where it is built; and nothing for sm_100 verified on a
    GPU the project has (all sm_90)."""
    for key, entry in _status.KERNELS.items():
        cell = ver.cell(key)
        written = bool(entry.compiled_as) and not entry.missing
        if entry.missing and not (entry.self_tested and prime_kernels.mega._selftest.candidate(key)):
            assert cell.level == ver.NOT_WRITTEN, key
        if written:
            assert cell.level != ver.NOT_WRITTEN, key
        if entry.unverified:
            assert cell.level in (ver.COMPILED, ver.CPU_ONLY, ver.PARTLY), key
        if entry.withheld:
            assert cell.level == ver.VERIFIED, key
        if "never run on Blackwell" in entry.available_note:
            assert cell.level in (ver.TORCH_FORCED, ver.CPU_ONLY), key
        if cell.level in (ver.VERIFIED, ver.PARTLY, ver.TORCH_FORCED):
            assert cell.gpu in ver.PROJECT_GPUS, key
        if entry.family == "sm100":
            assert cell.level not in (ver.VERIFIED, ver.PARTLY), f"{key}: no Blackwell GPU has run anything"


def test_build_info_says_per_built_arch_what_ran():
    info = prime_kernels.build_info()
    verified = info["verified"]
    assert set(verified) == set(info["cuda_archs"]) and verified == ver.by_arch(info["cuda_archs"])
    for arch, kernels in verified.items():
        family = ver.FAMILY_OF_ARCH[arch]
        assert kernels and all(k.endswith(f".{family}") for k in kernels), arch
        assert all(ver.cell(k).text() == text for k, text in kernels.items())
    every = ver.by_arch(("90a", "100a", "103a", "100f"))
    assert every["90a"]["mega_moe.bf16.sm90"] == "verified on an H200"
    assert every["90a"]["mega_moe_ep_peer.bf16.sm90"] == "verified on an H100"
    assert every["100a"]["routing_plan.int32.sm100"] == "compiled only, never run on hardware"
    assert every["100a"]["mega_moe_grouped.bf16.sm100"].startswith("runs torch's kernels, never run on Blackwell")
    assert every["100a"]["mega_moe.bf16.sm100"] == "compiled only, never run on hardware"
    assert "mega_moe.bf16.sm100" not in every["90a"] and every["100a"] == every["103a"] == every["100f"]
    assert not any(t.startswith("verified") for t in every["100a"].values())
