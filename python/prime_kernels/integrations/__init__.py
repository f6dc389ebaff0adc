"""Drop-in integrations of :mod:`prime_kernels.mega` into existing model code.

* :mod:`prime_kernels.integrations.transformers`: an experts implementation named ``"prime_mega_moe"``
  registered in transformers' (5.x) experts interface, and ``apply(model)`` which switches every
  experts module of a model to it and returns the names of the modules it switched.
* :mod:`prime_kernels.integrations.torchtitan`: ``apply(model)`` which replaces the routed experts of
  every TorchTitan ``MoE`` layer by :class:`~prime_kernels.integrations.torchtitan.MegaMoERoutedExperts`
  (w1/w3 fused once into w13; checkpoints keep TorchTitan's ``w1_EFD``/``w2_EDF``/``w3_EFD`` keys).

The submodules import their framework lazily (importing this package needs neither).

Backend choice: every entry point takes ``backend=`` (one of ``prime_kernels.mega.constants.BACKENDS``,
"auto" by default) and passes it to :func:`prime_kernels.mega.mega_moe` unchanged, so the integrations
follow :mod:`prime_kernels.mega._backend`: under "auto" the fused kernels as soon as
``prime_kernels.status()`` reports them, else the grouped-GEMM pipeline where it runs (CUDA, bf16, one
rank), else the reference only where ``PRIME_KERNELS_ALLOW_REFERENCE_FALLBACK=1`` allows it.

Precision: the transformers integration's ``apply`` also takes ``precision=`` (``_common.PRECISIONS``: "bf16",
"fp8", "fp8_bwd"), passed to every layer call the same way.
"""

from ._common import UnsupportedLayerError

__all__ = ["UnsupportedLayerError"]
