"""FP8AdamW's state dicts and the statistics of its states: the methods, over :mod:`~lightning_fp8.optim.checkpoint`.

``state_dict()`` exports what ``torch.optim.Optimizer`` does, plus the scaled low-precision states with their scales
and amaxes (and the masters kept in the parameters' storage); ``load_state_dict()`` checks everything before it loads
anything, from FP8AdamW or ``torch.optim.AdamW``; ``to_adamw_state_dict()`` and ``fp8_state_stats()`` read the states
out. The work is done by :mod:`~lightning_fp8.optim.checkpoint` and the modules beside it; this is the optimizer's
surface for it, apart from its settings and step. :class:`_StateDict` is a base of FP8AdamW, before
``torch.optim.Optimizer``, whose ``state_dict`` and ``load_state_dict`` it extends.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_fp8.optim import checkpoint


class _StateDict:
    """FP8AdamW's state-dict methods and :meth:`fp8_state_stats` (see the module docstring)."""

    @override
    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.AdamW``'s, plus per FP8 weight the scaled states, their 0-dim scales and amaxes.

        An adopted weight's master (its parameter's storage) is included as ``"master"``, so the optimizer state
        alone restores it. For a sharded (DTensor) parameter, each 0-dim scale and amax (of this rank's shard) is
        exported as a DTensor sharded like the parameter with one element per row of its sharded dimension (shape
        ``(rows, 1)`` under FSDP2), so that torch.distributed.checkpoint keeps every rank's and reshards them on
        another number of ranks (:mod:`~lightning_fp8.optim.checkpoint`). The parameters FSDP1 flattened (original
        parameters, or flat ones) have their states exported as fp32 values (a scale of 1, no amax, no master of an
        fp32 parameter), so that torch's ``FSDP.optim_state_dict`` and ``get_state_dict`` gather and reshard them
        (:func:`~lightning_fp8.optim.checkpoint.fsdp1_by_value`). Loads with ``torch.load(weights_only=True)``.
        """
        self._grad_casts.flush(self)
        return super().state_dict()  # with _export_states first among the post-hooks

    def _export_states(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # The first state-dict post-hook (registered in __init__ as a plain function, called with the optimizer), so
        # that the user's see the masters, the sharded scales and FSDP1's by-value states as they are saved.
        return checkpoint.shard_scalars(
            self, checkpoint.fsdp1_by_value(self, checkpoint.with_masters(self, state_dict))
        )

    @override
    @torch.inference_mode(False)  # training state, never inference tensors: see FP8AdamW.__init__'s adoption
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of FP8AdamW (any level, sharded or not) or of ``torch.optim.AdamW`` (converted: the master
        stays the parameter's current value, the moments are stored in this optimizer's dtypes with fresh scales; the
        fp16 moments of an fp16 model's AdamW, which carry no scale, load as their values). A ``torch.optim.Adam``
        group loads as into ``torch.optim.AdamW``: its ``decoupled_weight_decay=False`` becomes True, so an L2
        ``weight_decay`` continues as AdamW's decoupled decay (the constructor refuses such a group; set its decay to 0
        in the state dict to drop it).

        Everything is checked before anything is loaded: on an error, the optimizer and the weights are unchanged. As in
        ``torch.optim.Optimizer``, the hooks of ``register_load_state_dict_pre_hook`` run first, on a shallow copy of
        ``state_dict`` (the dict one returns is what the next gets, and what is checked and loaded), and those of
        ``register_load_state_dict_post_hook`` once everything is loaded.

        Raises:
            ValueError: when the parameter groups do not match (as ``torch.optim.Optimizer``) or hold values the
                constructor refuses (NaN, out of range, ``capturable``), or a state does not fit its parameter (wrong
                shape or dtype, missing entries, a scale or amax of the wrong shape or value, an amax below its state's
                values, inf or NaN values, a negative second moment, a bad step); the message names the parameter's
                index and the entry, and what to do. Also for a state dict of AMSGrad (a group with
                ``amsgrad=True``, a state with ``max_exp_avg_sq``), which FP8AdamW would continue without it.
        """
        state_dict = checkpoint.run_load_pre_hooks(self, state_dict)
        if self._unseen():  # checked before they are taken in (their weights' storage changes), and again after
            checkpoint.check(self, state_dict)
            self._admit_unseen()
        self._grad_casts.flush(self)
        checkpoint.load(self, state_dict)
        self._mark_masters()  # the loaded masters, not what the parameters held, are where the next step starts
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing: so that a load of
        several parts (a model, its optimizer, the FP8 state) can check every part before it loads any.

        The load_state_dict pre-hooks run first, as :meth:`load_state_dict` runs them, and the dict they return is
        checked: a check then a load runs them twice (they should only transform the dict they are given)."""
        checkpoint.check(self, checkpoint.run_load_pre_hooks(self, state_dict))

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as a ``torch.optim.AdamW`` state dict with fp32 moments (no lock-in).

        The weights themselves come from ``model.state_dict()``, which exports adopted weights unscaled.
        """
        return checkpoint.to_adamw(self)

    def fp8_state_stats(self) -> dict[str, Any]:
        """Read-only snapshot (Python numbers, one host transfer): per FP8 weight (by index in the param groups) the
        scales and amaxes of its master and moments, their min/max, and the gradient scaler's statistics. Parameters
        with low-precision moments only (``low_precision_moments="all"``) are not listed."""
        self._grad_casts.flush(self)
        return checkpoint.stats(self)
