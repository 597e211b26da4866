"""Kernels of lightning_fp8, installed as ``lightning_fp8.kernels``.

Each Triton kernel module (``cast``, ``adamw``, ...) has a pure-PyTorch reference of the same signature in
:mod:`lightning_fp8.kernels.reference`. Nothing here chooses between them: the core does that at one
dispatch point, :mod:`lightning_fp8.ops`. Triton modules are imported lazily, so this package imports
without Triton.
"""
