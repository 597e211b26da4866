"""FP8 layers under selective activation checkpointing (torch.utils.checkpoint's ``context_fn`` with
``create_selective_checkpoint_contexts``): the policy's cache hands the recompute the outputs the forward's ops saved,
matched by op and call count, so the recompute must run the forward's ops in the forward's order. A forward whose input
cast used its own amax (the first step of delayed scaling, every step of current scaling) once had its recompute cast
with the kept scale instead (fewer ops): a policy saving ``aten.amax`` gave silently wrong gradients, one saving
``aten.mul`` or ``aten.abs`` crashed inside the cast."""

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_fp8 import FP8MLP, FP8Linear


def _model(kind: str, recipe: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(FP8Linear(32, 64, recipe=recipe), nn.GELU(), FP8Linear(64, 32, recipe=recipe))
    return nn.Sequential(FP8MLP(32, 64, recipe=recipe), nn.LayerNorm(32), FP8Linear(32, 32, recipe=recipe))


def _saving(op):
    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func == op else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


@pytest.mark.parametrize("op", ["amax", "mul", "abs"])
@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-current"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_selective_checkpointing_of_own_amax_casts_equals_the_unchecked_run(kind, recipe, op):
    """From the first step (own-amax casts) on: gradients bit for bit those of the model without checkpointing."""
    op = {"amax": torch.ops.aten.amax.default, "mul": torch.ops.aten.mul.Tensor, "abs": torch.ops.aten.abs.default}[op]
    model = _model(kind, recipe)
    ref = copy.deepcopy(model)
    for step, magnitude in enumerate((1.0, 4.0, 0.25)):
        x = torch.randn(24, 32) * magnitude
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        checkpoint(model, xs[0], use_reentrant=False, context_fn=_saving(op)).square().mean().backward()
        ref(xs[1]).square().mean().backward()
        assert torch.equal(xs[0].grad, xs[1].grad), step
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (step, name)
        for name, buf in model.named_buffers():
            assert torch.equal(buf, ref.get_buffer(name)), (step, name)
        model.zero_grad()
        ref.zero_grad()
