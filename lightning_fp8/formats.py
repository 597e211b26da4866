"""FP8 formats: the two 8-bit float types FP8-LM uses and their ranges.

E4M3 (``torch.float8_e4m3fn``, max 448) has more precision and is used for activations and weights;
E5M2 (``torch.float8_e5m2``, max 57344) has more range and is used for gradients.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

FP8_DTYPES = (E4M3, E5M2)

# Largest finite value of each format. E4M3FN has no infinity: 448 = 1.75 * 2**8.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value representable in ``dtype`` (an FP8 dtype).

    Raises:
        ValueError: if ``dtype`` is not one of the two FP8 dtypes.
    """
    check_fp8_dtype(dtype)
    return FP8_MAX[dtype]


def check_fp8_dtype(dtype: torch.dtype) -> None:
    # Not `dtype not in FP8_MAX` alone: an unhashable value (a list) made that lookup a TypeError of its own.
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_MAX:
        raise ValueError(f"expected an FP8 dtype (torch.float8_e4m3fn or torch.float8_e5m2), got {dtype!r}")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_MAX
