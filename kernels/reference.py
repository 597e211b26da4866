"""Pure-PyTorch references of the Triton kernels, one function per kernel with the same signature.

They define the numerics: a Triton kernel must match its reference bit for bit (casts, optimizer
states) on any valid input. They also run everything on devices without Triton (CPU in CI).

The scale convention (DESIGN.md): ``x_fp8 = saturate(x * scale)``, ``x ~= x_fp8.float() * scale_inv``.
"""

from __future__ import annotations

import math
import struct
import sys
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.utils._python_dispatch import _disable_current_modes

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def amax_ref(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a 0-dim fp32 tensor; NaN counts as ``inf`` so a non-finite tensor has a non-finite amax.

    An empty tensor has amax 0.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.detach().float().abs()
    return torch.where(torch.isnan(a), torch.inf, a).amax()


def cast_to_fp8_ref(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating scaled cast to FP8, with an optional transposed copy, the amax and a saturation count.

    ``y = x.float() * scale``; ``y`` of a finite ``x`` is clamped to ``[-fp8_max, fp8_max]`` (also where a float64
    ``x`` beyond fp32's range made it inf) and rounded to nearest even; a non-finite ``x`` becomes NaN (so overflow is
    never hidden by the clamp).

    Args:
        x: a floating-point tensor (any shape; 2-D when ``transpose``).
        scale: 0-dim fp32 tensor, a power of two.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: also return ``x_fp8.t().contiguous()`` (the copy the backward GEMMs need).

    Returns:
        ``(x_fp8, x_fp8_t, amax, n_saturated)``: ``x_fp8`` has ``x``'s shape; ``x_fp8_t`` is the
        transposed copy or an empty tensor; ``amax`` is :func:`amax_ref` of ``x`` (unscaled); ``n_saturated``
        is a 0-dim int64 count of finite elements with ``|x * scale| >= fp8_max``.
    """
    fp8_max = torch.finfo(fp8_dtype).max  # not _FP8_MAX[...]: dynamo failed on that lookup in dynamic-shape backwards
    x32 = x.detach().float()
    # 0-dim: a one-element scale of more dimensions than x (the Triton cast takes any) broadcast x_fp8 to its rank.
    y = x32 * scale.detach().reshape(())  # (a scale requiring grad: plain outputs, as the Triton cast's)
    finite = torch.isfinite(x.detach())  # of x itself: a finite float64 past fp32's range saturates
    n_saturated = ((y.abs() >= fp8_max) & finite).sum()
    y = torch.where(finite, y.clamp(-fp8_max, fp8_max), torch.nan)
    x_fp8 = y.to(fp8_dtype)
    if transpose:
        # A copy always: for one row or column (or none) ``.t().contiguous()`` is a view of x_fp8, and the cast ops
        # that torch.compile sees (lightning_fp8/compiled_casts.py: quantize_op) must not return outputs that alias.
        x_fp8_t = x_fp8.t().clone(memory_format=torch.contiguous_format)
    else:
        x_fp8_t = torch.empty(0, dtype=fp8_dtype, device=x.device)
    return x_fp8, x_fp8_t, amax_ref(x), n_saturated


# Activations a cast can apply to what it reads (``quantize_ref(activation=...)``): a GELU's output cast straight to FP8
# by the kernel that reads the GELU's input (the GELU's own output never written), and in the backward the GELU's input
# gradient, ``grad * gelu'(h)``, cast as it is computed. fp32 math, the exact (erf) GELU, as torch computes it in fp32.
ACTIVATIONS = ("gelu", "gelu_backward")
_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_GELU_PDF = 0.3989422804014327  # 1 / sqrt(2 pi)


def gelu_ref(h: torch.Tensor) -> torch.Tensor:
    """``0.5 * h * (1 + erf(h / sqrt(2)))`` in fp32: torch's exact GELU formula (``torch.nn.functional.gelu``'s own
    kernel rounds differently by up to an ulp)."""
    h = h.detach().float()
    return 0.5 * h * (1.0 + torch.erf(h * _SQRT1_2))


def gelu_backward_ref(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``grad * gelu'(h)`` in fp32, ``gelu'(h) = Phi(h) + h * phi(h)`` (the formula of torch's fp32 GELU backward,
    which rounds differently by up to an ulp and flushes what this keeps below about 1e-44)."""
    h = h.detach().float()
    cdf = 0.5 * (1.0 + torch.erf(h * _SQRT1_2))
    pdf = torch.exp(-0.5 * h * h) * _GELU_PDF
    return grad.detach().float() * (cdf + h * pdf)


def activation_ref(
    x: torch.Tensor,
    activation: str | None,
    activation_input: torch.Tensor | None,
    activation_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a cast with ``activation`` casts: ``x`` itself (None), ``gelu_ref(x)`` ("gelu"), or
    ``gelu_backward_ref(x, activation_input)`` ("gelu_backward": ``x`` is the gradient of the GELU's output,
    ``activation_input`` the GELU's input, of ``x``'s shape; an FP8 one stands for its values times
    ``activation_scale_inv``, :func:`dequantize_ref`)."""
    if activation is None:
        return x
    if activation == "gelu":
        return gelu_ref(x)
    if activation_input.dtype in _FP8_MAX:
        activation_input = dequantize_ref(activation_input, activation_scale_inv)
    return gelu_backward_ref(x, activation_input)


def dequantize_ref(x_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The fp32 values an FP8 tensor stands for, ``x_fp8.float() * scale_inv`` (exact: ``scale_inv`` is a power of
    two, 0-dim fp32)."""
    return x_fp8.float() * scale_inv


# A "gelu" cast's input kept in FP8 as well (``quantize_ref(keep_input=True)``, FP8MLP(fp8_hidden=True)): its scale is
# the cast's divided by 2**PRE_ACTIVATION_HEADROOM, and at most PRE_ACTIVATION_MAX_SCALE. The GELU output's scale fits
# the positive inputs (gelu(h) ~ h there); the headroom keeps negative inputs down to -16 times the amax behind that
# scale unsaturated, at the cost of the smallest inputs' precision (subnormal below at most amax / 900: a rounding
# error of at most amax / 14000). The cap keeps inputs down to -14 (E4M3's 448 / 32) unsaturated whatever that amax:
# where every input is strongly negative the GELU output's amax is tiny, and -16 times it alone would saturate inputs
# whose gelu' is about 0 to a point where it is not (gradients off by orders of magnitude); below -14 gelu and gelu'
# are 0 in fp32. The cap bounds the precision too: the kept values are multiples of E4M3's smallest step at that scale,
# 2**-14, so the bounds above hold where the GELU output's amax is about 1 or more; inputs under 2**-15 in magnitude
# are kept as 0 whatever the amax (a model whose pre-activations are all that small loses its GELU gradients).
PRE_ACTIVATION_HEADROOM = 4
PRE_ACTIVATION_MAX_SCALE = 2.0**5


def kept_input_scale_inv(scale_inv: torch.Tensor) -> torch.Tensor:
    """The scale_inv of a "gelu" cast's kept input (``quantize_ref(keep_input=True)``) from the cast's ``scale_inv``:
    ``1 / min(scale * 2**-PRE_ACTIVATION_HEADROOM, PRE_ACTIVATION_MAX_SCALE)``, a power of two."""
    return torch.clamp(scale_inv * 2.0**PRE_ACTIVATION_HEADROOM, min=1.0 / PRE_ACTIVATION_MAX_SCALE)


def recast_activation_ref(
    x_fp8: torch.Tensor, x_scale_inv: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, activation: str
) -> torch.Tensor:
    """The transposed FP8 copy of ``activation`` ("gelu") of the values FP8 ``x_fp8`` stands for, cast with ``scale``,
    statistics dropped: FP8MLP's backward recomputing its GELU output's copy from the FP8 GELU input it kept."""
    return cast_to_fp8_ref(activation_ref(dequantize_ref(x_fp8, x_scale_inv), activation, None), scale, fp8_dtype,
                           transpose=True)[1]  # fmt: skip


def float32_exponent_mantissa(value: float) -> tuple[int, int]:
    """Biased exponent and mantissa fields of ``value`` rounded to fp32 (pure Python: no tensor, no graph break)."""
    (bits,) = struct.unpack("<i", struct.pack("<f", value))
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def pow2_scale_ref(amax: torch.Tensor, fmax: float, margin: int, prev: torch.Tensor) -> torch.Tensor:
    """``2 ** (floor(log2(fmax / amax)) - margin)`` from the fp32 bit patterns; ``prev`` where amax is 0 or non-finite.

    The same function as ``lightning_fp8.scale_rule.compute_scale`` (kernels import no core module), for any format max.
    """
    max_exp, max_mant = float32_exponent_mantissa(fmax)
    a = amax.float()
    bits = a.view(torch.int32)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # An fp32 subnormal (exponent field 0) is mant * 2**-149: mant as an fp32 (exact below 2**24) has its normalized
    # exponent (biased, plus 149) and mantissa. Without it every subnormal read as 2**-127 (a scale 2x or more too
    # small once the margin brings it under the clamp).
    sub = mant.float().view(torch.int32)
    normal = exp != 0
    exp = torch.where(normal, exp, ((sub >> 23) & 0xFF) - 149)
    mant = torch.where(normal, mant, sub & 0x7FFFFF)
    k = (max_exp - exp) - (mant > max_mant).to(torch.int32) - margin
    scale = ((k.clamp(-126, 127) + 127) << 23).view(torch.float32)
    return torch.where(torch.isfinite(a) & (a > 0), scale, prev)


# ---------------------------------------------------------------------------------------------------------------------
# Scale bookkeeping of one scaling state (kernels/scaling.py, run inside the fused casts of kernels/cast.py).
# ---------------------------------------------------------------------------------------------------------------------


def state_writes(buffer: torch.Tensor) -> AbstractContextManager:
    """The context of a scaling state's in-place bookkeeping (``buffer``: one of its buffers).

    Eagerly, out of sight of the dispatch modes that are on: selective activation checkpointing's mode
    (``create_selective_checkpoint_contexts``) caches what a policy saves, and a saved ``copy_`` or ``add_`` of a
    buffer that the next cast writes again failed the backward ("Tensor cached during selective activation checkpoint
    has been mutated"); a recompute writes the buffers again, out of sight too (``lightning_fp8.recompute`` restores
    them). Traced (torch.compile, make_fx, a FakeTensorMode: :func:`traced`) the writes stay in the trace, which must
    record them.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() == 0 or traced(buffer):
        return nullcontext()
    return _disable_current_modes()


def traced(t: torch.Tensor) -> bool:
    """Whether ``t``'s value cannot be read: a FakeTensor, or a fake, proxy or functional mode on (torch.compile's and
    make_fx's tracing runs the eager code under them; a result of ``t`` would be fake)."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is not None and isinstance(t, fake.FakeTensor):
        return True
    if torch._C._len_torch_dispatch_stack() == 0:  # counts the fake, proxy and functional modes too: none is on
        return False
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (keys.FAKE, keys.PROXY, keys.FUNCTIONAL))


def current_scale_ref(amax: torch.Tensor, scale: torch.Tensor, fmax: float, margin: int) -> None:
    """In place: ``scale <- pow2_scale(amax)`` (current scaling), keeping ``scale`` where amax is 0 or non-finite."""
    with state_writes(scale):
        scale.copy_(pow2_scale_ref(amax, fmax, margin, scale))


def record_cast_ref(
    amax: torch.Tensor,
    n_saturated: torch.Tensor,
    numel: int,
    used_scale: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    fmax: float,
    margin: int,
    algo_max: bool,
    delayed: bool,
) -> torch.Tensor:
    """Record one cast's statistics and, for delayed scaling, the scale of the next cast.

    In place: ``last_amax <- amax``, ``saturation <- n_saturated / numel``, ``nonfinite_count += amax is inf``,
    ``casts += 1``; ``amax_history`` rolls by one with ``amax`` (0 if non-finite: no information) in front; with
    ``delayed``, ``scale <- pow2_scale(max(history) if algo_max else history[0])`` where ``amax`` is finite and > 0.
    A cast whose amax is 0 or non-finite keeps the previous scale (DESIGN.md); its window still rolls, so that the
    histories of several ranks stay aligned for the amax sync's element-wise MAX.

    ``used_scale`` is the scale the cast used: a copy of ``scale``, never ``scale`` itself, because under
    ``torch.compile`` the backward may recompute the FP8 copy from it after ``scale`` was updated here.

    Returns:
        ``1 / used_scale``, 0-dim fp32.
    """
    scale_inv = used_scale.reciprocal()
    with state_writes(casts):
        finite = torch.isfinite(amax)
        nonfinite_count.add_((~finite).to(nonfinite_count.dtype))
        casts.add_(1)
        last_amax.copy_(amax)
        saturation.copy_(n_saturated.float() / max(numel, 1))
        informative = finite & (amax > 0)
        amax_history.copy_(torch.roll(amax_history, 1))
        amax_history[0] = torch.where(finite, amax, 0.0)
        if delayed:
            ref = amax_history.amax() if algo_max else amax_history[0]
            scale.copy_(torch.where(informative, pow2_scale_ref(ref, fmax, margin, scale), scale))
    return scale_inv


def quantize_ref(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    algo_max: bool,
    delayed: bool,
    current: bool,
    transpose: bool,
    unscale: torch.Tensor | None = None,
    column_sum: bool = False,
    activation: str | None = None,
    activation_input: torch.Tensor | None = None,
    activation_scale_inv: torch.Tensor | None = None,
    keep_input: bool = False,
) -> tuple[torch.Tensor, ...]:
    """One cast of a scaling state: the composition of the kernels above (kernels/cast.py fuses it).

    With ``current``, ``scale <- pow2_scale(amax(x))`` first; then the cast with ``scale`` and
    :func:`record_cast_ref` of its amax and saturation count (which, with ``delayed``, writes the next scale).
    ``unscale`` (0-dim, a power of two): ``x`` holds ``t * unscale`` (FP8AdamW's scaled master in the weight's
    storage); the state then describes ``t``: amaxes divided, scale multiplied and ``scale_inv`` divided by it.

    ``column_sum`` (2-D ``x``): also return :func:`column_sum_ref` of ``x`` (the bias gradient, when ``x`` is a
    linear layer's output gradient), which the fused cast computes from the values it reads anyway.

    ``activation`` (2-D ``x``): everything above applies to :func:`activation_ref` of ``x`` instead of ``x`` (the
    cast, its statistics, the column sums), computed in fp32 and never rounded to ``x``'s dtype; an FP8
    ``activation_input`` stands for its values times ``activation_scale_inv``. ``keep_input`` ("gelu" only): also
    cast ``x`` itself, with the cast's scale divided by ``2**PRE_ACTIVATION_HEADROOM``, statistics dropped.

    Returns:
        ``(x_fp8, x_fp8_t, scale_inv)``: ``scale_inv`` is ``1 / scale`` of this cast; ``x_fp8_t`` is empty unless
        ``transpose``. With ``column_sum``, ``(x_fp8, x_fp8_t, scale_inv, column sums)``; with ``keep_input``,
        ``(x_fp8, x_fp8_t, scale_inv, input_fp8)``, ``input_fp8``'s scale_inv being ``scale_inv`` times
        ``2**PRE_ACTIVATION_HEADROOM``.
    """
    fmax = torch.finfo(fp8_dtype).max  # see cast_to_fp8_ref
    pre = x
    x = activation_ref(x, activation, activation_input, activation_scale_inv)
    if current:
        a = amax_ref(x)  # read once: the scale's and, with an unscale, the no-information test's
        current_scale_ref(a, scale, fmax, margin)
    used_scale = scale.clone()
    if current and unscale is not None:
        # x holds t * unscale and the stored scale is t's: where x's amax carries no information (0, inf, NaN) the
        # kept scale casts x as scale / unscale, the cast of t with it (with scale itself, x's finite values saturated).
        used_scale = torch.where((a > 0) & (a < math.inf), used_scale, used_scale / unscale.reshape(()))
    x_fp8, x_fp8_t, amax, n_saturated = cast_to_fp8_ref(x, used_scale, fp8_dtype, transpose)
    if keep_input:
        kept_scale = torch.clamp(used_scale * 2.0**-PRE_ACTIVATION_HEADROOM, max=PRE_ACTIVATION_MAX_SCALE)
        pre_fp8 = cast_to_fp8_ref(pre, kept_scale, fp8_dtype)[0]
    scale_inv = record_cast_ref(
        amax, n_saturated, x.numel(), used_scale, amax_history, scale, last_amax, saturation, nonfinite_count, casts,
        fmax, margin, algo_max, delayed,
    )  # fmt: skip
    if unscale is not None:
        # 0-dim, as the kernels read it: a (1,) unscale failed the in-place divisions below once the state was written.
        unscale = unscale.reshape(())
        scale_inv = scale_inv / unscale
        with state_writes(scale):
            last_amax.div_(unscale)
            amax_history.div_(unscale)
            # An amax of 0 or inf kept the stored scale, which describes t already (multiplied again, an all-zero
            # weight's scale grew by 1 / unscale at every cast, to inf).
            scale.copy_(torch.where((amax > 0) & (amax < math.inf), scale * unscale, scale))
    if column_sum:
        return x_fp8, x_fp8_t, scale_inv, column_sum_ref(x)
    if keep_input:
        return x_fp8, x_fp8_t, scale_inv, pre_fp8
    return x_fp8, x_fp8_t, scale_inv


# The summation order of column_sum_ref. The fused cast (kernels/cast.py) sums in the same order when its transposed
# tiles have COLUMN_SUM_BLOCK_ROWS rows (CONFIGS["transpose"]["BLOCK_M"]), its row groups COLUMN_SUM_GROUP tiles
# (["GROUP_M"]) and its in-tile sums run in row order (the Triton interpreter's do; a GPU's reduction tree differs,
# so there the sums agree to fp32 rounding, deterministically).
COLUMN_SUM_BLOCK_ROWS = 64
COLUMN_SUM_GROUP = 8


def column_sum_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 sums of the columns of 2-D ``x``, in a fixed order (deterministic; no atomics in the kernel).

    Rows are taken in groups of ``COLUMN_SUM_GROUP`` blocks of ``COLUMN_SUM_BLOCK_ROWS`` rows (the last group padded
    with zeros). Within a group, row ``r`` of each block is added to an accumulator of zeros, block after block; the
    accumulator's rows are then added in order; the groups' partial sums are added by ``torch.sum`` over the groups.
    """
    if x.dim() != 2:
        raise ValueError(f"column_sum_ref needs a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    rows, group = COLUMN_SUM_BLOCK_ROWS, COLUMN_SUM_GROUP
    groups = -(-m // (rows * group))
    x32 = torch.zeros(groups * group * rows, n, dtype=torch.float32, device=x.device)
    x32[:m] = x.detach().float()
    b = x32.view(groups, group, rows, n)
    acc = torch.zeros(groups, rows, n, dtype=torch.float32, device=x.device)
    for k in range(group):
        acc = acc + b[:, k]
    partial = acc[:, 0]
    for i in range(1, rows):
        partial = partial + acc[:, i]
    return partial.sum(0)
