"""What has run on hardware, per arch: the one table that README.md's status table is generated from and
``prime_kernels.build_info()["verified"]`` reads (tests/test_verification.py checks that README holds it verbatim
and that it agrees with the status entries, so neither can drift from the code).

Each row covers some status() keys and says, per arch family, how far their kernels were checked: run and tested on
a GPU, compiled only, torch's kernels checked with them forced on Hopper, the CPU only, or not written. No Blackwell
GPU has been available to the project, so nothing in the sm_100 column is "verified".
"""

from __future__ import annotations

from dataclasses import dataclass

VERIFIED = "verified"
COMPILED = "compiled"
TORCH_FORCED = "torch_forced"
CPU_ONLY = "cpu_only"
NOT_WRITTEN = "not_written"
PARTLY = "partly"
_LEVEL_TEXT = {
    VERIFIED: "verified on an {gpu}",
    PARTLY: "partly run on an {gpu}, not yet verified",
    COMPILED: "compiled only, never run on hardware",
    TORCH_FORCED: "runs torch's kernels, never run on Blackwell; verified on an {gpu} with torch's GEMMs forced",
    CPU_ONLY: "never run on hardware, checked on the CPU only",
    NOT_WRITTEN: "not written",
}
#: The GPUs the project has run its tests on (both sm_90: they run no sm_100 code)
PROJECT_GPUS = ("H100", "H200")
FAMILY_OF_ARCH = {"90a": "sm90", "100a": "sm100", "103a": "sm100", "100f": "sm100"}


@dataclass(frozen=True)
class Cell:
    level: str
    gpu: str = ""   # for VERIFIED, PARTLY and TORCH_FORCED: the GPU the tests ran on
    note: str = ""  # markdown detail after the level (README only)

    def text(self) -> str:
        return _LEVEL_TEXT[self.level].format(gpu=self.gpu)

    def markdown(self) -> str:
        return self.text() + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Row:
    what: str      # README's first column (markdown)
    precision: str
    keys: tuple[str, ...]  # the status() keys it covers, of both families
    sm90: Cell
    sm100: Cell


def _v(gpu: str, note: str = "") -> Cell:
    return Cell(VERIFIED, gpu, note)


_NOT = Cell(NOT_WRITTEN)
_COMPILED = Cell(COMPILED)
_SELFTEST = ("the native forward of `csrc/sm100`, in builds with a Blackwell arch; used on a device only after its "
             "self-test against the grouped pipeline passes there: `prime_kernels.selftest()`, "
             "`status()[\"mega_moe.bf16.sm100\"]`; [docs/blackwell.md](docs/blackwell.md)")

ROWS: tuple[Row, ...] = (
    Row("fused forward (`mega_moe`)", "bf16", ("mega_moe.bf16.sm90", "mega_moe.bf16.sm100"),
        _v("H200"), Cell(COMPILED, note=_SELFTEST)),
    Row("fused backward (`mega_moe_backward`: L2 dgrad + SwiGLU backward, L1 dgrad and the weight gradients in one "
        "kernel)", "bf16", ("mega_moe_backward.bf16.sm90",),
        _v("H100", "bitwise the pipeline's kernels; sanitizer-clean; but 1.18-1.30x the time of the four pipeline "
                   "GEMMs it replaces (docs/performance.md), so `status()` withholds it and the backward runs the "
                   "grouped pipeline"), _NOT),
    Row("grouped pipeline, forward + backward (`mega_moe_grouped`)", "bf16",
        ("mega_moe_grouped.bf16.sm90", "mega_moe_grouped.bf16.sm100"), _v("H200"),
        Cell(TORCH_FORCED, "H100", "`mega_moe_grouped.bf16.sm100`: our routing plan, dispatch, SwiGLU and combine "
                                   "kernels around torch's grouped GEMM (`torch._grouped_mm`), what `\"grouped\"` and "
                                   "`\"auto\"` run for bf16, one rank or expert-parallel; "
                                   "[docs/blackwell.md](docs/blackwell.md)")),
    Row("grouped pipeline with `activation_clamp` (`mega_moe_grouped_clamp`)", "bf16",
        ("mega_moe_grouped_clamp.bf16.sm90", "mega_moe_grouped_clamp.bf16.sm100"),
        _v("H100", "against float64 with clamps 1, 7 and 10"),
        Cell(NOT_WRITTEN, note="torch's grouped GEMM returns h in bf16, the clamp masks need it in fp32: refused "
                               "with that reason")),
    Row("half-width last tiles, H or I a multiple of 64 but not of 128 (`mega_moe_half_tiles`)", "bf16",
        ("mega_moe_half_tiles.bf16.sm90",), _v("H100", "at (2880, 2880) and (1088, 320) against float64"),
        Cell(NOT_WRITTEN, note="torch's grouped GEMM, which runs there, takes these shapes")),
    Row("grouped GEMMs (`m_grouped_gemm_nt`, `_nn`, `_nt_gather`, `_swiglu`, `_swiglu_bwd`, `k_grouped_gemm_tn`)",
        "bf16", tuple(f"{k}.bf16.sm90" for k in ("m_grouped_gemm_nt", "m_grouped_gemm_nn", "m_grouped_gemm_nt_gather",
                                                  "m_grouped_gemm_swiglu", "m_grouped_gemm_swiglu_bwd",
                                                  "k_grouped_gemm_tn")),
        _v("H200"), Cell(NOT_WRITTEN, note="torch's grouped GEMM runs in their place")),
    Row("m-grouped GEMMs with a second weight tensor for the last groups (`m_grouped_gemm_second_b`: shared experts "
        "as chunks of width I beside the routed experts, L1 with SwiGLU, L2, L1 dgrad)", "bf16",
        ("m_grouped_gemm_second_b.bf16.sm90",),
        _v("H100", "bit for bit the routed GEMMs on the weights with the chunks as experts"), _NOT),
    Row("BF16 layer with its shared experts inside the grouped pipeline's launches (`mega_moe_shared`: the chunks "
        "as extra groups of the second-B GEMMs)", "bf16", ("mega_moe_shared.bf16.sm90",),
        _v("H100", "against float64 and the second pass; at 30B, T = 16384, forward + backward: one shared group "
                   "of width I 10.02 against the second pass's 11.25 ms, two 10.90 against 11.50; beyond two groups "
                   "bf16 takes the second pass (its forward measured faster there)"), _NOT),
    Row("its forward on the fused kernel with the shared chunks as its last groups (`mega_moe_shared_fused`: "
        "the fused BF16 forward's B tiles of those groups read from the shared weights)", "bf16",
        ("mega_moe_shared_fused.bf16.sm90",),
        _v("H100", "bit for bit the grouped pipeline's forward on the same routes, on NaN-poisoned memory"), _NOT),
    Row("routing plan, dispatch_rows, combine, SwiGLU (`routing_plan`, `dispatch_rows`, `combine`, `swiglu`)",
        "int32 / bf16", tuple(f"{k}.{f}" for k in ("routing_plan.int32", "dispatch_rows.bf16", "combine.bf16",
                                                   "swiglu.bf16") for f in ("sm90", "sm100")),
        _v("H200"), _COMPILED),
    Row("FP8 grouped GEMMs (`m_grouped_gemm_nt.fp8`, `k_grouped_gemm_tn.fp8`; [docs/fp8_gemm.md](docs/fp8_gemm.md))",
        "e4m3, fp32 block scales", ("m_grouped_gemm_nt.fp8.sm90", "k_grouped_gemm_tn.fp8.sm90"),
        _v("H200", "the FP8 backward calls them"), _NOT),
    Row("FP8 quantizing producers (`dispatch_rows.fp8`, `quantize_tokens.fp8`; [docs/fp8.md](docs/fp8.md))",
        "bf16 (qT: or e4m3 with 1 x 128 scales) -> e4m3, fp32 block scales",
        tuple(f"{k}.{f}" for k in ("dispatch_rows.fp8", "quantize_tokens.fp8") for f in ("sm90", "sm100")),
        _v("H200", "bit for bit to the recipe; the FP8 backward calls them"), _COMPILED),
    Row("FP8 weight quantization kernel (`quantize_weight.fp8`: a layer's weights in 128 x 128 tiles, one read)",
        "bf16 -> e4m3, fp32 tile scales", ("quantize_weight.fp8.sm90",),
        _v("H100", "bit for bit the recipe's CPU reference; 2.7 TB/s read + write at the layer's weights"), _NOT),
    Row("FP8 weight tiles transposed (`transpose_tiles.fp8`: the K-major copy the dgrad GEMMs read)",
        "e4m3", ("transpose_tiles.fp8.sm90",),
        _v("H100", "byte for byte torch's transpose; the 6-layer FP8 training step 337.1 -> 316.8 ms with it"), _NOT),
    Row("FP8 L2 dgrad with the SwiGLU backward, quantizing epilogue (`m_grouped_gemm_swiglu_bwd.fp8`; "
        "[docs/fp8.md](docs/fp8.md))", "e4m3 in, e4m3 + fp32 block scales out",
        ("m_grouped_gemm_swiglu_bwd.fp8.sm90",), _v("H200"), _NOT),
    Row("FP8 L1 GEMM with the SwiGLU forward, qK(s, 64) epilogue (`m_grouped_gemm_swiglu.fp8`; "
        "[docs/fp8.md](docs/fp8.md))", "e4m3 in, e4m3 + fp32 block scales out",
        ("m_grouped_gemm_swiglu.fp8.sm90",), _v("H200", "the FP8 forward calls it"), _NOT),
    Row("the same with the activation clamp (`m_grouped_gemm_swiglu_clamp.fp8`: gate and up clamped on the fp32 "
        "accumulators, h saved by the masked rounding)", "e4m3 in, e4m3 + fp32 block scales out",
        ("m_grouped_gemm_swiglu_clamp.fp8.sm90",),
        _v("H100", "against its emulation, the reference's FP8 forward with a clamp; precision=\"fp8\" with an "
                   "activation_clamp runs on it"), _NOT),
    Row("FP8 forward in the layer, pipeline (`mega_moe_grouped.fp8`: backend \"grouped\")", "fp8",
        ("mega_moe_grouped.fp8.sm90",), _v("H200"), _NOT),
    Row("fused FP8 forward (`mega_moe.fp8`: the quantizing dispatch, then L1 with SwiGLU and qK(s, 64) and L2 in one "
        "persistent kernel)", "fp8", ("mega_moe.fp8.sm90",),
        _v("H200", "the pipeline's bits; 3.0x torch's BF16 forward at 30B, T=16384"), _NOT),
    Row("BF16 forward, FP8 backward in the layer (`mega_moe.fp8_bwd`: the FP8 backward pipeline)", "bf16 / fp8",
        ("mega_moe.fp8_bwd.sm90",), _v("H200", "1.3-1.6x torch's BF16 backward: [docs/fp8.md](docs/fp8.md)"), _NOT),
    Row("fused FP8 backward data gradients (`mega_moe_backward.fp8`: the FP8 L2 dgrad with the SwiGLU backward and "
        "its quantizing epilogue, and the FP8 L1 dgrad, in one persistent kernel; the weight gradients stay with "
        "`k_grouped_gemm_tn.fp8`)", "e4m3 in, e4m3 + fp32 block scales and bf16 out", ("mega_moe_backward.fp8.sm90",),
        _v("H100", "bitwise the two launches it replaces (`m_grouped_gemm_swiglu_bwd.fp8`, `m_grouped_gemm_nt.fp8`); "
                   "fault matrix and sanitizer clean; but 0.99-1.06x their time (docs/performance.md), so `status()` "
                   "withholds it and the FP8 backward runs the two launches"), _NOT),
    Row("FP8 with H or I a multiple of 64 but not of 128: 64-wide last scale blocks (`mega_moe_half_tiles.fp8`; "
        "[docs/fp8.md](docs/fp8.md))", "fp8 / fp8_bwd", ("mega_moe_half_tiles.fp8.sm90",),
        _v("H100", "the kernels' tail cases against their emulation; the layer at (1088, 320) and (2880, 2880) within "
                   "the matrix's bounds"), _NOT),
    Row("FP8 layer with its shared experts inside the routed launches (`mega_moe_shared`: the FP8 kernels on the "
        "weights' FP8 copies with the shared chunks as experts)", "fp8", ("mega_moe_shared.fp8.sm90",),
        _v("H100", "within the FP8 bounds, with and without a clamp; 30B, T = 16384, forward + backward 9.40 against "
                   "the second pass's 10.71 ms (width I), 11.95 against 12.14 (width 4I)"), _NOT),
    Row("expert parallelism over peer memory (`mega_moe_ep_peer`: backend \"fused\" under a group)", "bf16",
        ("mega_moe_ep_peer.bf16.sm90",),
        _v("H100", "through its one-GPU emulator: forward and backward bit for bit EP = 1, bf16 and FP8, in one "
                   "launch and with per-rank delays, 2,000 back-to-back calls, a CUDA-graph replay, a late rank, "
                   "sanitizer-clean; never run on several GPUs, so \"auto\" under a group runs the all-to-all path "
                   "and \"fused\" runs this one"), _NOT),
    Row("MXFP8 quantization (`quantize.mxfp8`; [docs/mxfp8.md](docs/mxfp8.md))",
        "bf16 / fp32 -> e4m3 with one e8m0 scale per 32, plain or in torch's blocked layout (whole or per group)",
        ("quantize.mxfp8.sm90", "quantize.mxfp8.sm100"),
        _v("H100", "bit for bit the reference (`tests/test_mxfp8_kernel.py`), the same source as the sm_100 build's"),
        _COMPILED),
    Row("MXFP8 forward in the layer, pipeline (`mega_moe_grouped.mxfp8.sm100`: `precision=\"mxfp8\"` on backend "
        "\"grouped\" / \"auto\", one rank)", "mxfp8 forward, bf16 backward", ("mega_moe_grouped.mxfp8.sm100",),
        Cell(NOT_WRITTEN, note="torch's MXFP8 grouped GEMM runs on sm_100 only, and `\"mxfp8\"` raises that reason "
                               "before any launch"),
        Cell(CPU_ONLY, note="our kernels around `torch._scaled_grouped_mm` for L1 and L2, the bf16 grouped backward; "
                            "its plumbing checked on the CPU with the GEMM emulated ([docs/mxfp8.md](docs/mxfp8.md))")),
    Row("fused MXFP8 kernel (`mega_moe.mxfp8.sm100`)", "mxfp8", ("mega_moe.mxfp8.sm100",), _NOT, _NOT),
)

_HEADER = ("| kernel (`status()` key) | precision | sm_90 (H100 / H200) | sm_100 (B200 / B300) |\n"
           "| --- | --- | --- | --- |\n")


def markdown_table() -> str:
    """README.md's status table, as it must read there."""
    return _HEADER + "".join(f"| {r.what} | {r.precision} | {r.sm90.markdown()} | {r.sm100.markdown()} |\n"
                             for r in ROWS)


def cell(key: str) -> Cell:
    """The verification of status key ``key`` on its arch family."""
    family = key.rsplit(".", 1)[1]
    for row in ROWS:
        if key in row.keys:
            return row.sm90 if family == "sm90" else row.sm100
    raise KeyError(f"status key {key!r} has no row in prime_kernels._verification.ROWS")


def by_arch(archs) -> dict[str, dict[str, str]]:
    """For each built arch: status key -> how far its kernel was checked on hardware, for the kernels written for
    that arch's family (build_info()["verified"])."""
    out: dict[str, dict[str, str]] = {}
    for arch in archs:
        family = FAMILY_OF_ARCH.get(arch)
        out[arch] = {k: c.text() for r in ROWS for k in r.keys if k.endswith(f".{family}")
                     for c in (r.sm90 if family == "sm90" else r.sm100,) if c.level != NOT_WRITTEN}
    return out


if __name__ == "__main__":  # print the table to paste into README.md
    print(markdown_table(), end="")
