"""What autograd may do with the FP8 layers: their backwards are differentiable once (a double backward raises rather
than drop its second-order term), and ``torch.func`` transforms and batched backwards are refused by name (the casts
update scaling states in place, which functorch cannot transform). Used by FP8Linear, FP8MLP and the tensor-parallel
linear layer."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd import forward_ad


def once_differentiable(backward):
    """``torch.autograd.function.once_differentiable`` for the FP8 layers' backwards, which also refuses the double
    backward that torch's decorator lets through: torch's marks the gradients it returns as not differentiable again
    only when a gradient it receives requires grad, but dx depends on the weight and dW on the input, so with
    ``create_graph=True`` a gradient computed from a constant output gradient (a loss linear in the layer's output, a
    gradient penalty taken right after the last FP8 layer) has a second-order term too, which torch's decorator
    silently dropped. Here every backward run with ``create_graph=True`` returns gradients whose own backward raises;
    a backward under vmap (a ``torch.func`` transform, ``autograd.grad(..., is_grads_batched=True)``, a vectorized
    jacobian) raises a clear error instead of a batching rule's."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if torch.compiler.is_compiling():  # dynamo traces the backward with grad mode off: torch's decorator's path
            with torch.no_grad():
                return backward(ctx, *grads)
        check_no_functorch("an FP8 layer's backward")
        if _is_legacy_batched is not None and any(isinstance(g, torch.Tensor) and _is_legacy_batched(g) for g in grads):
            raise RuntimeError(
                "an FP8 layer's backward does not support batched gradients (torch.autograd.grad(..., "
                "is_grads_batched=True), torch.autograd.functional.jacobian/hessian(vectorize=True)): its FP8 casts "
                "update the layer's scaling state in place, which vmap cannot batch. Take one backward per row of "
                "grad_outputs (vectorize=False), or keep the layer in high precision: convert_to_fp8(model, "
                "module_filter_fn=...) returning False for it leaves it an nn.Linear"
            )
        if not torch.is_grad_enabled():  # create_graph=False: the engine runs backwards without grad mode
            with torch.no_grad():
                return backward(ctx, *grads)
        # create_graph=True. The error node below also takes, as they are, what the gradients depend on in the graph:
        # the incoming gradients and the saved tensors that require grad (the weight, kept for the dgrad's cast). With
        # the aliases alone it led nowhere but to them, so differentiating the gradients with respect to the input or
        # the weight (torch.autograd.grad(penalty, x), backward(inputs=[...]), hessian, hvp, jvp) never reached it:
        # zeros or "not used in the graph" instead of this error. The saved tensors are read once, here, and handed to
        # the backward: non-reentrant checkpointing refuses a second read.
        with torch.no_grad():
            saved = ctx.saved_tensors
            outputs = backward(_SavedRead(ctx, saved), *grads)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        links = [t for t in (*grads, *saved) if isinstance(t, torch.Tensor) and t.requires_grad]
        error = torch._C._functions.DelayedError(_DOUBLE_BACKWARD, len(outputs) + len(links))

        def differentiable_alias(t):  # DelayedError needs an input that requires grad to give its outputs a grad_fn
            if t is None:
                return None
            t = t.detach()
            t.requires_grad_(True)
            return t

        return error(*[differentiable_alias(t) for t in outputs], *links)[: len(outputs)]

    return wrapper


class _SavedRead:
    """A backward's ``ctx`` whose ``saved_tensors`` were read already: the rest is the ctx's own."""

    def __init__(self, ctx: Any, saved: tuple) -> None:
        self._ctx, self.saved_tensors = ctx, saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


# torch's own vmap of a backward (is_grads_batched=True, vectorized jacobians) is not a torch.func transform: its
# gradients are "legacy" batched tensors.
_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
_DOUBLE_BACKWARD = (
    b"trying to differentiate twice an FP8 layer's backward: its FP8 casts are not differentiable, so a double "
    b"backward through FP8Linear / FP8MLP (create_graph=True and a gradient penalty or another second-order term; "
    b"torch.autograd.functional.hessian, hvp, vhp and jvp, which take one) cannot be computed. Keep the layers the "
    b"second-order term goes through in high precision: convert_to_fp8(model, module_filter_fn=...) returning False "
    b"for them leaves them nn.Linear"
)


def check_no_functorch(name: str) -> None:
    """Raise if a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ``jvp``...) is active: FP8 layers cast
    through autograd.Functions that update their scaling state in place, which functorch cannot transform (PyTorch's
    own error says nothing of FP8). ``name``: the layer, for the message. Eagerly only (a C call per forward);
    torch.compile traces its own way. Also refuses torch.jit.trace (TorchScript), whose tracer fails inside the FP8
    autograd.Functions with an error that says nothing of FP8."""
    if torch.compiler.is_compiling():
        return
    if torch._C._is_tracing():
        raise RuntimeError(
            f"{name} cannot be traced by torch.jit.trace (TorchScript, also torch.onnx.export(..., dynamo=False), does "
            "not support FP8 layers): export with "
            "torch.export.export(model, args), or, for a TorchScript model in high precision, load "
            "model.state_dict() into the unconverted model and trace that"
        )
    if not torch._C._are_functorch_transforms_active():
        return
    raise RuntimeError(
        f"{name} does not support torch.func transforms (torch.func.grad, vmap, jacrev, jvp, ...): its FP8 casts "
        "update the layer's scaling state in place, which functorch cannot transform. Compute gradients with "
        "torch.autograd.grad or loss.backward() (per-sample gradients: one backward per sample, or "
        "torch.func on a model without FP8 layers), or keep this layer in high precision: convert_to_fp8(model, "
        "module_filter_fn=...) returning False for it leaves it an nn.Linear"
    )


def check_no_forward_ad(name: str, *tensors: torch.Tensor | None) -> None:
    """Raise if one of ``tensors`` (an FP8 layer's input and parameters) carries a forward-mode AD tangent
    (``torch.autograd.forward_ad``): the layers' autograd.Functions have no ``jvp``, and PyTorch would say so only after
    the forward ran, its casts recorded in the scaling state. ``name``: the layer, for the message. Eagerly only."""
    if torch.compiler.is_compiling() or forward_ad._current_level < 0:  # (traced: no guard on the level)
        return
    if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise RuntimeError(
            f"{name} does not support forward-mode AD (torch.autograd.forward_ad dual tensors): its FP8 casts have no "
            "jvp rule. Compute gradients with torch.autograd.grad or loss.backward() (reverse mode), or keep this "
            "layer in high precision: convert_to_fp8(model, module_filter_fn=...) returning False for it leaves it "
            "an nn.Linear"
        )
