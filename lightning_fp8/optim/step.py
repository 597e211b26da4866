"""FP8AdamW's step launches: the kernel's tensor lists per group of tensors, one multi-tensor launch each, and the
FP8 weight copies the step emits (:mod:`lightning_fp8.weight_cache`).

A launch takes tensors of one set of dtypes at one step count (bias correction); tensors that emit an FP8 copy
and those that do not go to separate launches (one ``EMIT`` constexpr per launch).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from lightning_fp8 import ops, weight_cache
from lightning_fp8.kernels import reference_adamw
from lightning_fp8.optim import master, shards
from lightning_fp8.recipe import check_flag


def launch_item(opt: Any, p: torch.Tensor, state: dict[str, Any], grad, grad_scale_inv, grad_amax) -> tuple:
    """The kernel's tensors for ``p``, ``p`` itself, then the key (dtypes, emission) that decides its launch."""
    # The parameter itself, not a detached alias: the step runs under no_grad (like torch.optim's in-place
    # updates), and detach() costs about a microsecond per parameter.
    target, copy = (state["master"], p) if "master" in state else (p, None)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    if p in opt._moments_only:  # a high-precision master: the kernel ignores its scale and writes its amax
        master_amax = opt._master_amax.get(p)
        if master_amax is None:
            master_amax = opt._master_amax[p] = torch.zeros((), dtype=torch.float32, device=p.device)
        scales = (state["exp_avg_scale"], state["exp_avg_scale"], state["exp_avg_sq_scale"])
        amaxes = (master_amax, state["exp_avg_amax"], state["exp_avg_sq_amax"])
    elif p in opt._low_precision:
        scales = (state["master_scale"], state["exp_avg_scale"], state["exp_avg_sq_scale"])
        amaxes = (state["master_amax"], state["exp_avg_amax"], state["exp_avg_sq_amax"])
    else:
        scales = amaxes = None
    dtensor = shards.is_dtensor(p)
    if dtensor:  # FSDP2: the kernel works on this rank's shards
        target = shards.local(target.detach())
        grad, exp_avg, exp_avg_sq = shards.local(grad), shards.local(exp_avg), shards.local(exp_avg_sq)
        copy = shards.local(copy.detach()) if copy is not None else None
    # The FP8 copy is for FP8Linear weights the forward reads as they are (not DTensors: see weight_cache).
    emit = opt.emit_fp8_weights and master.is_fp8_weight(p) and not dtensor
    key = (target.dtype, grad.dtype, exp_avg.dtype, exp_avg_sq.dtype, grad_scale_inv is not None,
           copy.dtype if copy is not None else None, emit)  # fmt: skip
    return target, grad, exp_avg, exp_avg_sq, grad_scale_inv, copy, scales, amaxes, grad_amax, p, key


def launch(opt: Any, group: dict[str, Any], step: int, items: list[tuple], grad_unscale: float, emit: bool) -> None:
    """One multi-tensor step over ``items`` (from :func:`launch_item`, without the key), emitting FP8 copies when
    ``emit``; FP8 weights written without emitting lose their old copy (its memory is freed)."""
    params, grads, exp_avgs, exp_avg_sqs, gsis, copies, scales, amaxes, grad_amaxes, owners = (
        list(x) for x in zip(*items, strict=True)
    )
    beta1, beta2 = (float(beta) for beta in group["betas"])  # tensor betas (torch allows them) as numbers
    # One pass bounds the new amaxes with Adam's step bound (needs beta1**2 < beta2) and the gradient amaxes.
    two_pass = opt.scale_update == "two_pass" or beta1**2 >= beta2 or scales[0] is None
    # lr 0 leaves the weights as they are, as in torch.optim.AdamW (the copy would be the rounded master;
    # torch.distributed.checkpoint creates the states of a resumed run with such a step).
    write_copies = copies[0] is not None and float(group["lr"]) != 0.0
    eps = _eps_at_least_normal(group["eps"], beta2, step)
    kwargs = {
        "lr": float(group["lr"]), "beta1": beta1, "beta2": beta2, "eps": eps,
        "weight_decay": group["weight_decay"], "step": step,
        "grad_unscale": -grad_unscale if group.get("maximize", False) else grad_unscale,
        "two_pass": two_pass, "grad_amaxes": None if two_pass else grad_amaxes,
        "param_copies": copies if write_copies else None,
    }  # fmt: skip
    caches = None
    if emit and (write_copies or copies[0] is None):  # an unwritten copy keeps its valid FP8 copy
        caches = [weight_cache.allocate(p, opt.recipe.forward_dtype, opt.recipe.margin) for p in owners]
        kwargs.update(fp8_weights=[c.data for c in caches], fp8_weight_stats=[c.record for c in caches],
                      fp8_margin=opt.recipe.margin)  # fmt: skip
    elif copies[0] is None or write_copies:
        weight_cache.drop_all(owners)
    args = (params, grads, exp_avgs, exp_avg_sqs, scales if scales[0] is not None else None,
            amaxes if amaxes[0] is not None else None, gsis if gsis[0] is not None else None)  # fmt: skip
    if ops.use_triton(params[0]) and all(t.is_contiguous() for t in params + exp_avgs + exp_avg_sqs):
        from lightning_fp8.kernels import adamw as adamw_kernels

        with ops.on_device(params[0]):  # the batch's device (adamw.py batches the step by device)
            adamw_kernels.adamw_step(*args, **kwargs)
        # A Triton write bumps no version counter, where torch.optim.AdamW's in-place updates (and the reference
        # below) do: a graph built before the step and backpropagated after it (a GAN's discriminator stepped
        # between its two losses' backwards) computed its gradients silently from the new weights where torch raises
        # "modified by an inplace operation". Before the seals below, which snapshot the versions.
        torch.autograd.graph.increment_version(
            [*params, *owners, *(copies if write_copies else ())]  # (a DTensor's local shard and the DTensor)
        )
    else:
        reference_adamw.adamw_step_ref(*args, **kwargs)
    if caches is not None:
        for p, cache in zip(owners, caches, strict=True):
            weight_cache.seal(p, cache)


# fp32's smallest normal number, twice: the least bias-corrected eps the step uses (see _eps_at_least_normal).
_EPS_HAT_MIN = 2.0**-125


def _eps_at_least_normal(eps: Any, beta2: float, step: int) -> Any:
    """``eps``, raised where needed so that the step's bias-corrected ``eps * sqrt(1 - beta2**step)`` is a normal fp32.

    With ``eps`` 0 (torch.optim.AdamW takes it), an element whose stored moments both flushed to zero in their
    per-tensor scaled formats (its gradient some 2**-20 below the tensor's largest), then got no gradient, stepped
    0 / 0 = NaN into its weight, where torch's moments stay nonzero and its step is 0. A normal eps_hat (GPUs flush
    subnormals) makes that step 0 and changes no other: the square root of any nonzero fp32 ``v`` exceeds it by 2**50.
    """
    least = _EPS_HAT_MIN / math.sqrt(1.0 - beta2**step)
    return least if float(eps) < least else eps


def _check_number(name: str, value: Any, tensor_ok: bool = False) -> None:
    if isinstance(value, torch.Tensor) and tensor_ok:
        return
    # numbers.Real: NumPy scalars too (np.float32(1e-3) from a config), as torch.optim.AdamW takes them for lr, eps and
    # weight_decay.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"FP8AdamW: {name} must be a number, got {type(value).__name__} {value!r}")


def _as_float(value: Any) -> Any:
    # A NumPy scalar as a Python float (np.float64 too, a subclass of float); Python numbers and tensors as they are.
    return float(value) if isinstance(value, numbers.Real) and type(value) not in (int, float) else value


def plain_hyper_parameters(group: dict[str, Any]) -> None:
    """Store the NumPy scalars among ``group``'s checked lr, betas, eps and weight_decay as Python floats: the state
    dict saves the groups, and ``torch.load(weights_only=True)`` refuses NumPy scalars."""
    for name in ("lr", "eps", "weight_decay"):
        group[name] = _as_float(group[name])
    if any(_as_float(beta) is not beta for beta in group["betas"]):
        group["betas"] = tuple(_as_float(beta) for beta in group["betas"])


# The constructor's, add_param_group's and a saved group's (a group would keep amsgrad=True and step without it).
_NO_AMSGRAD = (
    "FP8AdamW(amsgrad=True) is not supported: FP8AdamW implements AdamW without AMSGrad; drop amsgrad, or use "
    "torch.optim.AdamW(amsgrad=True) for these parameters"
)


_NO_TORCH_AMP = "torch.amp.GradScaler cannot unscale FP8 gradients: FP8GradScaler replaces it"


def check_grad_scaler(grad_scaler: Any) -> None:
    """Raise TypeError unless ``grad_scaler`` is an :class:`~lightning_fp8.FP8GradScaler` or None: anything else failed
    mid-backward (the FP8 gradient hook reports each cast to it, after taking the gradient out of ``param.grad``), or
    in ``step()`` with torch.amp's own assertions."""
    from lightning_fp8.grad_scaler import FP8GradScaler

    if grad_scaler is not None and not isinstance(grad_scaler, FP8GradScaler):
        what = "the FP8GradScaler class itself" if grad_scaler is FP8GradScaler else f"a {type(grad_scaler).__name__}"
        raise TypeError(
            f"FP8AdamW(grad_scaler=...) got {what}: pass an FP8GradScaler instance ({_NO_TORCH_AMP}), or None"
        )


def refuse_torch_amp_step(opt: Any) -> None:
    """Raise TypeError, nothing stepped, when ``torch.amp.GradScaler.step(opt)`` calls ``opt.step()``.

    FP8AdamW sets ``_step_supports_amp_scaling``, so torch.amp passes its loss scale and overflow flag as
    ``opt.grad_scale`` and ``opt.found_inf`` instead of unscaling ``param.grad`` itself. Its own unscaling went wrong
    silently: the FP8 weights' gradients (held by the optimizer, ``param.grad`` None) kept the loss scale, so their
    update came out that many times too large, and torch's overflow check never saw them. Both attributes are
    removed here: torch removes them only after a step that returned, and they would refuse every later step.
    """
    if "found_inf" not in vars(opt) and "grad_scale" not in vars(opt):
        return
    vars(opt).pop("found_inf", None)
    # torch.amp sets grad_scale to None when its unscale_(optimizer) already ran (for clipping): that call divided
    # the gradients left in param.grad in place, which a step with FP8GradScaler would divide again.
    unscaled = "grad_scale" in vars(opt) and vars(opt).pop("grad_scale") is None
    redo = (
        " torch.amp.GradScaler.unscale_(optimizer) already divided the gradients left in param.grad (not those "
        "FP8AdamW holds in FP8): call optimizer.zero_grad() and run the backward again."
        if unscaled
        else ""
    )
    raise TypeError(
        f"FP8AdamW.step() was called by torch.amp.GradScaler.step(optimizer): {_NO_TORCH_AMP}. Create "
        "scaler = lightning_fp8.FP8GradScaler(model=model), pass it as FP8AdamW(..., grad_scaler=scaler), then "
        "scaler.scale_loss(loss).backward() and scaler.step(optimizer) (or optimizer.step()); clip with "
        "scaler.clip_grad_norm_(...). Under Lightning use Trainer(precision='fp8-lm') instead of '16-mixed', under "
        f"Accelerate the FP8-LM launch config instead of mixed_precision='fp16'. Nothing was stepped.{redo}"
    )


def check_supported_flags(flags: dict[str, Any]) -> None:
    """Raise ValueError for ``amsgrad``, ``capturable`` or ``differentiable`` set true in the constructor's arguments,
    a parameter group or a saved group (a group would keep the flag and step without it)."""
    if flags.get("amsgrad"):
        raise ValueError(_NO_AMSGRAD)
    if "maximize" in flags:  # a truthy string such as "no" would otherwise turn the step into gradient ascent
        check_flag("FP8AdamW", "maximize", flags["maximize"])
    for name in ("capturable", "differentiable"):
        if flags.get(name):
            raise ValueError(
                f"FP8AdamW({name}=True) is not supported: FP8AdamW's step is a fused kernel over low-precision "
                f"states; drop {name}, or use torch.optim.AdamW for the parameters that need it"
            )


def _check_one_element(name: str, value: Any) -> None:
    _check_number(name, value, tensor_ok=True)
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"FP8AdamW: a tensor {name} must have one element, got shape {tuple(value.shape)}")


def check_hyper_parameters(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """AdamW's hyper-parameter checks, with torch.optim.AdamW's messages (and the fix); also refuses an lr, eps or
    weight_decay that is not finite (torch accepts inf, which makes every weight NaN or 0)."""
    # One-element tensors for eps and weight_decay too, as torch.optim.AdamW takes them (and the step does): refused
    # here, a torch.optim.AdamW state dict with them, or FP8AdamW's own after such a group was stepped, did not load.
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        _check_one_element(name, value)
    if isinstance(betas, (tuple, list)):
        for i, beta in enumerate(betas):  # a beta of several elements failed in float() with torch's own words
            _check_one_element(f"betas[{i}]", beta)
    eps, weight_decay = float(eps), float(weight_decay)
    if not 0.0 <= float(lr) < math.inf:
        raise ValueError(f"Invalid learning rate: {float(lr)} (FP8AdamW needs a finite lr >= 0)")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"Invalid epsilon value: {eps} (FP8AdamW needs a finite eps >= 0)")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r} (FP8AdamW needs a pair (beta1, beta2))")
    for i, beta in enumerate(betas):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {float(beta)} (FP8AdamW needs 0 <= beta < 1)")
    if not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (FP8AdamW needs a finite weight_decay >= 0)")


def check_decoupled_decay(group: dict[str, Any], weight_decay: Any) -> None:
    """Raise ValueError for a group with ``decoupled_weight_decay=False`` and a weight decay (the group's, else
    ``weight_decay``, the default): torch.optim.AdamW honours the flag (Adam's L2 decay, added to the gradient), where
    FP8AdamW would decay the weights decoupled. Without decay the two are the same (a group copied from
    ``torch.optim.Adam(weight_decay=0)``)."""
    decay = group.get("weight_decay", weight_decay)
    if not group.get("decoupled_weight_decay", True) and decay:
        raise ValueError(
            f"FP8AdamW: a parameter group with decoupled_weight_decay=False and weight_decay {decay} (Adam's L2 weight "
            "decay, added to the gradient) is not supported: FP8AdamW decays the weights decoupled, as AdamW. Drop "
            "the flag (or the decay), or use torch.optim.Adam(weight_decay=...) for these parameters"
        )


def check_group_at_step(group: dict[str, Any], index: int) -> None:
    """Raise what the constructor raises for ``group``'s hyper-parameters and flags, as a step finds them: a scheduler
    or the user's code may have written them since they were checked (``group["amsgrad"] = True`` would be stepped
    without AMSGrad, ``maximize="no"`` as gradient ascent, ``betas=(1.0, ...)`` failed with ZeroDivisionError,
    ``decoupled_weight_decay=False``, or a weight decay given to such a group, decayed decoupled where
    torch.optim.AdamW adds Adam's L2 term to the gradient). One-element tensors for ``eps`` and ``weight_decay``,
    which the step takes, are checked by value."""

    def value(name: str) -> Any:
        v = group.get(name)
        return float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v

    try:
        check_supported_flags(group)
        check_hyper_parameters(group.get("lr"), group.get("betas"), value("eps"), value("weight_decay"))
        check_decoupled_decay(group, 0.0)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"FP8AdamW.step: parameter group {index} holds a value it cannot step with, set since the group was "
            f"checked (by an LR scheduler or your code): {error}. Set a valid value in "
            f"optimizer.param_groups[{index}]; nothing was stepped"
        ) from None


def check_dense_grads(param_groups: list[dict[str, Any]]) -> None:
    """Raise RuntimeError for a sparse gradient (``nn.Embedding(sparse=True)``) before anything is stepped: found by
    the step's loop, it came after the groups before it were stepped (a half-applied step)."""
    for index, group in enumerate(param_groups):
        for p in group["params"]:
            grad = p.grad
            if grad is not None and grad.is_sparse:
                raise RuntimeError(
                    f"FP8AdamW does not support sparse gradients: the parameter of shape {tuple(p.shape)} in parameter "
                    f"group {index} has one (an nn.Embedding(sparse=True)?). Build the layer with sparse=False, or "
                    "train its parameters with torch.optim.SparseAdam (a second optimizer); nothing was stepped"
                )


def advance_steps(steps: list[torch.Tensor]) -> list[int]:
    """``step += 1`` for each 0-dim step tensor (one foreach call for CPU steps); returns the new counts."""
    if not steps:
        return []
    if all(s.is_cpu for s in steps):  # as torch.optim.AdamW: a tensor scalar and alpha take foreach's fast path
        torch._foreach_add_(steps, torch.ones((), device="cpu"), alpha=1.0)
    else:
        for s in steps:
            s += 1
    return [int(s.item()) for s in steps]
