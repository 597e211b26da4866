"""The bases of :class:`~lightning_fp8.FP8GradScaler` (:mod:`lightning_fp8.grad_scaler`), one concern each.

- :mod:`~lightning_fp8.grad_scaling.readings`: mu and the counts, read-only for monitoring.
- :mod:`~lightning_fp8.grad_scaling.losses`: scaling the loss by mu, and which mu the gradients then carry.
- :mod:`~lightning_fp8.grad_scaling.model`: the FP8 model whose ``grad_output`` scales mu changes rescale.
- :mod:`~lightning_fp8.grad_scaling.reports`: what the gradient casts and checks report per source, agreed across
  data-parallel ranks.
- :mod:`~lightning_fp8.grad_scaling.rules`: how ``update()`` halves or doubles mu and runs the fallback.
- :mod:`~lightning_fp8.grad_scaling.unscaling`: clipping and unscaling gradients outside FP8AdamW's fused step.
- :mod:`~lightning_fp8.grad_scaling.state`: the scaler's state dict, checked, and pickling.
"""
