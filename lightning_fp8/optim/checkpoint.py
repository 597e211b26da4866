"""FP8AdamW state dicts: saving with masters, loading any AdamW-like state, exporting to ``torch.optim.AdamW``.

Layout per parameter (DESIGN.md "State layout"): every state tensor has the parameter's shape, every scale
is a 0-dim fp32 tensor. Low-precision states are ``key`` (fp16/FP8 storage, ``x * scale``), ``key_scale``
and ``key_amax`` for ``key`` in ``master``, ``exp_avg``, ``exp_avg_sq``; other parameters have exactly the
keys of ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq`` in fp32).

Sharded (DTensor) parameters: each rank's shard of a state has its own scale and amax. The state dict spreads them
over the tensor dimension the parameter is sharded on: a DTensor sharded like the parameter, of the parameter's size
on that dimension and 1 on the others (``(rows, 1)`` under FSDP2), whose every element is the number of the shard
holding that row. Its shape does not depend on the number of ranks, so torch.distributed.checkpoint and full state
dicts reshard it with the states, and ``stored / scale`` (broadcast) is the state's value wherever it lands. A
parameter sharded on several dimensions (FSDP2 over row-parallel tensor parallelism) would need a number per
element: its scales are exported one per rank, which reloads only on the mesh that saved it.

Loading is by value: each saved state is dequantized to fp32 and stored in this optimizer's dtypes with a fresh
scale, except where dtype and scale already match (one scale for all of this rank's values), which copies the bits
(a resumed run continues bit-identically). So a ``torch.optim.AdamW`` state dict, an O1 one and an O2 one all load
anywhere. A state with ``torch.optim.AdamW``'s keys only (``step``, ``exp_avg``, ``exp_avg_sq``) holds the values
themselves, in the parameter's dtype: fp16 moments (an fp16 model's) load as they are, with scale 1; FP8AdamW writes
no fp16 or FP8 state without its scale, and refuses one in a state with its own keys. Everything is checked before
anything is loaded: a bad checkpoint raises and changes nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels.reference_adamw import BOUND_SLACK, SCALED_STATE_MAX
from lightning_fp8.optim import master, shards
from lightning_fp8.optim import step as step_
from lightning_fp8.scaling import compute_scale
from lightning_fp8.state import MAX_SCALE, MIN_SCALE

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW

_KEYS = ("master", "exp_avg", "exp_avg_sq")
_ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")  # torch.optim.AdamW's: a state has all of them or none
_FIX = "the checkpoint is corrupt or was written for another model"
# The dtypes a state may have besides the scaled ones (SCALED_STATE_MAX): these hold the value itself, with scale 1.
_UNSCALED = (torch.float64, torch.float32, torch.bfloat16)


def dequantize(state: dict[str, Any], key: str) -> torch.Tensor:
    """``state[key]`` as fp32, unscaled: ``stored / scale``, the scale 0-dim or broadcast (see the module docstring).

    A DTensor state gives a DTensor sharded the same way (each shard divided by its own scale).
    """
    value = state[key]
    x = shards.local(value).detach().float()
    scale = state.get(f"{key}_scale")
    if scale is not None and value.dtype in SCALED_STATE_MAX:
        scale = shards.local(scale)
        x = x / (scale.reshape(()) if scale.numel() == 1 else scale).to(x.device)
    return shards.like(value, x)


def quantize(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(stored, scale, amax)`` of the fp32 ``value`` in ``dtype``: scaled for fp16/FP8, else scale 1."""
    amax = ops.amax(value)
    if dtype not in SCALED_STATE_MAX:
        return value.to(dtype), torch.ones((), dtype=torch.float32, device=value.device), amax
    scale = compute_scale(amax, dtype)
    fmax = SCALED_STATE_MAX[dtype]
    return (value * scale).clamp(-fmax, fmax).to(dtype), scale, amax


def store(state: dict[str, Any], key: str, value: torch.Tensor, dtype: torch.dtype, shape, device) -> None:
    """Put the fp32 ``value`` into ``state`` as ``key``, ``key_scale``, ``key_amax`` in ``dtype``."""
    stored, scale, amax = quantize(value.detach().float().reshape(shape).to(device), dtype)
    state[key], state[f"{key}_scale"], state[f"{key}_amax"] = stored, scale, amax


def _param_order(opt: FP8AdamW) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


# ------------------------------------------------------------------------------------------------------------ saving
def with_masters(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Add ``"master"`` (the parameter's own storage) for adopted weights, without touching ``opt.state``."""
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        if index in packed and master.master_scale(p) is not None and p in opt._low_precision:
            packed[index] = {**packed[index], "master": p.detach()}
    return {**state_dict, "state": packed}


def shard_scalars(opt: FP8AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Export the 0-dim scales and amaxes of sharded (DTensor) parameters as DTensors (see the module docstring).

    They belong to this rank's shard; as plain tensors, torch.distributed.checkpoint would take them for
    replicated values and save (and load on every rank) one rank's only.
    """
    packed = dict(state_dict["state"])
    for index, p in enumerate(_param_order(opt)):
        if index in packed and shards.is_dtensor(p):
            packed[index] = {
                key: _export_scalar(value, p) if _is_shard_scalar(key, value) else value
                for key, value in packed[index].items()
            }
    return {**state_dict, "state": packed}


def _is_shard_scalar(key: str, value: Any) -> bool:
    return key.endswith(("_scale", "_amax")) and isinstance(value, torch.Tensor) and value.dim() == 0


def _sharded_dim(p: torch.Tensor) -> int | None:
    """The one tensor dimension that ``p``'s placements shard; None when they shard none or several."""
    # Not Placement.is_shard(): FSDP2 on top of tensor parallelism shards with _StridedShard, which is no Shard in
    # recent torch; both have the dimension they shard as ``dim``.
    dims = {getattr(placement, "dim", None) for placement in p.placements if not placement.is_replicate()}
    return next(iter(dims)) if len(dims) == 1 and None not in dims else None


def _export_scalar(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    value = value.detach()
    dim = _sharded_dim(p)
    if dim is None:  # replicated (one value everywhere), or sharded on several dimensions: one value per rank
        placements = [Replicate() if placement.is_replicate() else Shard(0) for placement in p.placements]
        return DTensor.from_local(value.reshape(1), p.device_mesh, placements, run_check=False)
    # Sharded on ``dim``: the parameter's size there, 1 elsewhere, sharded exactly like the parameter.
    local_shape, shape = [1] * p.dim(), [1] * p.dim()
    local_shape[dim], shape[dim] = shards.local(p).shape[dim], p.shape[dim]
    local = value.reshape([1] * p.dim()).expand(local_shape).clone()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


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


def _check(opt: FP8AdamW, state_dict: Any) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Each saved state as this rank's part (DTensors as their local shards) beside its parameter.

    Raises:
        ValueError: for anything the load could not take as it is (see :func:`_check_entry`).
    """
    well_formed = isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
    if not (well_formed and "param_groups" in state_dict):
        got = list(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"FP8AdamW.load_state_dict expects a dict with 'state' and 'param_groups' (an optimizer's state_dict()), "
            f"got {got}"
        )
    _check_no_amsgrad(state_dict)
    _check_groups(state_dict["param_groups"])
    groups = state_dict["param_groups"]
    saved = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None for g in groups]
    own = [len(group["params"]) for group in opt.param_groups]
    if saved != own:  # as torch.optim.Optimizer.load_state_dict would refuse them, said before anything changes
        raise ValueError(
            f"FP8AdamW.load_state_dict: the state dict's parameter groups hold {saved} parameters, this optimizer's "
            f"{own}: it was saved for another model or another grouping of its parameters; build the optimizer as "
            f"the run that saved it did, or {_FIX}"
        )
    saved_ids = [i for group in groups for i in group["params"]]
    params = _param_order(opt)
    listed = set(saved_ids)
    strays = [key for key in state_dict["state"] if key not in listed]
    if strays:  # e.g. keys turned into strings by a JSON round trip: every state would silently start again
        raise ValueError(
            f"FP8AdamW.load_state_dict: the state dict has states under {[repr(k) for k in strays[:5]]}, which no "
            f"parameter group lists (the groups list {saved_ids[:5]}{'...' if len(saved_ids) > 5 else ''}): those "
            f"states would be dropped. Load the dict that state_dict() returned as it was saved "
            f"(integer keys), or {_FIX}"
        )
    entries = []
    for index, p in zip(saved_ids, params, strict=True):
        # An absent index is a parameter without state yet; a present one must be a state (None is no dict).
        if index in state_dict["state"]:
            saved = state_dict["state"][index]
            entries.append((p, _check_entry(f"FP8AdamW.load_state_dict: parameter {index}", p, saved)))
    return entries


def _check_no_amsgrad(state_dict: dict[str, Any]) -> None:
    """Raise ValueError for a state dict of AMSGrad (``torch.optim.AdamW(amsgrad=True)``): FP8AdamW would drop the
    running maximum of the second moment and go on without it. ``amsgrad: False`` (torch's groups have it) loads."""
    groups = state_dict["param_groups"]
    amsgrad = [i for i, group in enumerate(groups) if isinstance(group, dict) and group.get("amsgrad")]
    with_max = [i for i, saved in state_dict["state"].items() if isinstance(saved, dict) and "max_exp_avg_sq" in saved]
    if amsgrad:
        found = f"parameter group {amsgrad[0]} has amsgrad=True"
    elif with_max:
        found = f"parameter {with_max[0]}'s state has 'max_exp_avg_sq'"
    else:
        return
    raise ValueError(
        f"FP8AdamW.load_state_dict: {found} (torch.optim.AdamW(amsgrad=True)'s state): FP8AdamW implements AdamW "
        "without AMSGrad and would drop the running maximum of the second moment ('max_exp_avg_sq'). Keep training "
        "these parameters with torch.optim.AdamW(amsgrad=True), or, to go on without AMSGrad, set every group's "
        "'amsgrad' to False and delete each state's 'max_exp_avg_sq' in the state dict before loading it"
    )


def _check_groups(groups: Any) -> None:
    """Raise ValueError for a saved group whose lr, betas, eps or weight_decay the constructor would refuse (NaN, inf,
    out of range, not a number), or with ``capturable``/``differentiable`` true: the base class would restore them as
    they are."""
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            continue  # torch.optim.Optimizer.load_state_dict says what is wrong
        try:
            step_.check_hyper_parameters(*(group.get(name) for name in ("lr", "betas", "eps", "weight_decay")))
            step_.check_supported_flags(group)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"FP8AdamW.load_state_dict: parameter group {i} of the state dict: {error}. Correct it in "
                f"state_dict['param_groups'][{i}] before loading, or {_FIX}"
            ) from None


def _check_entry(where: str, p: torch.Tensor, saved: Any) -> dict[str, Any]:
    """Raise ValueError for a state its parameter cannot take: not a dict; some of AdamW's step and moments without the
    others; a moment or master that is not a floating-point tensor of the parameter's (shard's) shape, or is sharded
    where the parameter is not, or has a dtype FP8AdamW does not store; an FP8 or fp16 moment or master without its
    scale (except the fp16 moments of a state with torch.optim.AdamW's keys only, which hold their values); a scale or
    amax of a shape that fits neither one number nor one per row (column) of its state, a scale outside 2**-126 to
    2**127, an amax that is not finite and >= 0; bad values (:func:`_check_values`); a step that is not a whole number
    from 0 to 2**24 (:func:`_check_step`). Returns the state with DTensors as local shards."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where}'s state is a {type(saved).__name__}, not a dict: {_FIX}")
    present = [key for key in _ADAMW_KEYS if key in saved]
    if present and len(present) != len(_ADAMW_KEYS):
        missing = [key for key in _ADAMW_KEYS if key not in saved]
        raise ValueError(f"{where}'s state has {present} without {missing}: {_FIX}")
    # torch.optim.AdamW's state (its keys only) keeps the moments in the parameter's dtype, fp16 for an fp16 model,
    # without a scale: they hold the values themselves. A state of FP8AdamW has more keys (master, scales, amaxes).
    adamw = set(saved) <= set(_ADAMW_KEYS)
    local = {key: shards.local(value) if shards.is_dtensor(value) else value for key, value in saved.items()}
    shard_shape = tuple(shards.local(p).shape)
    for key in _KEYS:
        if key not in saved:
            continue
        what = f"{where}'s {key!r}"
        _check_tensor(what, saved[key], p)
        # Whatever its shape: a rank whose shard has the whole parameter's shape (fewer rows than ranks) must refuse
        # as the others do, or it would load and run on while they raise.
        if shards.is_dtensor(p) and not shards.is_dtensor(saved[key]):
            raise ValueError(
                f"{what} is a plain tensor of shape {tuple(local[key].shape)} and its parameter is sharded (a DTensor, "
                f"this rank's shard {shard_shape}): a full (unsharded) state dict loads into sharded parameters "
                "through torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(..., "
                "options=StateDictOptions(full_state_dict=True))"
            )
        if tuple(local[key].shape) != shard_shape:
            raise ValueError(f"{what} has shape {tuple(local[key].shape)}, its parameter {shard_shape}: {_FIX}")
        dtype = local[key].dtype
        if dtype not in SCALED_STATE_MAX and dtype not in _UNSCALED:
            raise ValueError(
                f"{what} is {dtype}, which FP8AdamW does not store (it stores {list(_UNSCALED)} as they are, "
                f"{list(SCALED_STATE_MAX)} as value * '{key}_scale') and so cannot read. Convert it in the state dict "
                f"to fp32 values (stored / scale in the format's own convention) and delete '{key}_scale' and "
                f"'{key}_amax', or {_FIX}"
            )
        # FP8AdamW writes no scaled state without its scale: read without one, it would be the value times the scale.
        if dtype in SCALED_STATE_MAX and f"{key}_scale" not in saved and not (dtype == torch.float16 and adamw):
            whose = "torch.optim.AdamW keeps no FP8 moments"
            if not adamw:
                keys = sorted(map(str, saved))
                whose = f"the state has {keys}: FP8AdamW's, not torch.optim.AdamW's (fp16 moments as values)"
            raise ValueError(
                f"{what} is {dtype} without its '{key}_scale' (FP8AdamW stores it as value * scale; {whose}): {_FIX}"
            )
        for name in (f"{key}_scale", f"{key}_amax"):
            if name in saved:
                _check_scalar(f"{where}'s {name!r}", saved[name], local[name], local[key], p, name.endswith("scale"))
        _check_values(where, key, local)
    if "step" in saved:
        _check_step(where, saved["step"])
    return local


def _check_tensor(what: str, value: Any, p: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        raise ValueError(f"{what} is {kind}, not a floating-point tensor: {_FIX}")
    if shards.is_dtensor(value) and not shards.is_dtensor(p):
        raise ValueError(
            f"{what} is sharded (a DTensor) and its parameter is not: load a sharded checkpoint into the model sharded "
            "the same way, or gather it first (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict with "
            "StateDictOptions(full_state_dict=True))"
        )


def _check_scalar(what: str, value: Any, local: Any, state: torch.Tensor, p: torch.Tensor, is_scale: bool) -> None:
    _check_tensor(what, value, p)
    if shards.is_dtensor(value):  # every rank sees the same global shape: all of them raise, none waits for the others
        ranks, shapes = _exported_shapes(p)
        if tuple(value.shape) not in shapes:
            raise ValueError(
                f"{what} has shape {tuple(value.shape)}, and its parameter {tuple(p.shape)}, sharded {p.placements} "
                f"over {ranks} rank(s), takes {' or '.join(str(s) for s in shapes)}: the checkpoint was saved with "
                "another sharding, and the scales of a parameter sharded on several dimensions reshard with nothing "
                "else; load it into the model sharded as it was saved, on as many ranks"
            )
    fits = local.numel() == 1 or (
        local.dim() == state.dim() and all(n in (1, size) for n, size in zip(local.shape, state.shape, strict=True))
    )
    if not fits:
        raise ValueError(
            f"{what} has shape {tuple(local.shape)}, which is neither one number nor one per row (column) of its state "
            f"{tuple(state.shape)}: it holds one number per rank of a sharded run (a parameter sharded on several "
            "dimensions, or a checkpoint written before lightning_fp8 saved sharded scales per row). Load it into the "
            "model sharded as it was saved, on as many ranks, through torch.distributed.checkpoint.state_dict."
            "set_optimizer_state_dict"
        )
    if is_scale:  # the range FP8AdamW writes (see MIN_SCALE): the step multiplies by 1 / scale, inf for 2**-130
        bad = ~((local >= MIN_SCALE) & (local <= MAX_SCALE))  # NaN too
        wanted = "finite and positive, from 2**-126 to 2**127 (the scales FP8AdamW writes)"
    else:
        bad = ~torch.isfinite(local) | (local < 0)
        wanted = "finite and >= 0"
    if bool(bad.any()):
        raise ValueError(f"{what} has the value {local[bad].reshape(-1)[0].item()}, not {wanted}: {_FIX}")


def _check_values(where: str, key: str, local: dict[str, Any]) -> None:
    """Raise ValueError when this rank's part of state ``key`` holds inf or NaN, is a negative ``exp_avg_sq``, is
    unscaled with a scale other than 1 (FP8AdamW writes 1, and an adopted weight's forward would divide by it), or
    exceeds its amax by more than the rounding of its storage (``BOUND_SLACK``).

    The amax is not measured again on loading (a resumed run continues bit-identically): the one-pass scale update
    bounds the next values of the state from it, and an understated one makes the next step saturate the state.
    """
    what, x = f"{where}'s {key!r}", dequantize(local, key)  # fp32, unscaled
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{what} holds inf or NaN: the run had diverged (or the file is corrupt) when it was saved; resume from an "
            "earlier checkpoint"
        )
    if key == "exp_avg_sq" and bool((x < 0).any()):
        raise ValueError(f"{what} holds negative values (a second moment is a mean of squares, >= 0): {_FIX}")
    scale, amax = local.get(f"{key}_scale"), local.get(f"{key}_amax")
    if scale is not None and local[key].dtype not in SCALED_STATE_MAX and not bool((scale == 1).all()):
        raise ValueError(
            f"{where}'s '{key}_scale' is {scale.reshape(-1)[0].item()} for a {local[key].dtype} state, which FP8AdamW "
            f"stores unscaled (scale 1): {_FIX}"
        )
    if amax is not None:  # per row for per-row amaxes, plus the storage's smallest normal (a subnormal's rounding)
        dtype, amax = local[key].dtype, _broadcast(amax, x)
        scale = _broadcast(scale, x) if scale is not None and dtype in SCALED_STATE_MAX else 1.0
        if bool((x.abs() > amax * BOUND_SLACK + torch.finfo(dtype).smallest_normal / scale).any()):
            raise ValueError(
                f"{where}'s '{key}_amax' is below the largest value of {key!r} ({x.abs().max().item()}, amax "
                f"{amax.min().item()}): the next step would pick a scale too large from it and saturate the state. "
                f"The checkpoint is corrupt or was edited; to load its values anyway, delete '{key}_amax' from the "
                "state: it is then measured from them"
            )


def _broadcast(scalar: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A scale or amax (one number, or one per row) on ``x``'s device, to broadcast against ``x``."""
    return (scalar.reshape(()) if scalar.numel() == 1 else scalar).to(x.device)


def _exported_shapes(p: torch.Tensor) -> tuple[int, list[tuple[int, ...]]]:
    """How many shards ``p`` has, and the shapes its exported scales may have (:func:`_export_scalar`): one per rank
    (also what a checkpoint of the same sharding written before the per-row layout holds), one per row (column)."""
    ranks = math.prod(p.device_mesh.size(i) for i, placement in enumerate(p.placements) if not placement.is_replicate())
    dim = _sharded_dim(p)
    per_row = [tuple(size if d == dim else 1 for d, size in enumerate(p.shape))] if dim is not None else []
    return ranks, [(ranks,), *per_row]


# The step is kept as torch.optim.AdamW keeps it, in a float32 tensor, whose ``step += 1`` is exact up to 2**24 (16.8
# million steps, far more than a training run takes) and then stops counting: no run saves a larger step.
_MAX_STEP = 2**24


def _check_step(where: str, step: Any) -> None:
    """Raise ValueError unless ``step`` is a number of steps: an integer value from 0 to :data:`_MAX_STEP`, as a Python
    number or a one-element real tensor (torch.optim.AdamW saves a 0-dim float32 one). Not a bool: True loaded as 1."""
    try:
        value = torch.as_tensor(step)
        count = float(value) if value.numel() == 1 and not (value.is_complex() or value.dtype == torch.bool) else None
    except (TypeError, ValueError, RuntimeError):
        count = None
    if count is None or not (0 <= count <= _MAX_STEP and count.is_integer()):  # NaN fails the comparisons
        raise ValueError(
            f"{where}'s step is {step!r}, not a whole number of steps from 0 to 2**24 (a float32 step counts no "
            f"further): {_FIX}"
        )


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
        state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).detach().cpu().clone().reshape(())
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


# --------------------------------------------------------------------------------------------------- export, stats
def to_adamw(opt: FP8AdamW) -> dict[str, Any]:
    """The state as ``torch.optim.AdamW`` keeps it: fp32 moments, ``step``; groups with AdamW's keys added."""
    return adamw_state_dict(torch.optim.Optimizer.state_dict(opt))  # the states as kept (0-dim scales)


def adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A saved :class:`~lightning_fp8.FP8AdamW` state dict (``optimizer.state_dict()``, a Lightning checkpoint's
    ``optimizer_states`` entry) as ``torch.optim.AdamW``'s: fp32 moments, each low-precision one divided by its scale,
    ``step``; groups with AdamW's keys added to theirs (a scheduler's keys stay). For resuming without FP8:
    ``torch.optim.AdamW.load_state_dict`` takes an FP8AdamW state dict without a word but reads its scaled moments as
    they are stored (``x * scale``, the scales dropped), and Adam's steps are then off until the moments decay."""
    state = {
        index: {
            key: (saved[key].detach().cpu().clone() if key == "step" else dequantize(saved, key))
            for key in ("step", "exp_avg", "exp_avg_sq")
            if key in saved
        }
        for index, saved in state_dict["state"].items()
    }
    adamw_defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
    # Every key a group holds stays: an LR scheduler's (initial_lr, max_lr, ...) and the user's own as well.
    groups = [{**adamw_defaults, **group} for group in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def stats(opt: FP8AdamW) -> dict[str, Any]:
    """Body of :meth:`FP8AdamW.fp8_state_stats`."""
    names = [f"{k}_{suffix}" for k in _KEYS for suffix in ("scale", "amax")]
    rows: dict[int, list[torch.Tensor]] = {}
    for index, p in enumerate(_param_order(opt)):
        state = opt.state.get(p, {})
        if p in opt._low_precision and all(name in state for name in names):
            rows[index] = [state[name].float().reshape(1).to(p.device) for name in names]
    values: dict[int, list[float]] = {}
    by_device: dict[torch.device, list[int]] = {}
    for index, row in rows.items():
        by_device.setdefault(row[0].device, []).append(index)
    for indices in by_device.values():  # one host transfer per device
        table = torch.cat([torch.cat(rows[i]) for i in indices]).reshape(len(indices), len(names)).tolist()
        values.update(zip(indices, table, strict=True))
    params = {f"param_{i}": dict(zip(names, values[i], strict=True)) for i in sorted(values)}
    summary: dict[str, dict[str, float]] = {}
    for entry in params.values():
        for name, value in entry.items():
            s = summary.setdefault(name, {"min": value, "max": value})
            s["min"], s["max"] = min(s["min"], value), max(s["max"], value)
    out: dict[str, Any] = {"params": params, "summary": summary}
    scaler = opt.grad_scaler
    if scaler is not None:
        out["grad_scaler"] = {
            "scale": float(scaler.scale),
            "skipped_steps": scaler.skipped_steps,
            "last_saturation": scaler.last_saturation,
            "nonfinite_events": scaler.nonfinite_events,
            "growth_tracker": scaler.growth_tracker,
        }
    return out
