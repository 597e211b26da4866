"""Argument checks of the casts: what :class:`~lightning_fp8.scaling.ScalingState` and its ``quantize`` accept (and the
operands the emulated GEMM, :func:`~lightning_fp8.ops.scaled_mm`, takes).

Each raises before a cast records anything, with a message that names the argument, what was passed and what to do:
a bad value would otherwise fail only at the first cast (IndexError, KeyError) or silently cast something else.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, get_args

import torch

from lightning_fp8.formats import FP8_DTYPES
from lightning_fp8.kernels import reference
from lightning_fp8.recipe import AmaxComputeAlgo, check_flag, check_settings

if TYPE_CHECKING:
    from lightning_fp8.scaling import ScalingState


def check_castable(x: object, caller: str, wide: bool = True) -> None:
    """Raise TypeError unless ``x`` is a dense tensor of a floating dtype a cast reads (float16 to float64; to float32
    without ``wide``, as the Triton kernels): integer, bool and complex values would be cast as numbers they are not,
    an FP8 tensor is cast already, and a sparse or nested tensor has no dense rows for the kernels."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{caller} expects a tensor, got {type(x).__name__}")
    # Traced (torch.compile), a backward may not read the layout, and a traced tensor is dense.
    if not torch.compiler.is_compiling() and (x.is_nested or x.layout != torch.strided):
        if not x.is_nested:
            raise TypeError(f"{caller} takes dense tensors, got a {x.layout} tensor: pass x.to_dense()")
        # A nested tensor has no to_dense() (it raises for both layouts): name what does work.
        raise TypeError(
            f"{caller} takes dense tensors, got a nested tensor: pass its padded values, x.to_padded_tensor(0.0), or "
            "for a jagged one (layout=torch.jagged) its rows without padding, x.values(), and rebuild the result with "
            "torch.nested.nested_tensor_from_jagged(y, x.offsets())"
        )
    if x.dtype in FP8_DTYPES:
        raise TypeError(f"{caller} got an FP8 tensor ({x.dtype}): it is cast already; use it with its scale_inv")
    if not x.is_floating_point() or x.dtype.itemsize < 2 or (not wide and x.dtype == torch.float64):
        accepted = "float16, bfloat16, float32 or float64" if wide else "float16, bfloat16 or float32"
        raise TypeError(f"{caller} casts {accepted} values, got {x.dtype}: convert the tensor first (e.g. x.float())")


def check_cast_arguments(
    x: object, scale: object, fp8_dtype: object, transpose: object, caller: str, wide: bool = True
) -> None:
    """Raise for arguments of a plain cast (``ops.cast_to_fp8`` on the reference path) that the Triton cast refuses
    (kernels/cast.py): without these checks a complex input lost its imaginary part, a scale of shape (n,) scaled each
    column apart, a non-FP8 ``fp8_dtype`` returned that dtype, ``transpose`` of a 1-D tensor returned it as is, and a
    ``transpose`` that is not a bool was read by its truth (``"no"`` transposed). ``wide``: as
    :func:`check_castable`."""
    check_castable(x, caller, wide)
    check_flag(caller, "transpose", transpose)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"{caller}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        got = f"{scale.dtype}, shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{caller}: scale must be a one-element float32 tensor (see compute_scale), got {got}")
    if scale.device != x.device:
        raise ValueError(f"{caller}: scale is on {scale.device} but x is on {x.device}; move the scale to x's")
    if transpose and x.dim() != 2:
        raise ValueError(f"{caller}(transpose=True) needs a 2-D tensor, got shape {tuple(x.shape)}")


def check_state_settings(fp8_dtype: torch.dtype, history_len: int, margin: int, algo: str) -> None:
    """Raise for ScalingState arguments that FP8Recipe's rules (recipe.py: __post_init__) refuse: the casts would
    otherwise fail only at the first cast (IndexError, KeyError) or silently do something else (an unknown algo as
    ``"most_recent"``)."""
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"ScalingState(fp8_dtype={fp8_dtype}) is not supported: choose torch.float8_e4m3fn (E4M3) or "
            "torch.float8_e5m2 (E5M2)"
        )
    algos = get_args(AmaxComputeAlgo)
    check_settings("ScalingState", {"algo": (algo, algos)}, {"history_len": (history_len, 1), "margin": (margin, 0)})


def check_unscale(state: ScalingState, current: bool | None, unscale: object = None) -> None:
    """Raise for ``state.quantize(unscale=...)`` unless the cast computes its own scale and the history has length 1:
    the kernels divide the recorded amaxes (the whole history) by unscale and multiply the stored scale by it, which
    is right only when every cast computes its scale from x itself and the history holds this cast's amax alone. And
    ``unscale`` must be a one-element float32 tensor on the state's device (the reference broadcast a longer one after
    the state was written; the kernels read its first element, or failed on a float64 or a Python number)."""
    if unscale is not None and not (
        isinstance(unscale, torch.Tensor) and unscale.dtype == torch.float32 and unscale.numel() == 1
    ):
        got = f"{unscale.dtype}, shape {tuple(unscale.shape)}" if isinstance(unscale, torch.Tensor) else type(unscale)
        raise TypeError(f"ScalingState.quantize(unscale=...) must be a one-element float32 tensor, got {got}")
    if unscale is not None and unscale.device != state.scale.device:
        raise ValueError(
            f"ScalingState.quantize: unscale is on {unscale.device} but the scaling state on {state.scale.device}: "
            "move unscale to the state's device"
        )
    own_scale = bool(current) if current is not None else not state.delayed
    if not own_scale or state.amax_history.numel() != 1:
        why = (
            f"a history of {state.amax_history.numel()} amaxes (each cast would divide all of them again)"
            if own_scale
            else f"current={current} on a {'delayed' if state.delayed else 'current'}-scaling state (the cast would "
            "apply the scale stored for t to x = t * unscale)"
        )
        raise ValueError(
            f"ScalingState.quantize(unscale=...) needs a cast that computes its own scale from x (current=True, or "
            f"current=None on a current-scaling state) and a history of length 1, as weight states have; got {why}. "
            "Pass x / unscale without unscale instead"
        )


def check_activation(
    x: torch.Tensor,
    activation: str | None,
    activation_input: torch.Tensor | None,
    activation_scale_inv: torch.Tensor | None,
    keep_input: bool,
    column_sum: bool,
) -> torch.Tensor | None:
    """ScalingState.quantize's activation arguments, checked; returns ``activation_input`` detached and contiguous
    (None unless ``activation="gelu_backward"``)."""
    if keep_input and (activation != "gelu" or column_sum):
        raise ValueError(
            f"ScalingState.quantize(keep_input=True) keeps a GELU's input: it needs activation='gelu' and no "
            f"column_sum, got activation={activation!r}, column_sum={column_sum}"
        )
    if activation is None and (activation_input is not None or activation_scale_inv is not None):
        # Without an activation the cast reads x alone: the GELU's input would be dropped without a word.
        raise ValueError(
            "ScalingState.quantize(activation=None) takes no activation_input or activation_scale_inv: they are the "
            "GELU's input of activation='gelu_backward'; pass that activation too, or leave them out"
        )
    if activation not in reference.ACTIVATIONS:
        raise ValueError(
            f"ScalingState.quantize(activation={activation!r}): choose one of {reference.ACTIVATIONS} or None"
        )
    if x.dim() != 2:
        raise ValueError(f"ScalingState.quantize(activation={activation!r}) needs a 2-D tensor, got {tuple(x.shape)}")
    if activation != "gelu_backward":
        if activation_input is not None or activation_scale_inv is not None:
            raise ValueError(
                f"ScalingState.quantize(activation={activation!r}) takes no activation_input or activation_scale_inv"
            )
        return None
    if activation_input is None or activation_input.shape != x.shape or activation_input.device != x.device:
        got = None if activation_input is None else (tuple(activation_input.shape), str(activation_input.device))
        raise ValueError(
            f"ScalingState.quantize(activation='gelu_backward') needs activation_input, the GELU's input, of the "
            f"gradient's shape {tuple(x.shape)} on {x.device}; got {got}"
        )
    fp8_input = activation_input.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if activation_input.dtype not in (torch.float32, torch.bfloat16, torch.float16) and not fp8_input:
        raise TypeError(
            "ScalingState.quantize(activation='gelu_backward'): activation_input must be float32, bfloat16, float16 "
            f"or FP8 (the kernels read those), got {activation_input.dtype}: pass it as float32"
        )
    if fp8_input != (activation_scale_inv is not None):
        raise ValueError(
            "ScalingState.quantize: an FP8 activation_input needs its activation_scale_inv (and only an FP8 one takes "
            f"it); got activation_input {activation_input.dtype}, activation_scale_inv {activation_scale_inv}"
        )
    s = activation_scale_inv
    if fp8_input and (s.dtype != torch.float32 or s.numel() != 1 or s.device != x.device):
        raise ValueError(
            f"ScalingState.quantize: activation_scale_inv must be a one-element float32 tensor on {x.device}, got "
            f"{s.dtype} of shape {tuple(s.shape)} on {s.device}"
        )
    return activation_input.detach().contiguous()


def check_gemm_operands(a_fp8: torch.Tensor, b_fp8: torch.Tensor) -> None:
    """Raise ValueError for FP8 GEMM operands that ``torch._scaled_mm`` refuses: the emulation (a CPU, an older GPU)
    would multiply them all the same, and the script would first fail on a GPU with FP8 tensor cores."""
    if a_fp8.dim() != 2 or b_fp8.dim() != 2 or a_fp8.shape[1] != b_fp8.shape[0]:
        raise ValueError(
            f"scaled_mm multiplies a 2-D a_fp8 (M, K) by a 2-D b_fp8 (K, N), got shapes {tuple(a_fp8.shape)} and "
            f"{tuple(b_fp8.shape)}: flatten the leading dimensions of a_fp8 (a_fp8.reshape(-1, K))"
        )
    # A dimension of size 1 has no meaningful stride: any layout of it is both row- and column-major.
    if a_fp8.stride(1) != 1 and a_fp8.shape[1] > 1:
        raise ValueError(
            f"scaled_mm needs a row-major a_fp8, got strides {a_fp8.stride()} for shape {tuple(a_fp8.shape)}: pass "
            "a_fp8.contiguous()"
        )
    if b_fp8.stride(0) != 1 and b_fp8.shape[0] > 1:
        raise ValueError(
            f"scaled_mm needs a column-major b_fp8, got strides {b_fp8.stride()} for shape {tuple(b_fp8.shape)}: pass "
            "the transpose of a row-major tensor (w_fp8.t() for a row-major w_fp8 of shape (N, K))"
        )
    if a_fp8.dtype == b_fp8.dtype == torch.float8_e5m2:
        raise ValueError(
            "scaled_mm cannot multiply two torch.float8_e5m2 operands (FP8 tensor cores take E4M3 x E4M3, E4M3 x E5M2 "
            "or E5M2 x E4M3): cast one of them to torch.float8_e4m3fn"
        )


def check_recast_activation(
    x_fp8: object, x_scale_inv: object, scale: object, fp8_dtype: object, activation: object
) -> None:
    """Raise for arguments of :func:`~lightning_fp8.ops.recast_activation_transposed` that its two paths would treat
    apart: the Triton kernel cast ``x`` itself for an activation it does not know and read a high-precision ``x``
    without its ``x_scale_inv``, where the reference raised an AttributeError or multiplied by it."""
    caller = "recast_activation_transposed"
    if activation != "gelu":  # "gelu_backward" needs the gradient as well: ScalingState.quantize casts it
        raise ValueError(f"{caller}(activation={activation!r}): only 'gelu' is recomputed from an FP8 input")
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype not in FP8_DTYPES:
        got = x_fp8.dtype if isinstance(x_fp8, torch.Tensor) else type(x_fp8).__name__
        raise TypeError(
            f"{caller}: x_fp8 must be an FP8 tensor (the kept GELU input), got {got}: cast a high-precision input with "
            "ScalingState.quantize(..., activation='gelu') instead"
        )
    if x_fp8.dim() != 2:
        raise ValueError(f"{caller} needs a 2-D x_fp8, got shape {tuple(x_fp8.shape)}")
    for name, value in (("x_scale_inv", x_scale_inv), ("scale", scale)):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.numel() != 1:
            got = f"{value.dtype}, shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value)
            raise TypeError(f"{caller}: {name} must be a one-element float32 tensor, got {got}")
        if value.device != x_fp8.device:
            raise ValueError(f"{caller}: {name} is on {value.device} but x_fp8 on {x_fp8.device}; move it to x_fp8's")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"{caller}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")


def checked_prev_scale(prev_scale: object) -> object:
    """``compute_scale``'s ``prev_scale`` (not None) as it is, or as a tensor where it is an array or a sequence.

    Raises:
        ValueError: for a number (a Python or NumPy bool too) that is no positive power of two in 2**-126 .. 2**127:
            a number is checked here, a tensor's values are not read (no device sync); it is returned as the scale.
        TypeError: for what holds no real scales: torch.as_tensor took a bool tensor as 1.0 and a complex one as its
            real part, silently, and a string failed inside torch.
    """
    if type(prev_scale).__name__ in ("bool", "bool_") or (  # a Python or NumPy bool (NumPy's is no Real)
        isinstance(prev_scale, numbers.Real) and not (0 < prev_scale < math.inf and math.frexp(prev_scale)[0] == 0.5)
    ):
        raise ValueError(f"compute_scale(prev_scale={prev_scale!r}): must be a positive power of two, or a tensor")
    if isinstance(prev_scale, numbers.Real) and not 2.0**-126 <= prev_scale <= 2.0**127:  # fp32: 0, subnormal, inf
        raise ValueError(
            f"compute_scale(prev_scale={prev_scale!r}): a scale must lie in 2**-126 .. 2**127 (fp32's normal powers of "
            "two, the range of the scales compute_scale gives)"
        )
    if isinstance(prev_scale, numbers.Real):
        return prev_scale
    kind = type(prev_scale).__name__
    if not isinstance(prev_scale, (torch.Tensor, str)):
        try:  # a NumPy array or a list of numbers is a tensor of scales, as torch.as_tensor reads it
            prev_scale = torch.as_tensor(prev_scale)
        except (TypeError, ValueError, RuntimeError):
            pass
    if not isinstance(prev_scale, torch.Tensor) or prev_scale.dtype == torch.bool or prev_scale.is_complex():
        kind = f"a {prev_scale.dtype} tensor" if isinstance(prev_scale, torch.Tensor) else kind
        raise TypeError(
            f"compute_scale(prev_scale=...) takes a real (floating-point) tensor of scales, a positive power of two or "
            f"None, got {kind}"
        )
    return prev_scale
