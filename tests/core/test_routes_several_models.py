"""Route sweep of several FP8 models (and several optimizers, scalers, recipes) in one Python process: the ways a user
combines them, each checked against an independent reference. The main reference is the model trained alone: a model
trained interleaved with others, in another thread, or after other models were converted, trained or refused must give
the losses, ``state_dict()``, ``fp8_state_dict()`` (scales, amax histories, cast counts) and gradient-scaler state of
the same model (a deep copy made before any training) trained alone on the same batches, bit for bit. Other references:
two spellings of one loop that must agree, and what the documentation promises (docs/guides/pytorch.md,
docs/concepts/gradient-scaling.md, docs/concepts/gemms.md, docs/guides/lightning.md on evaluation forwards).

Routes:

- two models converted with different recipes (named ones, delayed and current scaling, other history lengths,
  ``most_recent``, margins, E4M3 gradients, O1 and O2, FP8 weight copies on one of them) trained step by step in
  turn, each with its own FP8AdamW and FP8GradScaler, mu moving at every other step; both models' losses summed
  into one backward, each scaled by its own mu;
- a non-finite step in one model only (an inf loss): only that model's step is skipped and its mu halved, the other
  trains as alone; the ``"bf16"`` fallback of one model (its own scaler, or one scaler given both models) puts back
  that model's layers only;
- a GAN loop (generator and discriminator, two optimizers): with two scalers, its two spellings (the discriminator
  frozen for the generator's backward, or its gradients dropped after it) agree bit for bit, also with a non-finite
  discriminator step, which skips the discriminator alone; with one scaler given a module holding both models, the
  skip halves mu once and rescales both models' ``grad_output`` states; a list of models is refused and a scaler
  given one model warns about the other's optimizer (both documented);
- teacher-student distillation: a frozen FP8 teacher evaluated under ``no_grad``, ``inference_mode`` or with
  gradients on but frozen, beside a training FP8 student: the student trains as alone on the teacher's outputs, the
  teacher records its evaluation casts as alone (input and weight roles, never ``grad_output``) and keeps its weights;
- an ``nn.Linear`` shared by two models, converted together (one FP8Linear under both), trained as one module holding
  the same layers; an FP8Linear of one model put into a second one that is then converted; a model nested in another,
  converted twice and partially (a conversion asking another recipe is refused and changes nothing; the two orders
  give the same model; converting again mid-training changes nothing);
- ``copy.deepcopy`` of a trained model (with a fresh FP8AdamW and FP8GradScaler loading the original's state, and the
  FP8 state) and of the model, optimizer and scaler together (in two orders): nothing shared, the copy untouched by
  the original's training, and both train on alike; at O1, O2 and with FP8 weight copies;
- weight reads: two classes with the same ``__name__`` and ``__qualname__`` (one reads ``self.proj.weight``, the other
  calls ``self.proj``) in either order of conversion; two models of the same class whose weight reads differ (the
  class's forward patched between their conversions, an instance's own forward);
- process-global state: the conversion warnings of one model do not silence another's about its own layers, and the
  per-object warnings (a scaler without a model, an optimizer without a recipe) are given for each object; results do
  not depend on the global RNG state; bf16 autocast on in one model's forward and off in another's (also nested);
- two threads each training its own model at the same time (one O2 delayed, one O1 current), and one thread training
  while another evaluates a third model: each as alone, no exception;
- refusals (bad recipe names and values, a filter that raises, a float64 or mis-shaped input, FP8AdamW over an
  output still referenced, a step without a scaled loss, FP8AdamW built before the conversion) interleaved with a
  model's training, other models converted between its steps (which moves the conversion count its optimizer
  checks): that model trains as alone, and the refused objects are left as documented.

Found by this sweep and fixed: ``weight_reads.forward_weight_reads`` cached its reading of a class's forward for good,
so a forward patched on the class after a first conversion was not read again; and it read the class only, so an
instance's own ``forward`` that computes with a layer's weight was not seen. Either way the layer became FP8 and at O2
the forward computed with FP8AdamW's scaled fp16 master.

Routes covered elsewhere are not repeated: two FP8AdamW over the same weights (test_optim_shared_weights.py), several
optimizers sharing one scaler (test_scaler_multi_optimizer.py), copies by pickle and ``torch.save``
(test_routes_layouts.py, test_routes_module_protocol.py), conversion refusals one by one (test_routes_bad_input.py,
test_convert.py), torch.compile (test_routes_compile.py).
"""

from __future__ import annotations

import copy
import functools
import threading
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import (
    FP8AdamW,
    FP8GradScaler,
    FP8Linear,
    FP8Recipe,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
)
from lightning_fp8.optim import master
from lightning_fp8.recovery import fallen_back_layers
from tests.numerics import assert_same

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops (and the threads' runs)

WIDTH, HIDDEN, BATCH = 32, 64, 8  # multiples of 16
STEPS = 5
LR = 1e-2
# mu doubles every other step of a model whose gradients have headroom: its grad_output states are rescaled as the
# runs go (gradient-scaling.md), so the references are compared with mu moving.
GROWTH_INTERVAL = 2


# ------------------------------------------------------------------------------------------------------------ helpers
def _net(seed: int, recipe: FP8Recipe | str = "fp8-lm", out: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, out)), recipe)


def _batches(seed: int, n: int = STEPS, out: int = WIDTH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, out, generator=gen)) for _ in range(n)]


class _Run:
    """A model with its own FP8AdamW and FP8GradScaler (the optimizer's step routes through the scaler)."""

    def __init__(self, model: nn.Module, recipe: FP8Recipe | str = "fp8-lm", scaler: FP8GradScaler | None = None,
                 **optimizer_kwargs) -> None:  # fmt: skip
        self.model = model
        self.scaler = scaler if scaler is not None else FP8GradScaler(model=model, growth_interval=GROWTH_INTERVAL)
        self.opt = FP8AdamW(model.parameters(), lr=LR, recipe=recipe, grad_scaler=self.scaler, **optimizer_kwargs)
        self.losses: list[torch.Tensor] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, poison: bool = False, autocast: bool = False) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = self.model(x)
        loss = (out.float() - y).square().mean()
        self.scaler.scale_loss(loss * float("inf") if poison else loss).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.detach())

    def train(self, batches, **kwargs) -> _Run:
        for x, y in batches:
            self.step(x, y, **kwargs)
        return self


def _snapshot(model: nn.Module, scaler: FP8GradScaler | None = None) -> dict:
    """What must agree with the reference: weights (unscaled, as saved), the FP8 scaling state and mu's state."""
    snap = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "fp8": {k: v.detach().clone() for k, v in fp8_state_dict(model).items()},
    }
    if scaler is not None:
        snap["scaler"] = scaler.state_dict()
    return snap


def _assert_trained_alike(run: _Run, reference: _Run) -> None:
    assert_same(run.losses, reference.losses)
    assert_same(_snapshot(run.model, run.scaler), _snapshot(reference.model, reference.scaler))
    assert_same(run.opt.state_dict(), reference.opt.state_dict())  # masters, moments, their scales, step counts


def _interleave(runs: list[_Run], batches: list[list], **step_kwargs) -> None:
    """One step of each run in turn; ``step_kwargs[name][r][i]``: that keyword of run ``r``'s step ``i``."""
    for i, steps in enumerate(zip(*batches, strict=True)):
        for r, (run, (x, y)) in enumerate(zip(runs, steps, strict=True)):
            run.step(x, y, **{k: v[r][i] for k, v in step_kwargs.items()})


def _messages(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in record]


# ---------------------------------------------------------------------------------- models trained step by step in turn
RECIPE_PAIRS = {
    "o2_delayed_and_o1": ("fp8-lm", "fp8-lm-o1"),
    "current_and_short_most_recent_margin": (
        "fp8-lm-current",
        FP8Recipe(amax_history_len=2, amax_compute_algo="most_recent", margin=1),
    ),
    "e4m3_and_o1_current_margin": ("fp8-lm-e4m3", FP8Recipe(scaling="current", margin=2, opt_level="O1")),
}


@pytest.mark.parametrize("emit", [False, True], ids=["casting", "fp8_weight_copies"])
@pytest.mark.parametrize("pair", RECIPE_PAIRS)
def test_two_models_of_different_recipes_trained_in_turn_train_as_each_alone(pair, emit):
    recipe_a, recipe_b = RECIPE_PAIRS[pair]
    a, b = _net(0, recipe_a), _net(1, recipe_b)
    a_alone, b_alone = copy.deepcopy(a), copy.deepcopy(b)
    batches_a, batches_b = _batches(10), _batches(11)
    kwargs_a = {"emit_fp8_weights": True, "scale_update": "two_pass"} if emit else {}
    runs = [_Run(a, recipe_a, **kwargs_a), _Run(b, recipe_b)]
    _interleave(runs, [batches_a, batches_b])
    _assert_trained_alike(runs[0], _Run(a_alone, recipe_a, **kwargs_a).train(batches_a))
    _assert_trained_alike(runs[1], _Run(b_alone, recipe_b).train(batches_b))
    assert runs[0].scaler.scale > 1 and runs[1].scaler.scale > 1  # mu moved (and the grad_output states with it)


def test_two_models_losses_in_one_backward_train_as_each_alone():
    """Both models' forwards, then one backward of the sum of their losses, each scaled by its own scaler's mu."""
    a, b = _net(0), _net(1, "fp8-lm-o1")
    a_alone, b_alone = copy.deepcopy(a), copy.deepcopy(b)
    run_a, run_b = _Run(a), _Run(b, "fp8-lm-o1")
    for (xa, ya), (xb, yb) in zip(_batches(10), _batches(11), strict=True):
        loss_a, loss_b = (a(xa) - ya).square().mean(), (b(xb) - yb).square().mean()
        (run_a.scaler.scale_loss(loss_a) + run_b.scaler.scale_loss(loss_b)).backward()
        for run, loss in ((run_a, loss_a), (run_b, loss_b)):
            run.opt.step()
            run.opt.zero_grad()
            run.losses.append(loss.detach())
    _assert_trained_alike(run_a, _Run(a_alone).train(_batches(10)))
    _assert_trained_alike(run_b, _Run(b_alone, "fp8-lm-o1").train(_batches(11)))


def test_a_nonfinite_step_in_one_model_skips_that_model_alone():
    """An inf loss in A at step 2: A's step is skipped and its mu halved (as A alone with the same inf), B trains as
    alone."""
    a, b = _net(0), _net(1, "fp8-lm-o1")
    a_alone, b_alone = copy.deepcopy(a), copy.deepcopy(b)
    batches_a, batches_b = _batches(10), _batches(11)
    runs = [_Run(a), _Run(b, "fp8-lm-o1")]
    _interleave(runs, [batches_a, batches_b], poison=[[i == 2 for i in range(STEPS)], [False] * STEPS])
    reference_a = _Run(a_alone)
    for i, (x, y) in enumerate(batches_a):
        reference_a.step(x, y, poison=i == 2)
    _assert_trained_alike(runs[0], reference_a)
    _assert_trained_alike(runs[1], _Run(b_alone, "fp8-lm-o1").train(batches_b))
    assert (runs[0].scaler.skipped_steps, runs[1].scaler.skipped_steps) == (1, 0)
    assert [e["action"] for e in runs[0].scaler.history].count("skip") == 1


@pytest.mark.parametrize("shared_scaler", [False, True], ids=["a_scaler_each", "one_scaler_for_both"])
def test_the_bf16_fallback_of_one_model_puts_back_that_models_layers_only(shared_scaler):
    a, b = _net(0), _net(1)
    b_alone = copy.deepcopy(b)
    settings = {"nonfinite_fallback": "bf16", "fallback_after": 2, "growth_interval": GROWTH_INTERVAL}
    if shared_scaler:
        scaler_a = scaler_b = FP8GradScaler(model=nn.ModuleList([a, b]), **settings)
    else:
        scaler_a, scaler_b = FP8GradScaler(model=a, **settings), FP8GradScaler(model=b, **settings)
    runs = [_Run(a, scaler=scaler_a), _Run(b, scaler=scaler_b)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's report
        _interleave(runs, [_batches(10), _batches(11)], poison=[[i in (1, 2) for i in range(STEPS)], [False] * STEPS])
    assert sorted(fallen_back_layers(a)) == ["0", "2"]
    assert fallen_back_layers(b) == [] and all(isinstance(b[i], FP8Linear) for i in (0, 2))
    if not shared_scaler:  # with one scaler B's mu is A's too: B then differs from alone by mu, as documented
        reference = _Run(b_alone, scaler=FP8GradScaler(model=b_alone, **settings)).train(_batches(11))
        _assert_trained_alike(runs[1], reference)


# ------------------------------------------------------------------------------------------------------------------ GAN
def _gan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    generator = convert_to_fp8(nn.Sequential(nn.Linear(16, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)))
    discriminator = convert_to_fp8(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 16)))
    return generator, discriminator


def _gan_data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, WIDTH, generator=gen) + 1, torch.randn(BATCH, 16, generator=gen)) for _ in range(steps)]


def _train_gan(g, d, scaler_g, scaler_d, spelling: str, poison_d_at: int | None = None) -> dict:
    """The discriminator's step (real and detached fake batches), then the generator's through the discriminator,
    which is either frozen for that backward (``"freeze"``) or has the gradients it got dropped (``"zero_grad"``).
    Returns the losses and the discriminator's weights after each of its steps."""
    opt_g = FP8AdamW(g.parameters(), lr=LR, grad_scaler=scaler_g)
    opt_d = FP8AdamW(d.parameters(), lr=LR, grad_scaler=scaler_d)
    record = {"losses": [], "d_after_step": []}
    for i, (real, z) in enumerate(_gan_data()):
        d_loss = F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()
        scaler_d.scale_loss(d_loss * (float("inf") if i == poison_d_at else 1.0)).backward()
        opt_d.step()
        opt_d.zero_grad()
        record["d_after_step"].append({k: v.clone() for k, v in d.state_dict().items()})
        if spelling == "freeze":
            d.requires_grad_(False)
        g_loss = F.softplus(-d(g(z))).mean()
        scaler_g.scale_loss(g_loss).backward()
        opt_g.step()
        opt_g.zero_grad()
        if spelling == "freeze":
            d.requires_grad_(True)
        else:
            opt_d.zero_grad()  # the discriminator's gradients of the generator's loss (and their reports to its mu)
        record["losses"].append((d_loss.detach(), g_loss.detach()))
    return record


def _two_scalers(g, d) -> tuple[FP8GradScaler, FP8GradScaler]:
    return (FP8GradScaler(model=g, growth_interval=GROWTH_INTERVAL),
            FP8GradScaler(model=d, growth_interval=GROWTH_INTERVAL))  # fmt: skip


@pytest.mark.parametrize("poison_d_at", [None, 2], ids=["finite", "nonfinite_discriminator_step"])
def test_gan_with_two_scalers_trains_alike_in_both_spellings_and_skips_only_the_discriminator(poison_d_at):
    g, d = _gan()
    g2, d2 = copy.deepcopy(g), copy.deepcopy(d)
    scalers, scalers2 = _two_scalers(g, d), _two_scalers(g2, d2)
    dropped = _train_gan(g, d, *scalers, "zero_grad", poison_d_at)
    frozen = _train_gan(g2, d2, *scalers2, "freeze", poison_d_at)
    assert_same(dropped, frozen)
    assert_same(_snapshot(g, scalers[0]), _snapshot(g2, scalers2[0]))
    assert_same(_snapshot(d, scalers[1]), _snapshot(d2, scalers2[1]))
    assert scalers[0].skipped_steps == 0
    if poison_d_at is not None:
        assert scalers[1].skipped_steps == 1
        assert_same(dropped["d_after_step"][poison_d_at], dropped["d_after_step"][poison_d_at - 1])


def test_gan_with_one_scaler_given_both_models_halves_mu_once_and_rescales_both_models():
    """One scaler for both optimizers, its model a module holding both (FP8GradScaler's "for several models, pass the
    module that holds them all"): a non-finite discriminator step skips the discriminator only, halves mu once, and
    that change rescales the grad_output states of both models' layers, with no warning about another model."""
    g, d = _gan()
    scaler = FP8GradScaler(model=nn.ModuleList([g, d]), growth_interval=GROWTH_INTERVAL)
    opt_g = FP8AdamW(g.parameters(), lr=LR, grad_scaler=scaler)
    opt_d = FP8AdamW(d.parameters(), lr=LR, grad_scaler=scaler)

    def grad_output_histories() -> list[torch.Tensor]:
        return [m.fp8_scaling["grad_output"].amax_history.clone() for m in (*g, *d) if isinstance(m, FP8Linear)]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "none of this optimizer's FP8 weights" nor "no model"
        for i, (real, z) in enumerate(_gan_data()):
            d_loss = F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()
            scaler.scale_loss(d_loss * (float("inf") if i == 2 else 1.0)).backward()
            before, d_weights, mu = grad_output_histories(), copy.deepcopy(d.state_dict()), scaler.scale
            opt_d.step()
            opt_d.zero_grad()
            if i == 2:
                assert scaler.scale == mu / 2 and scaler.skipped_steps == 1
                assert_same(d.state_dict(), d_weights)
                assert_same(grad_output_histories(), [h * 0.5 for h in before])
            g_weights = copy.deepcopy(g.state_dict())
            scaler.scale_loss(F.softplus(-d(g(z))).mean()).backward()
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
            assert not all(torch.equal(v, g.state_dict()[k]) for k, v in g_weights.items())  # the generator stepped
    assert scaler.skipped_steps == 1


def test_a_scaler_takes_one_module_and_warns_about_an_optimizer_of_another_model():
    g, d = _gan()
    with pytest.raises(TypeError, match="pass the module that holds them all"):
        FP8GradScaler(model=[g, d])
    scaler = FP8GradScaler(model=g)
    opt_d = FP8AdamW(d.parameters(), lr=LR, grad_scaler=scaler)
    real, _ = _gan_data(1)[0]
    scaler.scale_loss(d(real).square().mean()).backward()
    assert any("none of this FP8AdamW's FP8 weights is a parameter of the scaler's model" in m
               for m in _messages(opt_d.step))  # fmt: skip


# ----------------------------------------------------------------------------------------------- teacher and student
TEACHER_MODES = ("no_grad", "inference_mode", "frozen_with_grad_enabled")


def _teacher_forward(teacher: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "no_grad":
        with torch.no_grad():
            return teacher(x)
    if mode == "inference_mode":
        with torch.inference_mode():
            out = teacher(x)
        return out.clone()  # an ordinary tensor outside inference mode
    return teacher(x)  # frozen: no graph (neither the input nor the weights need a gradient)


@pytest.mark.parametrize("mode", TEACHER_MODES)
def test_distillation_student_trains_as_alone_and_the_teacher_records_only_its_evaluation_casts(mode):
    teacher = _net(7)
    _Run(teacher).train(_batches(9, 2))  # a trained teacher: every role has a history
    teacher.eval().requires_grad_(False)
    student = _net(8, "fp8-lm-o1")
    teacher_alone, student_alone = copy.deepcopy(teacher), copy.deepcopy(student)
    before = _snapshot(teacher)
    inputs = [x for x, _ in _batches(12)]
    run = _Run(student, "fp8-lm-o1")
    for x in inputs:
        target = _teacher_forward(teacher, x, mode)
        assert not target.requires_grad
        run.step(x, target)
    # References: the teacher evaluated alone on the same inputs (evaluation forwards record their amaxes:
    # docs/guides/lightning.md), the student trained alone on those outputs.
    targets = [_teacher_forward(teacher_alone, x, mode) for x in inputs]
    _assert_trained_alike(run, _Run(student_alone, "fp8-lm-o1").train(list(zip(inputs, targets, strict=True))))
    assert_same(_snapshot(teacher), _snapshot(teacher_alone))
    after = _snapshot(teacher)
    assert_same(after["model"], before["model"])
    changed = {k for k in after["fp8"] if not torch.equal(after["fp8"][k], before["fp8"][k])}
    assert changed and all(".input." in k or ".weight." in k for k in changed)  # never grad_output
    assert int(after["fp8"]["0.fp8_scaling.input.casts"]) == int(before["fp8"]["0.fp8_scaling.input.casts"]) + STEPS


# -------------------------------------------------------------------------------------- shared and nested submodules
class _Pair(nn.Module):
    """Two heads on one shared layer, as one module: the reference for two models sharing the layer (which runs once
    per model, as there)."""

    def __init__(self, shared: nn.Module, head_a: nn.Module, head_b: nn.Module) -> None:
        super().__init__()
        self.shared, self.head_a, self.head_b = shared, head_a, head_b

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head_a(F.gelu(self.shared(x))), self.head_b(F.gelu(self.shared(x)))


def test_a_linear_shared_by_two_models_converted_together_is_one_fp8_layer_trained_as_one_module():
    torch.manual_seed(3)
    shared, head_a, head_b = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH), nn.Linear(HIDDEN, 16)
    pair = _Pair(*copy.deepcopy((shared, head_a, head_b)))
    a, b = nn.Sequential(shared, nn.GELU(), head_a), nn.Sequential(shared, nn.GELU(), head_b)
    both = convert_to_fp8(nn.ModuleList([a, b]))
    assert isinstance(a[0], FP8Linear) and a[0] is b[0]
    convert_to_fp8(pair)
    runs = []
    for model, forward in ((both, lambda x: (a(x), b(x))), (pair, pair)):
        scaler = FP8GradScaler(model=model, growth_interval=GROWTH_INTERVAL)
        opt = FP8AdamW(model.parameters(), lr=LR, grad_scaler=scaler)
        losses = []
        for (x, y), (_, y16) in zip(_batches(13), _batches(14, out=16), strict=True):
            out_a, out_b = forward(x)
            loss = (out_a - y).square().mean() + (out_b - y16).square().mean()
            scaler.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, scaler.state_dict(), [fp8_state_dict(m) for m in (a[0], a[2], b[2])]))
    runs[1] = (runs[1][0], runs[1][1], [fp8_state_dict(m) for m in (pair.shared, pair.head_a, pair.head_b)])
    assert_same(runs[0], runs[1])
    assert_same(a.state_dict(), nn.Sequential(pair.shared, nn.GELU(), pair.head_a).state_dict())
    assert_same(b.state_dict(), nn.Sequential(pair.shared, nn.GELU(), pair.head_b).state_dict())


def test_an_fp8_layer_put_into_a_second_model_stays_that_layer():
    a = _net(0, "fp8-lm-current")
    b = nn.Sequential(a[0], nn.GELU(), nn.Linear(HIDDEN, WIDTH))
    with pytest.raises(ValueError, match="already an FP8 layer"):
        convert_to_fp8(b, "fp8-lm")  # another recipe: refused, nothing changed
    assert type(b[2]) is nn.Linear
    convert_to_fp8(b, "fp8-lm-current")
    assert b[0] is a[0] and isinstance(b[2], FP8Linear)


def _outer(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), inner, nn.GELU(), nn.Linear(WIDTH, WIDTH))


def _not_inner(module: nn.Module, fqn: str) -> bool:
    return not fqn.startswith("2.")


def test_a_nested_model_converted_twice_and_partially_in_either_order():
    inner_first, outer_first = _outer(), _outer()
    convert_to_fp8(inner_first[2], "fp8-lm-current")
    conversions = master.conversions
    with pytest.raises(ValueError, match="'2.0' is already an FP8 layer"):
        convert_to_fp8(inner_first, "fp8-lm")
    assert type(inner_first[0]) is nn.Linear and type(inner_first[4]) is nn.Linear  # nothing changed
    assert master.conversions == conversions
    convert_to_fp8(inner_first, "fp8-lm", module_filter_fn=_not_inner)
    convert_to_fp8(outer_first, "fp8-lm", module_filter_fn=_not_inner)
    convert_to_fp8(outer_first[2], "fp8-lm-current")
    scalings = {n: m.recipe.scaling for n, m in inner_first.named_modules() if isinstance(m, FP8Linear)}
    assert scalings == {"0": "delayed", "2.0": "current", "2.2": "current", "4": "delayed"}
    assert scalings == {n: m.recipe.scaling for n, m in outer_first.named_modules() if isinstance(m, FP8Linear)}
    run = _Run(inner_first).train(_batches(15))
    reference = _Run(outer_first)
    for i, (x, y) in enumerate(_batches(15)):
        if i == 2:  # converting again mid-training (both calls): the same modules, the states as they were
            modules = list(outer_first.modules())
            convert_to_fp8(outer_first, "fp8-lm", module_filter_fn=_not_inner)
            convert_to_fp8(outer_first[2], "fp8-lm-current")
            assert all(m is n for m, n in zip(modules, outer_first.modules(), strict=True))
        reference.step(x, y)
    _assert_trained_alike(run, reference)


# -------------------------------------------------------------------------------------------------------- deep copies
COPY_SETTINGS = {
    "o2": ("fp8-lm", {}),
    "o1": ("fp8-lm-o1", {}),
    "o2_fp8_weight_copies": ("fp8-lm", {"emit_fp8_weights": True, "scale_update": "two_pass"}),
}


def _storages(model: nn.Module, opt: torch.optim.Optimizer) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [s for p in model.parameters() if (s := master.master_scale(p)) is not None]
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@pytest.mark.parametrize("how", ["model_then_fresh_optimizer_and_scaler", "all_three", "all_three_scaler_first"])
@pytest.mark.parametrize("setting", COPY_SETTINGS)
def test_a_deep_copy_of_a_trained_model_shares_nothing_and_trains_on_as_the_original(setting, how):
    recipe, kwargs = COPY_SETTINGS[setting]
    batches = _batches(16, 8)
    original = _Run(_net(0, recipe), recipe, **kwargs).train(batches[:3])
    if how == "model_then_fresh_optimizer_and_scaler":
        model = copy.deepcopy(original.model)
        copied = _Run(model, recipe, **kwargs)
        # As torch.optim: a live state_dict() holds the optimizer's own tensors; a copy of it gives the copy its own.
        copied.opt.load_state_dict(copy.deepcopy(original.opt.state_dict()))
        copied.scaler.load_state_dict(original.scaler.state_dict())
        # The fresh scaler's load rescaled the copy's grad_output states from its own mu (1) to the loaded one, as
        # for any model it follows (FP8GradScaler.load_state_dict); the FP8 state of the same checkpoint, loaded
        # after it, puts the saved values back (the documented pair of loads).
        load_fp8_state_dict(model, fp8_state_dict(original.model))
    else:
        objects = (original.model, original.opt, original.scaler)
        order = (2, 0, 1) if how == "all_three_scaler_first" else (0, 1, 2)
        copies = dict(zip(order, copy.deepcopy(tuple(objects[i] for i in order)), strict=True))
        copied = _Run.__new__(_Run)
        copied.model, copied.opt, copied.scaler, copied.losses = copies[0], copies[1], copies[2], []
        assert copied.scaler.model is copied.model and copied.opt.grad_scaler is copied.scaler
    assert_same(_snapshot(copied.model, copied.scaler), _snapshot(original.model, original.scaler))
    assert not _storages(copied.model, copied.opt) & _storages(original.model, original.opt)
    frozen = _snapshot(copied.model, copied.scaler)
    original.train(batches[3:5])  # the original trains on: the copy stays as it was
    assert_same(_snapshot(copied.model, copied.scaler), frozen)
    original.losses = original.losses[3:]
    copied.train(batches[3:])
    original.train(batches[5:])
    _assert_trained_alike(copied, original)


# ------------------------------------------------------------------------------------------------------ weight reads
def _net_class() -> type[nn.Module]:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.proj.weight.t()  # computes with the weight itself: the layer must stay nn.Linear

    return Net


_READING_NET = _net_class()


def _net_class() -> type[nn.Module]:  # noqa: F811 (the same name on purpose: both classes get the same qualname)
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    return Net


_CALLING_NET = _net_class()


@pytest.mark.parametrize("reading_first", [True, False])
def test_two_classes_of_the_same_name_and_qualname_are_read_apart(reading_first, fresh_warnings):
    assert _READING_NET.__qualname__ == _CALLING_NET.__qualname__ and _READING_NET is not _CALLING_NET
    for cls in (_READING_NET, _CALLING_NET) if reading_first else (_CALLING_NET, _READING_NET):
        lightning_fp8.warnings._seen.clear()
        model = cls()
        messages = _messages(lambda model=model: convert_to_fp8(model))
        if cls is _READING_NET:
            assert type(model.proj) is nn.Linear
            assert any("reads their weight itself" in m and m.endswith(": proj") for m in messages)
        else:
            assert isinstance(model.proj, FP8Linear) and not messages


def _reading_forward(self, x: torch.Tensor) -> torch.Tensor:
    return x @ self.proj.weight.t() + self.proj.bias


def _assert_left_in_high_precision_and_right_at_o2(model: nn.Module, reference: nn.Module) -> None:
    """The layer whose weight the forward reads stays nn.Linear (as for a class that reads it from the start), so that
    FP8AdamW (O2) leaves its weight as it is and the forward computes what the unconverted model does."""
    assert type(model.proj) is nn.Linear
    FP8AdamW(model.parameters(), lr=LR)
    x = torch.randn(BATCH, WIDTH)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


# Found by this sweep: weight_reads.forward_weight_reads was a functools.cache keyed on the class alone, so its
# reading of the class's forward was kept for good: a forward patched on the class after a first conversion of one of
# its models (as kernel libraries patch modules' forwards) was never read. The second model's proj became an
# FP8Linear, and at O2 its forward computed with FP8AdamW's scaled fp16 master (the weight times its master scale,
# 2**18 here). Each function's reading is cached now, by the function object.
def test_a_forward_patched_on_the_class_after_a_first_conversion_is_read_again():
    class Patched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    first = convert_to_fp8(Patched())
    assert isinstance(first.proj, FP8Linear)  # its forward calls the layer
    Patched.forward = _reading_forward
    torch.manual_seed(0)
    second = Patched()
    reference = copy.deepcopy(second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_to_fp8(second)
    _assert_left_in_high_precision_and_right_at_o2(second, reference)


def _own_forward(model: nn.Module, form: str):
    """``model``'s own forward computing with ``proj``'s weight, in the forms a user or a library sets one."""
    if form == "bound method":
        return types.MethodType(_reading_forward, model)
    if form == "partial":  # as Accelerate's hooks bind theirs: partial(new_forward, module)
        return functools.partial(_reading_forward, model)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return x @ model.proj.weight.t() + model.proj.bias

    return closure


# Found by this sweep: eligibility._bypassed_layers read forward_weight_reads(type(parent)) only, so a model whose own
# forward (model.forward = ..., an instance attribute, which nn.Module.__call__ runs) computes with proj's weight was
# judged by its class's forward: the layer became FP8, and at O2 that forward computed with the scaled fp16 master (an
# error of ~4e5 on this model). The instance's forward is read too now.
@pytest.mark.parametrize("form", ["bound method", "partial", "closure"])
def test_a_model_whose_own_forward_reads_the_weight_keeps_that_layer_out_where_its_class_twin_converts(form):
    torch.manual_seed(0)
    plain, reading = _CALLING_NET(), _CALLING_NET()
    reference = copy.deepcopy(reading)
    reading.forward = _own_forward(reading, form)
    reference.forward = _own_forward(reference, form)
    convert_to_fp8(plain)
    assert isinstance(plain.proj, FP8Linear)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_to_fp8(reading)
    _assert_left_in_high_precision_and_right_at_o2(reading, reference)


class _Holder:
    """Another object whose method builds a model's forward: its ``self`` is not the model."""

    def __init__(self) -> None:
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward_for(self, model: nn.Module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return model.proj(x) + self.proj.weight.sum()

        return forward


def test_an_own_forward_calling_the_layer_or_reading_another_objects_weight_converts_it(fresh_warnings):
    from accelerate.hooks import ModelHook, add_hook_to_module

    hooked, other = _CALLING_NET(), _CALLING_NET()
    add_hook_to_module(hooked, ModelHook())  # an own forward: partial(new_forward, module) calling the class's
    other.forward = _Holder().forward_for(other)
    for model in (hooked, other):
        assert not _messages(lambda model=model: convert_to_fp8(model))
        assert isinstance(model.proj, FP8Linear)


# ---------------------------------------------------------------------------------------------- process-global state
def test_conversion_warnings_of_one_model_do_not_silence_another_models_about_their_own_layers(fresh_warnings):
    left_a = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, 30))
    left_b = nn.Sequential(nn.Linear(WIDTH, 30), nn.Linear(30, WIDTH))
    messages = _messages(lambda: convert_to_fp8(left_a))
    assert any(m.startswith("convert_to_fp8 left 1 linear layer(s)") and m.endswith("1 (64->30)") for m in messages)
    messages = _messages(lambda: convert_to_fp8(left_b))
    assert any("0 (32->30)" in m and "1 (30->32)" in m for m in messages)


def test_per_object_warnings_are_given_for_each_model():
    """A scaler without a model warns at the first step of each such scaler, an FP8AdamW without a recipe over O1
    layers warns for each optimizer: neither is silenced by another model's."""
    for seed in range(2):
        model = _net(seed)
        scaler = FP8GradScaler()
        opt = FP8AdamW(model.parameters(), grad_scaler=scaler)
        x, y = _batches(seed, 1)[0]
        scaler.scale_loss((model(x) - y).square().mean()).backward()
        assert any(m.startswith("FP8GradScaler has no model") for m in _messages(opt.step))
        o1 = _net(seed, "fp8-lm-o1")
        messages = _messages(lambda o1=o1: FP8AdamW(o1.parameters()))
        assert any(m.startswith("FP8AdamW was built without recipe=") for m in messages)


def test_results_do_not_depend_on_the_global_rng_state():
    model = _net(0)
    alone = copy.deepcopy(model)
    run = _Run(model)
    for i, (x, y) in enumerate(_batches(17)):
        torch.manual_seed(1000 + i)  # other code (another model's init, dropout) moving the global generator
        torch.rand(7 * i + 1)
        run.step(x, y)
    _assert_trained_alike(run, _Run(alone).train(_batches(17)))


def test_autocast_on_in_one_models_forward_and_off_in_anothers():
    a, b, c = _net(0), _net(1, "fp8-lm-o1"), _net(2, "fp8-lm-current")
    alone = [copy.deepcopy(m) for m in (a, b, c)]
    batches = [_batches(20), _batches(21), _batches(22)]
    runs = [_Run(a), _Run(b, "fp8-lm-o1"), _Run(c, "fp8-lm-current")]
    for steps in zip(*batches, strict=True):
        runs[0].step(*steps[0], autocast=True)
        runs[1].step(*steps[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # C's forward in an autocast region, with autocast off
            with torch.autocast("cpu", enabled=False):
                out = c(steps[2][0])
            loss = (out.float() - steps[2][1]).square().mean()
        runs[2].scaler.scale_loss(loss).backward()
        runs[2].opt.step()
        runs[2].opt.zero_grad()
        runs[2].losses.append(loss.detach())
    _assert_trained_alike(runs[0], _Run(alone[0]).train(batches[0], autocast=True))
    _assert_trained_alike(runs[1], _Run(alone[1], "fp8-lm-o1").train(batches[1]))
    _assert_trained_alike(runs[2], _Run(alone[2], "fp8-lm-current").train(batches[2]))


# ------------------------------------------------------------------------------------------------------------ threads
def _in_threads(*jobs) -> None:
    """Run each job in its own thread, all at once (a barrier at every step keeps them side by side); re-raise the
    first error."""
    barrier = threading.Barrier(len(jobs), timeout=60)
    errors: list[BaseException] = []

    def target(job) -> None:
        try:
            job(barrier)
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def test_two_threads_training_their_own_models_train_as_each_alone():
    recipes = ("fp8-lm", FP8Recipe(scaling="current", opt_level="O1"))
    models = [_net(0, recipes[0]), _net(1, recipes[1])]
    alone = [copy.deepcopy(m) for m in models]
    batches = [_batches(30, 6), _batches(31, 6)]
    runs = [_Run(m, r) for m, r in zip(models, recipes, strict=True)]

    def trainer(run: _Run, run_batches):
        def job(barrier: threading.Barrier) -> None:
            for x, y in run_batches:
                barrier.wait()
                run.step(x, y)

        return job

    _in_threads(*(trainer(run, b) for run, b in zip(runs, batches, strict=True)))
    for run, model, recipe, run_batches in zip(runs, alone, recipes, batches, strict=True):
        _assert_trained_alike(run, _Run(model, recipe).train(run_batches))


def test_a_thread_evaluating_a_model_while_another_trains_one():
    trained, evaluated = _net(0), _net(1, "fp8-lm-current")
    trained_alone, evaluated_alone = copy.deepcopy(trained), copy.deepcopy(evaluated)
    batches = _batches(32, 6)
    inputs = [x for x, _ in _batches(33, 6)]
    run, outputs = _Run(trained), []

    def train(barrier: threading.Barrier) -> None:
        for x, y in batches:
            barrier.wait()
            run.step(x, y)

    def evaluate(barrier: threading.Barrier) -> None:
        for x in inputs:
            barrier.wait()
            with torch.no_grad():
                outputs.append(evaluated(x))

    _in_threads(train, evaluate)
    _assert_trained_alike(run, _Run(trained_alone).train(batches))
    with torch.no_grad():
        assert_same(outputs, [evaluated_alone(x) for x in inputs])
    assert_same(_snapshot(evaluated), _snapshot(evaluated_alone))


# ----------------------------------------------------------------------------------------------------------- refusals
def _refusals() -> list:
    """Calls that are refused, each on a model of its own, with what they raise; ``None``: checked in the call."""
    x, y = _batches(40, 1)[0]

    def small() -> nn.Sequential:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH))

    def optimizer_over_a_referenced_output() -> None:
        model = _net(41)
        out = model(x)  # still referenced: O2 would change the dtype of weights whose graph holds them
        dtypes = [p.dtype for p in model.parameters()]
        with pytest.raises(RuntimeError, match="nothing was changed"):
            FP8AdamW(model.parameters())
        assert [p.dtype for p in model.parameters()] == dtypes and out is not None
        assert all(master.master_scale(p) is None for p in model.parameters())

    def step_without_a_scaled_loss() -> None:
        run = _Run(_net(42))
        (run.model(x) - y).square().mean().backward()
        with pytest.raises(RuntimeError, match="no loss was scaled"):
            run.opt.step()

    def optimizer_built_before_the_conversion() -> None:
        model = small()
        opt = FP8AdamW(model.parameters())
        convert_to_fp8(model)
        (model(x) - y).square().mean().backward()
        with pytest.raises(RuntimeError, match="became an FP8 layer's weight"):
            opt.step()

    def conversion_refused(call, error, match):
        def check() -> None:
            model = small()
            with pytest.raises(error, match=match):
                call(model)
            assert type(model[0]) is nn.Linear  # nothing converted

        return check

    def forward_refused(x_bad, error, match):
        def check() -> None:
            model = convert_to_fp8(small())
            before = _snapshot(model)
            with pytest.raises(error, match=match):
                model(x_bad)
            assert_same(_snapshot(model), before)  # refused before any cast

        return check

    return [
        conversion_refused(lambda m: convert_to_fp8(m, "fp8-lm-bogus"), ValueError, "unknown FP8 recipe name"),
        conversion_refused(lambda m: convert_to_fp8(m, FP8Recipe(margin=-1)), ValueError, "margin"),
        conversion_refused(lambda m: convert_to_fp8(m, FP8Recipe(amax_history_len=0)), ValueError, "amax_history_len"),
        conversion_refused(
            lambda m: convert_to_fp8(m, module_filter_fn=lambda mod, fqn: 1 / 0), ZeroDivisionError, "division"
        ),
        forward_refused(x.double(), TypeError, "float64"),
        forward_refused(x[:, :16], ValueError, "last dimension must be 32"),
        optimizer_over_a_referenced_output,
        step_without_a_scaled_loss,
        optimizer_built_before_the_conversion,
    ]


def test_refusals_on_other_models_leave_a_models_training_as_alone():
    model = _net(0)
    alone = copy.deepcopy(model)
    run = _Run(model)
    for (x, y), refusal in zip(_batches(43, len(_refusals())), _refusals(), strict=True):
        run.step(x, y)
        refusal()
    _assert_trained_alike(run, _Run(alone).train(_batches(43, len(_refusals()))))
