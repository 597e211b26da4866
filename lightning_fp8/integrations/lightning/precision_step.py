"""FP8LMPrecision's backward and step: the loss scaled by mu, gradients unscaled for the hooks that read them,
clipping on gradients that carry mu, and the step through :class:`~lightning_fp8.FP8GradScaler`.

:class:`_PrecisionStep` is a base of the plugin (:mod:`~lightning_fp8.integrations.lightning.precision`) and reads
its attributes: ``grad_scaler``, ``fp8_grads`` and the model as the strategy wrapped it. The gradients are unscaled
in place only where an ``on_before_optimizer_step`` hook (or a ``configure_gradient_clipping`` of the module's own)
may read them: :func:`_hooks_read_gradients` says where.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from typing_extensions import override

from lightning_fp8.grad_scaling.unscaling import holds_gradients
from lightning_fp8.integrations.clipping import (
    UnscaledGradients,
    clip_factor,
    clip_grad_value_keeping_overflow_,
    clip_scaled_grad_norm_,
    mul_grads_by_,
    optimizer_grads,
)
from lightning_fp8.integrations.lightning import comm
from lightning_fp8.integrations.lightning import optimizers as optimizer_swap
from lightning_fp8.integrations.lightning.callbacks import SCALED_GRADIENTS_MARK, _unwrap_optimizer
from lightning_fp8.optim import checkpoint


class _PrecisionStep:
    """The plugin's backward, gradient-unscaling, clipping and step hooks."""

    grad_scaler: Any
    fp8_grads: bool
    _wrapped_model: nn.Module | None
    _unscaled: UnscaledGradients | None

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        return super().pre_backward(self.grad_scaler._scale_for_backward(tensor), module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("precision='fp8-lm' cannot step LBFGS (its closure re-evaluates the loss): use AdamW")
        if checkpoint.is_state_init_step(optimizer):  # torch's state-making step (DCP): no loss, hooks or scaler
            return optimizer.step()
        closure_result = closure()
        # training_step returned None in automatic optimization: no backward ran for this micro-batch. The earlier ones
        # of its accumulation window may have left gradients, which are stepped, as torch.optim steps them under
        # precision="bf16-mixed"; with none, there is nothing to step.
        nothing_to_step = closure_result is None and model.automatic_optimization and not holds_gradients(optimizer)
        with self.unscaled_gradients(optimizer, enabled=not nothing_to_step and _hooks_read_gradients(model)):
            self._after_closure(model, optimizer)  # on_before_optimizer_step hooks + gradient clipping
        if kwargs:
            raise TypeError(f"precision='fp8-lm' steps through FP8GradScaler.step(optimizer); got extra {list(kwargs)}")
        # Lightning's stand-in optimizer (configure_optimizers returned None) steps nothing: mu stays as it is.
        if nothing_to_step or optimizer_swap.is_mock_optimizer(optimizer):
            return closure_result
        if getattr(optimizer, "grad_scaler", None) is self.grad_scaler:
            optimizer.step()  # FP8AdamW routes through the scaler: skip or step (unscaling in its kernel), update mu
        else:
            self.grad_scaler.step(optimizer)  # skips on a non-finite gradient (agreed on all ranks)
            self.grad_scaler._update(judge_unstepped=False)  # this step's: another's unscale_ stays its own
        return closure_result

    @contextlib.contextmanager
    def unscaled_gradients(self, optimizer: Any, enabled: bool = True) -> Generator[None, None, None]:
        """Inside, ``optimizer``'s gradients are the true gradients (divided by mu); outside, scaled by mu again.

        mu is a power of two, so for fp32 and bf16 gradients both multiplications are exact. fp16 gradients (the FP8
        weights' at O2) are not: mu is there for the values fp16 cannot hold unscaled (below 2^-24, above 65504),
        which the division would round away or overflow. Their scaled values are kept meanwhile and put back where
        the code inside left the values as the division made them (:class:`~lightning_fp8.integrations.clipping.
        UnscaledGradients`), so a hook that only reads changes nothing of the step; values changed inside are
        multiplied back (rounded once). With mu == 1 (the common case) this costs nothing.
        """
        mu = self.grad_scaler.loss_scale  # the backward's mu
        if not enabled or self._unscaled is not None or mu == 1.0:
            yield
            return
        self._unscaled = UnscaledGradients(optimizer, mu)
        try:
            yield
        finally:
            self._end_unscaled_region()

    def _end_unscaled_region(self) -> None:
        region, self._unscaled = self._unscaled, None
        if region is not None:
            region.scale_back()

    def gradient_factor(self) -> float:
        """The factor the gradients carry now: mu (the backward's), or 1 while :meth:`unscaled_gradients` has them
        unscaled. Callbacks that read gradients in ``on_before_optimizer_step`` without the unscaling divide by it."""
        return 1.0 if self._unscaled is not None else self.grad_scaler.loss_scale

    @override
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Reached from inside optimizer_step's unscaled region (automatic optimization) or directly from
        # LightningModule.clip_gradients (manual optimization); the flag keeps the first from unscaling twice.
        # What the optimizer does (an FP8AdamW, the plugin's or the user's: its fp8_grads hooks, none for weights
        # sharded by fully_shard), else the plugin's flag
        inner = _unwrap_optimizer(optimizer)
        holds_fp8_grads = inner.holds_fp8_grads if hasattr(inner, "holds_fp8_grads") else self.fp8_grads
        if clip_val > 0 and holds_fp8_grads and GradClipAlgorithmType(gradient_clip_algorithm) is not (
                GradClipAlgorithmType.NORM):  # fmt: skip
            raise ValueError(
                f"gradient clipping by value (clip_val={clip_val}) would miss the FP8 weights' gradients, which "
                "FP8AdamW holds in FP8 (fp8_grads=True: they leave param.grad as soon as they are computed; clipping "
                "by norm clips them too, through their scales): clip by norm, or use FP8LMPrecision(fp8_grads=False) "
                "(the default) and, for your own FP8AdamW, fp8_grads=False"
            )
        if clip_val <= 0:
            return
        # Clipped carrying mu: an unscaled region (hooks, a configure_gradient_clipping of the module's own) puts its
        # gradients back exactly first, and is opened again after, for the code that runs on in it.
        region, self._unscaled = self._unscaled, None
        if region is not None:
            region.scale_back()
        try:
            super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
        finally:
            if region is not None:
                self._unscaled = UnscaledGradients(region.optimizer, region.mu)

    @override
    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        # The gradients carry mu (a power of two): clamping them at clip_val * mu clamps the true ones at clip_val.
        clip_grad_value_keeping_overflow_(self.main_params(optimizer), clip_val * self.grad_scaler.loss_scale)

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        # On the gradients as they are (carrying mu, fp16 for the FP8 weights at O2: unscaling them would round): the
        # factor min(1, clip_val / (true norm + 1e-6)) of torch's clip_grad_norm_, the norm summed in fp32.
        mu = self.grad_scaler.loss_scale
        clip = getattr(self._wrapped_model, "clip_grad_norm_", None)
        if clip is not None and comm.is_fsdp1_root(self._wrapped_model):
            # FSDP1 shards gradients: only the root computes the global norm (in fp32); max_norm=inf clips nothing.
            # FSDP1 computes it only outside its root's forward or once a backward has finished: in training_step
            # (inside that forward), FP8FSDPStrategy finishes each manual_backward as FSDP1 would.
            if self._wrapped_model.training_state.name != "IDLE":
                raise ValueError(
                    "clip_gradients(gradient_clip_algorithm='norm') under strategy='fsdp_fp8' ran inside the root "
                    "module's forward with no finished backward (FSDP1 computes the global norm only outside it): "
                    "call self.manual_backward(loss) first, with strategy='fsdp_fp8' (FP8FSDPStrategy), or clip by "
                    "value"
                )
            total = clip(float("inf"))
            mul_grads_by_(optimizer_grads(optimizer), clip_factor(total, clip_val, mu))
            return
        clip_scaled_grad_norm_(self.main_params(optimizer), clip_val, mu)


def _hooks_read_gradients(model: Any) -> bool:
    """Whether something may read or change gradients between the backward and the step, so that they are
    unscaled for it: an ``on_before_optimizer_step`` of the module or of a callback (not Lightning's own, nor one
    marked with ``callbacks.reads_scaled_gradients``), also one assigned on the instance, or the module's own
    ``configure_gradient_clipping``."""
    trainer = getattr(model, "trainer", None)
    callbacks = getattr(trainer, "callbacks", None) or []
    return (
        _user_hook(model, "on_before_optimizer_step")
        or _user_hook(model, "configure_gradient_clipping")
        or any(_user_hook(cb, "on_before_optimizer_step") for cb in callbacks)
    )


def _user_hook(obj: Any, name: str) -> bool:
    if name in getattr(obj, "__dict__", {}):  # assigned on the instance
        return True
    hook = getattr(type(obj), name, None)
    if hook is None or getattr(hook, SCALED_GRADIENTS_MARK, False):
        return False
    module = getattr(hook, "__module__", None) or ""  # Lightning's own (the base classes' no-ops), either flavour
    return not module.startswith(("lightning.pytorch.", "pytorch_lightning."))
