"""The checks of a state dict before :class:`~lightning_fp8.optim.FP8AdamW` loads any of it.

Everything is checked before anything is loaded, so that a bad checkpoint raises and changes nothing: the dict's form
and parameter groups (their number, sizes and hyper-parameters, no AMSGrad), and each parameter's state (its keys,
each tensor's dtype, shape and sharding, its scale and amax, its values and step), with errors that say what is wrong
and what to do. :func:`_check` returns each state as this rank's part beside its parameter, for
:mod:`~lightning_fp8.optim.checkpoint` to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8.kernels.reference_adamw import BOUND_SLACK, SCALED_STATE_MAX
from lightning_fp8.optim import shards
from lightning_fp8.optim import step as step_
from lightning_fp8.optim.shard_scales import _exported_shapes
from lightning_fp8.optim.state_layout import _ADAMW_KEYS, _KEYS, _UNSCALED, _param_order, dequantize
from lightning_fp8.state_values import MAX_SCALE, MIN_SCALE

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW

_FIX = "the checkpoint is corrupt or was written for another model"


def _check(opt: FP8AdamW, state_dict: Any) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Each saved state as this rank's part (DTensors as their local shards) beside its parameter.

    With sharded (DTensor) parameters every rank checks its own shards, and the ranks agree (one all-reduce per
    dimension of each mesh): when one refuses its part, all raise, and none loads its own. Parameters that FSDP1
    flattened agree the same way over the default process group (a collective: every rank of it loads its part of
    an FSDP1 state dict, one optimizer after another in the same order).

    Raises:
        ValueError: for anything the load could not take as it is (see :func:`_check_entry`).
    """
    params = _param_order(opt)
    sharded = [p for p in params if shards.is_dtensor(p)]
    flattened = not sharded and any(shards.is_fsdp1_view(p) for p in params) and _world_size() > 1
    if not sharded and not flattened:
        return _check_here(opt, state_dict)
    try:
        entries, error = _check_here(opt, state_dict), None
    except Exception as caught:  # every rank goes on to the agreement below, or the others would wait for it
        entries, error = [], caught
    if sharded:
        meshes = list({id(p.device_mesh): p.device_mesh for p in sharded}.values())
        local = shards.local(sharded[0]).device
        device = local if local.type == meshes[0].device_type else torch.device(meshes[0].device_type)  # CPU offload
        refused = shards.any_rank(meshes, error is not None, device)
    else:
        refused = _any_rank_of_world(error is not None, [p for p in params if shards.is_fsdp1_view(p)])
    if refused and error is None:
        raise ValueError(
            "FP8AdamW.load_state_dict: another rank refused its part of the state dict (its error says why), so no "
            "rank loads its own: nothing was changed"
        )
    if error is not None:
        raise error
    return entries


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _any_rank_of_world(flag: bool, params: list[torch.Tensor]) -> bool:
    """Whether ``flag`` is true on any rank of the default process group (a MAX all-reduce; every rank calls this),
    on NCCL on the device of the first of ``params`` on CUDA (FSDP1 runs with the model on ``cuda:rank`` and no
    ``set_device``), else the current CUDA device (parameters offloaded to the CPU)."""
    import torch.distributed as dist

    from lightning_fp8.distributed.exchange import cuda_backend_is_nccl

    device = torch.device("cpu")
    if cuda_backend_is_nccl(None):
        cuda = [p.device for p in params if p.device.type == "cuda"]
        device = cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _check_here(opt: FP8AdamW, state_dict: Any) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """:func:`_check` on this rank's parts."""
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
    # A tuple of indices too, as torch.optim.Optimizer.load_state_dict takes it.
    saved = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) else None
             for g in groups]  # fmt: skip
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
    """Raise ValueError for a saved group without lr, betas, eps or weight_decay (another optimizer's), whose values the
    constructor would refuse (NaN, inf, out of range, not a number), or with ``capturable``/``differentiable`` true:
    the base class would restore them as they are."""
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            continue  # torch.optim.Optimizer.load_state_dict says what is wrong
        missing = [name for name in ("lr", "betas", "eps", "weight_decay") if name not in group]
        if missing:  # another optimizer's groups (SGD's have no betas or eps): not "eps must be a number"
            raise ValueError(
                f"FP8AdamW.load_state_dict: parameter group {i} of the state dict has no {missing}: it is not the "
                "state of an AdamW (another optimizer's, e.g. torch.optim.SGD's, saved it). FP8AdamW loads the state "
                "dicts of FP8AdamW and torch.optim.AdamW; to switch from another optimizer, start FP8AdamW from its "
                "fresh state instead of loading that one"
            )
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
    _check_keys(where, saved)
    # torch.optim.AdamW's state (its keys only) keeps the moments in the parameter's dtype, fp16 for an fp16 model,
    # without a scale: they hold the values themselves. A state of FP8AdamW has more keys (master, scales, amaxes).
    adamw = set(saved) <= set(_ADAMW_KEYS)
    local = {key: shards.local(value) if shards.is_dtensor(value) else value for key, value in saved.items()}
    meta = [key for key, value in local.items() if isinstance(value, torch.Tensor) and value.is_meta]
    if meta:
        raise ValueError(
            f"{where}'s {meta[:3]} are on the meta device (they hold no data): load the checkpoint with "
            "torch.load(..., map_location='cpu') or the device of the model"
        )
    for key in _KEYS:
        if key in saved:
            _check_state(where, key, p, saved, local, adamw)
    if "step" in saved:
        _check_step(where, saved["step"])
    return local


def _check_keys(where: str, saved: Any) -> None:
    """Raise ValueError for a state that is not a dict, or has some of AdamW's step and moments without the others."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where}'s state is a {type(saved).__name__}, not a dict: {_FIX}")
    present = [key for key in _ADAMW_KEYS if key in saved]
    if present and len(present) != len(_ADAMW_KEYS):
        missing = [key for key in _ADAMW_KEYS if key not in saved]
        raise ValueError(f"{where}'s state has {present} without {missing}: {_FIX}")


def _check_state(
    where: str, key: str, p: torch.Tensor, saved: dict[str, Any], local: dict[str, Any], adamw: bool
) -> None:
    """Raise ValueError for state ``key`` (a moment or the master) that ``p`` cannot take: the tensor, its sharding and
    shape, the dtype it is stored in, its scale and amax, its values. ``local``: the state with DTensors as local
    shards; ``adamw``: whether it has torch.optim.AdamW's keys only."""
    what, shard_shape = f"{where}'s {key!r}", tuple(shards.local(p).shape)
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
    _check_dtype(what, key, local[key].dtype, saved, adamw)
    for name in (f"{key}_scale", f"{key}_amax"):
        if name in saved:
            _check_scalar(f"{where}'s {name!r}", saved[name], local[name], local[key], p, name.endswith("scale"))
    _check_values(where, key, local)


def _check_dtype(what: str, key: str, dtype: torch.dtype, saved: dict[str, Any], adamw: bool) -> None:
    """Raise ValueError for state ``key`` of a dtype FP8AdamW does not store, or of a scaled one (FP8, fp16) without
    its scale (except the fp16 moments of torch.optim.AdamW's state, ``adamw``, which hold their values)."""
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


def _check_tensor(what: str, value: Any, p: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        kind = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        raise ValueError(f"{what} is {kind}, not a floating-point tensor: {_FIX}")
    if value.layout != torch.strided:  # (the checks below would fail on it with NotImplementedError)
        raise ValueError(f"{what} is a {value.layout} tensor; optimizer states are dense: load it with .to_dense()")
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
        why = _FIX
        if not is_scale and not bool(torch.isfinite(local).all()):  # a step's non-finite state records its amax so
            why = f"the run had diverged when it was saved (resume from an earlier checkpoint), or {_FIX}"
        raise ValueError(f"{what} has the value {local[bad].reshape(-1)[0].item()}, not {wanted}: {why}")


def _check_values(where: str, key: str, local: dict[str, Any]) -> None:
    """Raise ValueError when this rank's part of state ``key`` holds inf or NaN, is a negative ``exp_avg_sq``, is
    unscaled with a scale other than 1 (FP8AdamW writes 1, and an adopted weight's forward would divide by it), or
    exceeds its amax by more than the rounding of its storage (``BOUND_SLACK``).

    The amax is not measured again on loading (a resumed run continues bit-identically): the one-pass scale update
    bounds the next values of the state from it, and an understated one makes the next step saturate the state.
    """
    dtype, scale, amax = local[key].dtype, local.get(f"{key}_scale"), local.get(f"{key}_amax")
    if amax is not None and scale is not None and dtype in SCALED_STATE_MAX:
        # FP8AdamW picks each scale so that amax * scale fits the storage; more means the values were cut at its
        # maximum (torch 2.13) or made NaN (2.11): a state saved in a wider format (fp16, E5M2) read into this
        # optimizer's narrower one, as torch.distributed.checkpoint reads a checkpoint into the optimizer's own layout.
        # Checked before the values: it says why they are not finite.
        if bool((amax * scale.to(amax.device) > SCALED_STATE_MAX[dtype] * BOUND_SLACK).any()):
            raise ValueError(
                f"{where}'s {key!r} is {dtype}, and its '{key}_amax' times '{key}_scale' is above {dtype}'s maximum "
                f"{SCALED_STATE_MAX[dtype]}: the values were saved in a wider format and cut to fit this one (a "
                "torch.distributed.checkpoint load reads a checkpoint into the optimizer's own dtypes). Build the "
                "FP8AdamW with the settings of the run that saved it (opt_level, low_precision_moments, exp_avg_dtype, "
                f"...) to load it, or {_FIX}"
            )
    what, x = f"{where}'s {key!r}", dequantize(local, key)  # fp32, unscaled
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{what} holds inf or NaN: the run had diverged (or the file is corrupt) when it was saved; resume from an "
            "earlier checkpoint"
        )
    if key == "exp_avg_sq" and bool((x < 0).any()):
        raise ValueError(f"{what} holds negative values (a second moment is a mean of squares, >= 0): {_FIX}")
    if scale is not None and dtype not in SCALED_STATE_MAX and not bool((scale == 1).all()):
        raise ValueError(
            f"{where}'s '{key}_scale' is {scale.reshape(-1)[0].item()} for a {dtype} state, which FP8AdamW "
            f"stores unscaled (scale 1): {_FIX}, or a checkpoint of scaled (FP8/fp16) states was read into this "
            "optimizer's fp32 ones (torch.distributed.checkpoint reads into the optimizer's own dtypes, and under "
            "FSDP1 those of original parameters are fp32 values): load it into the model wrapped as it was saved"
        )
    if amax is not None:  # per row for per-row amaxes, plus the storage's smallest normal (a subnormal's rounding)
        amax = _broadcast(amax, x)
        scale = _broadcast(scale, x) if scale is not None and dtype in SCALED_STATE_MAX else 1.0
        if bool((x.abs() > amax * BOUND_SLACK + torch.finfo(dtype).smallest_normal / scale).any()):
            why = (
                f"The checkpoint is corrupt or was edited; to load its values anyway, delete '{key}_amax' from the "
                "state: it is then measured from them"
            )
            if dtype == torch.float32 and f"{key}_scale" in local and bool((local[f"{key}_scale"] == 1).all()):
                why += (
                    ". Or it holds fp32 values (as FP8AdamW exports the states of parameters FSDP1 flattened) that "
                    "torch's set_state_dict(full_state_dict=True) put beside this optimizer's own amaxes, as it does "
                    "for a model FSDP1 does not wrap: hand such a full state dict to optimizer.load_state_dict instead"
                )
            raise ValueError(
                f"{where}'s '{key}_amax' is below the largest value of {key!r} ({x.abs().max().item()}, amax "
                f"{amax.min().item()}): the next step would pick a scale too large from it and saturate the state. "
                + why
            )


def _broadcast(scalar: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A scale or amax (one number, or one per row) on ``x``'s device, to broadcast against ``x``."""
    return (scalar.reshape(()) if scalar.numel() == 1 else scalar).to(x.device)


# The step is kept as torch.optim.AdamW keeps it, in a float32 tensor, whose ``step += 1`` is exact up to 2**24 (16.8
# million steps, far more than a training run takes) and then stops counting: no run saves a larger step.
_MAX_STEP = 2**24


def _check_step(where: str, step: Any) -> None:
    """Raise ValueError unless ``step`` is a number of steps: an integer value from 0 to :data:`_MAX_STEP`, as a Python
    number or a one-element real tensor (torch.optim.AdamW saves a 0-dim float32 one). Not a bool: True loaded as 1."""
    try:
        # A Python float as float64, not the default dtype's: under torch.set_default_dtype(torch.float16) 70000.0 was
        # inf (refused), under bfloat16 300.5 rounded to a whole 300 (accepted, and loaded as 300.5).
        exact = torch.float64 if isinstance(step, float) else None
        value = torch.as_tensor(step, dtype=exact, device="cpu") if not isinstance(step, torch.Tensor) else step
        count = float(value) if value.numel() == 1 and not (value.is_complex() or value.dtype == torch.bool) else None
    except (TypeError, ValueError, RuntimeError):
        count = None
    if count is None or not (0 <= count <= _MAX_STEP and count.is_integer()):  # NaN fails the comparisons
        raise ValueError(
            f"{where}'s step is {step!r}, not a whole number of steps from 0 to 2**24 (a float32 step counts no "
            f"further): {_FIX}"
        )
