"""The FP8 weight copy FP8AdamW(emit_fp8_weights=True) writes in its step: the forward uses it instead of casting,
training is unchanged (two passes: bit for bit), and any other change of the weight invalidates it."""

import copy
import io

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from lightning_fp8 import (
    FP8MLP,
    FP8AdamW,
    FP8GradScaler,
    convert_to_fp8,
    fp8_modules,
    fp8_state_dict,
    load_fp8_state_dict,
    weight_cache,
)
from lightning_fp8.optim import master
from lightning_fp8.scaling import ScalingState
from tests.core.gpt_tiny import TinyGPT, batches, train
from tests.core.test_optim import _one_thread

__all__ = ["_one_thread"]  # the module-scoped fixture, re-used

# One pass: the copy's scale comes from an upper bound of the weight's amax, at times a binade below the forward's
# current scale, so those copies carry one bit less precision; the tiny GPT's losses over 30 steps measured within
# 9e-5 of the casting run (both start equal). The bound leaves about 10x margin.
ONE_PASS_LOSS_TOL = 1e-3
STATS = ("amax", "scale", "saturation", "amax_history", "nonfinite_count", "casts")


@pytest.fixture
def weight_casts(monkeypatch):
    """Counts the weight casts the forwards run (ScalingState.quantize on a weight role)."""
    calls = []
    original = ScalingState.quantize

    def quantize(self, x, *args, **kwargs):
        if self.amax_history.numel() == 1 and not self.delayed:  # the weight role: history 1, current scaling
            calls.append(self)
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(ScalingState, "quantize", quantize)
    return calls


def _gpt(base):
    # Converted after the copy: deepcopy does not copy the attributes FP8Linear and FP8AdamW set on parameters.
    return convert_to_fp8(copy.deepcopy(base), module_filter_fn=lambda m, fqn: "head" not in fqn)


def _drop_all(model):
    for p in model.parameters():
        weight_cache.drop(p)


def _weights(model):
    return [m.weight for m in fp8_modules(model).values()]


@pytest.mark.parametrize("opt_level", ["O2", "O1"])
def test_two_pass_training_with_the_copy_is_bit_identical(opt_level, weight_casts):
    base = TinyGPT(n_layer=1, n_embd=48)
    runs = {}
    for emit in (False, True):
        model = _gpt(base)
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, grad_scaler=scaler, opt_level=opt_level,
                       scale_update="two_pass", emit_fp8_weights=emit)  # fmt: skip
        weight_casts.clear()
        runs[emit] = (train(model, opt, batches(12), scaler), model, len(weight_casts))
    (losses, model, casts), (losses_e, model_e, casts_e) = runs[False], runs[True]
    n = len(_weights(model))
    assert casts == 12 * n and casts_e == n  # with the copy, only the first forward casts
    assert torch.equal(losses, losses_e)
    for a, b in zip(model.parameters(), model_e.parameters(), strict=True):
        assert torch.equal(a, b)
    for (name, m), m_e in zip(fp8_modules(model).items(), fp8_modules(model_e).values(), strict=True):
        for key in STATS:  # the statistics monitoring sees are the same numbers
            assert torch.equal(getattr(m.fp8_scaling["weight"], key), getattr(m_e.fp8_scaling["weight"], key)), name
    assert losses[-3:].mean() < losses[:3].mean()


def test_one_pass_training_with_the_copy_stays_close(weight_casts):
    torch.manual_seed(0)  # (the model's initialization otherwise depends on the tests run before)
    base = TinyGPT(n_layer=1, n_embd=48)
    losses = {}
    for emit in (False, True):
        model = _gpt(base)
        opt = FP8AdamW(model.parameters(), lr=3e-3, emit_fp8_weights=emit)
        losses[emit] = train(model, opt, batches(30))
    assert (losses[True] - losses[False]).abs().max() < ONE_PASS_LOSS_TOL
    assert losses[True][0] == losses[False][0]


def _emitted(seed=0, **kwargs):
    """A small FP8 MLP after one emitting step: (model, optimizer, data)."""
    torch.manual_seed(seed)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=True, **kwargs)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    return model, opt, x


def _valid(model):
    return [weight_cache.lookup(m.weight, m.fp8_scaling["weight"]) is not None for m in fp8_modules(model).values()]


def _change_by_load_state_dict(model, opt):
    sd = model.state_dict()
    sd["0.weight"] = sd["0.weight"] * 1.5
    model.load_state_dict(sd)


def _change_by_copy(model, opt):
    with torch.no_grad():
        model[0].weight.copy_(model[0].weight * 2)


def _change_by_data(model, opt):
    model[0].weight.data = model[0].weight.data.clone()


def _change_by_optimizer_load(model, opt):
    sd = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(sd)


def _change_by_step_without_emit(model, opt):
    opt.emit_fp8_weights = False
    ((model(torch.randn(8, 32)) - 1) ** 2).mean().backward()
    opt.step()


@pytest.mark.parametrize("kernels", ["reference", "triton"])  # a Triton write bumps no version counter by itself
@pytest.mark.parametrize(
    "change",
    [_change_by_load_state_dict, _change_by_copy, _change_by_data, _change_by_optimizer_load,
     _change_by_step_without_emit],
    ids=["load_state_dict", "copy_", "data", "optimizer_load_state_dict", "step_without_emit"],
)  # fmt: skip
def test_any_other_change_of_the_weight_invalidates_the_copy(change, kernels, monkeypatch, weight_casts):
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    model, opt, x = _emitted()
    assert _valid(model) == [True, True]
    change(model, opt)
    valid = _valid(model)
    assert not valid[0]
    if change in (_change_by_copy, _change_by_data):  # the other layer's weight did not change: its copy is valid
        assert valid[1]
    weight_casts.clear()
    model(x)  # the forward casts the changed weight
    assert model[0].fp8_scaling["weight"] in weight_casts


@pytest.mark.parametrize("change", ["half", "data"])
def test_a_copy_found_invalid_lets_go_of_the_old_weight_storage(change):
    # The copy holds its weight's storage while valid (its address must not be reused); found invalid by a forward, it
    # kept it: after model.half() the old fp32 weights stayed alive beside the new ones until the next emitting step.
    model, opt, x = _emitted(opt_level="O1")
    weight = model[0].weight
    cache = getattr(weight, weight_cache.ATTR)
    old = weight.untyped_storage()
    assert cache._storage is not None and cache._storage.data_ptr() == old.data_ptr()
    if change == "half":
        model.half()
        x = x.half()
    else:
        weight.data = weight.data.clone()
    with torch.no_grad():
        model(x)
    assert cache._storage is None and cache.data_t is None and not _valid(model)[0]
    if change == "data":  # the next emitting step seals the same copy again
        ((model(x) - 1) ** 2).mean().backward()
        opt.step()
        assert getattr(weight, weight_cache.ATTR) is cache and _valid(model) == [True, True]


@pytest.mark.parametrize("opt_level", ["O2", "O1"])
def test_a_write_through_param_data_takes_effect_after_drop(opt_level, weight_casts):
    # An in-place write through param.data bumps no version counter PyTorch keeps (.data is a fresh alias each time):
    # the documented remedy is weight_cache.drop(param), after which the forward casts the written weight, as the same
    # model that never emitted a copy does.
    outputs = []
    for emit in (True, False):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
        opt = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=emit,
                       opt_level=opt_level)  # fmt: skip
        x = torch.randn(24, 32)
        model(x).square().mean().backward()
        opt.step()
        model[0].weight.data.mul_(0.5)  # (at O2 the scaled master: the weight halves all the same)
        weight_cache.drop(model[0].weight)
        weight_casts.clear()
        outputs.append(model(x))
        assert model[0].fp8_scaling["weight"] in weight_casts
    assert torch.equal(*outputs)


@pytest.mark.parametrize("what", ["layer", "name"])
def test_drop_of_something_else_than_the_weight_is_refused(what):
    # Found by a sweep: weight_cache.drop(layer) (the layer for its weight) did nothing, silently, and the forward
    # kept using the copy of the weight as it was before the write through .data.
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48)))
    FP8AdamW(model.parameters(), emit_fp8_weights=True)
    with pytest.raises(TypeError, match=r"weight_cache.drop takes the weight tensor.*drop\(layer.weight\)"):
        weight_cache.drop(model[0] if what == "layer" else "0.weight")


def test_skipped_step_keeps_the_weight_and_a_valid_copy(weight_casts):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    scaler = FP8GradScaler(model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, scale_update="two_pass", emit_fp8_weights=True)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    for bad in (False, True):
        opt.zero_grad()
        loss = ((model(x * (float("inf") if bad else 1.0)) - y) ** 2).mean()
        scaler.scale_loss(loss).backward()
        before = [m.weight.clone() for m in fp8_modules(model).values()]
        opt.step()
    assert scaler.skipped_steps == 1
    assert all(torch.equal(b, m.weight) for b, m in zip(before, fp8_modules(model).values(), strict=True))
    assert _valid(model) == [True, True]
    for m in fp8_modules(model).values():  # the copy is the cast of the weight as it is
        state = copy.deepcopy(m.fp8_scaling["weight"])
        cast = state.quantize(m.weight, False, True, master.master_scale(m.weight))[0]
        assert torch.equal(weight_cache.lookup(m.weight, state).data.view(torch.uint8), cast.view(torch.uint8))
    weight_casts.clear()
    model(x)
    assert weight_casts == []  # served by the copies


def test_copy_is_not_used_when_the_recipe_differs_or_traced(monkeypatch, weight_casts):
    model, _, x = _emitted()
    model[0].fp8_scaling["weight"].margin = 1  # as a layer whose recipe has another margin
    weight_casts.clear()
    model(x)
    assert weight_casts == [model[0].fp8_scaling["weight"]]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert weight_cache.lookup(model[2].weight, model[2].fp8_scaling["weight"]) is None


def test_copy_is_not_saved_and_a_resumed_run_rebuilds_it(weight_casts):
    model, opt, x = _emitted()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert not any("cache" in key for key in saved["model"])
    resumed, ropt, _ = _emitted(seed=3)
    resumed.load_state_dict(saved["model"])
    load_fp8_state_dict(resumed, saved["fp8"])
    ropt.load_state_dict(saved["opt"])
    assert _valid(resumed) == [False, False]  # the forward casts until the next step
    opt.zero_grad()
    ropt.zero_grad()
    for m in (model, resumed):
        ((m(x) - 1) ** 2).mean().backward()
    opt.step()
    ropt.step()
    assert _valid(resumed) == [True, True]
    weight_casts.clear()
    assert torch.equal(model(x), resumed(x)) and weight_casts == []


def test_param_groups_emit_with_their_own_hyper_parameters():
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    groups = [{"params": [model[0].weight], "lr": 1e-2}, {"params": [model[2].weight], "lr": 0.0},
              {"params": [model[0].bias, model[2].bias]}]  # fmt: skip
    opt = FP8AdamW(groups, lr=1e-3, scale_update="two_pass", emit_fp8_weights=True)
    ((model(torch.randn(8, 32)) - 1) ** 2).mean().backward()
    opt.step()
    assert _valid(model) == [True, True]
    assert weight_cache.lookup(model[0].bias, model[0].fp8_scaling["weight"]) is None  # only FP8 weights


def _compile_counted(model, backend):
    counter = CompileCounterWithBackend(backend)
    return torch.compile(model, backend=counter), counter


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("opt_level", ["O2", "O1"])
def test_compiled_training_uses_the_copy_bit_for_bit(opt_level, backend):
    """Compiled, the forwards use the copies the steps write (checked as the code runs) and train bit for bit as the
    same compiled model casting its weights; the copy keeps its key from step to step, so the model compiles twice
    (before the first copy and after) and never again."""
    base = TinyGPT(n_layer=1, n_embd=48)
    runs = {}
    for emit in (False, True):
        torch._dynamo.reset()
        model = _gpt(base)
        opt = FP8AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, opt_level=opt_level, scale_update="two_pass",
                       emit_fp8_weights=emit)  # fmt: skip
        compiled, counter = _compile_counted(model, backend)
        hits = weight_cache.compiled_hits
        runs[emit] = (train(compiled, opt, batches(6)), model, weight_cache.compiled_hits - hits, counter.frame_count)
    (losses, model, no_hits, frames), (losses_e, model_e, hits, frames_e) = runs[False], runs[True]
    assert no_hits == 0 and hits == 5 * len(_weights(model_e))  # every forward after the first step
    assert frames_e == frames  # no compile more than casting (the first forward and its first-cast path: 2)
    assert torch.equal(losses, losses_e)
    for a, b in zip(model.parameters(), model_e.parameters(), strict=True):
        assert torch.equal(a, b)
    for m, m_e in zip(fp8_modules(model).values(), fp8_modules(model_e).values(), strict=True):
        for role in ("input", "weight", "grad_output"):
            for key in STATS:
                assert torch.equal(getattr(m.fp8_scaling[role], key), getattr(m_e.fp8_scaling[role], key)), (role, key)


def _change_by_halving(model, opt):
    # (At O2 the storage holds the weight times its master scale, near fp16's maximum: doubling it would overflow.)
    with torch.no_grad():
        model[0].weight.mul_(0.5)


@pytest.mark.parametrize("change", [_change_by_halving, _change_by_load_state_dict, _change_by_data],
                         ids=["mul_", "load_state_dict", "data"])  # fmt: skip
def test_compiled_forward_casts_a_weight_changed_after_the_step(change):
    """A weight changed after the step that wrote its copy: the compiled forward and backward cast it (the check runs
    with the compiled code, without recompiling) and give what the eager layers give; an unchanged layer's copy is
    still used."""
    torch._dynamo.reset()
    model, opt, x = _emitted()
    compiled, counter = _compile_counted(model, "aot_eager")
    x = x.clone().requires_grad_()
    ((compiled(x) - 1) ** 2).mean().backward()  # compiles with the copies' keys
    opt.zero_grad()
    change(model, opt)
    saved = fp8_state_dict(model)
    hits = weight_cache.compiled_hits
    x.grad = None
    out = compiled(x)
    out.sum().backward()  # dx: model[2]'s dgrad from its copy's transpose (if valid), model[0]'s from its cast again
    # load_state_dict writes every weight; mul_ and .data change model[0]'s alone
    assert weight_cache.compiled_hits - hits == (0 if change is _change_by_load_state_dict else 1)
    # A load also makes the layers' input and grad_output scaling start fresh: their first casts again, which the
    # compiled code guards on (one more compile; mul_ and .data do not restart it).
    assert counter.frame_count == (2 if change is _change_by_load_state_dict else 1)
    load_fp8_state_dict(model, saved)
    x_ref = x.detach().clone().requires_grad_()
    ref = model(x_ref)  # eager: model[0] casts, model[2] uses its copy
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, x_ref.grad)


@pytest.mark.gpu
def test_gpu_compiled_training_with_the_copy_is_bit_identical():
    """On a GPU, compiled by inductor under bf16 autocast (Triton casts, real FP8 GEMMs): training with the copies the
    steps write is bit for bit training that casts the weights, and the compiled forwards use the copies."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    data = [(torch.randn(512, 256, device="cuda"), torch.randn(512, 256, device="cuda")) for _ in range(6)]
    runs = {}
    for emit in (False, True):
        torch._dynamo.reset()
        model = convert_to_fp8(copy.deepcopy(base))
        opt = FP8AdamW(model.parameters(), lr=1e-3, scale_update="two_pass", emit_fp8_weights=emit)
        compiled = torch.compile(model)
        hits = weight_cache.compiled_hits
        losses = []
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ((compiled(x).float() - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs[emit] = (torch.stack(losses), model, weight_cache.compiled_hits - hits)
    (losses, model, _), (losses_e, model_e, hits) = runs[False], runs[True]
    assert hits == 5 * 2
    assert torch.equal(losses, losses_e)
    for a, b in zip(model.parameters(), model_e.parameters(), strict=True):
        assert torch.equal(a, b)


def test_copies_persist_while_emitting_and_are_freed_when_emission_stops():
    """Emitting steps write each weight's copy in place (same object, key and bytes' storage: compiled code keeps its
    guards); a step without emission releases the copies (their memory is freed, the forwards cast)."""
    model, opt, x = _emitted()
    caches = [getattr(w, weight_cache.ATTR) for w in _weights(model)]
    storages = [c.data.data_ptr() for c in caches]
    ((model(x) - 1) ** 2).mean().backward()
    opt.step()
    assert [getattr(w, weight_cache.ATTR) for w in _weights(model)] == caches
    assert [c.data.data_ptr() for c in caches] == storages and _valid(model) == [True, True]
    _change_by_step_without_emit(model, opt)
    assert [getattr(w, weight_cache.ATTR) for w in _weights(model)] == [None, None]


def test_compiled_fp8mlp_uses_the_copies_bit_for_bit():
    """FP8MLP (the GELU fused into its casts) compiled: its two layers' GEMMs go through the copy ops too, and training
    is bit for bit training that casts the weights."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x, y = torch.randn(24, 32), torch.randn(24, 32)
    runs = {}
    for emit in (False, True):
        torch._dynamo.reset()
        src = copy.deepcopy(base)
        model = FP8MLP.from_modules(src[0], src[2])
        opt = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=emit)
        compiled = torch.compile(model, backend="aot_eager")
        hits = weight_cache.compiled_hits
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = ((compiled(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs[emit] = (torch.stack(losses), model, weight_cache.compiled_hits - hits)
    (losses, model, no_hits), (losses_e, model_e, hits) = runs[False], runs[True]
    assert no_hits == 0 and hits == 3 * 2
    assert torch.equal(losses, losses_e)
    for a, b in zip(model.parameters(), model_e.parameters(), strict=True):
        assert torch.equal(a, b)


def cast_and_copy_runs():
    """For a weight's record by the forward's cast (``emit`` False) against its record by FP8AdamW's emitted copy
    (True): an input and ``[(emit, model)]``, two FP8 copies of one small model (seed 0)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
    x = torch.randn(8, 32)
    return x, [(emit, convert_to_fp8(copy.deepcopy(base))) for emit in (False, True)]


@pytest.mark.parametrize("opt_level", ["O2", "O1"])
@pytest.mark.parametrize("scale_update", ["two_pass", "one_pass"])
def test_a_copy_of_an_all_zero_weight_keeps_the_previous_scale(opt_level, scale_update):
    """A cast whose amax is 0 keeps the scale it had (DESIGN.md); the copy of a weight the step zeroed records the
    same statistics as the forward's cast of it, scale included (the step's record carries scale 1)."""
    x, runs = cast_and_copy_runs()
    stats = {}
    for emit, model in runs:
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(model.parameters(), lr=1.0, weight_decay=1.0, grad_scaler=scaler, opt_level=opt_level,
                       scale_update=scale_update, emit_fp8_weights=emit)  # fmt: skip
        scaler.scale_loss(model(x).sum() * 0).backward()  # zero gradients; the forward records each weight's scale
        before = [m.fp8_scaling["weight"].scale.clone() for m in fp8_modules(model).values()]
        opt.step()  # weight * (1 - lr * weight_decay): exactly 0
        assert all(m.weight.count_nonzero() == 0 for m in fp8_modules(model).values())
        assert _valid(model) == [emit, emit]
        model(x)
        stats[emit] = [
            {k: getattr(m.fp8_scaling["weight"], k).clone() for k in STATS} for m in fp8_modules(model).values()
        ]
        assert [s["scale"] for s in stats[emit]] == before and all(b > 1 for b in before)
    for cast, copied in zip(stats[False], stats[True], strict=True):
        for key in STATS:
            assert torch.equal(cast[key], copied[key]), key
