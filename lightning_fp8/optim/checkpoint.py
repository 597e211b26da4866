"""FP8AdamW state dicts: saving with masters, loading any AdamW-like state.

The parts live beside this module: the layout of a parameter's states and ``stored = value * scale``
(:mod:`~lightning_fp8.optim.state_layout`), the scales of sharded parameters (:mod:`~lightning_fp8.optim.shard_scales`),
the checks of a state dict before it is loaded (:mod:`~lightning_fp8.optim.state_checks`), the export to
``torch.optim.AdamW`` (:mod:`~lightning_fp8.optim.adamw_export`) and the statistics of the states
(:mod:`~lightning_fp8.optim.state_stats`). FP8AdamW reaches all of them through this module, which re-exports what
it uses of the parts.

Loading is by value: each saved state is dequantized to fp32 and stored in this optimizer's dtypes with a fresh
scale, except where dtype and scale already match (one scale for all of this rank's values), which copies the bits
(a resumed run continues bit-identically). So a ``torch.optim.AdamW`` state dict, an O1 one and an O2 one all load
anywhere. A state with ``torch.optim.AdamW``'s keys only (``step``, ``exp_avg``, ``exp_avg_sq``) holds the values
themselves, in the parameter's dtype: fp16 moments (an fp16 model's) load as they are, with scale 1; FP8AdamW writes
no fp16 or FP8 state without its scale, and refuses one in a state with its own keys. Everything is checked before
anything is loaded: a bad checkpoint raises and changes nothing.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels.reference_adamw import SCALED_STATE_MAX
from lightning_fp8.optim import master, shards
from lightning_fp8.optim import step as step_
from lightning_fp8.optim.adamw_export import adamw_state_dict, to_adamw
from lightning_fp8.optim.shard_scales import shard_scalars
from lightning_fp8.optim.state_checks import _check
from lightning_fp8.optim.state_layout import _KEYS, _param_order, dequantize, quantize, store
from lightning_fp8.optim.state_stats import stats

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW

# What FP8AdamW, lightning_fp8.optim.apart and .adoption, and the tests use of this module.
__all__ = [
    "adamw_state_dict",
    "as_stored",
    "check",
    "dequantize",
    "fsdp1_by_value",
    "is_state_init_step",
    "load",
    "quantize",
    "run_load_pre_hooks",
    "shard_scalars",
    "stats",
    "store",
    "to_adamw",
    "with_masters",
]


# ------------------------------------------------------------------------------------------------------ state init
# torch's functions that step an optimizer on zero gradients only so that it has states to save or load into:
# torch.distributed.checkpoint's get_state_dict / get_optimizer_state_dict (an optimizer without state or gradients,
# lr set to 0; also inside Lightning's and Accelerate's sharded checkpointing), and _NamedOptimizer.init_state (at
# the real lr).
_STATE_INIT_CALLERS = {
    ("torch.distributed.checkpoint.state_dict", "_init_optim_state"),
    ("torch.distributed.optim.named_optimizer", "init_state"),
}


def is_state_init_step(opt: torch.optim.Optimizer) -> bool:
    """Whether this call (a step, or the ``zero_grad`` after it) comes from one of torch's state-making steps
    (``_STATE_INIT_CALLERS``), which a ``grad_scaler`` must not see: no loss was scaled for those zero gradients, so it
    refused the step (leaving DCP's lr at 0, which torch restores only after the step) or counted it as a training
    step. Told by the caller, not by the values: the same answer on every rank (a rank's zero gradient shards at a
    genuine first step at lr 0 must not take another path than the others, whose scaler step is a collective) and no
    device read. Only an optimizer without state is taken for one (a second ``init_state`` steps as any step: the
    scaler refuses it, as no loss was scaled); the stack is walked only then (once, at the first step)."""
    if opt.state:
        return False
    frame = sys._getframe(1)
    while frame is not None:  # any depth: Lightning's, Accelerate's and torch's wrappers of step lie between
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _STATE_INIT_CALLERS:
            return True
        frame = frame.f_back
    return False


# ------------------------------------------------------------------------------------------------------------ saving
def with_masters(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Add ``"master"`` (the parameter's own storage) for adopted weights, without touching ``opt.state``."""
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        if index in packed and master.master_scale(p) is not None and p in opt._low_precision:
            packed[index] = {**packed[index], "master": p.detach()}
    return {**state_dict, "state": packed}


def fsdp1_by_value(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The states of parameters that FSDP1 flattened (``use_orig_params=True``: the original parameters; ``False``:
    the flat parameters themselves) as fp32 values, without amaxes, a scale of 1 for each scaled one.

    torch's ``FSDP.optim_state_dict`` (full and sharded, and ``get_state_dict`` over it) gathers an original
    parameter's states from the ranks' parts of its flat parameter and wants every non-0-dim state in one dtype and
    every 0-dim state equal on all ranks: the E4M3 and fp16 states beside each other, with each rank's own scales,
    stop it with an ``AssertionError``; and a flat parameter's scaled states were gathered under one rank's scale. By
    value they gather, reshard and load (:func:`load` stores them with fresh scales). The scales of 1 keep a
    torch.distributed.checkpoint template honest: a checkpoint of scaled states read into these fp32 ones brings its
    own scales, which the load refuses (they would otherwise be read as values).

    torch also wants the same states for every parameter of a flat parameter: the master kept apart from an fp32
    parameter (an FP8 weight's fp16 master at O2) is left out, as ``torch.optim.AdamW``'s state has none. Each step
    writes such a parameter from its master as stored, so the parameter holds the master's value, and a state loaded
    without a master takes it from the parameter. The master of a parameter in another dtype (a bf16 model's fp32
    masters) is kept, in fp32. Skipped inside :func:`as_stored`.
    """
    if getattr(opt, _AS_STORED, 0):
        return state_dict
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        saved = packed.get(index)
        if saved is None or not shards.is_fsdp1_view(p) or not any(key in saved for key in _KEYS):
            continue
        dropped = {f"{key}_{part}" for key in _KEYS for part in ("scale", "amax")}
        if p.dtype == torch.float32:
            dropped.add("master")
        state = {key: dequantize(saved, key) if key in _KEYS else value for key, value in saved.items()}
        state = {key: value for key, value in state.items() if key not in dropped}
        for key in _KEYS:  # where the state is scaled: a state with torch.optim.AdamW's keys only keeps them only
            if key in state and f"{key}_scale" in saved:
                state[f"{key}_scale"] = torch.ones((), dtype=torch.float32, device=state[key].device)
        packed[index] = state
    return {**state_dict, "state": packed}


_AS_STORED = "_lightning_fp8_as_stored"


@contextmanager
def as_stored(opt: Any) -> Iterator[None]:
    """Within it, ``opt.state_dict()`` of an :class:`~lightning_fp8.FP8AdamW` (``opt`` itself, not a wrapper of it)
    keeps the states of parameters FSDP1 flattened as stored: scaled, with this rank's scales and amaxes (see
    :func:`fsdp1_by_value`). For a state saved and loaded per rank, on the same ranks, which resumes bit for bit.
    Nests; other optimizers ignore it."""
    setattr(opt, _AS_STORED, getattr(opt, _AS_STORED, 0) + 1)
    try:
        yield
    finally:
        setattr(opt, _AS_STORED, getattr(opt, _AS_STORED) - 1)


# ----------------------------------------------------------------------------------------------------------- loading
def run_load_pre_hooks(opt: FP8AdamW, state_dict: Any) -> Any:
    """``state_dict`` as the hooks of ``opt.register_load_state_dict_pre_hook`` leave it, as
    ``torch.optim.Optimizer.load_state_dict`` runs them: each gets the dict (a shallow copy of the caller's) and may
    return another, which the next one gets and which is loaded."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load(opt: FP8AdamW, state_dict: dict[str, Any]) -> None:
    """Body of :meth:`FP8AdamW.load_state_dict` (see the module docstring), after its pre-hooks ran."""
    entries = _check(opt, state_dict)  # before anything is loaded: a bad checkpoint changes nothing
    # The base class validates the groups and restores their hyper-parameters; the states are loaded here,
    # because the base class would cast every state to the parameter's dtype. Its load hooks stay out of this part
    # of the load: FP8AdamW.load_state_dict runs them around the whole of it.
    hooks = opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks
    opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks = OrderedDict(), OrderedDict()
    try:
        torch.optim.Optimizer.load_state_dict(opt, {"state": {}, "param_groups": state_dict["param_groups"]})
    finally:
        opt._optimizer_load_state_dict_pre_hooks, opt._optimizer_load_state_dict_post_hooks = hooks
    for group in opt.param_groups:
        group.setdefault("maximize", False)
        step_.plain_hyper_parameters(group)  # checked by _check_groups
    for p, saved in entries:
        _load_one(opt, p, saved)


def check(opt: FP8AdamW, state_dict: Any) -> None:
    """Body of :meth:`FP8AdamW.check_state_dict`."""
    _check(opt, state_dict)


def _single(t: torch.Tensor | None) -> torch.Tensor | None:
    """The one value of ``t`` (0-dim) when all its elements are equal, else (or when empty, or None) None."""
    if t is None:
        return None
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        return None
    return flat[0].clone()


def _copy_or_convert(state: dict[str, Any], saved: dict[str, Any], key: str, dtype, p: torch.Tensor) -> None:
    """``state[key]`` (and its scale, amax) from this rank's part of ``saved[key]``, in ``dtype``."""
    saved_scale = saved.get(f"{key}_scale")
    scale = _single(saved_scale)
    # The saved bits themselves when they have this dtype and one scale (or none, for a dtype that takes none); else
    # by value: another dtype, or rows saved by shards of different scales meet on this rank (another world size).
    one_scale = scale is not None or (saved_scale is None and dtype not in SCALED_STATE_MAX)
    if saved[key].dtype != dtype or not one_scale:
        value = dequantize(saved, key)
        store(state, key, value, dtype, value.shape, p.device)
    else:
        state[key] = saved[key].detach().to(p.device).clone()
        state[f"{key}_scale"] = (scale if scale is not None else torch.ones(())).to(p.device, torch.float32)
        amax = _single(saved.get(f"{key}_amax"))
        amax = amax if amax is not None else ops.amax(dequantize(state, key))
        state[f"{key}_amax"] = amax.to(p.device, torch.float32)
    state[key] = shards.like(p, state[key])


def _load_one(opt: FP8AdamW, p: torch.Tensor, saved: dict[str, Any]) -> None:
    """Load this rank's part of ``p``'s checked state (:func:`_check`) into ``opt``."""
    state = opt.state[p]
    adopted = p in opt._low_precision and master.master_scale(p) is not None
    if adopted:  # the adopted master's scale is p's
        state["master_scale"] = master.master_scale(p)
        state["master_amax"] = getattr(p, master.AMAX_ATTR)
    if "step" in saved:
        state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32, device="cpu").detach().clone().reshape(())
    with torch.no_grad():
        if p not in opt._low_precision or p in opt._moments_only:  # the master is high precision
            for key, dtype in (("exp_avg", opt.exp_avg_dtype), ("exp_avg_sq", opt.exp_avg_sq_dtype)):
                if key in saved and p in opt._moments_only:
                    _copy_or_convert(state, saved, key, dtype, p)
                elif key in saved:
                    state[key] = shards.like(p, dequantize(saved, key).to(p.device))
            if p.dtype != torch.float32:
                source = dequantize(saved, "master") if "master" in saved else shards.local(p).detach().float()
                state["master"] = shards.like(p, source.to(p.device))
            elif "master" in saved:
                p.copy_(shards.like(p, dequantize(saved, "master").to(p.device)))
            return
        if adopted:
            _load_adopted_master(p, saved)
        elif "master" in saved:
            _copy_or_convert(state, saved, "master", opt.master_dtype, p)
        elif "step" in state:  # a torch.optim.AdamW state: the parameter is the master
            local = shards.local(p).detach().float()
            store(state, "master", local, opt.master_dtype, local.shape, local.device)
            state["master"] = shards.like(p, state["master"])
        for key, dtype in (("exp_avg", opt.exp_avg_dtype), ("exp_avg_sq", opt.exp_avg_sq_dtype)):
            if key in saved:
                _copy_or_convert(state, saved, key, dtype, p)


def _load_adopted_master(p: torch.Tensor, saved: dict[str, Any]) -> None:
    if "master" not in saved:
        return  # a torch.optim.AdamW state: the weight is the parameter's current value
    scale, amax = master.master_scale(p), getattr(p, master.AMAX_ATTR)
    saved_scale = _single(saved.get("master_scale"))
    if saved["master"].dtype == p.dtype and saved_scale is not None:
        p.copy_(saved["master"])
        scale.copy_(saved_scale)
        saved_amax = _single(saved.get("master_amax"))
        amax.copy_(saved_amax if saved_amax is not None else ops.amax(dequantize(saved, "master")))
        return
    stored, new_scale, new_amax = quantize(dequantize(saved, "master").to(p.device), p.dtype)
    p.copy_(stored)
    scale.copy_(new_scale)
    amax.copy_(new_amax)
