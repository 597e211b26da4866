"""Which parameters of :class:`~lightning_fp8.optim.FP8AdamW` get low-precision states, and where their masters live.

At O2 an FP8 linear weight is *adopted*: its storage becomes the fp16 master, scaled by a power of two
(:mod:`~lightning_fp8.optim.master`), and its moments are low precision; with ``low_precision_moments="all"`` every
other parameter gets the low-precision moments only. :meth:`_Adoption.release` and
:meth:`_Adoption.release_weights` undo it (the recovery "back to high precision", and handing the model to other code);
:meth:`_Adoption._init_state` creates each parameter's states at its first step, and
:meth:`_Adoption._check_storages` refuses a step whose weights' storages no longer hold this optimizer's masters;
:meth:`_Adoption._admit_unseen` takes in parameters put into ``param_groups`` without ``add_param_group``.
:class:`_Adoption` is a base of FP8AdamW and reads its settings.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_fp8.optim import apart, checkpoint, master, shards
from lightning_fp8.optim import step as step_
from lightning_fp8.optim.grad_cast import FP8Grad as _FP8Grad

_FP32 = torch.float32


class _Adoption:
    """Adoption of parameters, their release, and the creation of their states (see the module docstring)."""

    def _warn_if_layers_differ(self, params: list[torch.Tensor]) -> None:
        """Warn when FP8 layers among ``params`` were converted with another opt level or gradient format than the
        default recipe this optimizer was built with (no ``recipe=``, no ``opt_level=``): a model converted with
        ``"fp8-lm-o1"`` would otherwise get O2's fp16 masters without a word."""
        # The gradient format matters only where this optimizer casts the gradients (fp8_grads).
        unlike = {
            f"opt level {r.opt_level}, gradients in {str(r.backward_dtype).removeprefix('torch.')}"
            for r in master.layer_recipes(params)
            if r.opt_level != self.opt_level or (self.fp8_grads and r.backward_dtype != self.grad_dtype)
        }
        if unlike:
            warnings.warn(
                f"FP8AdamW was built without recipe= and so steps with the default recipe 'fp8-lm' (opt level "
                f"{self.opt_level}, FP8 gradients in {str(self.grad_dtype).removeprefix('torch.')}), but FP8 layers "
                f"among its parameters were converted with {' / '.join(sorted(unlike))}. Pass the layers' recipe "
                "(FP8AdamW(..., recipe=recipe)) to match them, or recipe='fp8-lm' to keep the default and silence this",
                stacklevel=3,
            )

    def _check_params(self, params: list[torch.Tensor], g: int) -> None:
        """Raise TypeError or ValueError for a parameter of group ``g`` this optimizer cannot step (see the checks)."""
        seen: set[int] = set()
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(
                    f"FP8AdamW: parameter {i} of parameter group {g} appears in the group more than once (torch.optim "
                    "deprecates this and steps it once per listing): list each parameter once (e.g. "
                    "list(dict.fromkeys(params)))"
                )
            seen.add(id(p))
            if p.is_complex():
                raise TypeError(
                    f"FP8AdamW got a complex parameter of shape {tuple(p.shape)}: FP8 training has no complex "
                    "formats; optimize it with torch.optim.AdamW (e.g. a second optimizer)"
                )
            if p.dtype == torch.float64:
                raise TypeError(
                    f"FP8AdamW got a float64 parameter of shape {tuple(p.shape)}: it steps in fp32 arithmetic, "
                    "which would drop the updates float64 keeps; convert the model to float32 first "
                    "(model.float()), or optimize float64 parameters with torch.optim.AdamW (a second optimizer)"
                )
            # A parameter made under torch.inference_mode() has no autograd history (no gradient accumulator to check
            # at O2: an AttributeError deep inside), and torch refuses the in-place updates of its step. Frozen ones,
            # never stepped, are left as torch.optim.AdamW leaves them.
            if p.requires_grad and p.is_inference():
                raise ValueError(
                    f"FP8AdamW got parameter {i} of parameter group {g}, of shape {tuple(p.shape)}, created under "
                    "torch.inference_mode(): an inference tensor cannot be trained (torch refuses to update it in "
                    "place or save it for a backward). Build or materialize the model outside inference_mode (or "
                    "freeze it: requires_grad_(False)); nothing was changed"
                )
            # Before check_adoptable: a pruned layer's computed weight holds the accumulator (no DDP involved).
            where = f"parameter {i} of parameter group {g}"
            master.check_not_reparametrized(p, where)
            master.check_shareable(p, where, self._settings(), self._storage_master_dtype(p))
        self._check_grad_hooks_allowed(params)

    def _unseen(self) -> list[torch.Tensor]:
        """The parameters of ``param_groups`` that :meth:`add_param_group` did not take in; their groups get the
        defaults of the keys they lack, as ``add_param_group`` gives them."""
        unseen = []
        for group in self.param_groups:
            new = [p for p in group["params"] if p not in self._admitted]
            if new:
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                unseen += new
        return unseen

    def _admit_unseen(self) -> None:
        """Take in the parameters put into ``param_groups`` without :meth:`add_param_group` (``optimizer.param_groups =
        groups``, as Lightning's ``BaseFinetuning`` does when a fit resumes), checked and adopted as it would: else
        their FP8 weights would step with fp32 states (16 bytes per parameter, not 6) and a checkpoint's O2 states
        would load into those. Runs before a load and a step (a few hundred set lookups). Where the weight's gradient
        accumulator is held (a step's ``loss`` still referenced, DDP) its master is kept apart from its storage."""
        unseen = self._unseen()
        if not unseen:
            return
        for g, group in enumerate(self.param_groups):
            if any(p not in self._admitted for p in group["params"]):
                step_.check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
                self._check_params(group["params"], g)
        for p in unseen:
            if p not in self._low_precision and self._wants_low_precision(p):
                # An output of a forward still referenced (a step's loss) or DDP's reducer holds the gradient
                # accumulator, which taking the storage would leave behind: the master is kept apart (as a frozen
                # weight's is), with O2 states all the same.
                self._adopt(p, take_storage=not master.accumulator_held(p))
        self._register_o1_grad_hooks(unseen)
        self._claim_grads(unseen)
        self._admit(unseen)
        self._held = None

    def _admit(self, params: list[torch.Tensor]) -> None:
        """Note ``params`` as taken in, and those of them that are no FP8 weight now, which a later
        ``convert_to_fp8`` could make one (see :meth:`_check_not_converted_since`)."""
        self._admitted.update(params)
        self._plain_at_admission.update(p for p in params if not master.is_fp8_weight(p))

    def _check_not_converted_since(self) -> None:
        """Raise RuntimeError, before anything is stepped, if ``convert_to_fp8`` made FP8 weights of parameters this
        optimizer took in as plain ones and would treat otherwise as FP8 weights: O2 states (fp16 master in the
        weight's storage, FP8 and fp16 moments) or, with ``fp8_grads``, the FP8 gradient hook. Their states were made
        for plain parameters (fp32), and would train so without a word (16 bytes per parameter, not 6). Runs only
        after a conversion (``master.conversions`` changed), over the parameters that were plain when taken in."""
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p not in self._plain_at_admission or not master.is_fp8_weight(p) or p in self._low_precision:
                    continue
                if p not in self._hooks and (self._wants_low_precision(p) or self._gets_grad_hook(p)):
                    raise RuntimeError(
                        f"FP8AdamW.step: parameter {i} of parameter group {g} (shape {tuple(p.shape)}) became an FP8 "
                        f"layer's weight (convert_to_fp8) after this {self._settings()} was built, which took it for a "
                        "plain parameter: it would train it with fp32 states and a high-precision gradient, not as an "
                        "FP8 weight at this level. Convert the model first, then build the optimizer: model = "
                        "convert_to_fp8(model, recipe); optimizer = FP8AdamW(model.parameters(), recipe=recipe). "
                        "Nothing was stepped"
                    )
        self._conversions_seen = master.conversions

    def _is_own_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is its own master while it is fp32 (a parameter with fp32 states, or with low-precision
        moments only), not an FP8 weight whose fp16 master is in its storage or kept apart."""
        return p not in self._low_precision or p in self._moments_only

    def _master_back_in_param(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """An fp32 master kept apart for a parameter that is fp32 again (``model.float()`` after ``model.bfloat16()``):
        the parameter takes the master's value and is its own master again, as a parameter fp32 from the start."""
        if p.dtype == torch.float32 and "master_scale" not in state and self._is_own_master(p):
            with torch.no_grad():
                p.copy_(state.pop("master"))
            self._master_marks.pop(p, None)

    def _wants_low_precision(self, p: torch.Tensor) -> bool:
        if master.is_fp8_weight(p) or id(p) in self._extra_fp8_params:
            return (self.master_dtype, self.exp_avg_dtype, self.exp_avg_sq_dtype) != (_FP32,) * 3
        return self.low_precision_moments == "all" and (self.exp_avg_dtype, self.exp_avg_sq_dtype) != (_FP32,) * 2

    def _storage_master_dtype(self, p: torch.Tensor) -> torch.dtype | None:
        """The dtype of the master this optimizer would keep in the storage of ``p``, an FP8 weight (``master_dtype``),
        or ``None`` where ``p`` itself is the master (fp32 states: O1)."""
        return self.master_dtype if self._wants_low_precision(p) else None

    def _settings(self) -> str:
        """This optimizer's level and master dtype, as its error messages name it."""
        return f"FP8AdamW(opt_level={self.opt_level!r}, master_dtype={self.master_dtype})"

    def _takes_storage(self, p: torch.Tensor) -> bool:
        """Whether :meth:`_adopt` makes ``p``'s storage the master, changing its dtype. Not a sharded weight (a
        DTensor, or a view of FSDP1's flat parameter): their masters are kept apart."""
        sharded = shards.is_dtensor(p) or shards.is_fsdp1_view(p)
        shareable = master.is_fp8_weight(p) and not sharded and p.requires_grad
        return shareable and master.master_scale(p) is None and p.dtype != self.master_dtype

    def _adopt_all(self, params: list[torch.Tensor]) -> None:
        """:meth:`_adopt` each of ``params``, once all are known to take it (else RuntimeError, nothing changed)."""
        for p in params:
            if self._takes_storage(p):
                master.check_adoptable(p)  # under DDP's hooks: raise before any weight changes
        for p in params:
            self._adopt(p)

    def _adopt(self, p: torch.Tensor, take_storage: bool = True) -> None:
        """Give ``p`` O2 states; an FP8Linear weight also gives its storage to the master (unless not
        ``take_storage``: its master is then kept apart, see :meth:`_init_state`)."""
        # No entry in self.state before the first step: torch.distributed.checkpoint creates the states of an
        # optimizer whose ``state`` is empty (a zero-gradient step); a non-empty one is taken as initialized, and
        # its state dict then lacks every other parameter (the load of a sharded checkpoint fails).
        # A frozen weight (requires_grad=False) keeps its storage, as torch.optim leaves it untouched; should it get
        # gradients later, its master is kept apart (see _init_state).
        self._low_precision.add(p)
        if not (master.is_fp8_weight(p) or id(p) in self._extra_fp8_params):
            self._moments_only.add(p)  # low_precision_moments="all": only the moments
            return
        grad = None
        if take_storage and self._takes_storage(p):
            grad = p.grad  # of the old dtype: master.adopt drops it, kept below
            master.adopt(p, self.master_dtype)
        # Adopted now or earlier, or kept apart where the weight already has the master's dtype (else fp8_grads was
        # ignored there without a word: a model.half() weight's gradient stayed fp16, an fp32 master's fp32).
        if self._gets_grad_hook(p):
            self._register_grad_hook(p)
        if grad is not None:  # a backward before the optimizer took the weight: its next step applies it
            if p in self._hooks:
                self.accumulate_fp8_grad(p, grad)
            else:
                with torch.no_grad():
                    p.grad = grad.to(p.dtype)  # in true units, as the layer's backward writes it (not the storage's)

    @torch.inference_mode(False)  # training state, never inference tensors: see FP8AdamW.__init__'s adoption
    def release(self, p: torch.Tensor) -> None:
        """Turn ``p`` back into a plain parameter with fp32 states (the recovery "back to high precision"): fp32
        moments, and an fp32 master kept apart where ``p`` is not fp32, as for any parameter of that dtype. A gradient
        not stepped yet is handed back to ``p.grad`` (a pending FP8 one dequantized), in ``p``'s dtype.

        At O1 (fp32 states already) it only stops holding ``p``'s gradient in FP8: the hook is removed and a pending
        FP8 gradient is handed back.

        Raises:
            TypeError: for a ``p`` that is not a tensor (one parameter per call).
            ValueError: for a ``p`` in none of this optimizer's parameter groups (nothing of it to release).
        """
        # Else a parameter of another optimizer (or None) was released without a word, and a list failed with
        # "unhashable type: 'list'".
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"FP8AdamW.release takes one parameter (a tensor), got {type(p).__name__}: call it once per parameter"
            )
        if not self._holds(p):
            raise ValueError(
                f"FP8AdamW.release: the parameter of shape {tuple(p.shape)} is in none of this FP8AdamW's parameter "
                "groups, so it holds nothing of it to release: call release on the optimizer that holds it; nothing "
                "was released"
            )
        if p not in self._low_precision:
            if not self._unhook(p):
                return
            self._grad_casts.flush(self)
            self._hand_back_grad(p, self._pending.pop(p, None))
            return
        self._grad_casts.flush(self)
        state = self.state[p]
        moments = {key: checkpoint.dequantize(state, key) for key in ("exp_avg", "exp_avg_sq") if key in state}
        if p in self._moments_only:  # its master already is what a plain parameter's is (the param, or fp32 apart)
            kept = {key: state[key] for key in ("step", "master") if key in state}
            self._moments_only.discard(p)
            self._master_amax.pop(p, None)
        else:
            kept = self._release_master(p, state)
        self._low_precision.discard(p)
        self.state[p] = {**kept, **moments}

    def _release_master(self, p: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """Give the FP8 weight ``p`` its own storage back, in its own dtype, holding its master's value, and its
        gradient back to ``p.grad`` in that dtype. Returns what of ``state`` it keeps as a plain parameter: ``step``
        and, where ``p`` is not fp32, the master in fp32, kept apart as :meth:`_init_state` keeps it (in bf16 storage
        alone, updates below the weight's rounding would be lost)."""
        kept: dict[str, Any] = {"step": state["step"]} if "step" in state else {}
        value = None  # the master, unscaled fp32
        if "master" in state:  # kept apart: what was written to p since the last step comes first, as in a step
            apart.take_writes(p, state, self._master_marks.get(p))
            value = checkpoint.dequantize(state, "master")
            with torch.no_grad():
                p.copy_(value)
        elif master.master_scale(p) is not None:  # in p's storage (the scale is not moved by module.to(), see export)
            value = p.detach().float() / master.master_scale(p).to(p.device)
        self._unhook(p)
        grad, entry = p.grad, self._pending.pop(p, None)  # master.release drops p.grad (in the storage's dtype)
        master.release(p)
        setattr(p, master.MARKER, False)
        if grad is not None:
            p.grad = grad.to(p.dtype)
        self._hand_back_grad(p, entry)
        if "step" in kept and value is not None and p.dtype != _FP32:
            kept["master"] = value
            self._master_marks[p] = apart.mark(p)  # a write to p from now on reaches the master at the next step
        return kept

    def _hand_back_grad(self, p: torch.Tensor, entry: _FP8Grad | None) -> None:
        """Add the pending FP8 gradient ``entry`` of ``p`` (if any) to ``p.grad``, dequantized in ``p``'s dtype."""
        if entry is not None:
            with torch.no_grad():
                grad = (entry.data.float() * entry.scale_inv).to(p.dtype)
                p.grad = grad if p.grad is None else p.grad + grad

    @torch.inference_mode(False)  # training state, never inference tensors: see FP8AdamW.__init__'s adoption
    def release_weights(self) -> None:
        """Give every FP8 weight whose storage holds this optimizer's fp16 master its own storage back: the unscaled
        weight, in the model's dtype. The masters move into the optimizer's state, kept apart from the parameters (as
        for sharded weights), so the optimizer can go on (each step then also writes the weights) and its state dict
        means what it meant. The weights stay FP8 weights: a new FP8AdamW takes their storage again. Gradients not
        stepped yet are dropped (they had the storage's dtype and scale): call it after a step.

        For handing the model to other code after FP8 training: another optimizer or precision (the storage would
        otherwise hold ``weight * scale`` in fp16, which they would train as the weight), code that reads
        ``param.data``. The Lightning plugin calls it when a fit ends, ``Accelerator.free_memory`` likewise.
        Afterwards the masters are the optimizer's own, kept apart: a write to a weight (``model.load_state_dict``)
        reaches its master at the next step (:mod:`lightning_fp8.optim.apart`). Each weight's dtype has changed, so
        call it on a model no DDP wrapper will run again (DDP's hooks sit on the old gradient accumulators)."""
        self._grad_casts.flush(self)
        released = False
        for p in list(self._low_precision):
            scale = master.master_scale(p)
            if scale is None or p in self._moments_only:
                continue
            released = True
            self._unhook(p)  # fp8_grads: only adopted weights are hooked
            self._pending.pop(p, None)  # a gradient not stepped yet is dropped, as release() drops it
            stored, amax, state = p.detach(), getattr(p, master.AMAX_ATTR), self.state.get(p)
            master.release(p)  # (param.grad too: it had the storage's dtype)
            if state:  # stepped: the stored master, its scale and amax now live in the state (else _init_state)
                # (on the master's device: Lightning's teardown moves the model and the states, not the attributes)
                state.update(master=stored, master_scale=scale.to(stored.device), master_amax=amax.to(stored.device))
                self._master_marks[p] = apart.mark(p)  # writes to the released weight from now on reach the master
        if released and self.grad_scaler is not None:  # the dropped gradients' casts no longer count for a step
            self.grad_scaler._discard(self)

    def _check_storages(self) -> None:
        """Raise RuntimeError for a weight whose storage holds a master (:func:`master.adopt`) that this optimizer does
        not step there: another FP8AdamW took it after this one was created (:func:`master.check_not_taken`), or the
        model was cast to another dtype since (:func:`master.check_storage_dtypes`)."""
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if master.master_scale(p) is not None:  # (about 0.3 us of host time per parameter and step)
                    # This optimizer steps the storage as its master where p has O2 states and no master kept apart
                    # (after release_weights(), or for a weight frozen when this one was built: see _init_state).
                    in_storage = p in self._low_precision and p not in self._moments_only
                    in_storage = in_storage and "master" not in self.state.get(p, ())
                    master.check_not_taken(p, f"parameter {i} of parameter group {g}", in_storage)
        master.check_storage_dtypes(self._low_precision, self.master_dtype)

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        # On the CPU as torch.optim.AdamW keeps it, whatever the default device (torch.set_default_device).
        state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
        if p not in self._low_precision:
            state["exp_avg"] = torch.zeros_like(p, dtype=_FP32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=_FP32, memory_format=torch.preserve_format)
            if p.dtype != _FP32:
                state["master"] = p.detach().float()
            return
        for key, dtype in (("exp_avg", self.exp_avg_dtype), ("exp_avg_sq", self.exp_avg_sq_dtype)):
            # zeros_like: a sharded (DTensor) parameter gets states sharded the same way
            state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state[f"{key}_scale"] = torch.ones((), dtype=_FP32, device=p.device)
            state[f"{key}_amax"] = torch.zeros((), dtype=_FP32, device=p.device)
        if p in self._moments_only:  # the master is the parameter, or an fp32 copy as for plain parameters
            if p.dtype != _FP32:
                state["master"] = p.detach().float()
        elif master.master_scale(p) is not None:  # the parameter's storage is the master (see _adopt)
            state["master_scale"] = master.master_scale(p)
            state["master_amax"] = getattr(p, master.AMAX_ATTR)
        else:  # the master is kept apart from the parameter (this rank's shard of it)
            local = shards.local(p).detach().float()
            checkpoint.store(state, "master", local, self.master_dtype, local.shape, local.device)
            state["master"] = shards.like(p, state["master"])
