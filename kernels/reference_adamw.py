"""Pure-PyTorch reference of the precision-decoupled AdamW step (kernels/adamw.py), and of the FP8 weight copy it
can emit: the numerics the Triton kernel matches bit for bit (see :mod:`lightning_fp8.kernels.reference` for the
casts).
"""

from __future__ import annotations

import struct

import torch
from lightning_fp8.kernels.reference import _FP8_MAX, amax_ref, cast_to_fp8_ref, pow2_scale_ref

# ---------------------------------------------------------------------------------------------------------------------
# AdamW step of the precision-decoupled optimizer (kernels/adamw.py). Numerics, per element, in fp32, one rounding per
# operation (no fused multiply-add), in this order:
#
#     g = grad * grad_scale_inv                    grad_scale_inv = (FP8 grad's scale_inv or 1) * grad_unscale (1/mu)
#     g = clamp(g, +-GRAD_SATURATION)              where v is stored scaled and g is finite (saturate_grad_ref)
#     m = m_stored * ((1 / m_scale) * beta1) + g * (1 - beta1)
#     v = v_stored * ((1 / v_scale) * beta2) + (g * g) * (1 - beta2)
#     w = w_stored * ((1 / w_scale) * (1 - lr * wd)) - (m / (sqrt(v) + eps_hat)) * step_size_hat
#     state = RNE(saturate(x * new_scale))         new_scale = pow2_scale(a), a = the fresh amax (two_pass) or an upper
#                                                  bound of it known before the update (one pass; see adamw_bound_ref)
#     copy = RNE(state_p / new_p_scale)             a high-precision copy of the weight (if any): the stored master
#
# The per-tensor factors in parentheses are fp32 (1 / scale is exact: scales are powers of two); fp32/bf16 states are
# unscaled (factor beta1, beta2, 1 - lr * wd). Bias correction is folded into two per-step constants, Adam's efficient
# form (Kingma & Ba 2015, end of section 2): step_size_hat = lr * sqrt(1 - beta2**t) / (1 - beta1**t) and
# eps_hat = eps * sqrt(1 - beta2**t), the same update as torch.optim.AdamW's
# lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps) up to rounding.
# ---------------------------------------------------------------------------------------------------------------------

# Storage formats that carry a per-tensor scale, with their largest finite value.
SCALED_STATE_MAX = {torch.float16: 65504.0, **_FP8_MAX}
# The one-pass bounds start from amaxes of values before their last rounding (to the storage format, or to the FP8
# gradient): a stored value exceeds its amax by at most 2**-3 relative (E5M2), covered with margin by this factor.
BOUND_SLACK = 1.25
# Where the second moment is stored scaled, a finite gradient saturates at +-2**63 (its square, 2**126, and the
# moment stay finite in fp32); see saturate_grad_ref.
GRAD_SATURATION = 2.0**63


class AdamWConstants:
    """The step's scalars, each rounded once to fp32 so that the kernel and the reference use identical values.

    ``step_size`` and ``eps`` are Adam's bias-corrected ``step_size_hat`` and ``eps_hat`` (see above).
    """

    def __init__(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
        def f32(x: float) -> float:
            return struct.unpack("<f", struct.pack("<f", x))[0]

        self.beta1, self.one_minus_beta1 = f32(beta1), f32(1.0 - beta1)
        self.beta2, self.one_minus_beta2 = f32(beta2), f32(1.0 - beta2)
        self.decay = f32(1.0 - lr * weight_decay)
        bc2_sqrt = (1.0 - beta2**step) ** 0.5
        self.eps = f32(eps * bc2_sqrt)
        self.step_size = f32(lr * bc2_sqrt / (1.0 - beta1**step))
        # |m| <= K sqrt(v) for Adam's moments (Cauchy-Schwarz over the exponential sums) when beta1**2 < beta2, so
        # |update| <= K * step_size; the factor 2 absorbs the moments' storage rounding. None: no bound.
        k = (1.0 - beta1) / ((1.0 - beta2) * (1.0 - beta1**2 / beta2)) ** 0.5 if beta1**2 < beta2 else None
        self.max_update = f32(2.0 * k * self.step_size) if k is not None else None


def adamw_bound_ref(j: int, amax: torch.Tensor, grad_amax: torch.Tensor, c: AdamWConstants) -> torch.Tensor:
    """Upper bound of the new ``max|x|`` of state ``j`` (0 master, 1 exp_avg, 2 exp_avg_sq), known before the update.

    From the stored amax of the state and ``grad_amax``, an amax of ``grad * grad_scale_inv`` (in fp32, in this order):
    exp_avg ``<= A*S*b1 + G*(1-b1)``, exp_avg_sq ``<= A*S*b2 + G*G*(1-b2)``, master ``<= A*S*|decay| + max_update``,
    with ``S = BOUND_SLACK`` and ``G = grad_amax * S`` (``decay = 1 - lr * weight_decay`` is negative where
    ``lr * weight_decay > 1``: the decayed weight changes sign, its magnitude is ``|decay|`` times the old one).
    """
    a = amax.float() * BOUND_SLACK
    if j == 0:
        return a * abs(c.decay) + c.max_update
    if j == 1:
        return a * c.beta1 + grad_amax * c.one_minus_beta1
    # As the moments take it (saturate_grad_ref): a finite amax saturates; inf stays inf (keeps the previous scale)
    ga = torch.where(grad_amax < float("inf"), grad_amax.clamp(max=GRAD_SATURATION), grad_amax)  # NaN stays NaN
    return a * c.beta2 + (ga * ga) * c.one_minus_beta2


def saturate_grad_ref(g: torch.Tensor) -> torch.Tensor:
    """A finite ``g`` clamped to ``+-GRAD_SATURATION``; ``inf`` and NaN unchanged.

    For a second moment stored scaled: ``g * g`` of a finite ``|g| > ~1.8e19`` overflows fp32, and the scaled store
    keeps the ``inf`` moment as NaN (the mark of a non-finite gradient), which the next step spreads into the weight.
    Saturated before both moments take it, the step stays Adam's (``|m| <= K sqrt(v)``: the update is bounded) and
    only a non-finite gradient makes the states NaN."""
    return torch.where(torch.isfinite(g), g.clamp(-GRAD_SATURATION, GRAD_SATURATION), g)


def _is_scaled(t: torch.Tensor, scales: object) -> bool:
    return scales is not None and t.dtype in SCALED_STATE_MAX


def _store_scaled_ref(x: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor) -> None:
    # Finite values saturate at the format max; a non-finite value stays NaN so an overflow is never hidden.
    fmax = SCALED_STATE_MAX[dst.dtype]
    y = torch.where(torch.isfinite(x), (x * scale).clamp(-fmax, fmax), torch.nan)
    dst.copy_(y.to(dst.dtype))


def decay_progress_ref(dst: torch.Tensor, x_scaled: torch.Tensor, old: torch.Tensor, beta1: float) -> None:
    """After ``dst`` (FP8 ``exp_avg``, written with the scale it was stored with) took ``x_scaled`` rounded to
    nearest: where that gave back the stored value ``old`` (not 0) though the exact value fell at least half the decay
    toward zero (``|x| <= |old| (1 + beta1) / 2``: the decay, not the gradient, drives it), step one code toward zero.
    Without it a first moment whose gradient vanished stays at a small value for good (RNE(0.9 k) = k for k <= 4 of
    E4M3's smallest steps) while the second moment decays: the update ``m / sqrt(v)`` would grow without end. A value
    the gradient holds (a steady state within rounding) keeps its nearest rounding. A step that changes the scale
    moves every stored value anyway."""
    fmax = SCALED_STATE_MAX[dst.dtype]
    half_decay = (1.0 + torch.tensor(beta1, dtype=torch.float32, device=dst.device)) * 0.5
    bits, old_bits = dst.view(torch.uint8), old.view(torch.uint8)
    q = dst.float()
    held = (bits == old_bits) & (q != 0) & (x_scaled.clamp(-fmax, fmax).abs() <= q.abs() * half_decay)
    bits.copy_(torch.where(held, bits - 1, bits))  # sign and magnitude: one code less is one step toward zero


def adamw_update_ref(g, w, m, v, factors, c: AdamWConstants, scaled_v: bool = False):
    """One AdamW update in the operation order of the kernel; returns the new fp32 ``(w, m, v)``.

    ``g``: the unscaled fp32 gradient; ``w, m, v``: the stored states as fp32; ``factors``: their per-tensor fp32
    factors ``(1 / scale) * (1 - lr * wd, beta1, beta2)`` (0-dim tensors or Python floats); ``scaled_v``: the second
    moment is stored scaled: the moments take the gradient saturated (:func:`saturate_grad_ref`).
    """
    w_mul, m_mul, v_mul = factors
    if scaled_v:
        g = saturate_grad_ref(g)
    m = m * m_mul + g * c.one_minus_beta1
    v = v * v_mul + (g * g) * c.one_minus_beta2
    # torch.sqrt of fp32 on CPU is not always correctly rounded; through fp64 it is (53 >= 2 * 24 + 2 bits).
    denom = torch.sqrt(v.double()).float() + c.eps
    w = w * w_mul - (m / denom) * c.step_size
    return w, m, v


def _scalar(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.reshape(()) if t is not None else None


def _state_factor(t: torch.Tensor, scale: torch.Tensor | None, factor: float) -> torch.Tensor | float:
    # The kernel's fp32 (1 / scale) * factor; 1 / scale is exact for a power of two.
    if scale is None or t.dtype not in SCALED_STATE_MAX:
        return factor
    return (1.0 / scale.float()) * factor


def adamw_step_ref(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scales: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None,
    amaxes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None,
    grad_scale_invs: list[torch.Tensor] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_unscale: float = 1.0,
    two_pass: bool = True,
    grad_amaxes: list[torch.Tensor] | None = None,
    param_copies: list[torch.Tensor] | None = None,
    fp8_weights: list[torch.Tensor] | None = None,
    fp8_weight_stats: list[torch.Tensor] | None = None,
    fp8_margin: int = 0,
) -> None:
    """A multi-tensor AdamW step on (possibly scaled, low-precision) states, in place.

    Args:
        params: master weights (fp32, or fp16 scaled), updated in place.
        grads: gradients (fp32/bf16/fp16, or FP8 with ``grad_scale_invs``), same shapes; read only.
        exp_avgs, exp_avg_sqs: first and second moments (fp32/bf16 unscaled, or fp16/FP8 scaled), in place.
        scales: per tensor the 0-dim fp32 storage scales ``(param, exp_avg, exp_avg_sq)``, replaced by the new
            scales (only entries of scaled formats are used); ``None`` when no state is scaled.
        amaxes: per tensor 0-dim fp32 ``max|x|`` of the new ``(param, exp_avg, exp_avg_sq)`` before storage
            rounding, replaced by the new values; ``None`` with ``scales=None``.
        grad_scale_invs: per tensor 0-dim fp32 ``scale_inv`` of an FP8 gradient, or ``None`` (all 1).
        lr, beta1, beta2, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        step: the step number t >= 1 (bias correction).
        grad_unscale: a factor applied to every gradient (1/mu of the gradient scaler); a power of two keeps it exact.
        two_pass: new scales from the fresh amax (True; the kernel reads the inputs twice), or from an upper bound
            of it known before the update (False: one pass, never saturates, at most a binade or so conservative).
        grad_amaxes: with ``two_pass=False`` and ``scales``: per tensor 0-dim fp32 ``max|grad * grad_scale_inv|``
            (before any FP8 rounding of the gradient); needs ``beta1**2 < beta2``.
        param_copies: optional high-precision tensors that receive the new unscaled weights (a model parameter that
            is not the master's storage), in their own dtype: the master as stored, unscaled, so that the weight is
            what the master holds (a state dict of the model and one of the optimizer agree).
        fp8_weights: optional FP8 tensors (one format), the params' shapes: receive the FP8 cast of the weight the
            model reads (``param_copies`` if given, else ``params``' storage, unscaled by its scale) exactly as an
            FP8Linear forward casts it (current scaling, see :func:`emit_fp8_weight_ref`).
        fp8_weight_stats: with ``fp8_weights``: per tensor an int64 [5] record, see :func:`fp8_weight_record_views`.
        fp8_margin: the margin (binades) of the FP8 weight copies' scales.

    Raises:
        ValueError: for a one-pass step with scales but no ``grad_amaxes``, or with ``beta1**2 >= beta2``, and for
            ``fp8_weights`` that do not match the params (see :func:`check_fp8_weights`).
    """
    c = AdamWConstants(lr, beta1, beta2, eps, weight_decay, step)
    if not two_pass and scales is not None and (grad_amaxes is None or c.max_update is None):
        raise ValueError("adamw_step(two_pass=False) needs grad_amaxes and beta1**2 < beta2 for its scale bounds")
    check_fp8_weights(params, fp8_weights, fp8_weight_stats, fp8_margin)
    if fp8_weights is not None and not two_pass and amaxes is None:
        raise ValueError("adamw_step(two_pass=False) with fp8_weights needs the amaxes for the copies' scale bounds")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        states = (p, m, v)
        ginv = torch.tensor(grad_unscale, dtype=torch.float32, device=g.device)
        if grad_scale_invs is not None:
            ginv = grad_scale_invs[i].float().reshape(()) * grad_unscale
        # One-element scales and amaxes of any shape, as the kernel reads them: 0-dim views (copy_ writes through).
        state_scales = tuple(_scalar(t) for t in scales[i]) if scales is not None else (None, None, None)
        state_amaxes = tuple(_scalar(t) for t in amaxes[i]) if amaxes is not None else None
        factors = [_state_factor(t, s, f) for t, s, f in zip(states, state_scales, (c.decay, c.beta1, c.beta2),
                                                                 strict=True)]  # fmt: skip
        new = adamw_update_ref(g.float() * ginv, *(t.float() for t in states), factors, c,
                               scaled_v=_is_scaled(v, state_scales[2]))  # fmt: skip
        fresh = [amax_ref(x) for x in new]
        if fp8_weights is not None and not two_pass:  # the one-pass bound of the master, before its amax is replaced
            g_amax = grad_amaxes[i].float() * abs(grad_unscale) * BOUND_SLACK if scales is not None else None
            emit_bound = adamw_bound_ref(0, state_amaxes[0], g_amax, c)
        for j, (x, dst) in enumerate(zip(new, states, strict=True)):
            if _is_scaled(dst, state_scales[j]):
                if two_pass:
                    source = fresh[j]
                else:
                    g_amax = grad_amaxes[i].float() * abs(grad_unscale) * BOUND_SLACK
                    source = adamw_bound_ref(j, state_amaxes[j], g_amax, c)
                write_scale = pow2_scale_ref(source, SCALED_STATE_MAX[dst.dtype], 0, state_scales[j].float())
                same_scale = j == 1 and dst.dtype in _FP8_MAX and not dst.is_meta  # (meta: shapes only)
                same_scale = same_scale and bool(write_scale == state_scales[j].float())
                old = dst.clone() if same_scale else None
                _store_scaled_ref(x, dst, write_scale)
                if same_scale:
                    decay_progress_ref(dst, x * write_scale, old, c.beta1)
                state_scales[j].copy_(write_scale)
            else:
                dst.copy_(x)
            if state_amaxes is not None:
                state_amaxes[j].copy_(fresh[j])
        p_scale = state_scales[0] if _is_scaled(p, state_scales[0]) else None  # the new one, after the store
        if param_copies is not None:  # the master as stored (rounded), unscaled: the weight is what the master holds
            param_copies[i].copy_(p.float() / p_scale if p_scale is not None else p.float())
        if fp8_weights is not None:
            src, unscale = (param_copies[i], None) if param_copies is not None else (p, p_scale)
            if param_copies is not None and not two_pass:  # the copy's bound: the master's stored image, unscaled
                emit_bound = stored_amax_ref(emit_bound, p.dtype, p_scale)
                emit_bound = emit_bound / p_scale if p_scale is not None else emit_bound
            emit_fp8_weight_ref(src, unscale, None if two_pass else emit_bound, fp8_weights[i], fp8_weight_stats[i],
                                fp8_margin)  # fmt: skip


def stored_amax_ref(a: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """The amax of values stored in ``dtype`` (times ``scale``, a power of two, for scaled storage) whose fp32 amax
    is ``a``: the storage's rounding is monotonic, so it is ``a``'s stored image (a scaled store saturates at the
    format max; a non-finite ``a`` gives ``inf``). 0-dim fp32, scaled like the storage."""
    y = a.float() * scale if scale is not None else a.float()
    if scale is not None:  # as the scaled store: saturate at the format max, NaN for a non-finite value
        y = torch.where(torch.isfinite(y), y.clamp(max=SCALED_STATE_MAX[dtype]), torch.nan)
    return amax_ref(y.to(dtype))


def fp8_weight_record_views(record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two views of an FP8 weight copy's int64 [5] record: fp32 [5] ``(scale_inv, amax, scale, saturation,
    history)`` (bytes 0-19) and int64 [2] ``(nonfinite, 1)`` (bytes 24-39), what the forward's cast of the weight
    records into its scaling state (:func:`record_cast_ref` with ``unscale``): one buffer, one table column.
    ``scale_inv`` comes first: the GEMM reads it, and cuBLASLt wants its scale pointers 16-byte aligned."""
    return record[:3].view(torch.float32)[:5], record[3:5]


def check_fp8_weights(
    params: list[torch.Tensor], fp8_weights: list | None, fp8_weight_stats: list | None, margin: int = 0
) -> None:
    """Validate the FP8 weight copies of an AdamW step (one format, contiguous, the params' sizes and devices; int64
    [5] records) and their scales' ``margin`` (an int >= 0).

    Raises:
        ValueError: naming the first list or tensor that does not fit, or the margin.
    """
    if fp8_weights is None and fp8_weight_stats is None:
        return
    # Both paths check it (the reference scaled a copy past the FP8 maximum with a negative one, where the kernel
    # refused it).
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"adamw_step(fp8_margin={margin!r}): the margin must be an int >= 0 binades")
    if fp8_weights is None or fp8_weight_stats is None:
        raise ValueError("adamw_step: pass fp8_weights and fp8_weight_stats together (both or neither)")
    if len(fp8_weights) != len(params) or len(fp8_weight_stats) != len(params):
        raise ValueError(f"adamw_step: {len(fp8_weights)} fp8_weights and {len(fp8_weight_stats)} records for "
                         f"{len(params)} params")  # fmt: skip
    for i, (p, w, r) in enumerate(zip(params, fp8_weights, fp8_weight_stats, strict=True)):
        same_format = w.dtype in _FP8_MAX and w.dtype == fp8_weights[0].dtype
        # On the param's device too: the kernel writes both by their addresses.
        if not same_format or not w.is_contiguous() or w.numel() != p.numel() or w.device != p.device:
            raise ValueError(f"adamw_step: fp8_weights[{i}] ({w.dtype}, {tuple(w.shape)}, {w.device}) must be "
                             f"contiguous, of one FP8 format for all, with the {p.numel()} elements of its param, on "
                             f"its device ({p.device})")  # fmt: skip
        if r.dtype != torch.int64 or r.numel() != 5 or not r.is_contiguous() or r.device != p.device:
            raise ValueError(
                f"adamw_step: fp8_weight_stats[{i}] must be a contiguous int64 tensor of 5 elements on "
                f"its param's device ({p.device}), got {r.dtype}, {r.numel()} elements on {r.device}"
            )


def emit_fp8_weight_ref(
    src: torch.Tensor,
    unscale: torch.Tensor | None,
    bound: torch.Tensor | None,
    out: torch.Tensor,
    record: torch.Tensor,
    margin: int,
) -> None:
    """The FP8 copy of a weight as the FP8Linear forward casts it, and the statistics that cast records.

    ``src`` holds the stored weight (times ``unscale``, a power of two, for a scaled master). The scale is
    ``pow2_scale(a)`` for the FP8 maximum and ``margin``, with ``a = amax(src)`` (``bound=None``: the forward's
    own current scaling, so the copy equals its cast bit for bit) or the stored image of ``bound``, an upper bound
    of the weight's amax (one pass: the same rounding the storage applies, so ``a >= amax(src)``).
    An amax of 0 or a non-finite one gives the weight (``src / unscale``) scale 1 here, i.e. ``src`` the scale
    ``1 / unscale`` (with ``src``'s scale 1, the finite values of a scaled master holding a NaN saturated); recorded
    into the layer's state, it keeps the state's previous scale, as the forward's cast does
    (lightning_fp8.weight_cache.WeightCache.record_into).
    """
    fmax = _FP8_MAX[out.dtype]
    a = amax_ref(src) if bound is None else stored_amax_ref(bound, src.dtype, unscale)
    u = unscale.float().reshape(()) if unscale is not None else torch.ones((), dtype=torch.float32, device=src.device)
    scale = pow2_scale_ref(a, fmax, margin, u.reciprocal())
    x_fp8, _, amax, n_saturated = cast_to_fp8_ref(src, scale, out.dtype)
    out.copy_(x_fp8.view(out.shape))
    floats, counts = fp8_weight_record_views(record)
    finite = torch.isfinite(amax)
    floats.copy_(torch.stack([scale.reciprocal() / u, amax / u, scale * u, n_saturated.float() / max(src.numel(), 1),
                              torch.where(finite, amax, 0.0) / u]))  # fmt: skip
    counts.copy_(torch.stack([(~finite).long(), torch.ones((), dtype=torch.int64, device=src.device)]))
