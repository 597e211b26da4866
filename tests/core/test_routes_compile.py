"""Route sweep of ``torch.compile`` on the CPU: the ways a user combines it with this library, each trained against an
eager twin (a deep copy with the same initialization, fed the same batches): losses, weights (``state_dict``) and the
FP8 scaling state (``fp8_state_dict``: scales, amax histories, cast counts) compared bit for bit, which the library
claims for dynamo's ``eager`` and ``aot_eager`` backends (docs/guides/pytorch.md) and for inductor where the ops that
are not FP8 casts round as eagerly (ReLU here; GELU outside FP8MLP may not, docs/concepts/gemms.md). Recompiles are
counted with ``torch._dynamo.testing.CompileCounterWithBackend``: after the warm-up steps (the first step's graph, then
the steady one: docs/concepts/gemms.md, "An FP8 model is compiled twice") no step may compile again, although scales,
amax histories and mu move at every step.

Routes:

- how the model gets compiled: ``torch.compile(model)``, ``model.compile()`` in place, compiled (and run) before
  ``convert_to_fp8``, ``convert_to_fp8(torch.compile(model))``; an FP8 layer compiled on its own (in place, or by a
  ``torch.compile`` wrapper registered in its place) and then put back to high precision (the ``"bf16"`` fallback's
  swap);
- backends ``eager``, ``aot_eager``, ``inductor`` (default, ``reduce-overhead``, ``max-autotune-no-cudagraphs``);
  automatic dynamic shapes over varying batch and sequence sizes; ``fullgraph=True`` with ``dynamic=True`` over FP8MLP
  (``fp8_hidden``), LayerNorm, bf16 autocast and FP8AdamW's FP8 weight copies;
- recipes (delayed, current, a 2-step ``most_recent`` history with a margin) at O1 and O2, over enough steps
  for the history to roll, with mu moving at every step;
- a whole compiled train step (autocast, ``scale_loss``, backward, ``scaler.clip_grad_norm_``, ``FP8AdamW.step``,
  ``zero_grad``); FP8AdamW created after a compiled step; the scaler given the compiled wrapper, non-finite steps and
  the ``"bf16"`` fallback;
- evaluation forwards (``no_grad``, ``inference_mode``, ``eval()`` with gradients on) before and between steps;
- checkpoints: ``_orig_mod.`` keys, eager checkpoints into compiled models and back, ``fp8_state_dict`` both ways, a
  whole run (model, optimizer with FP8 weight copies, FP8 state) resumed into a model compiled and trained already,
  loads (new weights, a fresh FP8 state) into a compiled model mid-training;
- ``torch._dynamo.reset()`` mid-training, a ``torch.compiler.disable`` region, activation checkpointing inside the
  compiled model (``torch.utils.checkpoint``: selective, reentrant; ``checkpoint_wrapper``) and ``fullgraph=True``
  over such a region (the documented refusal);
- frozen layers (dgrad only; FP8MLP with a frozen ``fc``).

Found by this sweep and fixed: a layer put back to ``nn.Linear`` inside a ``torch.compile`` wrapper kept running in
FP8. (The same swap by ``convert_to_fp8``, a ``torch.compile(nn.Linear)`` converted silently while the wrapper kept
calling the ``nn.Linear``, was found here too and fixed by the conversion sweep: tests/core/test_routes_convert.py.)

Routes covered elsewhere are not repeated: a compiled step function calling ``backward()``, ``torch.compile(opt.step)``
and ``scale_loss`` recompiles (test_compiled_training.py), non-reentrant checkpointing under compile and dynamo's
``skip_fwd_side_effects_in_bwd_under_checkpoint`` (test_layer_checkpointing.py), compiled layers' autograd outputs
(test_compiled_function_outputs.py), first-cast rules under compile (test_layer_first_casts.py), single-token and empty
inputs, inductor's rounding of biases (test_linear.py), FP8 weight copies under compile (test_weight_cache.py),
tensor parallelism (tests/distributed/test_tp_compile.py).
"""

from __future__ import annotations

import copy
import io
import warnings
from functools import partial

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import lightning_fp8.warnings
from lightning_fp8 import (
    FP8MLP,
    FP8AdamW,
    FP8GradScaler,
    FP8Recipe,
    convert_to_fp8,
    fp8_modules,
    fp8_state_dict,
    load_fp8_state_dict,
)
from lightning_fp8.recovery import fallen_back_layers, put_back_to_high_precision
from tests.numerics import assert_same, same

# Compiled frames a converted model needs: the first step's graph (no amax history: delayed roles use their own amax),
# then the steady one (docs/concepts/gemms.md). Nothing after that, whatever the scales do.
WARMUP_FRAMES = 2


# ------------------------------------------------------------------------------------------------------------ helpers
def _net(recipe: FP8Recipe | str = "fp8-lm", seed: int = 0) -> nn.Module:
    """Two FP8 layers around a ReLU (which inductor rounds as eager code does)."""
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)), recipe)


def _inputs(n: int, shape: tuple[int, ...] = (16, 32)) -> list[torch.Tensor]:
    """Fresh random batches of growing magnitude: the delayed input scales move from step to step."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=gen) * (1 + i) for i in range(n)]


def _counter(backend: str = "aot_eager") -> torch._dynamo.testing.CompileCounterWithBackend:
    torch._dynamo.reset()
    return torch._dynamo.testing.CompileCounterWithBackend(backend)


class _Run:
    """One model and how it is called (itself, or its compiled wrapper), with its optimizer and gradient scaler."""

    def __init__(self, model: nn.Module, call=None, opt_recipe: str | FP8Recipe | None = None, scaler: bool = False):
        self.model, self.call = model, call if call is not None else model
        self.scaler = FP8GradScaler(model=model, growth_interval=1) if scaler else None  # mu moves at every step
        self.opt = None
        if opt_recipe is not None:
            self.opt = FP8AdamW(
                model.parameters(), lr=1e-2, weight_decay=0.1, recipe=opt_recipe, grad_scaler=self.scaler
            )

    def step(self, x: torch.Tensor, autocast: bool = False, eagerly: bool = False) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = (self.model if eagerly else self.call)(x)
        loss = y.float().square().mean()
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad()
        else:
            self.model.zero_grad()
        return loss.detach()


def _fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``fp8_state_dict`` under the layers' own names: it keeps the names wrappers insert (activation checkpointing's
    ``_checkpoint_wrapped_module.``), which ``load_fp8_state_dict`` matches; ``state_dict`` drops them."""
    return {key.replace("_checkpoint_wrapped_module.", ""): value for key, value in fp8_state_dict(model).items()}


def _assert_same_state(eager: nn.Module, compiled_model: nn.Module) -> None:
    """Weights (the unscaled ``state_dict``) and the FP8 scaling state, bit for bit, under the same names."""
    assert_same(eager.state_dict(), compiled_model.state_dict())
    assert_same(_fp8_state(eager), _fp8_state(compiled_model))


def _train_twins(eager: _Run, compiled: _Run, xs: list[torch.Tensor], autocast: bool = False) -> None:
    for i, x in enumerate(xs):
        assert same(eager.step(x, autocast), compiled.step(x, autocast)), f"loss of step {i}"
    _assert_same_state(eager.model, compiled.model)


def _eager_step_first(eager: _Run, compiled: _Run, x: torch.Tensor) -> None:
    """One training step of both models run eagerly before the first compiled call: then the model compiles once
    (docs/concepts/gemms.md), which halves the compile time of a test whose subject is not the first step."""
    assert same(eager.step(x), compiled.step(x, eagerly=True))


# ------------------------------------------------------------------------------------- how the model gets compiled
@pytest.mark.parametrize("route", ["torch.compile", "module.compile", "compiled_before_conversion", "convert_wrapper"])
def test_compile_routes_train_as_eager(route):
    """Every way of putting a converted model under torch.compile trains as the eager model at O2 with mu moving. A
    model compiled (and traced with its nn.Linear layers) before the conversion recompiles for the FP8 layers."""
    counter = _counter()
    eager = _net()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    if route == "torch.compile":
        model = convert_to_fp8(plain)
        call = torch.compile(model, backend=counter)
    elif route == "module.compile":
        model = convert_to_fp8(plain)
        model.compile(backend=counter)
        call = model
    elif route == "compiled_before_conversion":
        call = torch.compile(plain, backend=counter)
        call(torch.randn(4, 32)).sum().backward()  # traced with the nn.Linear layers
        plain.zero_grad()
        model = convert_to_fp8(plain)
    else:
        call = convert_to_fp8(torch.compile(plain, backend=counter))
        model = plain
        assert sorted(fp8_modules(call)) == ["_orig_mod.0", "_orig_mod.2"]
    assert_same(model.state_dict(), eager.state_dict())
    assert sorted(fp8_modules(model)) == ["0", "2"]
    runs = _Run(eager, opt_recipe="fp8-lm", scaler=True), _Run(model, call, opt_recipe="fp8-lm", scaler=True)
    xs = _inputs(5)
    _train_twins(*runs, xs[:2])
    frames = counter.frame_count
    # module.compile(): dynamo skips nn.Sequential's own (torch) frames and compiles each FP8 layer's forward.
    bound = {"module.compile": 2 * WARMUP_FRAMES, "compiled_before_conversion": WARMUP_FRAMES + 1}
    assert 1 <= frames <= bound.get(route, WARMUP_FRAMES), frames
    _train_twins(*runs, xs[2:])
    assert counter.frame_count == frames  # scales, histories and mu moved; nothing compiled again


@pytest.mark.parametrize(
    ("backend", "mode", "recipe"),
    [
        ("eager", None, "fp8-lm"),
        ("inductor", None, "fp8-lm"),
        ("inductor", "reduce-overhead", "fp8-lm-o1"),  # no CUDA graphs on the CPU: the plain inductor graph
        ("inductor", "max-autotune-no-cudagraphs", "fp8-lm-current"),
    ],
)
def test_backends_and_modes_train_as_eager(backend, mode, recipe):
    """dynamo's eager backend and inductor (its generated C++ kernels round ReLU, the casts and the emulated GEMMs' fp32
    products as eager code does) train bit for bit as eagerly at O2 / O1 with mu moving; aot_eager is the other
    tests' backend. One eager step first, so that the model compiles once (docs/concepts/gemms.md)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager = _net(recipe)
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=backend, mode=mode)
    runs = _Run(eager, opt_recipe=recipe, scaler=True), _Run(model, call, opt_recipe=recipe, scaler=True)
    xs = _inputs(3)
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# ---------------------------------------------------------------------------------------------- recipes and history
_RECIPES = {
    "fp8-lm-o1": FP8Recipe.from_name("fp8-lm-o1"),
    "fp8-lm-current": FP8Recipe.from_name("fp8-lm-current"),
    "history2_most_recent_margin1": FP8Recipe(amax_history_len=2, amax_compute_algo="most_recent", margin=1),
}


@pytest.mark.parametrize("name", list(_RECIPES))
def test_recipes_train_as_eager_while_the_amax_history_rolls(name):
    """Six steps of growing inputs at the recipe's opt level, mu doubling at each step: the compiled model's losses,
    weights, scales and amax histories are the eager model's at every step, the scales moved, and the steps after the
    warm-up compiled nothing (no guard on a scale, a history or mu)."""
    recipe = _RECIPES[name]
    counter = _counter()
    eager = _net(recipe)
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe=recipe, scaler=True), _Run(model, call, opt_recipe=recipe, scaler=True)
    input_scales = []
    for i, x in enumerate(_inputs(6)):
        assert same(runs[0].step(x), runs[1].step(x)), i
        assert same(fp8_state_dict(eager), fp8_state_dict(model)), i
        input_scales.append(float(model[0].fp8_scaling["input"].scale))
        if i == 1:
            frames = counter.frame_count
    assert counter.frame_count == frames <= WARMUP_FRAMES
    assert len(set(input_scales)) >= 2, input_scales  # the scales moved between steps: the guards did not see them
    history = model[0].fp8_scaling["input"].amax_history
    assert int((history > 0).sum()) == min(history.numel(), 6), history  # a 2-step window rolled past its length
    assert runs[1].scaler.scale == runs[0].scaler.scale > 1  # mu moved, in both alike
    assert_same(eager.state_dict(), model.state_dict())


def test_varying_batch_and_sequence_sizes_recompile_a_bounded_number_of_times():
    """3-D inputs of five (batch, sequence) sizes, one of them a batch of 1 (which dynamo specializes), with dynamo's
    automatic dynamic shapes (the default; ``dynamic=True`` is the fullgraph test's): at most three graphs (the first
    step's, a dynamic steady one, the size-1 one), and every step as eagerly."""
    counter = _counter()
    eager = _net()
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    sizes = [(2, 8), (3, 5), (1, 9), (5, 3), (2, 11)]
    gen = torch.Generator().manual_seed(2)
    _train_twins(*runs, [torch.randn(b, t, 32, generator=gen) for b, t in sizes])
    assert counter.frame_count <= 3, counter.frame_count


def test_fullgraph_fp8mlp_model_with_autocast_dynamic_shapes_and_weight_copies():
    """fullgraph=True (no graph break) over FP8MLP with fp8_hidden, a LayerNorm and two FP8Linear layers, current
    scaling, bf16 autocast, dynamic shapes and FP8AdamW writing the weights' FP8 copies: as eagerly, bit for bit, in one
    graph (one eager step first)."""
    counter = _counter()
    torch.manual_seed(0)
    recipe = "fp8-lm-current"
    mlp = FP8MLP(64, 128, recipe=recipe, fp8_hidden=True)
    eager = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), mlp, nn.Linear(64, 32)), recipe)
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    runs = [_Run(m, c) for m, c in ((eager, None), (model, call))]
    for run in runs:
        run.opt = FP8AdamW(run.model.parameters(), lr=1e-2, emit_fp8_weights=True)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(b, t, 32, generator=gen) for b, t in [(2, 5), (3, 7), (4, 4)]]
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:2], autocast=True)
    frames = counter.frame_count
    _train_twins(*runs, xs[2:], autocast=True)
    assert counter.frame_count == frames <= 2, counter.frame_count  # (the wrapper's first frame traces no op)


# ------------------------------------------------------------------------------------------ training step, optimizer
class _Block(nn.Module):
    """A pre-norm residual block with an FP8MLP, then an FP8 head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp, self.head = nn.LayerNorm(32), FP8MLP(32, 64), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(self.norm(x)))


def test_a_compiled_train_step_with_clipping_and_the_optimizer_step_trains_as_eager():
    """The whole step in one compiled function, as docs/guides/pytorch.md allows: bf16 autocast forward,
    ``scale_loss(loss).backward()``, ``scaler.clip_grad_norm_``, ``FP8AdamW.step()`` and ``zero_grad`` (``scale_loss``
    and the step run eagerly inside the compiled code, the clipping is traced). Losses, norms, weights, FP8 state and
    mu as the same function run eagerly; nothing compiles again after the warm-up."""
    counter = _counter()
    torch.manual_seed(0)
    eager = convert_to_fp8(_Block())
    model = copy.deepcopy(eager)
    steps = []
    for m in (eager, model):
        scaler = FP8GradScaler(model=m, growth_interval=1)
        opt = FP8AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, grad_scaler=scaler)

        def train_step(x, m=m, scaler=scaler, opt=opt):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x).float().square().mean()
            scaler.scale_loss(loss).backward()
            norm = scaler.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach(), norm

        steps.append((train_step, scaler))
    compiled_step = torch.compile(steps[1][0], backend=counter)
    for i, x in enumerate(_inputs(4, (4, 6, 32))):
        assert same(steps[0][0](x), (steps[1][0] if i == 0 else compiled_step)(x)), i  # one eager step first
        if i == 2:
            frames = counter.frame_count
    # clip_grad_norm_ is traced (scale_loss and the step run eagerly): dynamo guards on mu, a float, once, then makes
    # it dynamic when it first changed (step 2); nothing compiles after that, though mu doubles at every step.
    assert counter.frame_count == frames
    assert steps[0][1].scale == steps[1][1].scale
    _assert_same_state(eager, model)


def test_fp8adamw_created_after_a_compiled_step_recompiles_for_its_fp16_masters():
    """A compiled forward and backward before the optimizer exists, then FP8AdamW (O2) takes the weights' storage
    (fp16 masters with a scale): the compiled model uses the masters as the eager one does."""
    counter = _counter()
    eager = _net()
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    xs = _inputs(5)
    for m in (eager, call):
        m(xs[0]).square().mean().backward()
    eager.zero_grad()
    model.zero_grad()
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    assert model[0].weight.dtype == torch.float16
    _train_twins(*runs, xs[1:])
    assert counter.frame_count <= WARMUP_FRAMES + 1


def test_scaler_given_the_compiled_wrapper_recovers_as_eager_with_the_bf16_fallback():
    """FP8GradScaler(model=torch.compile(model)) with nonfinite_fallback="bf16": an inf in one batch skips the step and
    halves mu, two in a row put the layers back to nn.Linear (inside the compiled wrapper, which recompiles for them);
    all as the eager model with its own scaler."""
    counter = _counter()
    torch.manual_seed(0)
    eager = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), FP8MLP(64, 128), nn.ReLU(), nn.Linear(64, 32)))
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = []
    for m, c in ((eager, eager), (model, call)):
        run = _Run(m, c)
        run.scaler = FP8GradScaler(model=c, nonfinite_fallback="bf16", fallback_after=2)
        run.opt = FP8AdamW(m.parameters(), lr=1e-2, grad_scaler=run.scaler)
        runs.append(run)
    xs = _inputs(6)
    xs[1] = xs[1].clone()
    xs[1][0, 0] = float("inf")  # one skipped step
    xs[3], xs[4] = xs[3].clone(), xs[4].clone()
    xs[3][0, 0] = xs[4][0, 0] = float("inf")  # two in a row: the fallback
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:])
    assert runs[1].scaler.skipped_steps == runs[0].scaler.skipped_steps == 3
    assert fallen_back_layers(model) == fallen_back_layers(eager) != []
    assert not fp8_modules(model)


# ------------------------------------------------------------------------------------------------ evaluation forwards
def test_evaluation_forwards_of_a_compiled_model_record_as_eagerly():
    """``no_grad`` and ``inference_mode`` forwards (``model.eval()``), and an ``eval()`` forward with gradients on whose
    graph is dropped, before and between training steps: the compiled model's outputs and FP8 state after each are
    the eager model's (evaluation forwards record their input and weight casts; the output-gradient role is left to the
    first backward, docs/concepts/formats.md); a few graphs in all, not one per call."""
    counter = _counter()
    eager = _net()
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    sequence = ["no_grad", "inference_mode", "train", "no_grad", "train", "inference_mode", "eval_with_grad", "train"]
    for i, (kind, x) in enumerate(zip(sequence, _inputs(len(sequence)), strict=True)):
        outs = []
        for run in runs:
            if kind == "train":
                outs.append(run.step(x))
                continue
            run.model.eval()
            grad = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode()}.get(kind)
            with grad if grad is not None else torch.enable_grad():
                outs.append(run.call(x).detach().clone())
            run.model.train()
        assert same(outs[0], outs[1]), (i, kind)
        assert same(fp8_state_dict(eager), fp8_state_dict(model)), (i, kind)
        if i == 0:
            states = model[0].fp8_scaling
            assert int(states["input"].casts) == 1 and not states["grad_output"].initialized
    assert_same(eager.state_dict(), model.state_dict())
    assert counter.frame_count <= 6, counter.frame_count  # per grad mode: the first-step and the steady graph


# -------------------------------------------------------------------------------------------------------- checkpoints
def test_checkpoints_cross_between_compiled_and_eager_models():
    """A compiled model's ``state_dict`` and ``fp8_state_dict`` are the eager model's under ``_orig_mod.`` names (O2:
    unscaled weights in their own dtype); the eager checkpoint loads into a compiled model that has traced its first
    step already (``load_fp8_state_dict`` matches the wrapper's names) and the compiled one into an eager model, and
    both then train on as the original does."""
    counter = _counter()
    eager = _net()
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = [_Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")]
    xs = _inputs(6)
    _train_twins(*runs, xs[:3])
    saved_compiled, saved_eager = call.state_dict(), eager.state_dict()
    assert list(saved_compiled) == [f"_orig_mod.{key}" for key in saved_eager]
    assert_same(list(saved_compiled.values()), list(saved_eager.values()))
    assert saved_eager["0.weight"].dtype == torch.float32 and model[0].weight.dtype == torch.float16
    fp8_compiled, fp8_eager = fp8_state_dict(call), fp8_state_dict(eager)
    assert list(fp8_compiled) == [f"_orig_mod.{key}" for key in fp8_eager]
    assert_same(list(fp8_compiled.values()), list(fp8_eager.values()))

    into_compiled = _net(seed=5)
    into_call = torch.compile(into_compiled, backend=counter)
    into_call(torch.randn(4, 32)).sum().backward()  # its first-step graph is traced, its state initialized
    into_compiled.zero_grad()
    into_call.load_state_dict({f"_orig_mod.{key}": value for key, value in saved_eager.items()})
    load_fp8_state_dict(into_call, fp8_eager)
    into_eager = _net(seed=6)
    into_eager.load_state_dict({key.removeprefix("_orig_mod."): value for key, value in saved_compiled.items()})
    load_fp8_state_dict(into_eager, fp8_compiled)
    _assert_same_state(into_compiled, eager)
    _assert_same_state(into_eager, eager)
    # Fresh optimizers (the optimizer state was not saved): the two loaded models train on alike.
    _train_twins(_Run(into_eager, opt_recipe="fp8-lm"), _Run(into_compiled, into_call, opt_recipe="fp8-lm"), xs[3:])


def test_a_run_resumes_into_a_model_compiled_and_trained_already():
    """A checkpoint (``state_dict``, FP8AdamW's ``state_dict`` with FP8 weight copies emitted, ``fp8_state_dict``,
    through ``torch.save`` / ``torch.load(weights_only=True)``) loaded into a model that was compiled and trained on
    other data (its steady graph traced, its O2 masters and copies in place): it continues as the run that saved it."""
    counter = _counter()
    xs = _inputs(6)
    saver = _Run(_net(), opt_recipe="fp8-lm")
    saver.opt = FP8AdamW(saver.model.parameters(), lr=1e-2, emit_fp8_weights=True)
    for x in xs[:3]:
        saver.step(x)
    buffer = io.BytesIO()
    torch.save(
        {"model": saver.model.state_dict(), "opt": saver.opt.state_dict(), "fp8": fp8_state_dict(saver.model)}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model = _net(seed=7)
    call = torch.compile(model, backend=counter)
    resumed = _Run(model, call)
    resumed.opt = FP8AdamW(model.parameters(), lr=1e-2, emit_fp8_weights=True)
    for x in xs[:2]:
        resumed.step(x * 0.1)
    call.load_state_dict({f"_orig_mod.{key}": value for key, value in saved["model"].items()})
    resumed.opt.load_state_dict(saved["opt"])
    load_fp8_state_dict(call, saved["fp8"])
    _train_twins(saver, resumed, xs[3:])
    assert counter.frame_count <= WARMUP_FRAMES + 1


def test_loads_into_a_compiled_model_mid_training_take_effect():
    """New weights (``load_state_dict`` through the wrapper, into O2 masters), then a fresh, uninitialized FP8 state
    (``load_fp8_state_dict``: the first-cast flags are guards, so the first-step graph comes back), each loaded
    between compiled steps: the next steps use them, as the eager model's do."""
    counter = _counter()
    eager = _net()
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    xs = _inputs(5)
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:2])
    other = _net(seed=4)
    weights = other.state_dict()
    eager.load_state_dict(weights)
    call.load_state_dict({f"_orig_mod.{key}": value for key, value in weights.items()})
    assert_same(model.state_dict(), eager.state_dict())  # (the fp16 masters round the loaded fp32 values)
    _train_twins(*runs, xs[2:3])
    for m in (eager, call):
        load_fp8_state_dict(m, fp8_state_dict(other))
    assert not model[0].fp8_scaling["input"].initialized
    _train_twins(*runs, xs[3:])


# ------------------------------------------------------------------------------------------ dynamo and checkpointing
class _Stack(nn.Module):
    """Three FP8 layers; the middle one in a region that ``how`` runs: plainly, under ``torch.compiler.disable``, or
    under non-reentrant / reentrant / selective (GEMMs saved, the rest recomputed) ``torch.utils.checkpoint``."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 32)
        self.how = how

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "disable":
            h = torch.compiler.disable(self.middle)(h)
        elif self.how in ("checkpoint", "reentrant"):
            h = checkpoint(self.middle, h, use_reentrant=self.how == "reentrant")
        elif self.how == "selective_checkpoint":
            context_fn = partial(create_selective_checkpoint_contexts, _save_gemms)
            h = checkpoint(self.middle, h, use_reentrant=False, context_fn=context_fn)
        else:
            h = self.middle(h)
        return self.c(torch.relu(h))


def _save_gemms(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    gemms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in gemms else CheckpointPolicy.PREFER_RECOMPUTE


def _stack(how: str = "plain") -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(_Stack(how))


def test_dynamo_reset_mid_training_trains_on_as_eager():
    """``torch._dynamo.reset()`` between steps drops the compiled graphs: the next call compiles the steady graph
    afresh from the state the earlier steps left (the first-cast flags set, read as guards again), and training goes
    on as eagerly."""
    counter = _counter()
    eager = _stack()
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    xs = _inputs(4)
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:2])
    assert counter.frame_count == 1
    torch._dynamo.reset()
    _train_twins(*runs, xs[2:])
    assert counter.frame_count == 2  # the steady graph again, from the state the earlier steps left


@pytest.mark.parametrize("how", ["disable", "selective_checkpoint", "checkpoint_wrapper"])
def test_regions_dynamo_does_not_trace_train_as_the_plain_eager_model(how):
    """A ``torch.compiler.disable`` region, a selective ``torch.utils.checkpoint`` region (GEMMs saved) inside the
    compiled forward (which dynamo runs eagerly: docs/concepts/gemms.md; the plain non-reentrant one is
    test_layer_checkpointing.py's) and ``torch.compile(checkpoint_wrapper(block))`` (the documented way to compile
    checkpointed FP8 blocks): the plain eager model's steps, bit for bit."""
    counter = _counter()
    eager = _stack()
    if how == "checkpoint_wrapper":
        model = copy.deepcopy(eager)
        model.b = checkpoint_wrapper(model.b)
    else:
        model = _stack(how)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    xs = _inputs(4)
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:2])
    frames = counter.frame_count
    _train_twins(*runs, xs[2:])
    assert counter.frame_count == frames  # a frame on each side of the region, compiled once


def test_reentrant_checkpoint_inside_a_compiled_model_warns_once_and_trains_as_eagerly(monkeypatch):
    """use_reentrant=True: the recompute casts with its own amax (the documented warning, once), compiled as eagerly."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    counter = _counter()
    eager = _stack("reentrant")
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = _Run(eager, opt_recipe="fp8-lm"), _Run(model, call, opt_recipe="fp8-lm")
    xs = _inputs(3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _eager_step_first(*runs, xs[0])
        _train_twins(*runs, xs[1:])
    assert sum("use_reentrant=True" in str(w.message) for w in seen) == 1


def test_fullgraph_over_a_checkpointed_fp8_region_is_refused_by_dynamo():
    """docs/concepts/gemms.md: fullgraph=True cannot cover a checkpointed region holding FP8 layers (their traced
    forward has a side effect): dynamo refuses at the first call, naming the checkpoint, instead of compiling a
    recompute that would read moved scales."""
    torch._dynamo.reset()
    call = torch.compile(_stack("checkpoint"), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="checkpoint"):
        call(torch.randn(8, 32))


# ------------------------------------------------------------------------------------------------------ frozen layers
def test_frozen_layers_compile_as_eager():
    """A frozen middle layer (dgrad only, no weight gradient) and an FP8MLP whose fc is frozen: outputs, weights and
    every scaling state as eagerly (the frozen layers still cast their output gradients for the dgrad chain)."""
    counter = _counter()
    torch.manual_seed(0)
    eager = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), FP8MLP(64, 128)))
    eager[2].requires_grad_(False)
    eager[3].fc.requires_grad_(False)
    model = copy.deepcopy(eager)
    call = torch.compile(model, backend=counter)
    runs = [_Run(eager), _Run(model, call)]
    for run in runs:
        run.opt = FP8AdamW([p for p in run.model.parameters() if p.requires_grad], lr=1e-2)
    xs = _inputs(3)
    _eager_step_first(*runs, xs[0])
    _train_twins(*runs, xs[1:])
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------ layers compiled on their own
@pytest.mark.parametrize("how", ["in_place", "wrapper"])
def test_put_back_of_an_fp8_layer_compiled_on_its_own_runs_it_in_high_precision(how):
    """An FP8 layer compiled on its own after the conversion, in place (``layer.compile()``) or by a wrapper registered
    in its place (``model[0] = torch.compile(model[0])``), then put back to ``nn.Linear`` by
    ``put_back_to_high_precision`` (what FP8GradScaler's ``"bf16"`` fallback and a resumed run call): the model then
    computes that layer in high precision, as a twin whose layer was put back uncompiled."""
    # Found by this sweep (how="wrapper"): the nn.Linear went into the wrapper's `_orig_mod`, but torch's
    # OptimizedModule had bound its forward to the FP8Linear when it was built, so the FP8 layer kept running in FP8
    # while put_back_to_high_precision returned the layer (FP8GradScaler(nonfinite_fallback="bf16") alike); and
    # fallen_back_layers named the wrapper too ("0", read through the wrapper's attribute proxy). The wrapper is now
    # bound to the nn.Linear, and only the layer is named.
    torch._dynamo.reset()
    model = _net()
    twin = copy.deepcopy(model)
    fp8_layer = model[0]
    if how == "in_place":
        model[0].compile(backend="aot_eager")
        name = "0"
    else:
        model[0] = torch.compile(model[0], backend="aot_eager")
        name = "0._orig_mod"
    opt, opt_twin = (FP8AdamW(m.parameters(), lr=1e-2, recipe="fp8-lm-o1") for m in (model, twin))
    x = torch.randn(16, 32)
    assert_same(model(x), twin(x))
    assert put_back_to_high_precision(model, [name], opt) == [name]
    assert put_back_to_high_precision(twin, ["0"], opt_twin) == ["0"]
    assert fallen_back_layers(model) == [name] and type(model.get_submodule(name)) is nn.Linear
    casts = int(fp8_layer.fp8_scaling["input"].casts)
    y = model(x)
    assert int(fp8_layer.fp8_scaling["input"].casts) == casts, "the FP8 layer put back still runs"
    assert_same(y, twin(x))
