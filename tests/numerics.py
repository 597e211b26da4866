"""Numerics helpers for tests: SQNR and the named tolerances, each with its reason (STYLE.md habit 7)."""

import math

import torch


def assert_same(a, b) -> None:
    """Bit for bit: tensors (dtype and bytes), and dicts, lists and values of them."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def same(a, b) -> bool:
    """:func:`assert_same` as a truth value (for a record that a test asserts later)."""
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def sqnr(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||ref|| / ||actual - ref||)."""
    ref = reference.detach().double()
    err = (actual.detach().double() - ref).norm()
    if err == 0:
        return float("inf")
    return (20 * torch.log10(ref.norm() / err)).item()


# One E4M3 rounding has relative error <= 2**-4 (3 mantissa bits), about 30 dB of SQNR on Gaussian data; the forward
# GEMM multiplies two such quantized operands, so its output SQNR is ~27-29 dB. 25 dB leaves margin for the
# accumulation over K and odd shapes.
FORWARD_SQNR_DB = 25.0
# Gradients use E5M2 for grad_output (2 mantissa bits, relative error <= 2**-3, ~24 dB per rounding), combined with an
# E4M3 operand: ~22-24 dB observed. 20 dB bounds it with margin.
BACKWARD_SQNR_DB = 20.0
# All-E4M3 recipe: gradients get 3 mantissa bits too, so backward SQNR rises to the forward level.
BACKWARD_E4M3_SQNR_DB = 25.0


def pow2_scale(amax: float, fmax: float) -> float:
    """The largest power of two ``2**k`` with ``amax * 2**k <= fmax`` (DESIGN.md's scale at margin 0), found in
    float64 by stepping from a rounded ``log2``, not with the library's bit-pattern rule."""
    k = math.floor(math.log2(fmax / amax))
    while amax * 2.0 ** (k + 1) <= fmax:
        k += 1
    while amax * 2.0**k > fmax:
        k -= 1
    return 2.0**k
