"""What ``torch.save(optimizer)`` and ``copy.deepcopy(optimizer)`` keep of :class:`~lightning_fp8.optim.FP8AdamW`.

``torch.optim.Optimizer`` pickles its defaults, state and parameter groups; FP8AdamW adds its settings, the master
scales of adopted weights (attributes of the parameters, which a parameter's deep copy drops) and the gradient cast
states, and registers its gradient hooks and state-dict export again on the copy. :class:`_Pickling` is a base of
FP8AdamW, before ``torch.optim.Optimizer``, whose ``__getstate__`` and ``__setstate__`` it extends.
"""

from __future__ import annotations

from typing import Any

from lightning_fp8.kernels.reference_grad_cast import grad_cast_state_buffers
from lightning_fp8.optim import apart, grad_cast, master
from lightning_fp8.optim.fp8_grads import _GRAD_OWNER_IDS, _OPTIMIZERS, hook_table

# The attributes an adopted weight carries besides its scaled storage (master.adopt).
_MASTER_ATTRS = (master.SCALE_ATTR, master.AMAX_ATTR, master.DTYPE_ATTR)


class _Pickling:
    """``__getstate__`` and ``__setstate__`` of FP8AdamW (see the module docstring)."""

    # FP8AdamW's own attributes that torch.save(optimizer) and copy.deepcopy keep as they are, besides
    # torch.optim.Optimizer's (defaults, state, param_groups); __setstate__ rebuilds the others.
    _PICKLED = (
        "recipe", "opt_level", "master_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "scale_update",
        "low_precision_moments", "emit_fp8_weights", "grad_scaler", "grad_dtype", "fp8_grads", "_low_precision",
        "_moments_only", "_master_amax", "skipped_grad_amax",
    )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        """What ``torch.save(optimizer)`` and ``copy.deepcopy(optimizer)`` keep: the copy steps its parameters as this
        optimizer steps these. Its parameters are those of the model saved or deep-copied with it (in the same call,
        as for ``torch.optim.AdamW``), else copies of the parameters; an adopted weight's master scale (an attribute
        of the parameter, which the parameter's deep copy drops) follows them. The FP8 gradient hooks are registered
        again on the copy's parameters. No gradient is kept (PyTorch keeps no ``param.grad`` either), not even the FP8
        gradients this optimizer holds; nor are the FP8 weight copies (the next emitting step writes them)."""
        adopted = [p for p in self._low_precision if master.master_scale(p) is not None]
        return {
            **super().__getstate__(),
            **{name: getattr(self, name) for name in self._PICKLED},
            "_extra_fp8_params": [
                p for group in self.param_groups for p in group["params"] if id(p) in self._extra_fp8_params
            ],
            # int64 with float32 views, which torch.save refuses: the views are made again on loading.
            "_grad_cast_states": {p: packed for p, (packed, _) in self._grad_cast_states.items()},
            "_grad_cast_bucket_bytes": self._grad_casts.bucket_bytes,
            "_hooked": list(self._hooks),
            # Put into param_groups without add_param_group and not taken in yet (adoption._admit_unseen).
            "_unadmitted": [p for group in self.param_groups for p in group["params"] if p not in self._admitted],
            "_plain_at_admission": [
                p for group in self.param_groups for p in group["params"] if p in self._plain_at_admission
            ],
            "_masters": {p: tuple(getattr(p, attr) for attr in _MASTER_ATTRS) for p in adopted},
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_hooked" not in state:  # torch.optim.Optimizer.load_state_dict updates state and param_groups this way
            super().__setstate__(state)
            for group in self.param_groups:  # as torch.optim.AdamW: a loaded torch.optim.Adam group's L2 flag
                if "decoupled_weight_decay" in group:
                    group["decoupled_weight_decay"] = True
            return
        state = dict(state)
        masters, hooked, unadmitted = state.pop("_masters"), state.pop("_hooked"), state.pop("_unadmitted", [])
        plain_ids = {id(p) for p in state.pop("_plain_at_admission", [])}
        cast_states, extra = state.pop("_grad_cast_states"), state.pop("_extra_fp8_params")
        self._grad_casts = grad_cast.GradCastQueue(state.pop("_grad_cast_bucket_bytes"))
        super().__setstate__(state)
        for p, values in masters.items():
            for attr, value in zip(_MASTER_ATTRS, values, strict=True):
                if not hasattr(p, attr):
                    setattr(p, attr, value)
        self._extra_fp8_params = {id(p) for p in extra}
        self._grad_cast_states = {p: (packed, grad_cast_state_buffers(packed)) for p, packed in cast_states.items()}
        self._pending, self._stepped_fp8_grads, self._held = {}, [], None
        unadmitted_ids = {id(p) for p in unadmitted}
        self._admitted = {p for group in self.param_groups for p in group["params"] if id(p) not in unadmitted_ids}
        self._plain_at_admission = {p for group in self.param_groups for p in group["params"] if id(p) in plain_ids}
        self._conversions_seen = None  # the copy's first step checks them (see _Adoption._check_not_converted_since)
        self._fp8_unscale, self._fp8_in_step, self._adopting = None, False, None
        self._hooks, self._grad_owner_id = hook_table(self), next(_GRAD_OWNER_IDS)
        _OPTIMIZERS.add(self)
        self._mark_masters()
        for p in hooked:
            self._register_grad_hook(p)
        # torch.optim.Optimizer pickles no hooks (a copy starts without the user's): register the export again.
        from lightning_fp8.optim.adamw import FP8AdamW  # (adamw imports this module)

        self.register_state_dict_post_hook(FP8AdamW._export_states, prepend=True)

    def _mark_masters(self) -> None:
        # Masters kept apart (optim/apart.py) as they are now: a write to their parameters from here on reaches them.
        self._master_marks = {p: apart.mark(p) for p, state in self.state.items() if "master" in state}
