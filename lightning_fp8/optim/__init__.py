"""The precision-decoupled optimizer of FP8-LM (DESIGN.md "The precision-decoupled optimizer").

- :class:`FP8AdamW`: AdamW whose FP8-linear-weight states are low precision at O2 (fp16 master, E4M3 first
  moment, fp16 second moment, each with a power-of-two per-tensor scale) and whose step is one fused Triton
  kernel per group of tensors.
- :mod:`lightning_fp8.optim.master`: the O2 master weight kept in the parameter's own storage.
- :mod:`lightning_fp8.optim.checkpoint`: FP8AdamW's state dicts: saving with masters, loading any AdamW-like state.
- :mod:`lightning_fp8.optim.state_layout`: a parameter's states, their keys and dtypes, ``stored = value * scale``.
- :mod:`lightning_fp8.optim.shard_scales`: the scales and amaxes of sharded (DTensor) parameters in a state dict.
- :mod:`lightning_fp8.optim.state_checks`: the checks of a state dict before any of it is loaded.
- :mod:`lightning_fp8.optim.adamw_export`: the state as ``torch.optim.AdamW``'s (:func:`adamw_state_dict`: a saved
  FP8AdamW state dict as AdamW's, to resume without FP8).
- :mod:`lightning_fp8.optim.state_stats`: the scales and amaxes of the states, for monitoring.
- :mod:`lightning_fp8.optim.grad_cast`: the FP8 casts of the weights' gradients, queued by the gradient hooks and
  cast together.
- :mod:`lightning_fp8.optim.adoption`: which parameters get low-precision states (adopted weights), their release
  back to high precision, and the creation of their states.
- :mod:`lightning_fp8.optim.fp8_grads`: the gradient hooks and the FP8 gradients FP8AdamW holds for its step.
- :mod:`lightning_fp8.optim.state_dict`: FP8AdamW's state-dict methods and the statistics of its states.
- :mod:`lightning_fp8.optim.pickling`: what ``torch.save(optimizer)`` and ``copy.deepcopy`` keep.
"""

from lightning_fp8.optim.adamw import FP8AdamW
from lightning_fp8.optim.adamw_export import adamw_state_dict

__all__ = ["FP8AdamW", "adamw_state_dict"]
