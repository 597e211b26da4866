"""Per-tensor scaling: the power-of-two scale convention and the per-role scaling state.

Convention (DESIGN.md): ``x_fp8 = saturate(x * scale)``, ``x ~= x_fp8.float() * scale_inv`` with
``scale = 2 ** (floor(log2(fp8_max / amax)) - margin)``. Powers of two make scaling exact: multiplying by
the scale and by its inverse adds no rounding error. An amax of 0 or a non-finite amax keeps the previous
scale and is counted.

Delayed scaling casts with the scale computed from the amax history of earlier casts, then records this
cast's amax: one pass over the data. Current scaling computes the tensor's amax first: two passes.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.formats import fp8_max

ROLES = ("input", "weight", "grad_output")

_MANTISSA_MASK = 0x7FFFFF


def _exponent_and_mantissa(value: float) -> tuple[int, int]:
    bits = torch.tensor(value, dtype=torch.float32).view(torch.int32).item()
    return (bits >> 23) & 0xFF, bits & _MANTISSA_MASK


def compute_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, prev_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Power-of-two scale ``2 ** (floor(log2(fp8_max / amax)) - margin)`` as a 0-dim fp32 tensor.

    The exponent is computed exactly from the fp32 bit patterns (no ``log2`` rounding): ``amax * scale``
    never exceeds ``fp8_max / 2**margin`` and doubling the scale would. Where ``amax`` is 0 or not finite,
    the result is ``prev_scale`` (1.0 when there is none).

    Args:
        amax: a 0-dim (or any-shape, elementwise) tensor of absolute maxima.
        fp8_dtype: the FP8 format the scale targets.
        margin: binades of headroom (>= 0).
        prev_scale: the scale to keep when ``amax`` carries no information.
    """
    max_exp, max_mant = _exponent_and_mantissa(fp8_max(fp8_dtype))
    amax32 = amax.float()
    bits = amax32.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    # Largest k with amax * 2**k <= fp8_max: compare exponents, then mantissas (both in [1, 2)).
    k = (max_exp - exp) - ((bits & _MANTISSA_MASK) > max_mant).to(torch.int32) - margin
    k = k.clamp(-126, 127)
    scale = ((k + 127) << 23).view(torch.float32)
    valid = torch.isfinite(amax32) & (amax32 > 0)
    if prev_scale is None:
        prev_scale = torch.ones_like(scale)
    return torch.where(valid, scale, prev_scale)


class ScalingState(nn.Module):
    """Scaling state of one tensor role (input, weight or grad_output) of one FP8 module.

    Buffers (non-persistent, so a converted model keeps ``nn.Linear``'s state_dict keys; see
    :func:`lightning_fp8.fp8_state_dict` to save them):

    - ``scale``: the scale the next delayed cast uses (0-dim fp32, a power of two);
    - ``amax_history``: the last ``amax_history_len`` amaxes, most recent first (0 where unknown);
    - ``amax``: the amax of the last cast; ``saturation``: fraction of its values at the FP8 maximum;
    - ``nonfinite_count``: casts whose amax was inf or NaN; ``casts``: number of casts.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        history_len: int,
        margin: int,
        algo: str,
        delayed: bool,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.fp8_dtype = fp8_dtype
        self.margin = margin
        self.algo = algo
        self.delayed = delayed
        # Python flag, not a tensor: the first delayed cast has no history and uses the tensor's own amax.
        # Set again when a saved state is loaded (lightning_fp8.state).
        self.initialized = False
        f32 = {"dtype": torch.float32, "device": device}
        i64 = {"dtype": torch.int64, "device": device}
        self.register_buffer("scale", torch.ones((), **f32), persistent=False)
        self.register_buffer("amax_history", torch.zeros(history_len, **f32), persistent=False)
        self.register_buffer("amax", torch.zeros((), **f32), persistent=False)
        self.register_buffer("saturation", torch.zeros((), **f32), persistent=False)
        self.register_buffer("nonfinite_count", torch.zeros((), **i64), persistent=False)
        self.register_buffer("casts", torch.zeros((), **i64), persistent=False)

    def extra_repr(self) -> str:
        kind = "delayed" if self.delayed else "current"
        return f"{self.fp8_dtype}, {kind}, history={self.amax_history.numel()}, margin={self.margin}"

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.scale.reciprocal()

    def needs_current_scale(self) -> bool:
        """True when the next cast must compute its own amax: current scaling, or no history yet."""
        return not self.delayed or not self.initialized

    def quantize(
        self, x: torch.Tensor, transpose: bool = False, current: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cast ``x`` to FP8 with this role's scale and record the cast's statistics.

        Delayed scaling uses the scale from earlier casts (the very first cast, with an empty history,
        uses the tensor's own amax); current scaling computes this tensor's amax first.

        Args:
            x: the high-precision tensor (2-D when ``transpose``).
            transpose: also return the transposed FP8 copy.
            current: force (True) or forbid (False) computing this tensor's amax first. ``None`` decides
                from :meth:`needs_current_scale` and marks the state initialized; code traced by
                ``torch.compile`` inside an autograd.Function passes it explicitly and sets
                ``initialized`` outside.

        Returns:
            ``(x_fp8, x_fp8_t, scale_inv)``: ``x_fp8_t`` is empty unless ``transpose``.
        """
        if current is None:
            current = self.needs_current_scale()
            self.initialized = True
        with torch.no_grad():
            if current:
                self.scale.copy_(compute_scale(ops.amax(x), self.fp8_dtype, self.margin, self.scale))
            scale = self.scale.clone()
            x_fp8, x_fp8_t, amax, n_saturated = ops.cast_to_fp8(x, scale, self.fp8_dtype, transpose)
            self._record(amax, n_saturated, x.numel())
        return x_fp8, x_fp8_t, scale.reciprocal()

    def _record(self, amax: torch.Tensor, n_saturated: torch.Tensor, numel: int) -> None:
        finite = torch.isfinite(amax)
        self.nonfinite_count.add_((~finite).to(torch.int64))
        self.casts.add_(1)
        self.amax.copy_(amax)
        self.saturation.copy_(n_saturated.float() / max(numel, 1))
        # A non-finite amax enters the history as 0 (no information), so it cannot pin the scale for a
        # whole window; with algo "most_recent" that keeps the previous scale.
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = torch.where(finite, amax, 0.0)
        if self.delayed:
            ref = self.amax_history.amax() if self.algo == "max" else self.amax_history[0]
            self.scale.copy_(compute_scale(ref, self.fp8_dtype, self.margin, self.scale))

    def reset(self) -> None:
        for name in ("amax_history", "amax", "saturation", "nonfinite_count", "casts"):
            getattr(self, name).zero_()
        self.scale.fill_(1.0)
        self.initialized = False
