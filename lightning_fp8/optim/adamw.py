"""FP8AdamW: AdamW with precision-decoupled states (FP8-LM, DESIGN.md "The precision-decoupled optimizer").

Bytes per FP8 linear weight at O2: fp16 master (2, kept in the parameter's own storage, see
:mod:`~lightning_fp8.optim.master`), E4M3 first moment (1), fp16 second moment (2), FP8 gradient (1):
6, against 16 for fp32 AdamW with an fp32 gradient. Each low-precision tensor carries a 0-dim fp32
power-of-two scale (``x_stored = x * scale``) renewed every step from the tensor's new amax. Every other
parameter (norms, biases, embeddings, excluded layers) keeps fp32 states, under the keys of
``torch.optim.AdamW``; with ``low_precision_moments="all"`` (as MS-AMP's O2 optimizer does) they keep their fp32
master and gradient but get the low-precision moments too: 11 bytes per parameter instead of 16.

Gradients of adopted weights reach the optimizer in fp16 (the parameter's dtype), multiplied by mu of the
gradient scaler (at O1 those of FP8Linear weights arrive in the weight's own dtype, fp32 usually, and are held in
FP8 the same way: 13 bytes per parameter with the fp32 master and moments); a post-accumulate-grad hook queues each,
and the queued ones are cast to FP8 (E5M2, per-tensor scale) together, freeing the fp16 copies
(:mod:`~lightning_fp8.optim.grad_cast`: when the queue reaches a bound, at the end of the backward pass, and before
anything reads them). The step runs in fp32 registers: one fused
multi-tensor Triton kernel per group of tensors on CUDA (kernels/adamw.py), its PyTorch reference elsewhere; both
give the same bits.

This module holds the optimizer's settings, parameter groups and step; its bases live beside it:
:mod:`~lightning_fp8.optim.adoption` (which parameters get low-precision states, and their release),
:mod:`~lightning_fp8.optim.fp8_grads` (the gradient hooks and the FP8 gradients held for the step),
:mod:`~lightning_fp8.optim.state_dict` (the state dicts and the statistics of the states) and
:mod:`~lightning_fp8.optim.pickling` (``torch.save`` and ``copy.deepcopy`` of the optimizer); the levels' state
dtypes and the checks of the constructor's arguments are in :mod:`~lightning_fp8.optim.settings`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_fp8 import ops
from lightning_fp8.optim import apart, checkpoint, grad_cast, master, shards
from lightning_fp8.optim import step as step_
from lightning_fp8.optim.adoption import _Adoption
from lightning_fp8.optim.fp8_grads import _GRAD_OWNER_IDS, _OPTIMIZERS, _FP8Grad, _FP8Grads, hook_table
from lightning_fp8.optim.fp8_grads import GRAD_OWNER_ATTR as GRAD_OWNER_ATTR  # its import path before the split
from lightning_fp8.optim.pickling import _Pickling
from lightning_fp8.optim.settings import fp8_param_ids, resolved_settings
from lightning_fp8.optim.state_dict import _StateDict
from lightning_fp8.recipe import FP8Recipe, check_flag

ScaleUpdate = Literal["one_pass", "two_pass"]
LowPrecisionMoments = Literal["fp8_weights", "all"]


class FP8AdamW(_Adoption, _FP8Grads, _StateDict, _Pickling, torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with FP8-LM's low-precision states.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (param groups, schedulers work as usual).
        recipe: an :class:`~lightning_fp8.FP8Recipe` or name; gives the default ``opt_level`` and the FP8 gradient
            format (``recipe.backward_dtype``). Default ``"fp8-lm"`` (O2); a warning names FP8 layers among the
            parameters that were converted with another opt level or gradient format (pass their recipe).
        opt_level: ``"O1"`` (fp32 master and moments everywhere; the FP8Linear weights' gradients in FP8, see
            ``fp8_grads``) or ``"O2"`` (low-precision states for FP8 linear weights); overrides the recipe's.
        master_dtype, exp_avg_dtype, exp_avg_sq_dtype: the states of FP8 linear weights; defaults per level
            (O2: fp16, E4M3, fp16; O1: fp32). fp16 and FP8 states carry a per-tensor scale. The choices: master fp32,
            fp16 or bf16; ``exp_avg`` fp32, bf16, fp16, E4M3 or E5M2; ``exp_avg_sq`` fp32, bf16 or fp16 (an FP8 second
            moment diverged in FP8-LM's experiments: not offered).
        grad_scaler: an :class:`~lightning_fp8.FP8GradScaler` (or None; anything else, ``torch.amp.GradScaler``
            among them, is a TypeError, and so is ``torch.amp.GradScaler.step(optimizer)``). Gradients are unscaled by
            its mu, the FP8 gradient casts report to it, and :meth:`step` routes through it (skip on non-finite, then
            ``update()``). Several optimizers may share one: each step then decides, and updates mu, on that
            optimizer's own gradients.
        fp8_params: more parameters to treat as FP8 linear weights (besides the weights FP8Linear marks); their
            master is kept apart from the parameter.
        fp8_grads: cast gradients of FP8 weights to FP8 as soon as they are accumulated, freeing the fp16 copy
            (at O1, the weight's fp32 copy: each FP8Linear weight that requires a gradient, not ``fp8_params``,
            nor sharded (DTensor) weights). Default: on unless ``torch.distributed`` is initialized, where it is
            refused: DDP reduces ``param.grad`` after the hook.
            The optimizer then holds those gradients, and ``param.grad`` is ``None``: only this optimizer's
            :meth:`zero_grad` drops them. ``model.zero_grad()`` (``nn.Module``'s) does not reach them, and nothing
            tells its call apart from the hook's own emptying of ``param.grad`` (it changes nothing then): discard
            a backward with ``optimizer.zero_grad()``, or use ``fp8_grads=False``.
        grad_cast_bucket_mb: with ``fp8_grads``, the gradient hooks queue the fp16 gradients and cast them together
            (two launches for any number on a GPU, bit for bit the casts one by one): when the queue reaches this many
            megabytes (2**20 bytes; it bounds the fp16 gradients an eager backward keeps alive), at the end of the
            backward pass, and before anything reads them. Default 0: each gradient is cast in its own hook (until
            a slow warm-up of a compiled GPT step seen with batched casts is explained: docs/benchmarks.md); 64 is a
            good value when host time matters.
        scale_update: how the kernel picks the new power-of-two scales of low-precision states. ``"one_pass"``
            (default): from an upper bound of the new amax known before the update (stored amaxes, gradient amax,
            Adam's step bound), so the states are read once and never saturate; a scale may be a binade or two
            lower than the fresh one. ``"two_pass"``: from the new amax itself, reading the inputs twice (1.5x the
            memory traffic). One pass needs ``beta1**2 < beta2`` (true for usual betas), else two passes run.
        maximize: maximize the objective, as in ``torch.optim.AdamW``.
        amsgrad: accepted for ``torch.optim.AdamW`` compatibility; only ``False`` (the AMSGrad maximum of the second
            moment is not implemented for low-precision states).
        foreach, fused: accepted for ``torch.optim.AdamW`` compatibility and without effect: the step is always one
            fused multi-tensor kernel per kind of state.
        capturable, differentiable: accepted for ``torch.optim.AdamW`` compatibility; only ``False`` (neither is
            implemented).
        emit_fp8_weights: the step also writes, for each FP8Linear weight, the FP8 copy (E4M3) the next forwards use
            instead of casting the weight (:mod:`lightning_fp8.weight_cache`). Costs up to 2 bytes per FP8 weight
            parameter between steps (the copy, and its transpose made by the first forward that needs it), saves
            the forward's weight cast (its amax pass and its cast). With ``scale_update="two_pass"`` the copy is
            the forward's own cast bit for bit; with one pass its scale comes from the same upper bound as the
            states' (a binade or so lower at times). The copy is never saved: after a resume, the next step makes
            it (until then the forward casts). Any change of the weight outside the step (``load_state_dict``,
            ``copy_``, ``param.data = ...``) invalidates it; a skipped step keeps it. Except an in-place write through
            ``param.data`` (``p.data.mul_(...)``, ``p.data.copy_(ema)``), which PyTorch does not record: write through
            the parameter under ``torch.no_grad()`` instead, or call ``lightning_fp8.weight_cache.drop(p)`` after
            it. Works at O1 and O2, eagerly and under ``torch.compile`` (checked as the compiled code runs); not for
            sharded (DTensor) weights, which keep casting.
        low_precision_moments: which parameters get the low-precision moments (``exp_avg_dtype``,
            ``exp_avg_sq_dtype``, each with its per-tensor scale). ``"fp8_weights"`` (default): FP8 linear weights
            (and ``fp8_params``); every other parameter keeps fp32 states. ``"all"``: every parameter, as MS-AMP's
            O2 optimizer does; parameters that are not FP8 weights keep their master in high precision (the
            parameter itself, or an fp32 copy for a bf16/fp16 one) and their gradient as it is, so an fp32
            embedding keeps 4 + 1 + 2 bytes of states per element instead of 4 + 4 + 4. The first moment of a
            parameter whose gradient spans more than E4M3's range in one tensor (an embedding's rare rows) loses
            its smallest values to zero between steps (the step's own gradient still enters the update); a first
            moment whose gradient vanished decays to zero, as in fp32 (docs/concepts/optimizer.md).

    Raises:
        ValueError: for a negative or non-finite lr, eps or weight_decay, betas outside [0, 1), a tensor among them
            of more than one element, an unknown level or state dtype, a ``grad_cast_bucket_mb`` that is not a number
            >= 0, ``amsgrad=True`` (here or in a parameter group, also one given to :meth:`add_param_group`),
            ``capturable=True`` or ``differentiable=True`` (the same), a parameter group with
            ``decoupled_weight_decay=False`` and a weight decay (Adam's L2 decay, which ``torch.optim.AdamW``
            honours), ``fp8_grads=True`` where ``torch.distributed`` is initialized (a backward raises RuntimeError
            once it is initialized after the optimizer was created with them). :meth:`step` raises the same for a
            group written to such values since.
        TypeError: for complex or float64 parameters (the step computes in fp32: use ``torch.optim.AdamW`` for
            float64 ones); for ``maximize``, ``emit_fp8_weights`` or ``fp8_grads`` other than True or False (a
            group's ``maximize`` too: ``"no"`` would switch it on), or ``fp8_params`` that is not an iterable of
            tensors.

    Example:
        >>> from torch import nn
        >>> from lightning_fp8 import convert_to_fp8
        >>> model = convert_to_fp8(nn.Sequential(nn.Linear(64, 64)))
        >>> opt = FP8AdamW(model.parameters(), lr=1e-3)
    """

    # torch.amp.GradScaler.step(optimizer) then hands its scale to step() instead of unscaling param.grad, where the
    # FP8 gradients the optimizer holds are not: step() refuses it (optim/step.py, refuse_torch_amp_step).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,  # positional as in torch.optim.AdamW; refused when true
        *,
        recipe: FP8Recipe | str | None = None,
        opt_level: str | None = None,
        master_dtype: torch.dtype | None = None,
        exp_avg_dtype: torch.dtype | None = None,
        exp_avg_sq_dtype: torch.dtype | None = None,
        grad_scaler: Any = None,
        fp8_params: Iterable[torch.Tensor] | None = None,
        fp8_grads: bool | None = None,
        scale_update: ScaleUpdate = "one_pass",
        maximize: bool = False,
        emit_fp8_weights: bool = False,
        grad_cast_bucket_mb: float = 0,
        low_precision_moments: LowPrecisionMoments = "fp8_weights",
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        step_.check_supported_flags(
            {"amsgrad": amsgrad, "capturable": capturable, "differentiable": differentiable, "maximize": maximize}
        )
        check_flag("FP8AdamW", "emit_fp8_weights", emit_fp8_weights)
        if fp8_grads is not None:
            check_flag("FP8AdamW", "fp8_grads", fp8_grads)
        step_.check_hyper_parameters(lr, betas, eps, weight_decay)
        step_.check_grad_scaler(grad_scaler)
        self.recipe, self.opt_level, dtypes = resolved_settings(
            recipe, opt_level, (master_dtype, exp_avg_dtype, exp_avg_sq_dtype), scale_update, low_precision_moments
        )
        self.master_dtype, self.exp_avg_dtype, self.exp_avg_sq_dtype = dtypes
        self.scale_update = scale_update
        self.low_precision_moments = low_precision_moments
        self.emit_fp8_weights = emit_fp8_weights
        self.grad_scaler = grad_scaler
        self.grad_dtype = self.recipe.backward_dtype
        self.fp8_grads = fp8_grads if fp8_grads is not None else not (dist.is_available() and dist.is_initialized())
        self._extra_fp8_params = fp8_param_ids(fp8_params)
        self._init_bookkeeping(grad_cast_bucket_mb)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(FP8AdamW._export_states, prepend=True)
        adopting, self._adopting = self._adopting, None
        # The constructor, add_param_group, load_state_dict, release and release_weights make training state (masters,
        # moments, step counts, a gradient handed over as FP8, the weights' own storage), which the next step updates
        # in place: made under torch.inference_mode() (an evaluation loop that builds the optimizer, rolls back to a
        # checkpoint, unfreezes layers or releases the weights) it would be inference tensors, which torch refuses to
        # update outside inference mode. So they make it with inference mode off.
        with torch.inference_mode(False):
            self._adopt_all(adopting)
        params = [p for group in self.param_groups for p in group["params"]]
        if recipe is None and opt_level is None:
            self._warn_if_layers_differ(params)
        self._register_o1_grad_hooks(params)
        self._claim_grads(params)
        _OPTIMIZERS.add(self)  # (see held_fp8_grads)

    def _init_bookkeeping(self, grad_cast_bucket_mb: float) -> None:
        """The optimizer's records of its parameters, gradients and hooks, empty: before any group is added."""
        self._low_precision: set[torch.Tensor] = set()  # params with O2 states
        self._moments_only: set[torch.Tensor] = set()  # those of them whose master is high precision (the param)
        self._master_amax: dict[torch.Tensor, torch.Tensor] = {}  # their master's amax, which the kernel writes
        self._pending: dict[torch.Tensor, _FP8Grad] = {}  # FP8 gradients waiting for the step
        self._held: set[torch.Tensor] | None = None  # the parameters of all groups: see _holds
        self._stepped_fp8_grads: list[torch.Tensor] = []  # the params the last step took an FP8 gradient of
        self._grad_casts = grad_cast.GradCastQueue(grad_cast.bucket_bytes(grad_cast_bucket_mb))  # fp16, to cast
        self._hooks = hook_table(self)  # {param: gradient hook handle}, removed when the optimizer is collected
        self._grad_owner_id = next(_GRAD_OWNER_IDS)  # see GRAD_OWNER_ATTR
        self._grad_cast_states: dict[torch.Tensor, tuple] = {}  # see _grad_cast_state
        self._master_marks: dict[torch.Tensor, apart.Mark | None] = {}  # masters kept apart: optim/apart.py
        self.skipped_grad_amax: dict[torch.Tensor, torch.Tensor] = {}  # gradient amaxes of the last skipped step
        self._fp8_unscale: float | None = None  # set while FP8GradScaler.step(self) runs the update through step()
        self._fp8_in_step = False  # step() is routing through self.grad_scaler (which then updates directly)
        self._adopting: list[torch.Tensor] | None = []  # the constructor's groups adopt together, after all are checked
        self._admitted: set[torch.Tensor] = set()  # the parameters taken in by add_param_group (see _admit_unseen)
        self._plain_at_admission: set[torch.Tensor] = set()  # those that were no FP8 weight then (see _admit)
        self._conversions_seen: int | None = master.conversions  # see _check_not_converted_since

    # -------------------------------------------------------------------------------------------- param handling
    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (e.g. layers unfrozen during training), checked as the constructor's.

        At O2 the group's FP8 weights become fp16 masters in their own storage here: no output of an earlier forward
        may still be referenced (``del loss`` first), or RuntimeError is raised and nothing is added.
        """
        if isinstance(param_group, dict):
            step_.check_supported_flags(param_group)
            step_.check_decoupled_decay(param_group, self.defaults.get("weight_decay", 0.0))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:  # a rejected group is not kept (nor stepped)
            step_.check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            step_.plain_hyper_parameters(group)
            self._check_params(group["params"], len(self.param_groups) - 1)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        wanted = [p for p in group["params"] if self._wants_low_precision(p)]
        adopting = getattr(self, "_adopting", None)  # a list while the constructor runs
        if adopting is not None:
            adopting.extend(wanted)
            self._admit(group["params"])
            return
        try:
            with torch.inference_mode(False):  # training state (see __init__)
                self._adopt_all(wanted)
        except RuntimeError:
            self.param_groups.pop()
            raise
        self._register_o1_grad_hooks(group["params"])
        self._claim_grads(group["params"])
        self._admit(group["params"])

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; also drops the FP8 gradients this optimizer holds, which
        ``model.zero_grad()`` cannot reach (their ``param.grad`` is ``None``, see ``fp8_grads``)."""
        if self._pending and checkpoint.is_state_init_step(self):  # after torch's state-making step: only its zeros
            super().zero_grad(set_to_none)
            return
        if not set_to_none:  # as torch.optim: a parameter that had a gradient keeps a zero one (and is stepped)
            self._grad_casts.flush(self)
            for p in (*self._stepped_fp8_grads, *self._pending):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self._stepped_fp8_grads = []
        super().zero_grad(set_to_none)
        self._pending.clear()
        self._grad_casts.clear()
        if self.grad_scaler is not None:  # the casts of the dropped gradients no longer count for this step
            self.grad_scaler._discard(self)

    # ------------------------------------------------------------------------------------------------------ step
    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step. With a ``grad_scaler``: its ``step(self)`` (agree across ranks, skip on non-finite
        gradients), then its ``update()`` of mu. ``grad_scaler.step(self)`` itself runs the update through this
        method (so that LR schedulers and step hooks see it), unscaled by its mu.

        ``torch.compile`` does not trace the update: ``torch.compile(optimizer.step)``, or a compiled function that
        calls it, runs it eagerly (it already is one fused kernel per group of tensors on a GPU); the closure, if any,
        runs first, as the caller's code.

        Returns:
            The closure's loss, when a closure is given.

        Raises:
            ValueError, TypeError: for a parameter group holding a value the constructor refuses (written since it was
                checked, e.g. ``group["amsgrad"] = True`` or an lr of NaN), before anything is stepped.
            TypeError: when ``torch.amp.GradScaler.step(optimizer)`` calls it (it cannot unscale the FP8 gradients:
                use :class:`~lightning_fp8.FP8GradScaler`), before anything is stepped.
            RuntimeError: when ``convert_to_fp8`` made FP8 weights of parameters this optimizer had taken in as plain
                ones (it was built before the conversion: build it after), before anything is stepped.
        """
        step_.refuse_torch_amp_step(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_after_closure()
        return loss

    @torch.compiler.disable  # host-side bookkeeping and fused kernels: eager inside a compiled caller
    @torch.no_grad()
    def _step_after_closure(self) -> None:
        self._admit_unseen()
        if self._conversions_seen != master.conversions:  # convert_to_fp8 ran since the last step: one int per step
            self._check_not_converted_since()
        if self._fp8_unscale is not None:  # FP8GradScaler.step(self) decided to step: unscale by its mu
            self._fp8_step(self._fp8_unscale)
        elif checkpoint.is_state_init_step(self):  # torch's state-making step: its zero gradients, not the scaler's
            if not self._pending:  # FP8-held gradients (param.grad None to torch): no step, as with gradients
                self._fp8_step(1.0)
        elif self.grad_scaler is not None:
            self._fp8_in_step = True  # the scaler updates directly (this call is the step schedulers and hooks see)
            try:
                self.grad_scaler.step(self)
            finally:
                self._fp8_in_step = False
            self.grad_scaler._update(judge_unstepped=False)  # this step's update: others' unscale_ stay theirs
        else:
            self._fp8_step(1.0)

    @torch.no_grad()
    def _fp8_step(self, grad_unscale: float) -> None:
        """The update itself, with every gradient multiplied by ``grad_unscale`` (1/mu; called by the scaler)."""
        self._check_storages()  # before anything is written
        for index, group in enumerate(self.param_groups):  # (a group may have been written since it was checked)
            step_.check_group_at_step(group, index)
        step_.check_dense_grads(self.param_groups)
        self._grad_casts.flush(self)
        for group in self.param_groups:
            live = []
            for p in group["params"]:
                grad, grad_scale_inv, grad_amax = self._grad_of(p)
                if grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    self._init_state(p, state)
                elif "master" in state:  # kept apart: what was written to p since the last step comes first
                    apart.take_writes(p, state, self._master_marks.get(p))
                    self._master_back_in_param(p, state)
                elif p.dtype != torch.float32 and self._is_own_master(p):
                    # Cast to bf16 / fp16 since its last step (model.half()): an fp32 master from now on, as a
                    # parameter of that dtype gets at its first step (else every update rounds into 16 bits).
                    state["master"] = p.detach().float()
                live.append([p, state, grad, grad_scale_inv, grad_amax])
            # The amaxes of high-precision gradients with low-precision states: a few launches for all of them.
            measured = [e for e in live if e[4] is None and e[0] in self._low_precision]
            for entry, amax in zip(measured, ops.amaxes([shards.local(e[2]) for e in measured]), strict=True):
                entry[4] = amax
            # Params at different step counts (some had no gradient at times) need their own bias correction.
            batches: dict[tuple, list[tuple]] = defaultdict(list)
            for (p, state, *grads), step in zip(live, step_.advance_steps([e[1]["step"] for e in live]), strict=True):
                item = step_.launch_item(self, p, state, *grads)
                batches[(p.device, step, *item[-1])].append(item[:-1])
            for key, items in batches.items():
                step_.launch(self, group, key[1], items, grad_unscale, emit=key[-1])
            self._master_marks.update((e[0], apart.mark(e[0])) for e in live if "master" in e[1])
        self._stepped_fp8_grads = list(self._pending)
        self._pending.clear()
