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
"""

from __future__ import annotations

import itertools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_fp8 import ops
from lightning_fp8.formats import E4M3, E5M2, fp8_max, is_fp8
from lightning_fp8.kernels.reference_grad_cast import grad_cast_state_buffers
from lightning_fp8.optim import apart, checkpoint, grad_cast, master, shards
from lightning_fp8.optim import step as step_
from lightning_fp8.recipe import FP8Recipe, resolve_recipe

ScaleUpdate = Literal["one_pass", "two_pass"]
LowPrecisionMoments = Literal["fp8_weights", "all"]

_FP32, _FP16, _BF16 = torch.float32, torch.float16, torch.bfloat16
# (master, exp_avg, exp_avg_sq) of FP8 linear weights per optimization level.
_LEVEL_DTYPES = {"O1": (_FP32, _FP32, _FP32), "O2": (_FP16, E4M3, _FP16)}
_ALLOWED = {
    "master_dtype": (_FP32, _FP16, _BF16),
    "exp_avg_dtype": (_FP32, _BF16, _FP16, E4M3, E5M2),
    # FP8-LM: an FP8 second moment diverged, so it is not offered.
    "exp_avg_sq_dtype": (_FP32, _BF16, _FP16),
}
# The attribute of an FP8 weight naming (by a number of its own) the FP8AdamW whose gradient hook takes its gradients:
# a later FP8AdamW over the same weight takes them over. A plain int: a weak reference to the parameter (a weak-keyed
# table) makes torch.utils.swap_tensors refuse it (swap_module_params_on_conversion), one to the optimizer on the
# parameter makes the model unpicklable.
GRAD_OWNER_ATTR = "_lightning_fp8_grad_owner"
_GRAD_OWNER_IDS = itertools.count(1)
_FP8Grad = grad_cast.FP8Grad  # a gradient in FP8 waiting for the step
# The attributes an adopted weight carries besides its scaled storage (master.adopt).
_MASTER_ATTRS = (master.SCALE_ATTR, master.AMAX_ATTR, master.DTYPE_ATTR)


def _distributed_fp8_grads(weights: str) -> str:
    # Why fp8_grads is refused under torch.distributed (and defaults off there).
    return (
        f"FP8AdamW(fp8_grads=True) under torch.distributed: its hook takes the gradient of {weights} out of "
        "param.grad as soon as backward accumulates it, before DistributedDataParallel averages param.grad over the "
        "ranks: each rank would step on its own gradient, and the replicas would drift apart. Create FP8AdamW with "
        "fp8_grads=False (its default once torch.distributed is initialized)"
    )


class FP8AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with FP8-LM's low-precision states.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (param groups, schedulers work as usual).
        recipe: an :class:`~lightning_fp8.FP8Recipe` or name; gives the default ``opt_level`` and the FP8 gradient
            format (``recipe.backward_dtype``). Default ``"fp8-lm"`` (O2).
        opt_level: ``"O1"`` (fp32 master and moments everywhere; the FP8Linear weights' gradients in FP8, see
            ``fp8_grads``) or ``"O2"`` (low-precision states for FP8 linear weights); overrides the recipe's.
        master_dtype, exp_avg_dtype, exp_avg_sq_dtype: the states of FP8 linear weights; defaults per level
            (O2: fp16, E4M3, fp16; O1: fp32). fp16 and FP8 states carry a per-tensor scale.
        grad_scaler: an :class:`~lightning_fp8.FP8GradScaler`. Gradients are unscaled by its mu, the FP8 gradient
            casts report to it, and :meth:`step` routes through it (skip on non-finite, then ``update()``). Several
            optimizers may share one: each step then decides, and updates mu, on that optimizer's own gradients.
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
            its smallest values to zero between steps (the step's own gradient still enters the update).

    Raises:
        ValueError: for a negative or non-finite lr, eps or weight_decay, betas outside [0, 1), an unknown level or
            state dtype, a ``grad_cast_bucket_mb`` that is not a number >= 0, ``amsgrad=True`` (here or in a
            parameter group, also one given to :meth:`add_param_group`), ``capturable=True`` or
            ``differentiable=True`` (the same), ``fp8_grads=True`` where ``torch.distributed`` is initialized (a
            backward raises RuntimeError once it is initialized after the optimizer was created with them).
        TypeError: for complex or float64 parameters (the step computes in fp32: use ``torch.optim.AdamW`` for
            float64 ones).

    Example:
        >>> model = convert_to_fp8(nn.Sequential(nn.Linear(64, 64)))
        >>> opt = FP8AdamW(model.parameters(), lr=1e-3)
    """

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
        step_.check_supported_flags({"amsgrad": amsgrad, "capturable": capturable, "differentiable": differentiable})
        step_.check_hyper_parameters(lr, betas, eps, weight_decay)
        self.recipe = resolve_recipe(recipe)
        self.opt_level = opt_level if opt_level is not None else self.recipe.opt_level
        if self.opt_level not in _LEVEL_DTYPES:
            raise ValueError(f"FP8AdamW(opt_level={self.opt_level!r}) is not supported: choose 'O1' or 'O2'")
        chosen = dict(zip(_ALLOWED, (master_dtype, exp_avg_dtype, exp_avg_sq_dtype), strict=True))
        for (name, dtype), default in zip(chosen.items(), _LEVEL_DTYPES[self.opt_level], strict=True):
            chosen[name] = default if dtype is None else dtype
            if chosen[name] not in _ALLOWED[name]:
                raise ValueError(f"FP8AdamW({name}={dtype}) is not supported: choose one of {list(_ALLOWED[name])}")
        self.master_dtype, self.exp_avg_dtype, self.exp_avg_sq_dtype = chosen.values()
        if scale_update not in ("one_pass", "two_pass"):
            raise ValueError(f"FP8AdamW(scale_update={scale_update!r}) is not supported: use 'one_pass' or 'two_pass'")
        self.scale_update = scale_update
        if low_precision_moments not in ("fp8_weights", "all"):
            raise ValueError(
                f"FP8AdamW(low_precision_moments={low_precision_moments!r}) is not supported: use 'fp8_weights' (the "
                "moments of FP8 linear weights only) or 'all' (every parameter's)"
            )
        self.low_precision_moments = low_precision_moments
        self.emit_fp8_weights = bool(emit_fp8_weights)
        self.grad_scaler = grad_scaler
        self.grad_dtype = self.recipe.backward_dtype
        self.fp8_grads = fp8_grads if fp8_grads is not None else not (dist.is_available() and dist.is_initialized())
        self._extra_fp8_params = {id(p) for p in fp8_params} if fp8_params is not None else set()
        self._low_precision: set[torch.Tensor] = set()  # params with O2 states
        self._moments_only: set[torch.Tensor] = set()  # those of them whose master is high precision (the param)
        self._master_amax: dict[torch.Tensor, torch.Tensor] = {}  # their master's amax, which the kernel writes
        self._pending: dict[torch.Tensor, _FP8Grad] = {}  # FP8 gradients waiting for the step
        self._held: set[torch.Tensor] | None = None  # the parameters of all groups: see _holds
        self._stepped_fp8_grads: list[torch.Tensor] = []  # the params the last step took an FP8 gradient of
        self._grad_casts = grad_cast.GradCastQueue(grad_cast.bucket_bytes(grad_cast_bucket_mb))  # fp16, to cast
        self._hooks: dict[torch.Tensor, Any] = {}
        self._grad_owner_id = next(_GRAD_OWNER_IDS)  # see GRAD_OWNER_ATTR
        self._grad_cast_states: dict[torch.Tensor, tuple] = {}  # see _grad_cast_state
        self._master_marks: dict[torch.Tensor, tuple[int, int] | None] = {}  # masters kept apart: optim/apart.py
        self.skipped_grad_amax: dict[torch.Tensor, torch.Tensor] = {}  # gradient amaxes of the last skipped step
        self._fp8_unscale: float | None = None  # set while FP8GradScaler.step(self) runs the update through step()
        self._fp8_in_step = False  # step() is routing through self.grad_scaler (which then updates directly)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        self._adopting: list[torch.Tensor] | None = []  # the constructor's groups adopt together, after all are checked
        super().__init__(params, defaults)
        self.register_state_dict_post_hook(FP8AdamW._export_states, prepend=True)
        adopting, self._adopting = self._adopting, None
        self._adopt_all(adopting)
        self._register_o1_grad_hooks([p for group in self.param_groups for p in group["params"]])

    # -------------------------------------------------------------------------------------------- param handling
    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            step_.check_supported_flags(param_group)
            # torch's AdamW honours a group's decoupled_weight_decay=False (Adam's L2 decay); without decay the two
            # are the same (a group copied from torch.optim.Adam(weight_decay=0)).
            coupled = not param_group.get("decoupled_weight_decay", True)
            if coupled and param_group.get("weight_decay", self.defaults.get("weight_decay", 0.0)):
                raise ValueError(
                    "FP8AdamW: a parameter group with decoupled_weight_decay=False and weight_decay "
                    f"{param_group.get('weight_decay', self.defaults.get('weight_decay'))} (Adam's L2 weight decay, "
                    "added to the gradient) is not supported: FP8AdamW decays the weights decoupled, as AdamW. Drop "
                    "the flag (or the decay), or use torch.optim.Adam(weight_decay=...) for these parameters"
                )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:  # a rejected group is not kept (nor stepped)
            step_.check_hyper_parameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            step_.plain_hyper_parameters(group)
            for i, p in enumerate(group["params"]):
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
                # Before check_adoptable: a pruned layer's computed weight holds the accumulator (no DDP involved).
                where = f"parameter {i} of parameter group {len(self.param_groups) - 1}"
                master.check_not_reparametrized(p, where)
                master.check_shareable(p, where, self._settings(), self._storage_master_dtype(p))
            self._check_grad_hooks_allowed(group["params"])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        wanted = [p for p in group["params"] if self._wants_low_precision(p)]
        adopting = getattr(self, "_adopting", None)  # a list while the constructor runs
        if adopting is not None:
            adopting.extend(wanted)
            return
        try:
            self._adopt_all(wanted)
        except RuntimeError:
            self.param_groups.pop()
            raise
        self._register_o1_grad_hooks(group["params"])

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
        """Whether :meth:`_adopt` makes ``p``'s storage the master, changing its dtype."""
        shareable = master.is_fp8_weight(p) and not shards.is_dtensor(p) and p.requires_grad
        return shareable and master.master_scale(p) is None and p.dtype != self.master_dtype

    def _adopt_all(self, params: list[torch.Tensor]) -> None:
        """:meth:`_adopt` each of ``params``, once all are known to take it (else RuntimeError, nothing changed)."""
        for p in params:
            if self._takes_storage(p):
                master.check_adoptable(p)  # under DDP's hooks: raise before any weight changes
        for p in params:
            self._adopt(p)

    def _adopt(self, p: torch.Tensor) -> None:
        """Give ``p`` O2 states; an FP8Linear weight also gives its storage to the master."""
        # No entry in self.state before the first step: torch.distributed.checkpoint creates the states of an
        # optimizer whose ``state`` is empty (a zero-gradient step); a non-empty one is taken as initialized, and
        # its state dict then lacks every other parameter (the load of a sharded checkpoint fails).
        # A frozen weight (requires_grad=False) keeps its storage, as torch.optim leaves it untouched; should it get
        # gradients later, its master is kept apart (see _init_state).
        self._low_precision.add(p)
        if not (master.is_fp8_weight(p) or id(p) in self._extra_fp8_params):
            self._moments_only.add(p)  # low_precision_moments="all": only the moments
            return
        if self._takes_storage(p):
            master.adopt(p, self.master_dtype)
        if master.master_scale(p) is not None and self.fp8_grads and p.requires_grad:  # adopted, now or earlier
            self._register_grad_hook(p)

    def _gets_grad_hook(self, p: torch.Tensor) -> bool:
        """Whether ``fp8_grads`` gives ``p`` the FP8 gradient hook: an FP8Linear weight that trains, not sharded, at
        O1 (:meth:`_register_o1_grad_hooks`) or adopted at O2 (:meth:`_adopt`)."""
        if not (self.fp8_grads and master.is_fp8_weight(p) and p.requires_grad) or shards.is_dtensor(p):
            return False
        if self.opt_level == "O1":
            return True
        return self._wants_low_precision(p) and (self._takes_storage(p) or master.master_scale(p) is not None)

    def _check_grad_hooks_allowed(self, params: Iterable[torch.Tensor]) -> None:
        """Raise ValueError if ``fp8_grads`` would hook the gradients of some of ``params`` under torch.distributed
        (see :func:`_distributed_fp8_grads`)."""
        hooked = [p for p in params if self._gets_grad_hook(p)]
        if hooked and dist.is_available() and dist.is_initialized():
            raise ValueError(f"{_distributed_fp8_grads(f'{len(hooked)} FP8 weight(s)')}; nothing was changed")

    def _register_o1_grad_hooks(self, params: Iterable[torch.Tensor]) -> None:
        """At O1 (with ``fp8_grads``), the FP8 gradient hook of each FP8Linear weight of ``params`` that trains.

        O2 registers it in :meth:`_adopt` (adopted weights); at O1 the weight keeps its storage (fp32 master) and
        gets the same FP8 gradient: 13 bytes per parameter. ``fp8_params`` (no FP8 GEMMs) and sharded (DTensor)
        weights keep their gradients as they are, as at O2; a frozen weight gets no hook.
        """
        if self.opt_level != "O1" or not self.fp8_grads:
            return
        for p in params:
            if p in self._hooks or not master.is_fp8_weight(p) or not p.requires_grad or shards.is_dtensor(p):
                continue
            self._register_grad_hook(p)

    def _register_grad_hook(self, p: torch.Tensor) -> None:
        owner, owner_id = weakref.ref(self), self._grad_owner_id
        setattr(p, GRAD_OWNER_ATTR, owner_id)

        def hook(param: torch.Tensor) -> None:
            optimizer = owner()
            if optimizer is not None and getattr(param, GRAD_OWNER_ATTR, None) == owner_id and param.grad is not None:
                # An O1 weight put back to high precision without this optimizer (recovery) keeps its gradient.
                if master.master_scale(param) is None and not master.is_fp8_weight(param):
                    return
                if dist.is_available() and dist.is_initialized():  # initialized after the optimizer was created
                    raise RuntimeError(
                        f"{_distributed_fp8_grads(f'the FP8 weight of shape {tuple(param.shape)}')} (this FP8AdamW "
                        "was created before torch.distributed was initialized, where fp8_grads defaults to True); "
                        "the gradient was left in param.grad"
                    )
                grad, param.grad = param.grad, None
                optimizer._grad_casts.put(optimizer, param, grad)

        self._hooks[p] = p.register_post_accumulate_grad_hook(hook)

    def release(self, p: torch.Tensor) -> None:
        """Turn ``p`` back into a plain parameter with fp32 states (the recovery "back to high precision"): fp32
        moments, and an fp32 master kept apart where ``p`` is not fp32, as for any parameter of that dtype. A gradient
        not stepped yet is handed back to ``p.grad`` (a pending FP8 one dequantized), in ``p``'s dtype.

        At O1 (fp32 states already) it only stops holding ``p``'s gradient in FP8: the hook is removed and a pending
        FP8 gradient is handed back.
        """
        if p not in self._low_precision:
            handle = self._hooks.pop(p, None)
            if handle is None:
                return
            handle.remove()
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
        handle = self._hooks.pop(p, None)
        if handle is not None:
            handle.remove()
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
            handle = self._hooks.pop(p, None)  # fp8_grads: only adopted weights are hooked
            if handle is not None:
                handle.remove()
            self._pending.pop(p, None)  # a gradient not stepped yet is dropped, as release() drops it
            stored, amax, state = p.detach(), getattr(p, master.AMAX_ATTR), self.state.get(p)
            master.release(p)  # (param.grad too: it had the storage's dtype)
            if state:  # stepped: the stored master, its scale and amax now live in the state (else _init_state)
                # (on the master's device: Lightning's teardown moves the model and the states, not the attributes)
                state.update(master=stored, master_scale=scale.to(stored.device), master_amax=amax.to(stored.device))
                self._master_marks[p] = apart.mark(p)  # writes to the released weight from now on reach the master
        if released and self.grad_scaler is not None:  # the dropped gradients' casts no longer count for a step
            self.grad_scaler._discard(self)

    # ------------------------------------------------------------------------------------------------ gradients
    def accumulate_fp8_grad(self, p: torch.Tensor, grad: torch.Tensor, scale_inv: torch.Tensor | None = None) -> None:
        """Add ``grad`` (high precision, or FP8 with ``scale_inv``) to ``p``'s pending FP8 gradient.

        The result is stored in ``recipe.backward_dtype`` with a fresh per-tensor scale and reported to the
        gradient scaler. FP8 communication hooks can hand their reduced FP8 gradient over this way.

        Raises:
            RuntimeError: for a sparse gradient.
            ValueError: for a ``p`` in none of this optimizer's parameter groups, an FP8 gradient without
                ``scale_inv``, or a shape that is not ``p``'s.
        """
        if not self._holds(p):  # its gradient would never be stepped, yet count in the scaler's non-finite check
            raise ValueError(
                f"accumulate_fp8_grad: the parameter of shape {tuple(p.shape)} is in none of this FP8AdamW's parameter "
                "groups, so its gradient would never be applied. Hand it to the optimizer that holds the parameter, "
                "or add the parameter first (optimizer.add_param_group({'params': [p]})); nothing was accumulated"
            )
        if grad.is_sparse:
            raise RuntimeError("FP8AdamW does not support sparse gradients")
        if grad.shape != p.shape:
            raise ValueError(f"accumulate_fp8_grad: gradient of shape {tuple(grad.shape)} for a {tuple(p.shape)} param")
        if is_fp8(grad) and scale_inv is None:
            raise ValueError("accumulate_fp8_grad: an FP8 gradient needs its scale_inv")
        if p in self._grad_casts:  # its queued gradient comes first
            self._grad_casts.flush(self)
        with torch.no_grad():
            entry = self._pending.get(p)
            if is_fp8(grad) and entry is None:  # already FP8 (the caller reported its cast): keep it as it is
                amax = ops.amax(grad.float()) * scale_inv
                self._pending[p] = _FP8Grad(grad, scale_inv.float().reshape(()), amax)
                return
            g = grad.float() * scale_inv if is_fp8(grad) else grad
            if entry is not None:
                g = entry.data.float() * entry.scale_inv + g.float()
            # Current scaling with a small per-parameter state: amax, scale, cast and 1 / scale in two launches.
            cast_state = self._grad_cast_state(p)
            data, _, scale_inv = ops.quantize(
                g.contiguous(), *cast_state, self.grad_dtype, 0, True, False, True, False
            )  # fmt: skip
            amax = cast_state[2]  # the state's last amax: this gradient's, until its next cast
            if self.grad_scaler is not None:
                n_saturated = (g.abs() >= fp8_max(self.grad_dtype)).sum()
                self.grad_scaler.record_gradient_cast(amax, n_saturated, g.numel(), self.grad_dtype, owner=self)
            self._pending[p] = _FP8Grad(data, scale_inv, amax)

    def _holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is in one of the parameter groups: a set lookup (this runs per parameter and backward), the
        set built again on a miss (a group added since)."""
        held = self._held
        if held is None or p not in held:
            held = self._held = {q for group in self.param_groups for q in group["params"]}
        return p in held

    def _grad_cast_state(self, p: torch.Tensor) -> list[torch.Tensor]:
        """The buffers of the FP8 gradient cast of ``p`` (as a ``ScalingState``'s, history of one): created once."""
        return grad_cast.cast_state(self._grad_cast_states, p)[1]

    def _grad_of(self, p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(grad, grad_scale_inv, grad_amax)`` of ``p`` for this step: its pending FP8 gradient, or ``p.grad``.

        The amax (of ``grad * grad_scale_inv``) is known for FP8 gradients, else ``None``: the step measures those
        of low-precision parameters' high-precision gradients (the one-pass scale bounds need them) all at once.
        """
        if p in self._grad_casts:
            self._grad_casts.flush(self)
        shards.reduce_partial_grad_(p)  # no-op unless a tensor-parallel gradient is a partial sum
        grad = p.grad  # a Python property: read once (this runs per parameter and step)
        if grad is not None and grad.is_sparse:
            raise RuntimeError("FP8AdamW does not support sparse gradients")
        entry = self._pending.get(p)
        if entry is not None and grad is not None:  # both: fold the high-precision one in
            p.grad = None
            self.accumulate_fp8_grad(p, grad)
            entry = self._pending[p]
        if entry is not None:
            return entry.data, entry.scale_inv, entry.amax
        if grad is None:
            return None, None, None
        return (grad if grad.is_contiguous() else grad.contiguous()), None, None

    def _nonfinite_grads(self) -> torch.Tensor:
        """0-dim: > 0 when a gradient of this step holds inf or NaN (for the gradient scaler; no host sync)."""
        self._grad_casts.flush(self)
        flags: list[torch.Tensor] = [(~torch.isfinite(e.amax)).float().reshape(1) for e in self._pending.values()]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None and not p.grad.is_sparse]
        for p in params:
            shards.reduce_partial_grad_(p)
        dense = [shards.local(p.grad) for p in params]
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for grad in dense:
            by_device[grad.device].append(grad)
        for grads in by_device.values():
            norms = torch._foreach_norm(grads, float("inf"))
            flags.append((~torch.isfinite(torch.stack([n.float() for n in norms]))).float())
        if not flags:
            return torch.zeros(())
        device = flags[0].device
        return torch.cat([f.to(device) for f in flags]).sum()

    def _fp8_skip(self) -> None:
        """The scaler skipped this step: drop the pending FP8 gradients (as the user will zero ``param.grad``)."""
        # Kept (0-dim, on device) so that a recovery action can tell which weights had non-finite gradients.
        self._grad_casts.flush(self)
        self.skipped_grad_amax = {p: entry.amax.clone() for p, entry in self._pending.items()}
        # They had gradients, as after a step taken: zero_grad(set_to_none=False) gives them zero ones (torch.optim's
        # rule), so that the next step still decays and moves them where their next backward does not reach them.
        self._stepped_fp8_grads = list(self._pending)
        self._pending.clear()

    @property
    def holds_fp8_grads(self) -> bool:
        """Whether gradients of some weights leave ``param.grad`` for FP8 copies this optimizer holds (``fp8_grads``):
        clipping ``param.grad`` would miss them."""
        return bool(self._hooks)

    @torch.no_grad()
    def fp8_grad_norms(self) -> dict[torch.Tensor, torch.Tensor]:
        """``{param: norm}``: the L2 norm (0-dim fp32) of each gradient this optimizer holds in FP8 for its next
        step (``fp8_grads``; ``param.grad`` is ``None`` for them), dequantized (the FP8 values times their
        ``scale_inv``). They are in the units of the backward: they carry the gradient scaler's mu (the step unscales
        them). Read-only: queued gradients are cast first, as the step would."""
        self._grad_casts.flush(self)
        return {
            p: (torch.linalg.vector_norm(e.data.float()) * e.scale_inv.float()).reshape(())
            for p, e in self._pending.items()
        }

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; also drops the FP8 gradients this optimizer holds, which
        ``model.zero_grad()`` cannot reach (their ``param.grad`` is ``None``, see ``fp8_grads``)."""
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
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step. With a ``grad_scaler``: its ``step(self)`` (agree across ranks, skip on non-finite
        gradients), then its ``update()`` of mu. ``grad_scaler.step(self)`` itself runs the update through this
        method (so that LR schedulers and step hooks see it), unscaled by its mu.

        Returns:
            The closure's loss, when a closure is given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fp8_unscale is not None:  # FP8GradScaler.step(self) decided to step: unscale by its mu
            self._fp8_step(self._fp8_unscale)
        elif self.grad_scaler is not None:
            self._fp8_in_step = True  # the scaler updates directly (this call is the step schedulers and hooks see)
            try:
                self.grad_scaler.step(self)
            finally:
                self._fp8_in_step = False
            self.grad_scaler.update()
        else:
            self._fp8_step(1.0)
        return loss

    @torch.no_grad()
    def _fp8_step(self, grad_unscale: float) -> None:
        """The update itself, with every gradient multiplied by ``grad_unscale`` (1/mu; called by the scaler)."""
        self._check_storages()  # before anything is written
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
        state["step"] = torch.zeros((), dtype=torch.float32)
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

    # ------------------------------------------------------------------------------------------------- pickling
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
        masters, hooked = state.pop("_masters"), state.pop("_hooked")
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
        self._fp8_unscale, self._fp8_in_step, self._adopting = None, False, None
        self._hooks, self._grad_owner_id = {}, next(_GRAD_OWNER_IDS)
        self._mark_masters()
        for p in hooked:
            self._register_grad_hook(p)
        # torch.optim.Optimizer pickles no hooks (a copy starts without the user's): register the export again.
        self.register_state_dict_post_hook(FP8AdamW._export_states, prepend=True)

    def _mark_masters(self) -> None:
        # Masters kept apart (optim/apart.py) as they are now: a write to their parameters from here on reaches them.
        self._master_marks = {p: apart.mark(p) for p, state in self.state.items() if "master" in state}

    # ------------------------------------------------------------------------------------------ state and stats
    @override
    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.AdamW``'s, plus per FP8 weight the scaled states, their 0-dim scales and amaxes.

        An adopted weight's master (its parameter's storage) is included as ``"master"``, so the optimizer state
        alone restores it. For a sharded (DTensor) parameter, each 0-dim scale and amax (of this rank's shard) is
        exported as a DTensor sharded like the parameter with one element per row of its sharded dimension (shape
        ``(rows, 1)`` under FSDP2), so that torch.distributed.checkpoint keeps every rank's and reshards them on
        another number of ranks (:mod:`~lightning_fp8.optim.checkpoint`). Loads with ``torch.load(weights_only=True)``.
        """
        self._grad_casts.flush(self)
        return super().state_dict()  # with _export_states first among the post-hooks

    def _export_states(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # The first state-dict post-hook (registered in __init__ as a plain function, called with the optimizer), so
        # that the user's see the masters and the sharded scales as they are saved.
        return checkpoint.shard_scalars(self, checkpoint.with_masters(self, state_dict))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of FP8AdamW (any level, sharded or not) or of ``torch.optim.AdamW`` (converted: the master
        stays the parameter's current value, the moments are stored in this optimizer's dtypes with fresh scales; the
        fp16 moments of an fp16 model's AdamW, which carry no scale, load as their values).

        Everything is checked before anything is loaded: on an error, the optimizer and the weights are unchanged. As in
        ``torch.optim.Optimizer``, the hooks of ``register_load_state_dict_pre_hook`` run first, on a shallow copy of
        ``state_dict`` (the dict one returns is what the next gets, and what is checked and loaded), and those of
        ``register_load_state_dict_post_hook`` once everything is loaded.

        Raises:
            ValueError: when the parameter groups do not match (as ``torch.optim.Optimizer``) or hold settings the
                constructor refuses, or a state does not fit its parameter (wrong shape or dtype, missing entries, a
                scale or amax of the wrong shape or value, an amax below its state's values, inf or NaN values, a
                negative second moment, a bad step); the message names the parameter's index and the entry, and what
                to do. Also for a state dict of AMSGrad (a group with ``amsgrad=True``, a state with
                ``max_exp_avg_sq``), which FP8AdamW would continue without it.
        """
        state_dict = checkpoint.run_load_pre_hooks(self, state_dict)
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
