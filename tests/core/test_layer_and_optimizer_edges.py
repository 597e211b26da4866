"""Edges between FP8Linear and FP8AdamW found by a sweep of the public API: torch.__future__'s
swap_module_params_on_conversion over an adopted (O2) weight, reset_parameters() of an adopted weight, a conversion
whose result was dropped, pickled and deep-copied optimizers and models, fp8_grads under torch.distributed."""

import contextlib
import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, convert_to_fp8, weight_cache
from lightning_fp8.optim import master
from tests.numerics import assert_same

# nn.Linear's initialization computed in fp32 and stored in fp16 times a power of two: one fp16 rounding.
FP16_ROUNDING_RTOL = 2**-10


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(8, 32, generator=gen) for _ in range(n)]


def _adopted(model: nn.Module) -> list[bool]:
    return [master.master_scale(p) is not None for name, p in model.named_parameters() if name.endswith("weight")]


# -- torch.__future__.set_swap_module_params_on_conversion(True) ------------------------------------------------------


def _train_across(conversion: str, fp8_grads: bool, swap: bool) -> tuple:
    """Three steps at O2, ``conversion`` after the first, with or without swapping."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model = _model()
        opt = FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=fp8_grads)
        held = []
        for i, x in enumerate(_batches(3)):
            if i == 1 and conversion == "half":
                model.half()  # accepted over fp16 masters: the other parameters step in fp16
            elif i == 1 and conversion == "to":
                model.to("cpu")
            elif i == 1:
                model.load_state_dict(_model(seed=1).state_dict())
            model(x).square().mean().backward()
            held.append(model[0].weight.grad is None)  # with fp8_grads, the FP8 gradient hook took it
            opt.step()
            opt.zero_grad()
        return model.state_dict(), opt.state_dict(), model(_batches(1)[0]), held
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)


@pytest.mark.parametrize("fp8_grads", [True, False])
@pytest.mark.parametrize("conversion", ["half", "to", "load_state_dict"])
def test_swapping_params_on_conversion_trains_as_without_swapping(conversion, fp8_grads):
    """Swapping kept the Parameter object but dropped what FP8 training hangs on it: the master scale (the forward and
    state_dict() read the scaled fp16 storage, max |w| 46336 instead of 0.18) and the FP8 gradient hook; with that
    hook, torch refused the swap ("has weakref") after the load had already written the new weight."""
    assert_same(_train_across(conversion, fp8_grads, swap=True), _train_across(conversion, fp8_grads, swap=False))


# -- reset_parameters() of an adopted weight ---------------------------------------------------------------------------


def test_reset_parameters_of_an_adopted_weight_stores_the_new_weight_scaled():
    """It wrote nn.Linear's unscaled initialization into the storage holding weight * master_scale: max |w| 4.8e-7."""
    layer = FP8Linear(64, 48)
    opt = FP8AdamW(layer.parameters(), lr=1e-2)
    ref = nn.Linear(64, 48)
    torch.manual_seed(1)
    layer.reset_parameters()
    torch.manual_seed(1)
    ref.reset_parameters()  # the same random draws, in fp32
    torch.testing.assert_close(layer.state_dict()["weight"], ref.weight.detach(), rtol=FP16_ROUNDING_RTOL, atol=0)
    assert_same(layer.bias.detach(), ref.bias.detach())
    # Stored as a load stores it: FP8AdamW's fp16 master, scaled by a fresh power of two for the new weight.
    assert_same(
        (layer.weight.detach(), master.master_scale(layer.weight), getattr(layer.weight, master.AMAX_ATTR)),
        master.quantize_fp16(ref.weight),
    )
    layer(torch.randn(8, 64)).square().mean().backward()
    opt.step()


# -- adoption follows the FP8 layer -----------------------------------------------------------------------------------


def test_a_weight_is_adopted_only_while_an_fp8_layer_holds_it():
    """convert_to_fp8(model[2]) not assigned back marked the nn.Linear's weight anyway: FP8AdamW made its storage a
    scaled fp16 master, which the model's nn.Linear computed with (output 104448 instead of 0.46)."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    convert_to_fp8(model[2])  # the result is dropped
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = model(x)
        FP8AdamW(model.parameters(), lr=1e-3)
        assert model[2].weight.dtype == torch.float32 and master.master_scale(model[2].weight) is None
        assert_same(model(x), before)
    # Kept: converted in place, assigned back, fused into an FP8MLP, deep-copied (the original gone), unpickled.
    assigned = nn.Sequential(nn.Linear(32, 32))
    assigned[0] = convert_to_fp8(assigned[0])
    fused = FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 32))
    copied = copy.deepcopy(_model())
    buffer = io.BytesIO()
    torch.save(_model(), buffer)
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)
    for kept in (_model(), assigned, fused, copied, unpickled):
        FP8AdamW(kept.parameters(), lr=1e-3)
        assert all(_adopted(kept)), kept


# -- pickling and deep copies ------------------------------------------------------------------------------------------


def _round_trip(obj, how: str):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _steps(model: nn.Module, opt: FP8AdamW, batches: list[torch.Tensor]) -> tuple:
    for x in batches:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), opt.state_dict(), model(batches[0])


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_optimizer_copied_with_its_model_steps_as_the_original(opt_level, how):
    """torch.optim.Optimizer pickles only defaults, state and param_groups: the copy's step() raised AttributeError
    ('_fp8_unscale')."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level, emit_fp8_weights=True)
    batches = _batches(4)
    _steps(model, opt, batches[:2])
    model_copy, opt_copy = _round_trip((model, opt), how)
    assert_same(_steps(model_copy, opt_copy, batches[2:]), _steps(model, opt, batches[2:]))
    assert opt_copy.holds_fp8_grads and model_copy[0].weight.grad is None  # the copy's own FP8 gradient hooks


def test_optimizer_deep_copied_alone_steps_its_copies_of_the_parameters():
    """As torch.optim.AdamW's: the copy holds copies of the parameters. An adopted weight's copy keeps its master
    scale (which nn.Parameter's deep copy drops), so the copy's first step reads the true weight."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    opt_copy = copy.deepcopy(opt)
    copies = [p for group in opt_copy.param_groups for p in group["params"]]
    for optimizer, params in ((opt, list(model.parameters())), (opt_copy, copies)):
        gen = torch.Generator().manual_seed(3)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optimizer.step()
    assert_same(copies, [p.detach() for p in model.parameters()])  # the scaled fp16 masters among them
    assert_same([master.master_scale(p) for p in copies], [master.master_scale(p) for p in model.parameters()])


def test_model_pickled_after_an_emitting_step_loads_and_casts():
    """The FP8 weight copy hangs on the parameter, whose __dict__ torch.save pickles: its int64 record with float32
    views made torch.save(model) fail ("Cannot save multiple tensors or storages that view the same data as different
    types"). It is dropped: the loaded model casts its weights, as the original does without its copies."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, emit_fp8_weights=True)
    _steps(model, opt, _batches(1))
    loaded = _round_trip(model, "torch.save")
    assert weight_cache._cache_of(loaded[0].weight) is None  # pickled, the copy was dropped
    for p in model.parameters():
        weight_cache.drop(p)
    x = torch.randn(8, 32)
    assert_same(loaded(x), model(x))


# -- fp8_grads under torch.distributed ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _process_group(tmp_path):
    """One rank of gloo: what FP8AdamW decides from is whether torch.distributed is initialized."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp8_grads_under_torch_distributed_is_refused_before_anything_changes(tmp_path, opt_level):
    """Its hook took each FP8 weight's gradient before DDP's reducer averaged param.grad: every rank stepped on its
    local gradient and the replicas drifted apart, silently (seen with DDP over 2 gloo ranks)."""
    model = _model()
    with _process_group(tmp_path):
        with pytest.raises(ValueError, match=r"fp8_grads=True\) under torch\.distributed.*fp8_grads=False"):
            FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level, fp8_grads=True)
        assert not any(_adopted(model)) and model[0].weight.dtype == torch.float32
        opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level)  # the default there: fp8_grads=False
        assert not opt.fp8_grads and all(_adopted(model)) == (opt_level == "O2")


def test_fp8_grads_of_an_optimizer_made_before_torch_distributed_refuse_the_first_backward(tmp_path):
    """Created before init_process_group, where fp8_grads defaults to True, then wrapped in DDP: refused at the first
    gradient, before the hook takes it."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    with _process_group(tmp_path):
        ddp = DDP(model)
        with pytest.raises(RuntimeError, match="was created before torch.distributed was initialized"):
            ddp(torch.randn(8, 32)).square().mean().backward()
        assert not opt._pending  # nothing taken


def test_an_adopted_weight_zeroed_in_place_gives_the_bias_and_keeps_its_scale():
    """At O2 the weight's storage is FP8AdamW's scaled fp16 master (weight * master_scale). Zeroed in place (pruned,
    re-initialized by hand), its casts see amax 0, which keeps the stored scale (DESIGN.md): the output is the bias,
    as nn.Linear's, at every forward, and the state saves and loads. Before, each forward multiplied the stored scale
    by the master scale again, to inf, and the outputs became NaN."""
    from lightning_fp8 import fp8_state_dict, load_fp8_state_dict

    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    x = _batches(1)[0]
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    layer, state = model[0], model[0].fp8_scaling["weight"]
    assert getattr(layer.weight, master.SCALE_ATTR) != 1  # the storage holds the weight times a master scale
    with torch.no_grad():
        layer.weight.zero_()
        kept = state.scale.clone()
        for _ in range(8):
            y = layer(x)
            torch.testing.assert_close(y, layer.bias.expand_as(y), rtol=0, atol=0)
            assert torch.equal(state.scale, kept)
    load_fp8_state_dict(model, fp8_state_dict(model))


@pytest.mark.parametrize("what", ["trainable_parameters", "keep_vars", "one_weight"])
def test_saved_fp8_weight_parameters_load_with_weights_only(what, tmp_path):
    """A saved Parameter carries its attributes: the FP8 weight's layer mark was a class of this package, which
    torch.load(weights_only=True) refused (nn.Linear's parameters load). It loads now, as an ordinary parameter with
    the same values; the layers it came from keep their mark."""
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    if what == "trainable_parameters":
        obj = {n: p for n, p in model.named_parameters() if p.requires_grad}
    elif what == "keep_vars":
        obj = model.state_dict(keep_vars=True)
    else:
        obj = model[0].weight
    torch.save(obj, tmp_path / "p.pt")
    loaded = torch.load(tmp_path / "p.pt", weights_only=True)
    pairs = [(loaded, obj)] if what == "one_weight" else [(loaded[k], v) for k, v in obj.items()]
    for got, want in pairs:
        assert torch.equal(got, want)
        assert not master.is_fp8_weight(got)  # no layer holds the loaded copy
    assert master.is_fp8_weight(model[0].weight) and master.is_fp8_weight(model[2].weight)


def test_weights_with_emitted_copies_save_and_load_with_weights_only(tmp_path):
    """A weight whose FP8 copy FP8AdamW(emit_fp8_weights=True) wrote pickled the copy as a function of this package,
    which torch.load(weights_only=True) refused; it loads now, without the copy, with the same values."""
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-3, emit_fp8_weights=True)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert weight_cache._cache_of(model[0].weight) is not None
    params = {n: p for n, p in model.named_parameters()}
    torch.save(params, tmp_path / "p.pt")
    loaded = torch.load(tmp_path / "p.pt", weights_only=True)
    for name, p in params.items():
        assert torch.equal(loaded[name], p) and weight_cache._cache_of(loaded[name]) is None


@pytest.mark.parametrize("scale_update", ["one_pass", "two_pass"])
@pytest.mark.parametrize("how", ["fp8_params", "all_moments"])
def test_finite_gradients_whose_squares_overflow_fp32_leave_the_weights_finite(how, scale_update):
    """|g| ~ 1e19-1e30 is finite in fp32 but g * g is not: the scaled second moment was stored NaN and the weights
    became NaN (5 of 32 at 1e19, every one at 1e20) while torch.optim.AdamW stays finite. Now they move against the
    gradient's sign, by no more than Adam's bounded update, and stay finite."""
    lr = 1e-2
    for magnitude in (1e19, 3e19, 1e30):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4, 8))
        kwargs = {"fp8_params": [p]} if how == "fp8_params" else {"low_precision_moments": "all"}
        opt = FP8AdamW([p], lr=lr, scale_update=scale_update, **kwargs)
        for i in range(3):
            before = p.detach().clone()
            g = torch.randn(4, 8)
            p.grad = g * magnitude
            opt.step()
            step = p.detach() - before
            assert torch.isfinite(p).all(), (magnitude, int((~torch.isfinite(p)).sum()))
            if i == 0:  # Adam's first step is -lr * sign(g) (up to eps and weight decay)
                assert torch.equal(torch.sign(step), -torch.sign(g))
            assert step.abs().max() <= 10 * lr * (1 + p.abs().max() * 2**-10), step.abs().max()  # fp16 master ulp
