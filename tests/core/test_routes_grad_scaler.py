"""FP8GradScaler against torch.amp.GradScaler and hand-computed values, route by route (from a route sweep of the
automatic gradient scaling and its NaN recovery).

Routes: ``scale_loss`` / ``step`` / ``update`` beside ``torch.amp.GradScaler("cpu")`` fed the same finite and
non-finite gradients (inf in one parameter, NaN in another, a NaN loss, a bad micro-batch among good ones) on SGD and
AdamW; ``FP8AdamW(grad_scaler=...)`` driving the scaler against ``scaler.step(FP8AdamW)`` and ``torch.optim.AdamW``
under torch.amp; repeated non-finite steps down to ``min_scale``; a state dict saved mid growth interval through
``torch.save`` / ``torch.load(weights_only=True)``; the ``"bf16"`` fallback from FP8 layers against a high-precision
model under torch.amp; an optimizer wrapper (Accelerate's, Lightning's: ``.optimizer`` inside) given to ``unscale_``
and ``step``; and an optimizer stepped without gradients where each optimizer's ``step()`` updates mu.
"""

import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8
from lightning_fp8.linear import FP8Linear

pytestmark = pytest.mark.usefixtures("one_thread")

MU0 = 2.0**6
# iteration -> what goes wrong in it: inf in the first layer's weight gradient, NaN in the second layer's bias
# gradient, a NaN loss
BAD = {2: "inf", 3: "nan", 7: "loss", 8: "inf", 9: "inf"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _x() -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def _scale(scaler, loss: torch.Tensor) -> torch.Tensor:
    return scaler.scale(loss) if isinstance(scaler, torch.amp.GradScaler) else scaler.scale_loss(loss)


def _backward(scaler, model: nn.Module, x: torch.Tensor, bad: str | None, accumulate: int) -> None:
    """One iteration's backwards, ``accumulate`` micro-batches; ``bad`` spoils the first one (the sum carries it)."""
    for k in range(accumulate):
        loss = model(x[k::accumulate]).square().mean()
        spoil = bad if k == 0 else None
        _scale(scaler, loss * math.nan if spoil == "loss" else loss).backward()
        if spoil == "inf":
            model[0].weight.grad[0, 0] = math.inf
        elif spoil == "nan":
            model[1].bias.grad[0] = math.nan


def _train(scaler, optimizer_cls, accumulate: int = 1, iterations: int = 14):
    model = _model()
    opt = optimizer_cls(model.parameters(), lr=0.1)
    x, scales, stepped = _x(), [], []
    for i in range(iterations):
        before = [p.detach().clone() for p in model.parameters()]
        _backward(scaler, model, x, BAD.get(i), accumulate)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        stepped.append(any(not torch.equal(u, p) for u, p in zip(before, model.parameters(), strict=True)))
    return scales, stepped, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_steps_skips_scales_and_weights_match_torch_amp(optimizer_cls, accumulate):
    ours = _train(FP8GradScaler(init_scale=MU0, growth_interval=3), optimizer_cls, accumulate)
    theirs = _train(torch.amp.GradScaler("cpu", init_scale=MU0, growth_interval=3), optimizer_cls, accumulate)
    assert ours[:2] == theirs[:2]
    for a, b in zip(ours[2], theirs[2], strict=True):
        assert torch.equal(a, b)
    # By hand: 64 64 | skip 32, skip 16 | three good steps: 32 | 32 | skip 16, 8, 4 | three good: 8 | 8 8
    assert ours[0] == [64, 64, 32, 16, 16, 16, 32, 16, 8, 4, 4, 4, 8, 8]
    assert ours[1] == [i not in BAD for i in range(14)]


def test_fp8adamw_driving_the_scaler_matches_scaler_step_and_torch_amp_adamw():
    """Plain nn.Linear weights (fp32 gradients): FP8AdamW(grad_scaler=scaler).step() alone, scaler.step(FP8AdamW)
    with update(), and torch.optim.AdamW under torch.amp.GradScaler skip the same steps with the same mu."""

    def run(route):
        model = _model()
        if route == "torch":
            scaler = torch.amp.GradScaler("cpu", init_scale=MU0, growth_interval=3)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        else:
            scaler = FP8GradScaler(init_scale=MU0, growth_interval=3)
            opt = FP8AdamW(model.parameters(), lr=0.01, grad_scaler=scaler)
        x, scales = _x(), []
        for i in range(14):
            _backward(scaler, model, x, BAD.get(i), 1)
            if route == "own":
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    own, stepped, reference = run("own"), run("scaler.step"), run("torch")
    assert own[0] == stepped[0] == reference[0]
    for a, b, c in zip(own[1], stepped[1], reference[1], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)


def test_repeated_nonfinite_steps_stop_at_min_scale_and_keep_skipping():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FP8GradScaler(init_scale=2.0**-1, min_scale=2.0**-3, growth_interval=2)
    start = [p.detach().clone() for p in model.parameters()]
    scales = []
    for _ in range(5):
        _backward(scaler, model, _x(), "inf", 1)
        assert scaler.step(opt) is False
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales == [2.0**-2, 2.0**-3, 2.0**-3, 2.0**-3, 2.0**-3]
    assert scaler.skipped_steps == 5 and [e["action"] for e in scaler.history] == ["skip"] * 5
    assert all(torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))
    for _ in range(2):  # good steps grow it back after growth_interval
        _backward(scaler, model, _x(), None, 1)
        assert scaler.step(opt) is True
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**-2


def _round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("reload_at", [4, 5])  # mid growth interval (tracker 1 and 2 of 3)
def test_a_state_dict_saved_mid_growth_interval_continues_as_the_uninterrupted_run_and_torch_amp(reload_at):
    def run(make, reload):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler, scales = make(), []
        for i in range(12):
            _backward(scaler, model, _x(), BAD.get(i), 1)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if reload and i == reload_at:
                state = _round_trip(scaler.state_dict())
                scaler = make()
                scaler.load_state_dict(state)
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    ours = lambda: FP8GradScaler(init_scale=MU0, growth_interval=3)  # noqa: E731
    theirs = lambda: torch.amp.GradScaler("cpu", init_scale=MU0, growth_interval=3)  # noqa: E731
    resumed, whole, reference = run(ours, True), run(ours, False), run(theirs, True)
    assert resumed[0] == whole[0] == reference[0]
    for a, b, c in zip(resumed[1], whole[1], reference[1], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_state_dict_loads_into_other_settings_under_this_scalers_growth_interval():
    """Documented difference: the settings are not saved, the loaded growth_tracker counts toward this scaler's
    growth_interval; torch.amp.GradScaler.load_state_dict takes growth_interval from the state dict."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved, theirs = FP8GradScaler(init_scale=MU0, growth_interval=4), torch.amp.GradScaler("cpu", growth_interval=4)
    for _ in range(2):
        _backward(saved, model, _x(), None, 1)
        saved.step(opt)
        saved.update()
        opt.zero_grad()
    loaded = FP8GradScaler(init_scale=1.0, growth_interval=3)
    loaded.load_state_dict(_round_trip(saved.state_dict()))
    assert (loaded.get_scale(), loaded.growth_tracker, loaded.growth_interval) == (MU0, 2, 3)
    _backward(loaded, model, _x(), None, 1)
    loaded.step(opt)
    loaded.update()
    assert loaded.get_scale() == 2 * MU0 and loaded.growth_tracker == 0  # 2 + 1 steps reach this scaler's 3
    other = torch.amp.GradScaler("cpu", growth_interval=3)
    other.load_state_dict(theirs.state_dict())
    assert other.get_growth_interval() == 4


def test_bf16_fallback_then_trains_as_a_high_precision_model_under_torch_amp():
    """Three non-finite steps from the start (nothing stepped yet) put both FP8 layers back; from there the model trains
    as the same nn.Linear model with torch.optim.AdamW under torch.amp.GradScaler: same mu, same skips, same weights."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    reference = copy.deepcopy(base)
    model = convert_to_fp8(copy.deepcopy(base), FP8Recipe(opt_level="O1"))
    scaler = FP8GradScaler(
        init_scale=2.0**8, growth_interval=2, nonfinite_fallback="bf16", fallback_after=3, model=model
    )
    opt = FP8AdamW(model.parameters(), lr=0.01, grad_scaler=scaler, recipe=FP8Recipe(opt_level="O1"))
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for i in range(9):
        factor = math.inf if i < 3 else 1.0
        scaler.scale_loss(model(x).square().mean() * factor).backward()
        opt.step()
        opt.zero_grad()
        ref_scaler.scale(reference(x).square().mean() * factor).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        if i == 1:
            assert all(isinstance(model[j], FP8Linear) for j in (0, 2))
    assert all(type(model[j]) is nn.Linear for j in (0, 2)) and scaler.skipped_steps == 3
    assert [e["action"] for e in scaler.history][:4] == ["skip", "skip", "skip", "fallback"]
    assert "put 2 layer(s) back to high precision: 0, 2" in scaler.history[3]["reason"]
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _Wrapper(torch.optim.Optimizer):
    """As accelerate.optimizer.AcceleratedOptimizer (and Lightning's LightningOptimizer): the optimizer inside as
    ``.optimizer``, its param_groups and state, and a step() that steps it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.steps = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        self.steps += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def test_unscale_then_step_of_a_wrapper_unscales_once_as_torch_amp():
    """Found by the route sweep: unscale_(wrapper) recorded the optimizer inside and step(wrapper) looked for the
    wrapper, so the gradients were unscaled a second time (the SGD update came out 1/mu of torch.amp's)."""
    results = []
    for scaler in (FP8GradScaler(init_scale=2.0**8), torch.amp.GradScaler("cpu", init_scale=2.0**8)):
        p = nn.Parameter(torch.ones(4))
        wrapper = _Wrapper(torch.optim.SGD([p], lr=0.1))
        _scale(scaler, p.sum()).backward()
        scaler.unscale_(wrapper)
        scaler.step(wrapper)
        scaler.update()
        wrapper.zero_grad()
        with pytest.raises(RuntimeError, match="after step"):  # the next iteration's unscale_ after its step
            _scale(scaler, p.sum()).backward()
            scaler.step(wrapper)
            scaler.unscale_(wrapper)
        results.append((p.detach().clone(), wrapper.steps, scaler.get_scale()))
    (ours, steps, mu), (theirs, ref_steps, ref_mu) = results
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours, torch.full((4,), 0.8))  # two steps of lr 0.1 on gradients of 1
    assert steps == ref_steps == 2 and mu == ref_mu


def test_scaler_step_of_a_wrapped_fp8adamw_unscales_once():
    """Found by the route sweep: scaler.step(wrapper of FP8AdamW(grad_scaler=scaler)) unscaled the gradients in place
    and then the FP8AdamW, stepped through the wrapper, routed through the scaler again and unscaled them once more:
    its first moment came out 1/mu of the true gradient's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16))
    x = torch.randn(4, 16)
    moments = []
    for wrap in (False, True):
        model = copy.deepcopy(base)
        scaler = FP8GradScaler(init_scale=2.0**8)
        opt = FP8AdamW(model.parameters(), lr=0.01, betas=(0.5, 0.999), grad_scaler=scaler)
        scaler.scale_loss(model(x).square().mean()).backward()
        true_grad = model[0].bias.grad / 2.0**8
        assert scaler.step(_Wrapper(opt) if wrap else opt) is True
        scaler.update()
        torch.testing.assert_close(opt.state[model[0].bias]["exp_avg"], 0.5 * true_grad)
        moments.append(opt.state[model[0].bias]["exp_avg"])
    assert torch.equal(*moments)


def test_an_optimizer_stepped_without_gradients_does_not_restart_mus_growth():
    """Found by the route sweep: where each optimizer's step() updates mu (FP8AdamW(grad_scaler=scaler), the
    integrations), an optimizer whose parameters got no gradient this iteration restarted the count of steps with
    headroom at its own update, and mu never grew. Reference: the same loop with update() once per iteration, and
    torch.amp.GradScaler stepping the optimizer that has gradients."""

    def run(route):
        torch.manual_seed(0)
        used, idle = nn.Linear(4, 4), nn.Linear(4, 4)
        if route == "torch":
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
            opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (used, idle)]
        else:
            scaler = FP8GradScaler(init_scale=4.0, growth_interval=2)
            opts = [FP8AdamW(m.parameters(), lr=0.01, grad_scaler=scaler) for m in (used, idle)]
        scales = []
        for _ in range(6):
            _scale(scaler, used(torch.ones(2, 4)).square().sum()).backward()
            if route == "own":
                opts[0].step()
                opts[1].step()  # no gradient: nothing to step
            else:
                scaler.step(opts[0])
                if route == "update once":
                    scaler.step(opts[1])
                scaler.update()
            for opt in opts:
                opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own, once, reference = run("own"), run("update once"), run("torch")
    assert own == once == reference == [4.0, 8.0, 8.0, 16.0, 16.0, 32.0]


def _train_with_new_scales(scaler, new_scales: dict[int, float], iterations: int = 10):
    """:func:`_train`'s SGD loop (BAD's iterations spoiled), ``update(new_scales[i])`` at iteration ``i``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, scales = _x(), []
    for i in range(iterations):
        _backward(scaler, model, x, BAD.get(i), 1)
        scaler.step(opt)
        new_scale = new_scales.get(i)
        scaler.update(torch.tensor(new_scale) if i == 5 and new_scale is not None else new_scale)
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def test_update_with_a_new_scale_sets_mu_as_torch_amp_does():
    """``update(new_scale)`` (torch.amp's, a number or a one-element tensor): it raised Python's "takes 1 positional
    argument"; set after a good step and after a skipped one, mu and the weights follow torch.amp's."""
    new_scales = {1: 2.0**10, 3: 2.0**3, 5: 2.0**12}  # iteration 3 is a NaN step; 5 a tensor
    scaler = FP8GradScaler(init_scale=MU0, growth_interval=3)
    ours = _train_with_new_scales(scaler, new_scales)
    theirs = _train_with_new_scales(torch.amp.GradScaler("cpu", init_scale=MU0, growth_interval=3), new_scales)
    assert ours[0] == theirs[0]
    assert ours[0][1] == 2.0**10 and ours[0][3] == 2.0**3
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a, b)
    assert [e["scale"] for e in scaler.history if e["action"] == "set"] == [2.0**10, 2.0**3, 2.0**12]
    assert scaler.is_enabled() is True


@pytest.mark.parametrize(
    ("new_scale", "error", "match"),
    [
        (3.0, ValueError, r"power of two .*nearest is 2\*\*2"),
        (-4.0, ValueError, "power of two"),
        (math.inf, ValueError, "power of two"),
        (2.0**30, ValueError, r"outside this scaler's \[min_scale, max_scale\]"),
        ("8", TypeError, "must be a number"),
        (torch.tensor([2.0, 4.0]), TypeError, "one floating-point element"),
    ],
)
def test_update_with_a_bad_new_scale_is_refused_before_anything_changes(new_scale, error, match):
    model = _model()
    scaler = FP8GradScaler(init_scale=MU0, max_scale=2.0**20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale_loss(model(_x()).square().mean()).backward()
    scaler.step(opt)
    with pytest.raises(error, match=match):
        scaler.update(new_scale)
    assert scaler.get_scale() == MU0 and scaler.history == ()
    scaler.update()  # the step's update is still to make
    assert scaler.history == () and scaler.get_scale() == MU0


def test_step_with_a_closure_is_refused_as_torch_amp_refuses_it():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        return model(_x()).sum()

    for scaler in (FP8GradScaler(init_scale=MU0), torch.amp.GradScaler("cpu", init_scale=MU0)):
        _scale(scaler, model(_x()).sum()).backward()
        with pytest.raises((TypeError, RuntimeError), match="[Cc]losure"):
            scaler.step(opt, closure=closure)
    with pytest.raises(TypeError, match="closure is not supported"):
        FP8GradScaler(init_scale=MU0).step(opt, closure)  # positional too (torch.amp passes it on to the step)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
