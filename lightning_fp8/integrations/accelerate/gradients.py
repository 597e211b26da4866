"""Backward, gradient unscaling and clipping, and the step's health bookkeeping of the FP8 Accelerator.

:class:`GradientsMixin` is a base class of :class:`~lightning_fp8.accelerate.Accelerator` (it uses the accelerator's
FP8 attributes: the scaler, the prepared optimizer, the health monitor and the step's records). Under FP8-LM the
gradients carry the gradient scale mu until the optimizer step unscales them inside FP8AdamW's kernel: ``backward``
multiplies the loss by mu, ``clip_grad_norm_`` / ``clip_grad_value_`` clip the true (unscaled) gradients,
``unscale_gradients`` divides them by mu in place for a script's own clipping, and the prepared optimizer calls
``_fp8_before_step`` before and ``_fp8_on_step`` after each step (skipped or not) to feed the health monitor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate.utils import DistributedType
from typing_extensions import override

from lightning_fp8.health import global_norm, memory_gib, scaler_fallbacks, skipped_step_action
from lightning_fp8.integrations.accelerate import parallel, refusals
from lightning_fp8.integrations.clipping import (
    check_clip_limit,
    checked_norm_type,
    clip_grad_norm_fp32,
    clip_grad_value_keeping_overflow_,
    unique,
)

logger = logging.getLogger("lightning_fp8.accelerate")


class GradientsMixin:
    """The gradient side of the FP8 Accelerator (see the module docstring); not usable on its own."""

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.fp8_grad_scaler is not None:
            refusals.check_fallback(self.fp8_grad_scaler, self._fp8_models)  # before a step can run it
            if self._fp8_optimizer is not None:  # gradients unscale_gradients unscaled carry mu again
                self._fp8_optimizer.scale_back()
            # The health loss: the loss's mean as fp32 0-dim (micro-batch losses of any shape average, a tensor given
            # with ``gradient=`` by its mean: a NaN in it is still a non-finite loss); an empty tensor records none.
            recorded = loss.detach().float().mean() if loss.numel() else None
            super().backward(self.fp8_grad_scaler._scale_for_backward(loss), **kwargs)
            if recorded is not None:
                self._fp8_loss.append(recorded)
            return
        super().backward(loss, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Under FP8-LM: divide the prepared optimizer's gradients by mu in place, the true gradients for the
        script's own clipping or reading (as Accelerate's fp16 ``GradScaler.unscale_``). They carry mu again from
        the next ``backward`` or the step on (the step unscales inside FP8AdamW's fused kernel; fp16 gradients get
        their scaled values back where nothing changed them); a second call before then changes nothing.
        ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` clip the true gradients either way.

        Raises:
            ValueError: when the prepared FP8AdamW holds the FP8 weights' gradients outside ``param.grad``
                (``fp8_grads=True``: a script's own clipping would miss them), or for an ``optimizer`` that was not
                prepared by this accelerator.
        """
        if self.fp8_grad_scaler is None or self._fp8_clipping:  # Accelerate's clip_grad_norm_ calls it: mu is ours
            return super().unscale_gradients(optimizer)
        prepared = self._fp8_optimizer
        given = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        strays = [opt for opt in given if prepared is None or opt not in (prepared, prepared.optimizer)]
        if strays:
            raise ValueError(
                f"accelerator.unscale_gradients: the {type(strays[0]).__name__} given was not prepared by this "
                "accelerator (under FP8-LM the gradients carry mu for the prepared optimizer's step): pass the "
                "optimizer accelerator.prepare returned, or none"
            )
        if prepared is not None:
            refusals.check_clippable(prepared.optimizer, "accelerator.unscale_gradients")
            prepared.unscale(self.fp8_grad_scaler.loss_scale)
            self._fp8_note_grad_norm()  # before the script's own clipping
        return None

    def _fp8_grad_factor(self, parameters: list[torch.Tensor]) -> float:
        """The factor ``parameters``' gradients carry: 1 while :meth:`unscale_gradients` has them unscaled, else the
        scaler's (mu, or 1 after ``fp8_grad_scaler.unscale_``)."""
        if self._fp8_optimizer is not None and self._fp8_optimizer.unscaled is not None:
            return 1.0
        return self.fp8_grad_scaler.grad_factor(parameters)

    @override
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """Clip the gradients as if they were unscaled; returns the norm of the unscaled gradients.

        The gradients carry the factor mu until the optimizer step (which unscales inside its fused kernel), so
        they are scaled by ``min(1, max_norm / (norm / mu))``: the true gradients' clipping, exact in the scale
        since mu is a power of two. The norm is accumulated in fp32 (FP8 weights' gradients are fp16 at O2, whose
        range a norm over many values can exceed). Under FSDP2 and tensor parallelism Accelerate's own clipping runs,
        on the scaled gradients: torch's 1e-6 guard against a zero norm then counts in their units (a relative
        difference of 1e-6 / (mu * norm) from the unscaled clipping, seen only for norms near 1e-6). After
        :meth:`unscale_gradients` it clips the scaled values that call kept (fp16 gradients divided by mu lose bits,
        or become 0), and leaves the gradients unscaled again, as it found them.
        """
        if self.fp8_grad_scaler is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        check_clip_limit("accelerator.clip_grad_norm_", "max_norm", max_norm)
        norm_type = checked_norm_type("accelerator.clip_grad_norm_", norm_type)
        parameters = unique(parameters)
        unscaled = self._fp8_optimizer.unscaled if self._fp8_optimizer is not None else None
        if unscaled is not None:  # after unscale_gradients: clip the scaled values it kept, not the rounded quotients
            self._fp8_optimizer.scale_back()
        try:
            return self._fp8_clip_grad_norm(parameters, max_norm, norm_type)
        finally:
            if unscaled is not None:  # the script reads unscaled gradients on, as before the call
                self._fp8_optimizer.unscale(unscaled.mu)

    def _fp8_clip_grad_norm(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        mu = self._fp8_grad_factor(parameters)
        if self.is_fsdp2 or self._fp8_tp_enabled:  # DTensor gradients: Accelerate's mesh-aware clipping, scaled
            self._fp8_clipping = True  # its unscale_gradients call leaves mu as it is
            try:
                total = super().clip_grad_norm_(parameters, max_norm * mu, norm_type)
            finally:
                self._fp8_clipping = False
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
            total = total / mu
        else:
            total = clip_grad_norm_fp32(parameters, max_norm, norm_type, grad_scale=mu)
        self._fp8_grad_norm = total.detach()
        return total

    @override
    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        if self.fp8_grad_scaler is None or self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            return super().clip_grad_value_(parameters, clip_value)  # Accelerate refuses it under FSDP and DeepSpeed
        check_clip_limit("accelerator.clip_grad_value_", "clip_value", clip_value)
        refusals.check_clippable(self._fp8_prepared_optimizer(), "accelerator.clip_grad_value_")
        self._fp8_note_grad_norm()
        parameters = unique(parameters)
        clip_grad_value_keeping_overflow_(parameters, clip_value * self._fp8_grad_factor(parameters))

    def _fp8_note_grad_norm(self) -> None:
        # health/grad_norm, as TrainingHealthMonitor's: the norm of the true gradients (held FP8 ones included) before
        # anything clips them, once per step: at the script's unscale_gradients or clip_grad_value_ (its own clipping
        # follows), else before the step; accelerator.clip_grad_norm_ records the norm it returns instead.
        if self._fp8_grad_norm is None and self._fp8_optimizer is not None:
            trained = [p for group in self._fp8_optimizer.optimizer.param_groups for p in group["params"]]
            self._fp8_grad_norm = parallel.grad_norm_fp32(trained, self._fp8_grad_factor(trained))

    def _fp8_before_step(self) -> None:
        # health/param_norm, as TrainingHealthMonitor's: the norm of the weights this step's loss came from (O2 masters
        # count unscaled, DTensor shards reduce over their mesh); and the gradient norm if nothing took it yet.
        params = [p for model in self._fp8_models for p in model.parameters()]
        self._fp8_param_norm = global_norm(params, device=self.device)
        self._fp8_note_grad_norm()

    def _fp8_on_step(self, stepped: bool) -> None:
        # Called by the prepared optimizer after each (possibly skipped) step: feed the health monitor.
        step = self._fp8_steps
        self._fp8_steps += 1
        # This step's records, taken and cleared first: an error below cannot leave them to the later steps.
        losses, grad_norm, param_norm = self._fp8_loss, self._fp8_grad_norm, self._fp8_param_norm
        self._fp8_loss, self._fp8_grad_norm, self._fp8_param_norm = [], None, None
        samples, tokens, seconds = self._fp8_work.take()
        loss = torch.stack(losses).mean() if losses else None
        events = []
        if not stepped:  # the event says what the scaler did: skipped, mu lowered, and a fallback it ran then
            fallbacks = []
            if self.fp8_grad_scaler is not None:
                fallbacks, self._fp8_fallback_seen = scaler_fallbacks(
                    self.fp8_grad_scaler.history, self._fp8_fallback_seen
                )
            events.append(self.fp8_health.record_nonfinite(step, "grad", skipped_step_action(fallbacks)))
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        # A skipped step's norm (non-finite) stays out of the monitor's series and spike tests, but is still logged
        # as this step's health/grad_norm, as TrainingHealthMonitor logs it under Lightning.
        self._fp8_skipped_grad_norm = None if stepped or grad_norm is None else (step, float(grad_norm))
        events += self.fp8_health.observe(
            step, loss=loss, grad_norm=grad_norm if stepped else None, param_norm=param_norm, samples=samples,
            tokens=tokens, seconds=seconds, memory_gib=memory_gib(self.device)["peak"],
        )  # fmt: skip
        for event in events:
            if self.is_main_process:
                logger.warning(f"lightning_fp8 health: {event.message} (action: {event.action})")
