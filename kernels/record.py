"""The bookkeeping of a cast whose data pass torch.compile generates (lightning_fp8/scaling.py: ``FUSED_CASTS``).

Inductor fuses such a cast into the kernel that produces its input and reduces its amax and saturated count; these
two one-program ``triton_op``\\ s do the rest:

- :func:`used_scale_op`: a copy of the state's scale, the scale the cast uses. An op the partitioner does not
  recompute, so a backward that casts the forward's tensor again (to keep one byte less per element to the backward)
  reads the scale of the forward, not the one the bookkeeping wrote since.
- :func:`record_op`: ``kernels/scaling.py: _record`` with the cast's amax and saturated count (statistics, amax history,
  next scale) and ``1 / used_scale``; numerics ``kernels/reference.py: record_cast_ref``, bit for bit.

As ``triton_op``\\ s their state updates survive in a compiled backward on torch 2.11, where tensor-op updates of
buffers there are lost (tests/core/test_linear.py).
"""

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.cast import _launchable, scalar_output
from lightning_fp8.kernels.quantize import _next_power_of_2, _record_fields
from lightning_fp8.kernels.scaling import _record


@triton.jit
def _copy_scalar_kernel(src_ptr, dst_ptr):
    tl.store(dst_ptr, tl.load(src_ptr))


@triton.jit
def _record_kernel(
    amax_ptr, nsat_ptr, used_scale_ptr, hist_ptr, scale_ptr, scale_inv_ptr, last_amax_ptr, saturation_ptr,
    nonfinite_ptr, casts_ptr, numel, H, BLOCK_H: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr, ALGO_MAX: tl.constexpr, DELAYED: tl.constexpr,
):  # fmt: skip
    used_scale = tl.load(used_scale_ptr)
    if not DELAYED:  # current scaling: the scale the cast used is the state's scale (quantize_ref's current_scale_ref)
        tl.store(scale_ptr, used_scale)
    _record(
        tl.load(amax_ptr), tl.load(nsat_ptr), numel, used_scale, hist_ptr, scale_ptr, scale_inv_ptr,
        last_amax_ptr, saturation_ptr, nonfinite_ptr, casts_ptr, H, 1.0, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN, ALGO_MAX,
        DELAYED, False,
    )  # fmt: skip


@torch.library.triton_op("lightning_fp8::used_scale", mutates_args=())
def used_scale_op(scale: torch.Tensor) -> torch.Tensor:
    """A copy of 0-dim ``scale`` (one launch of one program)."""
    out = torch.empty_like(scale)
    _launchable(_copy_scalar_kernel)[(1,)](scale, out)
    return out


@torch.library.triton_op(
    "lightning_fp8::record_cast",
    mutates_args=("amax_history", "scale", "last_amax", "saturation", "nonfinite_count", "casts"),
)
def record_op(
    amax: torch.Tensor,
    n_saturated: torch.Tensor,
    used_scale: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    numel: int,
    fp8_dtype: torch.dtype,
    margin: int,
    algo_max: bool,
    delayed: bool,
) -> torch.Tensor:
    """``record_cast_ref(amax, n_saturated, numel, used_scale, ...)`` in one launch: returns ``1 / used_scale``.

    ``amax``: the cast's amax with NaN as inf (``amax_ref``), 0-dim fp32; ``n_saturated``: 0-dim int64; ``numel`` >= 1.
    """
    if numel < 1:
        raise ValueError(f"record_op(numel={numel}): a cast of an empty tensor records nothing; use quantize_ref")
    scale_inv = scalar_output(torch.float32, amax.device)  # viewed as 0-dim once written
    h = amax_history.numel()
    _launchable(_record_kernel)[(1,)](
        amax, n_saturated, used_scale, amax_history, scale, scale_inv, last_amax, saturation, nonfinite_count, casts,
        numel, h, BLOCK_H=_next_power_of_2(h), ALGO_MAX=algo_max, DELAYED=delayed, **_record_fields(fp8_dtype, margin),
    )  # fmt: skip
    return scale_inv.view(())
