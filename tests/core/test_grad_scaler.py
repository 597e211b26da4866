"""FP8GradScaler: mu halves on planted saturation and non-finite gradients, doubles with headroom, agrees across ranks,
and falls back after repeated non-finite steps."""

import copy
import io
import os
import pickle
import socket
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, FP8Recipe, convert_to_fp8
from lightning_fp8.formats import E4M3, E5M2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tests run thousands of tiny ops; an intra-op thread pool only adds contention (10-40x slower measured on
    # a loaded 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _planted_gradients_carry_mu(scaler):
    """Gradients a test sets in ``param.grad`` stand for those of a scaled loss's backward: say that a loss was scaled
    (its mu is the one they are unscaled by), or ``step()`` refuses them as gradients of an unscaled loss."""
    scaler.scale_loss(torch.zeros(()))


def _record(scaler, amax, n_saturated=0, numel=1000, dtype=E5M2):
    scaler.record_gradient_cast(torch.tensor(float(amax)), torch.tensor(n_saturated), numel, dtype)


def test_planted_saturation_halves_mu():
    scaler = FP8GradScaler(init_scale=2.0**8, saturation_threshold=1e-3)
    _record(scaler, 57344.0, n_saturated=5, numel=1000)  # 0.5% of values at the E5M2 max > 0.1%
    scaler.update()
    assert float(scaler.scale) == 2.0**7
    assert scaler.last_saturation == pytest.approx(5e-3)
    assert scaler.history[-1]["action"] == "halve"
    _record(scaler, 40000.0, n_saturated=1, numel=10_000)  # 0.01%: under the threshold, no change
    scaler.update()
    assert float(scaler.scale) == 2.0**7


def test_headroom_for_growth_interval_doubles_mu():
    scaler = FP8GradScaler(init_scale=1.0, growth_interval=3, headroom=2.0)
    for _ in range(2):
        _record(scaler, 448.0 / 2, dtype=E4M3)  # exactly 2x under the max: headroom
        scaler.update()
    _record(scaler, 300.0, dtype=E4M3)  # less than 2x under: the window restarts
    scaler.update()
    assert scaler.growth_tracker == 0 and float(scaler.scale) == 1.0
    for _ in range(3):
        _record(scaler, 100.0, dtype=E4M3)
        scaler.update()
    assert float(scaler.scale) == 2.0 and scaler.history[-1]["action"] == "double"


def test_scale_is_clamped_to_its_bounds():
    scaler = FP8GradScaler(init_scale=2.0**-2, min_scale=2.0**-2, max_scale=1.0, growth_interval=1)
    _record(scaler, float("inf"))
    scaler.update()
    assert float(scaler.scale) == 2.0**-2
    for _ in range(5):
        _record(scaler, 1.0)
        scaler.update()
    assert float(scaler.scale) == 1.0
    # The history holds what happened: the skip (also at min_scale), then the two doublings up to max_scale; the
    # doublings held at max_scale did not happen and are not recorded.
    assert [(e["action"], e["scale"]) for e in scaler.history] == [("skip", 0.25), ("double", 0.5), ("double", 1.0)]
    scaler = FP8GradScaler(init_scale=2.0**-2, min_scale=2.0**-2, saturation_threshold=1e-3)
    _record(scaler, 57344.0, n_saturated=5, numel=1000)
    scaler.update()
    assert scaler.history == ()


def _fp8_model(seed=0):
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


@pytest.mark.parametrize("plant", [float("inf"), float("nan")])
def test_planted_nonfinite_gradient_skips_the_step_and_halves_mu(plant):
    model = _fp8_model()
    scaler = FP8GradScaler(init_scale=2.0**4, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    opt.zero_grad()
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    opt.step()  # a clean step creates the states
    before = {k: v.clone() for k, v in model.state_dict().items()}
    states = copy.deepcopy(opt.state_dict()["state"])
    opt.zero_grad()
    x_bad = x.clone()
    x_bad[3, 7] = plant  # one poisoned input: its gradients are non-finite
    scaler.scale_loss(((model(x_bad) - y) ** 2).mean()).backward()
    opt.step()
    assert scaler.skipped_steps == 1 and scaler.nonfinite_events == 1
    assert float(scaler.scale) == 2.0**3
    assert scaler.history[-1]["action"] == "skip"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for index, saved in opt.state_dict()["state"].items():
        assert float(saved["step"]) == float(states[index]["step"])  # no step was taken
    # The next clean step goes through.
    opt.zero_grad()
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    opt.step()
    assert scaler.skipped_steps == 1 and not torch.equal(before["0.weight"], model.state_dict()["0.weight"])


def test_plain_optimizer_is_unscaled_and_skipped():
    lin = nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = FP8GradScaler(init_scale=2.0**10)
    x = torch.randn(5, 8)
    ref = copy.deepcopy(lin)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).sum().backward()
    ref_opt.step()
    scaler.scale_loss(lin(x).sum()).backward()
    assert scaler.step(opt) is True
    scaler.update()
    torch.testing.assert_close(lin.weight, ref.weight)  # gradients were divided by mu = 1024 exactly
    opt.zero_grad()
    lin.weight.grad = torch.full_like(lin.weight, float("nan"))
    lin.bias.grad = torch.zeros_like(lin.bias)
    weight = lin.weight.detach().clone()
    assert scaler.step(opt) is False
    scaler.update()
    assert torch.equal(lin.weight.detach(), weight) and float(scaler.scale) == 2.0**9


@pytest.mark.parametrize("kind", ["sgd", "fp8adamw"])
def test_a_second_step_before_update_raises_as_with_torch_amp(kind):
    # torch.amp.GradScaler refuses a second step() of one optimizer before update(); FP8GradScaler unscaled a plain
    # optimizer's gradients again (by mu^2 in all) and stepped again. Refused before anything changes.
    def build(fp8: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16))
        if not fp8:
            return model, torch.optim.SGD(model.parameters(), lr=0.1)
        model = convert_to_fp8(model)
        return model, FP8AdamW(model.parameters(), lr=1e-2)

    x = torch.randn(4, 16)
    ref_model, ref_opt = build(fp8=False)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref.scale(ref_model(x).sum()).backward()
    ref.step(ref_opt)
    with pytest.raises(RuntimeError, match="already been called since the last update") as ref_error:
        ref.step(ref_opt)

    model, opt = build(fp8=kind == "fp8adamw")
    scaler = FP8GradScaler(init_scale=2.0**10)
    scaler.scale_loss(model(x).sum()).backward()
    assert scaler.step(opt)
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # FP8AdamW holds its FP8 gradients itself
    saved_params, saved_grads = _snapshot(model.parameters()), _snapshot(grads)
    with pytest.raises(type(ref_error.value), match="already been called since the last update.*call scaler.update"):
        scaler.step(opt)
    assert _equal(saved_params, model.parameters()) and _equal(saved_grads, grads)
    scaler.update()
    assert scaler.step(opt)  # after an update, the next step is taken


def _snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _equal(saved: list[torch.Tensor], tensors) -> bool:
    return all(torch.equal(u, v.detach()) for u, v in zip(saved, tensors, strict=True))


def test_sparse_gradients_are_unscaled_and_checked_as_with_torch_amp():
    # nn.Embedding(sparse=True) leaves an uncoalesced gradient when an index repeats; FP8GradScaler unscaled a
    # coalesced copy, so SGD stepped with the gradient mu times too large. Against torch.amp.GradScaler, bit for
    # bit, over clean steps and one with a non-finite gradient (skipped by both).
    idx = torch.tensor([1, 2, 1, 3, 1])
    runs = []
    for amp in (True, False):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if amp else FP8GradScaler(init_scale=2.0**10)
        for i in range(3):
            opt.zero_grad()
            loss = emb(idx).square().sum() * (float("inf") if i == 1 else 1.0)
            (scaler.scale(loss) if amp else scaler.scale_loss(loss)).backward()
            assert not emb.weight.grad.is_coalesced()
            scaler.step(opt)
            scaler.update()
        runs.append((emb.weight.detach().clone(), scaler.get_scale()))
    (ref_weight, ref_scale), (weight, scale) = runs
    assert torch.equal(weight, ref_weight) and scale == ref_scale == 2.0**9


def test_sparse_fp16_gradients_are_refused_as_with_torch_amp():
    # fp16 gradients of a plain optimizer are refused (unscaling them in fp16 loses what mu made representable),
    # sparse ones too, as torch.amp refuses them: uncoalesced, left as they were.
    emb = nn.Embedding(4, 2, sparse=True).half()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    index = torch.tensor([[1, 1]])
    values = torch.full((2, 2), 40000.0, dtype=torch.float16)
    emb.weight.grad = torch.sparse_coo_tensor(index, values, emb.weight.shape, check_invariants=True)
    weight = emb.weight.detach().clone()
    scaler = FP8GradScaler(init_scale=2.0**4)
    with pytest.raises(ValueError, match="fp16 gradients"):
        scaler.step(opt)
    assert torch.equal(emb.weight.detach(), weight) and not emb.weight.grad.is_coalesced()
    assert torch.equal(emb.weight.grad._values(), values) and scaler.state_dict() == FP8GradScaler(2.0**4).state_dict()


def test_sparse_gradients_alone_grow_mu_as_with_torch_amp():
    # A model whose only gradients are sparse (nn.Embedding(sparse=True) and SGD): the scaler measured the headroom
    # of dense gradients only, saw none, and never grew mu; torch.amp.GradScaler grows it every growth_interval steps.
    idx = torch.tensor([1, 2, 1, 3])
    scales = []
    for amp in (True, False):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        kwargs = {"init_scale": 2.0, "growth_interval": 2}
        scaler = torch.amp.GradScaler("cpu", **kwargs) if amp else FP8GradScaler(**kwargs)
        for _ in range(4):
            opt.zero_grad()
            loss = emb(idx).square().sum()
            (scaler.scale(loss) if amp else scaler.scale_loss(loss)).backward()
            assert emb.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
        scales.append(float(scaler.get_scale()))
    assert scales[1] == scales[0] == 8.0


def test_a_saved_scale_outside_this_scalers_bounds_is_brought_within_them():
    saved = FP8GradScaler(init_scale=2.0**20).state_dict()
    other = FP8GradScaler(init_scale=1.0, max_scale=2.0**10)
    with pytest.warns(UserWarning, match="outside this scaler's"):
        other.load_state_dict(saved)
    assert float(other.scale) == 2.0**10
    low = FP8GradScaler(init_scale=2.0**-28, min_scale=2.0**-30).state_dict()
    resumed = FP8GradScaler()  # min_scale 2**-24
    with pytest.warns(UserWarning, match="outside this scaler's"):
        resumed.load_state_dict(low)
    assert float(resumed.scale) == 2.0**-24


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_high_precision_gradients_grow_mu_with_headroom_under_their_dtype(dtype):
    # No FP8 cast reports a gradient (a plain optimizer, or FP8AdamW with fp8_grads=False): the scaler measures the
    # gradients itself, so mu still doubles after growth_interval clean steps, and stops where fp16 would overflow.
    # (fp16 parameters through FP8AdamW: a plain optimizer's fp16 gradients are refused.)
    lin = nn.Linear(8, 4).to(dtype)
    scaler = FP8GradScaler(init_scale=1.0, growth_interval=2)
    _planted_gradients_carry_mu(scaler)
    if dtype == torch.float32:
        opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    else:
        opt = FP8AdamW(lin.parameters(), lr=0.0, grad_scaler=scaler, fp8_grads=False)
    for _ in range(4):
        opt.zero_grad()
        lin.weight.grad = torch.randn_like(lin.weight) * float(scaler.scale)
        lin.bias.grad = torch.randn_like(lin.bias) * float(scaler.scale)
        assert scaler.step(opt) is True
        scaler.update()
    assert float(scaler.scale) == 4.0  # doubled at steps 2 and 4
    lin.weight.grad = torch.full_like(lin.weight, 40000.0)  # fp16: less than 2x under 65504; fp32: far under
    assert scaler.step(opt) is True
    scaler.update()
    assert scaler.growth_tracker == (1 if dtype == torch.float32 else 0)


def test_fp8adamw_without_fp8_gradients_grows_mu_back_after_a_nonfinite_step():
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
    scaler = FP8GradScaler(init_scale=2.0**4, growth_interval=2, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=False)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for step in range(5):
        scaler.scale_loss(((model(x) - y) ** 2).mean() * (float("nan") if step == 0 else 1.0)).backward()
        opt.step()
        opt.zero_grad()
    assert scaler.skipped_steps == 1
    assert float(scaler.scale) == 2.0**5  # halved once, then doubled twice


def test_mu_change_rescales_grad_output_states_exactly():
    model = _fp8_model()
    scaler = FP8GradScaler(init_scale=2.0**4, model=model, saturation_threshold=0.0)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    opt.step()
    state = model[0].fp8_scaling["grad_output"]
    history, scale = state.amax_history.clone(), state.scale.clone()
    _record(scaler, 57344.0, n_saturated=1, numel=10)  # saturation: mu halves
    scaler.update()
    assert float(scaler.scale) == 2.0**3
    assert torch.equal(state.amax_history, history / 2) and torch.equal(state.scale, scale * 2)


def test_an_integrations_model_is_replaced_by_the_next_one_and_a_users_model_stays():
    first, second, mine = _fp8_model(), _fp8_model(), _fp8_model()
    scaler = FP8GradScaler()
    scaler._take_model(first)
    assert scaler.model is first
    scaler._take_model(second)  # a second training: mu changes must rescale the model being trained
    assert scaler.model is second
    restored = pickle.loads(pickle.dumps(scaler))  # spawned processes keep the rule
    restored._take_model(first)
    assert restored.model is first
    scaler.model = mine  # set by the user: stays
    scaler._take_model(first)
    assert scaler.model is mine
    given = FP8GradScaler(model=mine)
    given._take_model(first)
    assert given.model is mine
    given.model = None  # cleared by the user: the next integration's model is taken again
    given._take_model(first)
    assert given.model is first


def test_a_scaler_pickled_before_model_was_a_property_loads():
    scaler = FP8GradScaler()
    state = scaler.__getstate__()
    state["model"] = state.pop("_model")
    del state["_model_from_integration"]
    old = FP8GradScaler.__new__(FP8GradScaler)
    old.__setstate__(state)
    assert old.model is None
    old._take_model(model := _fp8_model())
    assert old.model is model


def test_mu_change_keeps_grad_output_scales_in_range():
    # Output gradients of about 1e-36 (finite, normal fp32) give the grad_output scale compute_scale's upper clamp,
    # 2**127. A non-finite step halves mu; dividing that scale by 1/2 made it inf, every later gradient NaN and every
    # later step skipped. The scale stays at the clamp, as compute_scale would give for the halved history.
    # O1: fp32 weight gradients (at O2 gradients this small are fp16 zeros, and mu grows 16x per step for them).
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), FP8Recipe(opt_level="O1"))
    scaler = FP8GradScaler(init_scale=1.0, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=False, opt_level="O1")
    state = model[0].fp8_scaling["grad_output"]

    def step(factor: float) -> None:
        scaler.scale_loss(model(torch.randn(4, 16)).sum() * 1e-36 * factor).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step(1.0)
    assert float(state.scale) == 2.0**127
    step(float("inf"))
    assert scaler.skipped_steps == 1 and float(scaler.scale) == 0.5
    assert float(state.scale) == 2.0**127
    for _ in range(3):
        step(1.0)
    assert scaler.skipped_steps == 1  # the clean steps are taken
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lower_lr_fallback_after_repeated_nonfinite_steps():
    p = nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = FP8GradScaler(nonfinite_fallback="lower_lr", fallback_after=3, lr_factor=0.5)
    _planted_gradients_carry_mu(scaler)
    for i in range(3):
        p.grad = torch.full_like(p, float("inf"))
        assert scaler.step(opt) is False
        scaler.update()
        assert opt.param_groups[0]["lr"] == (0.05 if i == 2 else 0.1)
    assert scaler.history[-1]["action"] == "fallback" and "learning rate" in scaler.history[-1]["reason"]
    assert scaler.skipped_steps == 3


def test_update_finishes_the_step_when_the_fallback_raises():
    # A fallback that cannot act raises (recovery refuses DTensor and DDP models before changing anything): the error
    # reaches the caller, and the scaler is left as after any skipped step, as one without a fallback is; the next
    # finite step is taken (it used to be skipped, and every one after it, on the non-finite flags never reset).
    def refuse(scaler, optimizer):
        raise ValueError("refused: nothing was changed")

    runs = []
    for fallback in (refuse, None):
        p = nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = FP8GradScaler(init_scale=2.0**4, nonfinite_fallback=fallback, fallback_after=1)
        _planted_gradients_carry_mu(scaler)
        p.grad = torch.full_like(p, float("inf"))
        assert scaler.step(opt) is False
        if fallback is None:
            scaler.update()
        else:
            with pytest.raises(ValueError, match="refused"):
                scaler.update()
        p.grad = torch.full_like(p, 8.0)
        stepped = scaler.step(opt)
        scaler.update()
        runs.append((stepped, p.detach().clone(), scaler.state_dict()))
    (stepped, weight, state), (ref_stepped, ref_weight, ref_state) = runs
    assert stepped and ref_stepped and torch.equal(weight, ref_weight)
    assert state == ref_state and state["scale"] == 2.0**3 and state["skipped_steps"] == 1


@pytest.mark.parametrize("spelling", ["scaler.step", "optimizer.step"])
def test_lr_schedulers_and_step_hooks_see_the_steps_as_with_torch_amp(spelling):
    # torch.amp.GradScaler.step runs optimizer.step(), which an LR scheduler's wrapper marks as called (no warning
    # "lr_scheduler.step() before optimizer.step()") and step hooks see, once per step taken: not on the skipped
    # second iteration. FP8GradScaler.step(FP8AdamW) ran the update past optimizer.step(): the scheduler warned and
    # hooks saw nothing. FP8AdamW.step() (which routes through the scaler) runs its hooks once per call.
    def run(amp: bool) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32))
        if amp:
            scaler, opt = torch.amp.GradScaler("cpu", init_scale=2.0**4), torch.optim.AdamW(model.parameters())
        else:
            model, scaler = convert_to_fp8(model), FP8GradScaler(init_scale=2.0**4)
            opt = FP8AdamW(model.parameters(), grad_scaler=scaler)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        hooks = []
        opt.register_step_post_hook(lambda *_: hooks.append(1))
        x = torch.randn(8, 32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                loss = model(x).square().mean() * (float("nan") if i == 1 else 1.0)
                (scaler.scale(loss) if amp else scaler.scale_loss(loss)).backward()
                if amp or spelling == "scaler.step":
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
                scheduler.step()
        warned = [str(w.message)[:60] for w in caught if "lr_scheduler.step()" in str(w.message)]
        return len(hooks), warned, opt.param_groups[0]["lr"]

    hooks, warned, lr = run(amp=False)
    ref_hooks, ref_warned, ref_lr = run(amp=True)
    assert warned == ref_warned == [] and lr == ref_lr
    assert hooks == (ref_hooks if spelling == "scaler.step" else 3) and ref_hooks == 2


def test_bf16_fallback_puts_offending_layer_back_to_high_precision():
    model = _fp8_model()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    for _ in range(2):
        opt.zero_grad()
        hidden = model[1](model[0](x)).detach()  # only the last layer gets (non-finite) gradients
        scaler.scale_loss(((model[2](hidden) - y) ** 2).mean() * float("inf")).backward()
        opt.step()
    assert isinstance(model[0], FP8Linear) and type(model[2]) is nn.Linear
    assert model[2].weight.dtype == torch.float32
    assert "2" in scaler.history[-1]["reason"]
    opt.zero_grad()
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    opt.step()  # trains on, the released weight with fp32 states
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.float32


def test_bf16_fallback_with_several_processes_is_refused_on_every_rank_alike(monkeypatch):
    """Found by the twenty-third session's sweep: under DDP/FSDP each rank chose the layers to put back from its own
    gradients (one rank lowered the LR, another swapped a layer, then the ranks hung). The fallback runs at the same
    step on every rank (the skip decision is agreed), and there it now raises on every rank, changing no layer."""
    import lightning_fp8.grad_scaling.rules as scale_rules_module

    model = _fp8_model()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=1)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    x = torch.randn(24, 32)
    scaler.scale_loss(model(x).sum() * float("inf")).backward()
    # As on rank r of 2 whose peer saw the same (the agreeing all-reduce then sums one rank's counts: enough here).
    dist = scale_rules_module.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)
    with pytest.raises(ValueError, match=r"nonfinite_fallback='bf16'\) cannot run with 2 processes.*'lower_lr'"):
        opt.step()
    assert all(isinstance(model[i], FP8Linear) for i in (0, 2))


def test_state_dict_round_trip_with_weights_only():
    scaler = FP8GradScaler(init_scale=2.0**6, growth_interval=2)
    _record(scaler, float("nan"))
    scaler.update()
    _record(scaler, 10.0)
    scaler.update()
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    other = FP8GradScaler()
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.state_dict() == scaler.state_dict()
    assert float(other.scale) == 2.0**5 and other.skipped_steps == 1 and other.growth_tracker == 1
    with pytest.raises(KeyError, match="missing entries"):
        other.load_state_dict({"scale": 1.0})


_SAVED = {"step": 3, "action": "skip", "reason": "non-finite gradient", "scale": 2.0**9}


@pytest.mark.parametrize(
    ("entry", "value", "error", "named"),
    [
        ("growth_tracker", None, TypeError, "growth_tracker"),
        ("growth_tracker", 1.7, TypeError, "growth_tracker"),
        ("steps", -5, ValueError, "steps"),
        ("consecutive_nonfinite", True, TypeError, "consecutive_nonfinite"),
        ("last_saturation", "x", TypeError, "last_saturation"),
        ("last_saturation", 1.5, ValueError, "last_saturation"),
        ("scale", float("inf"), ValueError, "scale"),
        ("scale", 0.0, ValueError, "scale"),
        ("history", [1, 2], TypeError, "history"),
        ("history", [{"step": 3}], TypeError, "history"),
        ("history", [{**_SAVED, "scale": None}], TypeError, "history scale"),
        ("history", [{**_SAVED, "step": -1}], ValueError, "history step"),
    ],
)
def test_a_bad_state_dict_entry_raises_naming_it_and_loads_nothing(entry, value, error, named):
    # A bad entry used to raise a bare TypeError or ValueError after the scale was already loaded, and negative or
    # fractional counters were loaded. Every entry is checked first: the scaler is left exactly as it was.
    saved = FP8GradScaler(init_scale=2.0**10)
    _record(saved, float("nan"))
    saved.update()
    scaler = FP8GradScaler(init_scale=4.0)
    before = scaler.state_dict()
    with pytest.raises(error, match=f"entry '{named}' is .*FP8GradScaler.state_dict"):
        scaler.load_state_dict({**saved.state_dict(), entry: value})
    assert scaler.state_dict() == before and scaler.loss_scale == 4.0


@pytest.mark.parametrize("state", [None, [1, 2]])
def test_a_state_dict_that_is_not_a_dict_is_refused_clearly(state):
    # None raised a raw "'NoneType' object is not iterable"; a list a KeyError listing every entry as missing.
    scaler = FP8GradScaler(init_scale=4.0)
    with pytest.raises(TypeError, match=f"got {type(state).__name__}, expected the dict .*Nothing was loaded"):
        scaler.load_state_dict(state)
    with pytest.raises(TypeError, match="expected the dict"):
        scaler.check_state_dict(state)
    assert scaler.get_scale() == 4.0


def test_check_state_dict_raises_what_load_raises_and_changes_nothing():
    saved = FP8GradScaler(init_scale=2.0**10).state_dict()
    scaler = FP8GradScaler(init_scale=4.0)
    scaler.check_state_dict(saved)
    assert scaler.get_scale() == 4.0
    with pytest.raises(ValueError, match="entry 'steps' is -1"):
        scaler.check_state_dict({**saved, "steps": -1})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 3.0}, "power of two"),
        ({"min_scale": 4.0}, "min_scale <= init_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"saturation_threshold": 1.5}, "saturation_threshold"),
        ({"headroom": 0.5}, "headroom"),
        ({"nonfinite_fallback": "restart"}, "nonfinite_fallback"),
        ({"nonfinite_fallback": "bf16"}, "needs the model"),
        # ... and names Lightning's way, where the model is converted inside the fit (test_precision.py runs it)
        ({"nonfinite_fallback": "bf16"}, r"FP8LMPrecision\(grad_scaler=\{'nonfinite_fallback': 'bf16'\}\)"),
        # mu multiplies the loss in fp32: 2**-200 is 0 there (every gradient 0), 2**200 inf
        ({"min_scale": 2.0**-200}, r"min_scale=.*from 2\*\*-126 to 2\*\*127"),
        ({"max_scale": 2.0**200}, r"max_scale=.*from 2\*\*-126 to 2\*\*127"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8GradScaler(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_interval": True}, "growth_interval=True.*an int >= 1"),
        ({"fallback_after": True}, "fallback_after=True.*an int >= 1"),
        ({"headroom": True}, "headroom=True.*a number >= 1"),
        ({"saturation_threshold": "0.1"}, r"saturation_threshold='0.1'.*a number in \[0, 1\)"),
        ({"lr_factor": "0.5"}, r"lr_factor='0.5'.*a number in \(0, 1\)"),
        ({"headroom": "2"}, "headroom='2'.*a number >= 1"),
    ],
)
def test_bool_and_string_arguments_raise_type_errors_naming_the_field(kwargs, match):
    # True would pass the range checks as 1; a string would fail them with a bare comparison TypeError.
    with pytest.raises(TypeError, match=match):
        FP8GradScaler(**kwargs)


def test_scale_bounds_at_the_fp32_normal_range_are_accepted():
    scaler = FP8GradScaler(init_scale=1.0, min_scale=2.0**-126, max_scale=2.0**127)
    assert (scaler.min_scale, scaler.max_scale) == (2.0**-126, 2.0**127)


def test_a_process_group_that_is_not_one_is_refused():
    # It was kept, and failed only inside the first collective (or, with one process, never).
    with pytest.raises(TypeError, match=r"process_group=\.\.\.\) got a str: pass a process group"):
        FP8GradScaler(process_group="world")


def test_an_unconvertible_saved_scale_is_a_value_error_naming_the_entry():
    scaler = FP8GradScaler(init_scale=4.0)
    saved = scaler.state_dict()
    with pytest.raises(ValueError, match="entry 'scale' is .*Nothing was loaded"):
        scaler.load_state_dict({**saved, "scale": 2**2000})  # an int beyond float64: OverflowError before
    assert scaler.get_scale() == 4.0


def test_step_and_scale_loss_refuse_what_they_cannot_take():
    scaler = FP8GradScaler()
    with pytest.raises(TypeError, match=r"step\(optimizer\) takes the optimizer .* got NoneType"):
        scaler.step(None)
    for loss in (torch.tensor(3), torch.tensor(1.0 + 2.0j)):  # no backward through either
        with pytest.raises(TypeError, match="takes a real floating-point loss"):
            scaler.scale_loss(loss)


@pytest.mark.parametrize("model", [42, "net", [nn.Linear(4, 4)]], ids=["int", "str", "list"])
def test_a_model_that_is_not_a_module_is_refused_when_given(model):
    # It was kept, and the first change of mu failed inside update() ("'int' object has no attribute
    # 'named_modules'") after the scale had changed.
    with pytest.raises(TypeError, match=r"FP8GradScaler\(model=\.\.\.\) got a .*expected the FP8 model"):
        FP8GradScaler(model=model)
    scaler = FP8GradScaler()
    with pytest.raises(TypeError, match="expected the FP8 model"):
        scaler.model = model
    assert scaler.model is None


def test_numpy_scales_are_taken_and_an_infinite_headroom_is_refused():
    # np.float32 / np.int64 scales were refused as "must be a number"; headroom=inf was taken, and mu never grew.
    np = pytest.importorskip("numpy")
    scaler = FP8GradScaler(init_scale=np.float32(2.0), min_scale=np.int64(1), max_scale=np.float32(2.0**10))
    assert (scaler.get_scale(), scaler.min_scale, scaler.max_scale) == (2.0, 1.0, 1024.0)
    for headroom in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"headroom=.*must be finite and >= 1"):
            FP8GradScaler(headroom=headroom)


@pytest.mark.parametrize("recipe, model_given, warned", [("fp8-lm", False, 1), ("fp8-lm", True, 0),
                                                         ("fp8-lm-current", False, 0)])  # fmt: skip
def test_a_scaler_without_model_warns_once_where_delayed_grad_output_scales_would_lag_mu(recipe, model_given, warned):
    """Found by the sweep of the optimizer side: FP8GradScaler() without model= (the usage in its module docstring and
    in docs/concepts/gradient-scaling.md) left the FP8 layers' delayed grad_output scales at the old mu; after the
    fp16 rule grew mu 16x, 78% of a small MLP's grad_output cast values saturated for several steps, without a word
    (those casts report to no scaler). Warned once, at the first step; not with the model, nor for current scaling,
    whose scales have no history to lag."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), recipe=recipe)
    scaler = FP8GradScaler(model=model if model_given else None)
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler, recipe=recipe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            scaler.scale_loss(model(torch.randn(16, 32)).square().mean() * 1e-3).backward()
            opt.step()
            opt.zero_grad()
    assert scaler.get_scale() > 1.0  # mu changed
    messages = [str(w.message) for w in caught if "FP8GradScaler has no model" in str(w.message)]
    assert len(messages) == warned
    assert all("FP8GradScaler(model=model)" in m for m in messages)


def test_a_scaler_whose_model_holds_none_of_the_optimizers_fp8_weights_warns_at_its_first_step(recwarn):
    # Found by a sweep: model= another model was taken silently; mu changes then rescaled that model's grad_output
    # states, and the trained model's delayed scales lagged mu (as if no model had been given).
    trained, other = _fp8_model(), _fp8_model(1)
    scaler = FP8GradScaler(model=other)
    opt = FP8AdamW(trained.parameters(), lr=1e-3, grad_scaler=scaler)
    for _ in range(2):
        scaler.scale_loss(trained(torch.randn(4, 32)).square().mean()).backward()
        opt.step()
        opt.zero_grad()
    messages = [str(w.message) for w in recwarn if "is a parameter of the scaler's model" in str(w.message)]
    assert len(messages) == 1 and "FP8AdamW's FP8 weights" in messages[0]  # once, at the first step
    recwarn.clear()
    scaler = FP8GradScaler(model=trained)
    opt = FP8AdamW(trained.parameters(), lr=1e-3, grad_scaler=scaler)
    scaler.scale_loss(trained(torch.randn(4, 32)).square().mean()).backward()
    opt.step()
    assert not [w for w in recwarn if "is a parameter of the scaler's model" in str(w.message)]


def test_integer_arguments_take_any_integral_type():
    # numbers.Integral passed the type check, then `isinstance(x, int)` refused it: "growth_interval=np.int64(5):
    # must be an int >= 1". Stored as int: the state dict stays plain Python.
    np = pytest.importorskip("numpy")
    scaler = FP8GradScaler(growth_interval=np.int64(5), fallback_after=np.int32(2))
    assert scaler.growth_interval == 5 and type(scaler.growth_interval) is int
    assert scaler.fallback_after == 2 and type(scaler.fallback_after) is int
    with pytest.raises(ValueError, match="growth_interval"):
        FP8GradScaler(growth_interval=np.int64(0))


_DIST_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from lightning_fp8 import FP8GradScaler
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = FP8GradScaler(init_scale=4.0)
    scaler.scale_loss(torch.zeros(()))  # the planted gradients carry mu, as a scaled backward leaves them
    p.grad = torch.full((4,), float("inf") if rank == 1 else 1.0)  # only rank 1 overflows
    stepped = scaler.step(opt)
    scaler.update()
    print(f"rank{rank} stepped={stepped} scale={float(scaler.scale)} p0={p[0].item()}")
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_ranks_agree_to_skip(tmp_path):
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_DIST_WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    for rank, (out, _) in enumerate(outs):
        assert f"rank{rank} stepped=False scale=2.0 p0=1.0" in out


def test_stepping_an_fp8adamw_that_reports_elsewhere_warns_once():
    """scaler.step(opt) with an FP8AdamW created without grad_scaler=scaler: its FP8 gradient casts report their
    saturation to no scaler, so mu grows until a step overflows. Warned, once per optimizer; a bound one is not."""
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)))
    scaler = FP8GradScaler(init_scale=2.0**4, model=model)
    unbound = FP8AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    for expected in (1, 0):
        scaler.scale_loss(model(x).square().mean()).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert scaler.step(unbound)
        scaler.update()
        unbound.zero_grad()
        assert sum("reports its FP8 gradient casts to no scaler" in str(w.message) for w in caught) == expected
    bound = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
    scaler.scale_loss(model(x).square().mean()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scaler.step(bound)


def test_clip_grad_norm_clips_the_true_gradients_where_torchs_fp16_norm_overflows():
    """O2's fp16 gradients carrying mu: torch.nn.utils.clip_grad_norm_ at mu * max_norm (what the guide said) sums
    each norm in fp16, gets inf and multiplies every gradient by 0. The scaler's clip_grad_norm_ clips them as
    torch clips the true fp32 gradients (the reference), and returns the true norm."""
    torch.manual_seed(0)
    mu = 2.0**16
    true = [torch.randn(64, 64) * 0.1, torch.randn(32) * 0.1]  # each element finite in fp16 times mu, each norm not
    ref = [torch.nn.Parameter(t.clone()) for t in true]
    for p, t in zip(ref, true, strict=True):
        p.grad = t.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    naive = [torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float16)) for t in true]
    for p, t in zip(naive, true, strict=True):
        p.grad = (t * mu).half()
    torch.nn.utils.clip_grad_norm_(naive, mu * 1.0)
    assert all(p.grad.eq(0).all() for p in naive)  # the overflow the guide's old recipe hit
    scaler = FP8GradScaler(init_scale=mu)
    params = [torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float16)) for t in true]
    for p, t in zip(params, true, strict=True):
        p.grad = (t * mu).half()
    norm = scaler.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-3, atol=0)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad.float() / mu, r.grad, rtol=2e-3, atol=1e-6)


def _clipped_sgd_run(unscale: bool, steps: int = 4, bad_step: int | None = None) -> tuple[list[torch.Tensor], object]:
    """SGD with gradient clipping at 1.0: through the scaler (torch.amp's unscale_-then-clip pattern), or with the
    plain loss (the reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = FP8GradScaler(init_scale=2.0**10, growth_interval=1000)
    snapshots = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().sum() * (float("inf") if step == bad_step else 1.0)
        if unscale:
            scaler.scale_loss(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        elif step != bad_step:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad()
        snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return snapshots, scaler


@pytest.mark.parametrize("bad_step", [None, 1])
def test_unscale_then_clip_trains_as_clipping_the_true_gradients(bad_step):
    got, scaler = _clipped_sgd_run(unscale=True, bad_step=bad_step)
    ref, _ = _clipped_sgd_run(unscale=False, bad_step=bad_step)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # mu = 2**10 unscales exactly
    assert scaler.skipped_steps == (0 if bad_step is None else 1)


def test_unscale_refusals():
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = FP8GradScaler(init_scale=4.0)
    scaler.scale_loss(p.sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(4))
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    assert torch.equal(p.detach(), torch.full((4,), 0.9))  # stepped on the gradients unscaled once
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    opt.zero_grad()
    # unscale_ and an update without a step: the next iteration's gradients are unscaled again
    scaler.scale_loss(p.sum()).backward()
    scaler.unscale_(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale_loss(p.sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(4))

    half = nn.Parameter(torch.ones(4, dtype=torch.float16))
    half_opt = torch.optim.SGD([half], lr=0.1)
    scaler.scale_loss(half.float().sum()).backward()
    with pytest.raises(ValueError, match="unscale_: this SGD has fp16 gradients"):
        scaler.unscale_(half_opt)
    assert torch.equal(half.grad, torch.full((4,), 4.0, dtype=torch.float16))  # left as it was

    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    fp8_opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
    scaler.scale_loss(model(torch.randn(4, 16)).sum()).backward()
    with pytest.raises(ValueError, match="clip_grad_norm_"):
        scaler.unscale_(fp8_opt)


def test_unscale_keeps_its_nonfinite_flag_when_clipping_makes_the_gradients_finite():
    """torch.amp.GradScaler skips the step: unscale_ found the inf, which clip_grad_value_ turned into 1.0 before
    step() checked the gradients again. The flag was dropped and the step taken."""
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = FP8GradScaler(init_scale=2.0**10)
    scaler.scale_loss((p * torch.tensor([1.0, 1.0, 1.0, float("inf")])).sum()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_value_([p], 1.0)
    assert torch.isfinite(p.grad).all()
    assert scaler.step(opt) is False
    scaler.update()
    assert torch.equal(p.detach(), torch.ones(4)) and scaler.get_scale() == 2.0**9


def test_unscale_through_an_optimizer_wrapper_unscales_once():
    """Accelerate's and Lightning's optimizer wrappers step the optimizer inside (scaler.step(wrapper.optimizer)):
    unscale_(wrapper) recorded the wrapper, and the step unscaled the gradients a second time."""

    class Wrapper(torch.optim.Optimizer):  # as accelerate.optimizer.AcceleratedOptimizer: .optimizer inside
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = FP8GradScaler(init_scale=2.0**8)
    scaler.scale_loss(p.sum()).backward()
    scaler.unscale_(Wrapper(opt))
    scaler.step(opt)
    assert torch.equal(p.detach(), torch.full((4,), 0.9))
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(ValueError, match="FP8AdamW unscales each gradient"):
        scaler.unscale_(Wrapper(FP8AdamW(model.parameters())))


def test_clip_grad_norm_after_unscale_clips_the_true_gradients():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    sgd = torch.optim.SGD([a], lr=0.1)  # b's optimizer is not unscaled
    scaler = FP8GradScaler(init_scale=2.0**6)
    scaler.scale_loss((a * 12.0).sum() + (b * 12.0).sum()).backward()  # each true gradient norm 24
    scaler.unscale_(sgd)
    assert scaler.grad_factor([a]) == 1.0 and scaler.grad_factor([b]) == 2.0**6
    with pytest.raises(ValueError, match="some of these gradients were unscaled"):
        scaler.clip_grad_norm_([a, b], 1.0)
    norm = scaler.clip_grad_norm_([a], 1.0)
    assert float(norm) == pytest.approx(24.0) and float(a.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    norm = scaler.clip_grad_norm_([b], 1.0)  # still scaled: clipped in true units
    assert float(norm) == pytest.approx(24.0) and float(b.grad.norm()) == pytest.approx(2.0**6, rel=1e-5)


def test_a_fallback_module_and_another_model_are_refused_the_same_one_is_taken():
    """nonfinite_fallback=<module> is "bf16" on that module: a different model= was dropped without a word (mu's
    rescaling and the fallback would then act on the first)."""
    a, b = convert_to_fp8(nn.Sequential(nn.Linear(16, 16))), convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(ValueError, match="two different models; give the model once"):
        FP8GradScaler(nonfinite_fallback=a, model=b)
    for scaler in (FP8GradScaler(nonfinite_fallback=a, model=a), FP8GradScaler(nonfinite_fallback=a)):
        assert scaler.model is a and scaler.nonfinite_fallback == "bf16"


def test_health_config_is_exported_beside_health_monitor():
    import lightning_fp8
    from lightning_fp8 import health

    assert lightning_fp8.HealthConfig is health.HealthConfig and "HealthConfig" in lightning_fp8.__all__
    monitor = lightning_fp8.HealthMonitor(lightning_fp8.HealthConfig(window=5))
    assert monitor.config.window == 5


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((1.0, torch.tensor(0), 10), TypeError, r"record_gradient_cast\(amax=1.0\): pass a tensor"),
        ((torch.tensor(1.0), 0, 10), TypeError, r"record_gradient_cast\(n_saturated=0\): pass a tensor"),
        ((torch.tensor(1.0), torch.tensor(0), -5), ValueError, r"record_gradient_cast\(numel=-5\): .*int >= 0"),
        ((torch.tensor(1.0), torch.tensor(0), 10.0), TypeError, r"record_gradient_cast\(numel=10.0\): .*int >= 0"),
    ],
)
def test_record_gradient_cast_refuses_what_is_not_a_report_and_records_nothing(args, error, match):
    # A Python number failed with "'float' object has no attribute 'detach'"; a negative numel was recorded, and the
    # saturated fraction the next update judged came out negative or past 1.
    scaler = FP8GradScaler()
    with pytest.raises(error, match=match + r".*nothing was recorded"):
        scaler.record_gradient_cast(*args, E5M2)
    with pytest.raises(TypeError, match=r"record_nonfinite\(found=True\): pass a 0-dim tensor"):
        scaler.record_nonfinite(True)
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale_loss(param.sum()).backward()
    assert scaler.step(opt)
    scaler.update()
    assert scaler.last_saturation == 0.0 and scaler.skipped_steps == 0
