"""Gradients that :class:`~lightning_fp8.FP8GradScaler` unscales outside FP8AdamW's fused step.

An :class:`~lightning_fp8.FP8AdamW` unscales each gradient in fp32 inside its step. Any other optimizer has its
``param.grad`` divided by mu in place, as ``torch.amp.GradScaler`` does: by :meth:`_Unscaling.unscale_` (to clip or
read them before the step) or by the scaler's ``step()``; fp16 gradients are refused, since unscaling them in fp16
would flush the small values mu made representable. Clipping gradients that still carry mu
(:meth:`_Unscaling.clip_grad_norm_`) works for both kinds. :class:`_Unscaling` is a base of the scaler and reads
its state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_fp8.grad_scaling.arguments import check_optimizer
from lightning_fp8.grad_scaling.reports import _Counts
from lightning_fp8.recipe import check_flag


def _parameter_list(where: str, parameters: Any) -> list[torch.Tensor]:
    """``parameters`` (a tensor or an iterable of tensors) as a list; TypeError naming what was passed otherwise. An
    optimizer or a module passed in their place failed deep inside with "'FP8AdamW' object is not iterable" or
    "'FP8Linear' object has no attribute 'grad'", which says neither what was wrong nor what to pass."""
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    hint = "e.g. model.parameters()"
    if isinstance(parameters, torch.optim.Optimizer):
        hint = "e.g. model.parameters(), or [p for group in optimizer.param_groups for p in group['params']]"
    params = None
    # A module is taken where it iterates over tensors (an nn.ParameterList, as torch takes it), not a Sequential.
    if not isinstance(parameters, (torch.optim.Optimizer, str, bytes, dict)):
        try:
            params = list(parameters)
        except TypeError:
            params = None
    if params is None or not all(isinstance(p, torch.Tensor) for p in params):
        held = "" if params is None else " holding " + ", ".join(sorted({type(p).__name__ for p in params}))
        raise TypeError(
            f"{where} takes the parameters whose gradients to use (a tensor or an iterable of tensors, {hint}), got "
            f"{type(parameters).__name__}{held}; nothing was changed"
        )
    return params


def _is_fsdp1(module: Any) -> bool:
    """Whether ``module`` is an FSDP1 ``FullyShardedDataParallel`` module (its ``clip_grad_norm_`` takes the root)."""
    if not isinstance(module, torch.nn.Module) or not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _refuse_fsdp1_shards(where: str, params: list[torch.Tensor]) -> None:
    """ValueError for parameters flattened by FSDP1 (``FullyShardedDataParallel``) in a multi-process run, passed as
    parameters: each rank holds a shard of their gradients, so a norm taken of them would be its shard's and every
    rank would clip by another factor (as with ``torch.nn.utils.clip_grad_norm_``). The FSDP1 root itself is taken:
    its ``clip_grad_norm_`` reduces the norm over the ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if any(getattr(p, "_fsdp_flattened", False) for p in params):  # FSDP1's mark on its flat and original params
        raise ValueError(
            f"{where}: these parameters are FSDP1's (FullyShardedDataParallel): each rank holds a shard of their "
            "gradients, so each would clip by its own shard's norm. Pass the FSDP root module itself, "
            "scaler.clip_grad_norm_(model, max_norm): its norm is reduced over the ranks; nothing was clipped"
        )


def _fsdp1_norm(root: Any, params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The gradient norm FSDP1's ``clip_grad_norm_`` reduces over the ranks of ``root`` (an FSDP1 root), without its
    multiplication of every gradient by ``inf / norm`` where that norm is not finite (NaN gradients, where the fit
    skips the step anyway): whether any rank holds a NaN or an infinity is agreed first (one all-reduce of two flags;
    the norm is then NaN, else inf, as torch's), and only a finite norm is measured by FSDP1 (a limit of inf: a factor
    of 1, the gradients unchanged)."""
    import torch.distributed as dist

    flags = torch.zeros(2, device=root.compute_device)
    for grad in (p.grad for p in params if p.grad is not None):
        flags = torch.maximum(flags, torch.stack([grad.isnan().any(), grad.isinf().any()]).to(flags))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=root.process_group)
    has_nan, has_inf = flags.tolist()
    if has_nan or has_inf:
        return torch.tensor(math.nan if has_nan else math.inf, device=root.compute_device)
    return root.clip_grad_norm_(math.inf, norm_type).float()


_WHERE_CLIP = "FP8GradScaler.clip_grad_norm_"


class _Unscaling:
    """Clipping and unscaling of gradients that carry mu (see the module docstring)."""

    def clip_grad_norm_(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)`` of gradients that carry this scaler's
        mu (:attr:`loss_scale`), applied as if they did not: the plain-PyTorch spelling of unscale-then-clip, between
        the backward and the step. Each ``param.grad`` is multiplied by ``min(1, max_norm / (true norm + 1e-6))``;
        returns the true total norm (of the unscaled gradients), a 0-dim fp32 tensor. The norm is summed in fp32:
        ``torch.nn.utils.clip_grad_norm_(params, mu * max_norm)`` on O2's fp16 gradients computes each tensor's norm
        in fp16, which is inf once mu times it passes 65504, and then multiplies every gradient by 0. The gradients
        an ``FP8AdamW(fp8_grads=True)`` holds in FP8 for these parameters (``param.grad`` None) count and are clipped
        too, through their scales (their FP8 values stay as they are). Gradients that :meth:`unscale_` unscaled
        already are clipped as they are (:meth:`grad_factor`). A parameter listed twice counts once.

        A non-finite norm (an overflow) leaves the gradients non-finite for :meth:`step` to skip, unless
        ``error_if_nonfinite`` (raise RuntimeError, as torch). ``foreach`` is accepted for torch's signature: the
        gradients are multiplied with ``torch._foreach_mul_`` per device either way. DTensor gradients (FSDP2, tensor
        parallelism) take the L2 norm only. For FSDP1 pass the ``FullyShardedDataParallel`` root itself (its
        ``clip_grad_norm_`` reduces the sharded gradients' norm over the ranks, here with a limit of inf, and they are
        then multiplied by torch's factor); its parameters passed as parameters in a multi-process run are refused
        (each rank would clip by its own shard's norm).

        Raises:
            TypeError, ValueError: for a ``max_norm`` that is not a number >= 0 (negative flips the gradients' signs,
                NaN makes them NaN), a ``norm_type`` that is not a number > 0; TypeError for ``parameters`` that are
                not a tensor or an iterable of tensors (an optimizer or a module: pass ``model.parameters()``), or an
                ``error_if_nonfinite`` that is not a bool;
                ValueError for FSDP1's parameters in a multi-process run (pass the FSDP1 root instead).
        """
        from lightning_fp8.integrations.clipping import (  # torch only (no Lightning import)
            check_clip_limit,
            checked_norm_type,
            clip_factor,
            clip_grad_norm_fp32,
            clip_scaled_grad_norm_,
            mul_grads_by_,
            unique,
        )

        check_clip_limit("FP8GradScaler.clip_grad_norm_", "max_norm", max_norm)
        check_flag("FP8GradScaler.clip_grad_norm_", "error_if_nonfinite", error_if_nonfinite)
        norm_type = checked_norm_type("FP8GradScaler.clip_grad_norm_", norm_type)  # 'inf' too, as torch takes it
        fsdp1 = _is_fsdp1(parameters)
        params = unique(parameters.parameters() if fsdp1 else _parameter_list(_WHERE_CLIP, parameters))
        if not fsdp1:
            _refuse_fsdp1_shards(_WHERE_CLIP, params)
        mu = self.grad_factor(params)

        def check(total: torch.Tensor) -> None:  # before anything is clipped, as torch
            if error_if_nonfinite and not bool(torch.isfinite(total)):
                raise RuntimeError(
                    f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                    "cannot be clipped. To skip the step instead (as mu's overflow handling does), pass "
                    "error_if_nonfinite=False; nothing was clipped"
                )

        if fsdp1:  # FSDP1 reduces the shards' norm over the ranks; then torch's factor (1 where it is not finite)
            total = _fsdp1_norm(parameters, params, norm_type)
            check(total / mu)
            mul_grads_by_([p.grad for p in params if p.grad is not None], clip_factor(total, max_norm, mu))
            return total / mu
        if float(norm_type) == 2.0:
            return clip_scaled_grad_norm_(params, max_norm, mu, check).float() / mu
        if any(type(p).__name__ == "DTensor" for p in params):
            raise ValueError(
                f"FP8GradScaler.clip_grad_norm_(norm_type={norm_type}): the gradients of sharded (DTensor) parameters "
                "are clipped by their L2 norm only (norm_type=2); nothing was clipped"
            )
        return clip_grad_norm_fp32(params, max_norm, float(norm_type), mu, check)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_(parameters, clip_value)`` of gradients that carry this scaler's mu, as if
        they did not: each element is clamped to ``clip_value`` in true units, and an infinite one stays infinite so
        that :meth:`step` still skips the overflow (torch's clamp would turn it into a finite value and the step
        would be taken). Gradients that :meth:`unscale_` unscaled already are clamped as they are.

        Raises:
            TypeError, ValueError: for a ``clip_value`` that is not a number >= 0; TypeError for ``parameters`` that
                are not a tensor or an iterable of tensors; ValueError for gradients an
                ``FP8AdamW(fp8_grads=True)`` holds in FP8 (not in ``param.grad``: a clamp cannot reach them): build
                it with ``fp8_grads=False`` to clip by value, or clip by norm (:meth:`clip_grad_norm_`).
        """
        from lightning_fp8.integrations.clipping import check_clip_limit, clip_grad_value_keeping_overflow_, unique
        from lightning_fp8.optim.fp8_grads import held_fp8_grads

        check_clip_limit("FP8GradScaler.clip_grad_value_", "clip_value", clip_value)
        params = unique(_parameter_list("FP8GradScaler.clip_grad_value_", parameters))
        held = held_fp8_grads([p for p in params if p.grad is None])
        if held:
            raise ValueError(
                f"FP8GradScaler.clip_grad_value_: {len(held)} of these gradients are held in FP8 by an "
                "FP8AdamW(fp8_grads=True) (not in param.grad), which a clamp of values cannot reach: build the "
                "optimizer with fp8_grads=False to clip by value, or clip by norm (clip_grad_norm_, which clips them "
                "too); nothing was clipped"
            )
        clip_grad_value_keeping_overflow_(params, float(clip_value) * self.grad_factor(params))

    def grad_factor(self, parameters: Any) -> float:
        """The factor the gradients of ``parameters`` (a tensor or an iterable of them) carry now: :attr:`loss_scale`
        (mu), or 1 where :meth:`unscale_` has unscaled them (their optimizer's, since the last :meth:`update`).

        Raises:
            ValueError: when some of the gradients are unscaled and others are not: clip or read the two sets
                separately.
        """
        from lightning_fp8.optim.fp8_grads import held_fp8_grads

        params = _parameter_list("FP8GradScaler.grad_factor", parameters)
        unscaled = {id(p) for opt in list(self._unscaled) for group in opt.param_groups for p in group["params"]}
        kinds = {id(p) in unscaled for p in params if p.grad is not None}
        if held_fp8_grads([p for p in params if p.grad is None]):
            kinds.add(False)  # held in FP8 by an FP8AdamW, which unscale_ refuses: they carry mu
        if kinds == {True, False}:
            raise ValueError(
                "FP8GradScaler: some of these gradients were unscaled by unscale_(optimizer) and others still carry "
                "mu; clip the two sets separately (torch.nn.utils.clip_grad_norm_ for the unscaled ones, the scaler's "
                "clip_grad_norm_ for the others), or unscale_ none of them"
            )
        return 1.0 if kinds == {True} else self.loss_scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by mu in place, as ``torch.amp.GradScaler.unscale_`` does, for clipping or
        reading them between the backward and :meth:`step` (which then steps on them as they are, checking them for
        non-finite values again). At most once per optimizer between two :meth:`update` calls, and not after its
        step.

        For optimizers other than :class:`~lightning_fp8.FP8AdamW`, with fp32 or bf16 gradients (fp16 gradients are
        refused, as by :meth:`step`).

        Raises:
            ValueError: for an FP8AdamW, which unscales each gradient in fp32 inside its fused step (at O2 its FP8
                weights' gradients are fp16, which only mu keeps representable, or held in FP8 by the optimizer):
                clip with :meth:`clip_grad_norm_`, read true values as ``param.grad / scaler.loss_scale``. Also for
                fp16 gradients.
            RuntimeError: when called twice for one optimizer since the last :meth:`update`, or after its step.
            TypeError: for what is no optimizer (no ``param_groups``).
        """
        if not isinstance(optimizer, torch.optim.Optimizer):  # an LR scheduler has an .optimizer too: refused, as step
            check_optimizer("unscale_", optimizer)
        optimizer = _inner_optimizer(optimizer)
        check_optimizer("unscale_", optimizer)
        if getattr(optimizer, "_fp8_step", None) is not None:
            raise ValueError(
                f"FP8GradScaler.unscale_({type(optimizer).__name__}): FP8AdamW unscales each gradient in fp32 inside "
                "its fused step, and its FP8 weights' gradients (fp16 at O2, or held in FP8 with fp8_grads=True) "
                "cannot be unscaled in place without losing the values only mu keeps representable. To clip, call "
                "scaler.clip_grad_norm_(parameters, max_norm) between the backward and the step; to read a true "
                "gradient, divide param.grad by scaler.loss_scale"
            )
        if any(stepped is optimizer for stepped, _ in self._stepped):
            raise RuntimeError("FP8GradScaler.unscale_(optimizer) is being called after step(): call it before")
        if optimizer in self._unscaled:
            raise RuntimeError(
                "FP8GradScaler.unscale_(optimizer) has already been called on this optimizer since the last update()"
            )
        _refuse_fp16_grads(optimizer, "unscale_")
        self._refuse_unscaled_loss(optimizer, "unscale_")
        # step() adds the flag to its own check: clipping may have made the gradients finite since.
        flags = self._nonfinite_grad_flags[optimizer] = {}  # per gradient: the "bf16" fallback's, if not stepped
        found = self._unscaled[optimizer] = _unscale_in_place(optimizer, 1.0 / self.loss_scale, flags)
        # For an update() without its step: measured now, before the loop may zero the gradients.
        self._unscale_counts[optimizer] = self._unscaled_counts(optimizer, found)

    def _refuse_unscaled_loss(self, optimizer: torch.optim.Optimizer, caller: str) -> None:
        """Raise a RuntimeError if ``optimizer`` holds gradients and no loss was scaled by this scaler (since its
        construction or last :meth:`load_state_dict`): they do not carry mu, and dividing them by it would make the
        update 1/mu of what it should be, silently (``torch.amp.GradScaler`` refuses a step without ``scale()`` too).
        """
        if not self.loss_was_scaled and holds_gradients(optimizer):
            raise RuntimeError(
                f"FP8GradScaler.{caller}: no loss was scaled by this scaler (since it was created or its state was "
                f"loaded), so the gradients of this {type(optimizer).__name__} do not carry mu ({self._scale:g}) and "
                "unscaling them would shrink the update by that factor. Call scaler.scale_loss(loss).backward() "
                "instead of loss.backward() (under Lightning's manual optimization: self.manual_backward(loss)). "
                "Nothing was changed"
            )

    def _unscaled_counts(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> _Counts:
        """What an update judges of ``optimizer`` unscaled and not stepped: the headroom of its unscaled gradients
        (fp32 / bf16: fp16 ones are refused) and its non-finite flag ``found``."""
        counts = _Counts()
        self._record_high_precision_grads(optimizer, counts)
        counts.add((found > 0).float())
        return counts


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside Accelerate's and Lightning's wrappers (``.optimizer``), which step the one inside: what
    :meth:`_Unscaling.unscale_` and :meth:`FP8GradScaler.step <lightning_fp8.FP8GradScaler.step>` keep their records
    of, so that ``unscale_(wrapper)`` then ``step(wrapper)`` unscales the gradients once (as ``torch.amp.GradScaler``,
    which keys both by the object it is given)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def holds_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or the optimizer a Lightning or Accelerate wrapper holds) has any gradient to step on: a
    ``param.grad``, or one an FP8AdamW holds in FP8 (``fp8_grads``: those leave ``param.grad`` as backward produces
    them; queued ones are cast first, as its step would)."""
    if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        return True
    inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # Accelerate's AcceleratedOptimizer
    fp8_grad_norms = getattr(inner, "fp8_grad_norms", None)
    return fp8_grad_norms is not None and bool(fp8_grad_norms())


def _step_through_public_step(
    optimizer: torch.optim.Optimizer, inv_scale: float, fp8_adamw: torch.optim.Optimizer | None = None
) -> None:
    """Run an FP8AdamW's update through its ``step()``, as torch.amp runs ``optimizer.step()``: an LR scheduler's
    wrapper then marks the optimizer as stepped (no "lr_scheduler.step() before optimizer.step()" warning), and
    optimizer step hooks and the profiler see the step. ``_fp8_unscale`` tells that step to unscale by
    ``inv_scale`` and not to route through a gradient scaler again. ``fp8_adamw``: the FP8AdamW inside ``optimizer``,
    a wrapper whose ``step()`` steps it (default: ``optimizer`` itself)."""
    fp8_adamw = optimizer if fp8_adamw is None else fp8_adamw
    fp8_adamw._fp8_unscale = inv_scale  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        fp8_adamw._fp8_unscale = None  # type: ignore[attr-defined]


def _refuse_fp16_grads(optimizer: torch.optim.Optimizer, caller: str = "step") -> None:
    """Raise a ValueError if a plain optimizer has fp16 gradients, which :func:`_unscale_in_place` cannot unscale.

    mu is there for the gradients fp16 cannot hold unscaled: ``g * mu`` is representable where ``g`` (below fp16's
    smallest subnormal, 6e-8, or among its subnormals) is not, and multiplying by ``1 / mu`` in fp16 storage rounds
    them to zero (or to a few bits) again, silently. ``torch.amp.GradScaler`` refuses them ("Attempting to unscale
    FP16 gradients"); bf16 has fp32's range, so unscaling it by a power of two is exact."""
    fp16 = [p for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None and p.grad.dtype == torch.float16]  # fmt: skip
    if fp16:
        raise ValueError(
            f"FP8GradScaler.{caller}: this {type(optimizer).__name__} has fp16 gradients ({len(fp16)} parameter(s) in "
            f"fp16, e.g. one of shape {tuple(fp16[0].shape)}). Its gradients would be unscaled by 1/mu in place, in "
            "fp16, which turns the small gradients that mu made representable (below ~6e-8 unscaled) back into zero, "
            "silently; torch.amp.GradScaler refuses them too ('Attempting to unscale FP16 gradients'). Keep these "
            "parameters in fp32 (compute in fp16/bf16 with torch.autocast), or train them with "
            "lightning_fp8.FP8AdamW(..., grad_scaler=scaler), which unscales each gradient in fp32 inside its step "
            "(and keeps fp16 masters with per-tensor scales for the FP8 weights at O2). Nothing was changed."
        )


def _unscale_in_place(
    optimizer: torch.optim.Optimizer, inv_scale: float, flags: dict[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Multiply every gradient of a plain optimizer by ``inv_scale``; return a 0-dim non-finite flag (and put each
    gradient's in ``flags``, when given).

    A sparse gradient (``nn.Embedding(sparse=True)``) has its values unscaled in place, as in
    ``torch.amp.GradScaler``. fp16 gradients never come here (:func:`_refuse_fp16_grads`): fp32 and bf16 values are
    unscaled exactly, and the sums of a sparse gradient's repeated values overflow only where its values nearly do
    (past 1.7e38), so they are left uncoalesced, as torch.amp leaves them."""
    found = torch.zeros((), dtype=torch.float32)  # not the default dtype: the ranks sum the same dtype
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for p in params:
        values = p.grad._values() if p.grad.is_sparse else p.grad
        values = values.to_local() if hasattr(values, "to_local") else values  # a DTensor (FSDP2): this rank's shard
        values.mul_(inv_scale)
        bad = (~torch.isfinite(values)).any().float()  # the ranks agree on the sum (FP8GradScaler._agree)
        if flags is not None:
            flags[p] = bad
        found = found.to(bad.device) + bad
    return found


def _nonfinite_flags(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """``{param: flag}``, a 0-dim flag (> 0 where it holds inf or NaN) for every ``param.grad`` of ``optimizer``:
    this rank's values (a DTensor's shard, a sparse gradient's values). No host synchronization."""
    flags = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                flags[p] = _nonfinite_flag(p.grad)
    return flags


def _nonfinite_flag(grad: torch.Tensor) -> torch.Tensor:
    values = grad._values() if grad.is_sparse else grad
    values = values.to_local() if hasattr(values, "to_local") else values
    return (~torch.isfinite(values)).any().float()
