"""Training code that puts more than the model under ``torch.compile``: a step function that calls ``backward()``, the
optimizer's step, the scaler's ``scale_loss``. Each trains as the same code run eagerly, bit for bit (dynamo's
``aot_eager`` backend: the traced ops, no code generation; docs/concepts/gemms.md for compiling the model itself)."""

from __future__ import annotations

import copy

import torch
import torch._dynamo.testing
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_state_dict


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)))


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 32, generator=gen) for _ in range(n)]


def _assert_same_training(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    for (name, x), y in zip(fp8_state_dict(a).items(), fp8_state_dict(b).values(), strict=True):
        assert torch.equal(x, y), name


def test_a_compiled_step_function_that_calls_backward_trains_as_eager():
    """dynamo breaks the graph at backward() but traced the Python frames the backward called: FP8AdamW's gradient
    hook (fp8_grads, the default outside torch.distributed), whose cast state is dtype-punned views of one buffer.
    The second step failed ('input mutations on views with different dtypes')."""
    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    runs = []
    for model in (eager, compiled):
        scaler = FP8GradScaler(model=model, growth_interval=1)
        opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)

        def train_step(x, model=model, scaler=scaler):
            loss = model(x).square().mean()
            scaler.scale_loss(loss).backward()
            return loss.detach()

        runs.append((model, opt, train_step if model is eager else torch.compile(train_step, backend="aot_eager")))
    for x in _batches(4):
        losses = []
        for _, opt, step in runs:
            losses.append(step(x))
            opt.step()
            opt.zero_grad()
        assert torch.equal(losses[0], losses[1])
    _assert_same_training(eager, compiled)


def test_compiling_the_optimizer_step_runs_it_eagerly():
    """torch.compile(opt.step) failed inside dynamo (RecursionError in its struct.pack polyfill); the step is marked
    to run eagerly inside compiled callers."""
    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    opts = [FP8AdamW(m.parameters(), lr=1e-2, recipe="fp8-lm-o1", fp8_grads=False) for m in (eager, compiled)]
    steps = [opts[0].step, torch.compile(opts[1].step, backend="aot_eager")]
    for x in _batches(3):
        for model, opt, step in zip((eager, compiled), opts, steps, strict=True):
            model(x).square().mean().backward()
            step()
            opt.zero_grad()
    _assert_same_training(eager, compiled)


def test_scale_loss_in_a_compiled_function_does_not_recompile_as_mu_changes():
    """Its records (a deque of scaled losses, mu as a float) were guarded on: one recompile per call, until dynamo's
    recompile limit (8) left the function uncompiled."""
    torch._dynamo.reset()
    model = _model()
    eager = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    runs = []
    for m in (eager, model):
        scaler = FP8GradScaler(model=m, growth_interval=1)  # mu doubles at every step
        opt = FP8AdamW(m.parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=False)

        def scaled_loss(x, m=m, scaler=scaler):
            return scaler.scale_loss(m(x).square().mean())

        runs.append((opt, scaler, scaled_loss if m is eager else torch.compile(scaled_loss, backend=counter)))
    for x in _batches(12):
        for opt, _, fn in runs:
            fn(x).backward()
            opt.step()
            opt.zero_grad()
    assert runs[1][1].scale == runs[0][1].scale > 2.0**10  # mu moved at every step
    assert counter.frame_count <= 3, counter.frame_count  # the first steps' casts, then one graph for good
    _assert_same_training(eager, model)
