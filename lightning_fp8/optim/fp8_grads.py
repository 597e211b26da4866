"""The FP8 gradients :class:`~lightning_fp8.optim.FP8AdamW` holds for its next step (``fp8_grads``).

With ``fp8_grads`` a post-accumulate-grad hook on each FP8 weight takes its gradient out of ``param.grad`` and queues
it for an FP8 cast (:mod:`~lightning_fp8.optim.grad_cast`); the cast gradients wait in the optimizer until its step,
a skip, or ``zero_grad``. FP8 communication hooks hand their reduced gradients over the same way
(:meth:`_FP8Grads.accumulate_fp8_grad`). The step reads each parameter's gradient through :meth:`_FP8Grads._grad_of`,
the gradient scaler checks them through :meth:`_FP8Grads._nonfinite_grads`. :class:`_FP8Grads` is a base of
FP8AdamW and reads its settings.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_fp8 import ops
from lightning_fp8.cast_checks import check_castable
from lightning_fp8.formats import fp8_max, is_fp8
from lightning_fp8.optim import grad_cast, master, shards

# The attribute of an FP8 weight naming (by a number of its own) the FP8AdamW whose gradient hook takes its gradients:
# a later FP8AdamW over the same weight takes them over (one that does not hook it clears the mark: _claim_grads). A
# plain int: a weak reference to the parameter (a weak-keyed table) makes torch.utils.swap_tensors refuse it
# (swap_module_params_on_conversion), one to the optimizer on the parameter makes the model unpicklable.
GRAD_OWNER_ATTR = "_lightning_fp8_grad_owner"
_GRAD_OWNER_IDS = itertools.count(1)
_FP8Grad = grad_cast.FP8Grad  # a gradient in FP8 waiting for the step
# Every FP8AdamW (weak): where held_fp8_grads looks for the optimizer that holds a parameter's gradient.
_OPTIMIZERS: weakref.WeakSet[_FP8Grads] = weakref.WeakSet()


def hook_table(optimizer: _FP8Grads) -> dict[torch.Tensor, Any]:
    """A fresh ``{param: gradient hook handle}`` table for ``optimizer``, whose hooks are removed when ``optimizer`` is
    collected: a hook left behind does nothing (it holds the optimizer weakly), yet every backward would call it, and a
    hyper-parameter search that builds an optimizer per trial over one model would pile them up on its weights."""
    hooks: dict[torch.Tensor, Any] = {}
    # The finalizer holds the table, not the optimizer. Not at exit: the weights die with the interpreter anyway.
    weakref.finalize(optimizer, _remove_hooks, hooks).atexit = False
    return hooks


def _remove_hooks(hooks: dict[torch.Tensor, Any]) -> None:
    for handle in hooks.values():
        handle.remove()
    hooks.clear()


def _drop_older_hook(p: torch.Tensor, owner_id: int) -> None:
    """Remove the gradient hook on ``p`` of the FP8AdamW that takes its gradients now (its ``GRAD_OWNER_ATTR``), if
    that is not the optimizer numbered ``owner_id``, which takes them over: the older hook would do nothing from now
    on (the mark no longer names it), yet run at every backward for as long as the older optimizer lives."""
    older = getattr(p, GRAD_OWNER_ATTR, None)
    if older is None or older == owner_id:
        return
    for optimizer in list(_OPTIMIZERS):  # (when an optimizer is built, not per step)
        if optimizer._grad_owner_id == older:
            optimizer._unhook(p)


def _distributed_fp8_grads(weights: str) -> str:
    # Why fp8_grads is refused under torch.distributed (and defaults off there).
    return (
        f"FP8AdamW(fp8_grads=True) under torch.distributed: its hook takes the gradient of {weights} out of "
        "param.grad as soon as backward accumulates it, before DistributedDataParallel averages param.grad over the "
        "ranks: each rank would step on its own gradient, and the replicas would drift apart. Create FP8AdamW with "
        "fp8_grads=False (its default once torch.distributed is initialized)"
    )


def _one_scale_inv(scale_inv: object, grad: torch.Tensor) -> torch.Tensor:
    """An FP8 gradient's ``scale_inv`` as the 0-dim fp32 tensor on its device that the optimizer's kernels read (a
    one-element tensor of any shape and floating dtype goes in)."""
    if scale_inv is None:
        raise ValueError("accumulate_fp8_grad: an FP8 gradient needs its scale_inv (1 / the scale it was cast with)")
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.numel() != 1 or not scale_inv.is_floating_point():
        got = (
            f"a {tuple(scale_inv.shape)} {scale_inv.dtype} tensor"
            if isinstance(scale_inv, torch.Tensor)
            else (type(scale_inv).__name__)
        )
        raise ValueError(f"accumulate_fp8_grad: scale_inv must be a one-element floating tensor, got {got}")
    return scale_inv.detach().to(grad.device, torch.float32).reshape(())


class _FP8Grads:
    """The gradient hooks and the FP8 gradients they hold (see the module docstring)."""

    def _gets_grad_hook(self, p: torch.Tensor) -> bool:
        """Whether ``fp8_grads`` gives ``p`` the FP8 gradient hook: an FP8Linear weight that trains, not sharded, at
        O1 (:meth:`_register_o1_grad_hooks`) or adopted at O2 (:meth:`_adopt`), its master in its storage or kept
        apart (a weight already of the master's dtype: ``model.half()``, ``master_dtype=torch.float32``)."""
        if not (self.fp8_grads and master.is_fp8_weight(p) and p.requires_grad) or shards.is_dtensor(p):
            return False
        if self.opt_level == "O1":
            return True
        return self._wants_low_precision(p) and not shards.is_fsdp1_view(p)

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

    def _claim_grads(self, params: Iterable[torch.Tensor]) -> None:
        """Take the gradients of those of ``params`` this optimizer does not hook (``fp8_grads=False``, frozen,
        sharded) from an older FP8AdamW's hook: its owner mark is cleared, so that hook leaves them in ``param.grad``
        for this optimizer's step (and the scaler's ``clip_grad_norm_`` does not count them as held in FP8)."""
        for p in params:
            if p not in self._hooks and getattr(p, GRAD_OWNER_ATTR, None) is not None:
                _drop_older_hook(p, self._grad_owner_id)
                setattr(p, GRAD_OWNER_ATTR, None)

    def _unhook(self, p: torch.Tensor) -> bool:
        """Stop holding ``p``'s gradient in FP8: remove the hook and this optimizer's owner mark (a later backward
        leaves the gradient in ``param.grad``, and the scaler's ``clip_grad_norm_`` no longer counts ``p`` as held).
        Returns whether ``p`` was hooked."""
        handle = self._hooks.pop(p, None)
        if handle is None:
            return False
        handle.remove()
        if getattr(p, GRAD_OWNER_ATTR, None) == self._grad_owner_id:
            setattr(p, GRAD_OWNER_ATTR, None)
        return True

    def _register_grad_hook(self, p: torch.Tensor) -> None:
        owner, owner_id = weakref.ref(self), self._grad_owner_id
        _drop_older_hook(p, owner_id)
        setattr(p, GRAD_OWNER_ATTR, owner_id)

        @torch.compiler.disable  # a compiled function calling backward() would trace it (dtype-punned cast state)
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

    def accumulate_fp8_grad(self, p: torch.Tensor, grad: torch.Tensor, scale_inv: torch.Tensor | None = None) -> None:
        """Add ``grad`` (high precision, or FP8 with ``scale_inv``) to ``p``'s pending FP8 gradient.

        The result is stored in ``recipe.backward_dtype`` with a fresh per-tensor scale and reported to the
        gradient scaler. FP8 communication hooks can hand their reduced FP8 gradient over this way.

        Raises:
            RuntimeError: for a sparse gradient.
            TypeError: for a high-precision gradient that is not float16, bfloat16, float32 or float64 (an
                integer or complex tensor).
            ValueError: for a ``p`` in none of this optimizer's parameter groups, an FP8 gradient without
                ``scale_inv`` (or with one that is not a one-element floating tensor), a ``scale_inv`` given with a
                high-precision gradient, or a shape that is not ``p``'s.
        """
        if not self._holds(p):  # its gradient would never be stepped, yet count in the scaler's non-finite check
            raise ValueError(
                f"accumulate_fp8_grad: the parameter of shape {tuple(p.shape)} is in none of this FP8AdamW's parameter "
                "groups, so its gradient would never be applied. Hand it to the optimizer that holds the parameter, "
                "or add the parameter first (optimizer.add_param_group({'params': [p]})); nothing was accumulated"
            )
        if grad.is_sparse:
            raise RuntimeError(
                "accumulate_fp8_grad: FP8AdamW does not support sparse gradients; pass a dense one (grad.to_dense()); "
                "nothing was accumulated"
            )
        if grad.shape != p.shape:
            raise ValueError(f"accumulate_fp8_grad: gradient of shape {tuple(grad.shape)} for a {tuple(p.shape)} param")
        if is_fp8(grad):
            scale_inv = _one_scale_inv(scale_inv, grad)
        elif scale_inv is not None:
            raise ValueError(
                f"accumulate_fp8_grad: scale_inv goes with an FP8 gradient; this one is {grad.dtype} and is added as "
                "it is. Multiply it by the factor first (or pass the FP8 gradient); nothing was accumulated"
            )
        else:
            check_castable(grad, "accumulate_fp8_grad")  # an integer or complex gradient is no gradient to cast
        if p in self._grad_casts:  # its queued gradient comes first
            self._grad_casts.flush(self)
        with torch.no_grad():
            entry = self._pending.get(p)
            if is_fp8(grad) and entry is None:  # already FP8 (the caller reported its cast): keep it as it is
                # Contiguous: the fused step reads it by address (a transposed view failed the Triton step).
                grad = grad if grad.is_contiguous() else grad.contiguous()
                self._pending[p] = _FP8Grad(grad, scale_inv, ops.amax(grad.float()) * scale_inv)
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
                self.grad_scaler.record_gradient_cast(amax, n_saturated, g.numel(), self.grad_dtype, owner=self,
                                                      source_dtype=grad.dtype)  # fmt: skip
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
            if grad.numel():  # an empty one is finite, and _foreach_norm(inf) refuses it
                by_device[grad.device].append(grad)
        for grads in by_device.values():
            norms = torch._foreach_norm(grads, float("inf"))
            flags.append((~torch.isfinite(torch.stack([n.float() for n in norms]))).float())
        if not flags:
            return torch.zeros((), dtype=torch.float32)
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
        norms = fp8_grad_norms(list(self._pending.values()))
        return {p: norm.reshape(()) for p, norm in zip(self._pending, norms, strict=True)}


def held_fp8_grads(params: Iterable[torch.Tensor]) -> list[_FP8Grad]:
    """The FP8 gradients that FP8AdamW optimizers hold for ``params`` (``fp8_grads``: taken out of ``param.grad``;
    handed over by ``accumulate_fp8_grad``), each ``data * scale_inv`` and still carrying mu, for clipping them with
    the others (:func:`~lightning_fp8.integrations.clipping.clip_scaled_grad_norm_`). Their queued casts are made
    first, and a ``param.grad`` beside one is folded into it, as the step would do.

    A parameter's gradient is the newest FP8AdamW's over it (a later one takes the gradients over, as its hooks do):
    what an older one still holds of it (its backward before the newer one was made, never stepped) is not counted.
    """
    wanted = list(dict.fromkeys(params))  # the caller's order, not a set's (a tensor hashes by id): the norms are
    owner: dict[torch.Tensor, _FP8Grads] = {}  # summed in this order, and must sum alike in every process
    for optimizer in sorted(_OPTIMIZERS, key=lambda opt: opt._grad_owner_id):  # created later: a larger number
        held = {q for group in optimizer.param_groups for q in group["params"]}
        owner.update((p, optimizer) for p in wanted if p in held)
    found: dict[torch.Tensor, _FP8Grad] = {}
    for optimizer in {id(opt): opt for opt in owner.values()}.values():
        mine = [p for p, opt in owner.items() if opt is optimizer]
        if any(p in optimizer._grad_casts for p in mine):
            optimizer._grad_casts.flush(optimizer)
        for p in [p for p in mine if p in optimizer._pending]:
            if p.grad is not None:  # a gradient in both places (a hook removed in between): one, as the step takes it
                grad, p.grad = p.grad, None
                optimizer.accumulate_fp8_grad(p, grad)
            found[p] = optimizer._pending[p]
    return [found[p] for p in wanted if p in found]


def fp8_grad_norms(entries: list[_FP8Grad], norm_type: float = 2.0) -> list[torch.Tensor]:
    """The ``norm_type`` norm (0-dim fp32) of each FP8 gradient of ``entries``, dequantized."""
    return [p_norm(e.data.float(), norm_type) * e.scale_inv.float() for e in entries]


def p_norm(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``torch.linalg.vector_norm(t, norm_type)`` in fp32, where ``|t| ** norm_type`` may pass fp32's range (a norm of
    order 8 of gradients that carry mu = 2**16): ``t`` is divided by its largest magnitude first. Orders 1, 2 and inf
    are torch's as they are (their sums do not overflow where the norm itself fits)."""
    if float(norm_type) in (1.0, 2.0, math.inf) or t.numel() == 0:
        return torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)  # (no fp32 copy of an fp16 gradient)
    t = t.float()
    amax = t.abs().amax()
    unit = torch.where((amax > 0) & amax.isfinite(), amax, torch.ones_like(amax))  # inf and NaN stay what they are
    return torch.linalg.vector_norm(t / unit, norm_type) * unit


def scale_fp8_grads_(entries: list[_FP8Grad], factor: torch.Tensor) -> None:
    """Multiply each FP8 gradient of ``entries`` by ``factor`` (0-dim) through its ``scale_inv``: the FP8 values stay
    as they are; its amax (the one-pass step's bound, the scaler's non-finite check) follows. New tensors: the amax is
    the cast state's buffer, and the scaler's records may share it."""
    for entry in entries:
        f = factor.to(entry.scale_inv.device, torch.float32)
        entry.scale_inv = entry.scale_inv * f
        entry.amax = entry.amax * f
