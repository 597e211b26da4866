"""fp8_stats reads exactly what the scaling states, the optimizer and the gradient scaler hold."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8GradScaler, FP8Linear, convert_to_fp8, fp8_stats
from lightning_fp8.scaling import ROLES
from lightning_fp8.stats import clean_name


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 32), nn.LayerNorm(32), nn.Linear(32, 10))


def _trained(steps: int = 3) -> nn.Module:
    model = convert_to_fp8(_model())  # the last layer (32 -> 10) stays nn.Linear
    for _ in range(steps):
        model(torch.randn(7, 48) * 3).square().mean().backward()
    return model


def test_layers_mirror_the_scaling_buffers():
    model = _trained()
    stats = fp8_stats(model)
    assert set(stats["layers"]) == {"0", "2"}
    for name, layer in (("0", model[0]), ("2", model[2])):
        assert set(stats["layers"][name]) == set(ROLES)
        for role in ROLES:
            state, got = layer.fp8_scaling[role], stats["layers"][name][role]
            assert got["scale"] == state.scale.item()
            assert got["amax"] == state.amax.item()
            assert got["saturation"] == state.saturation.item()
            assert got["amax_history"] == state.amax_history.tolist()
            assert got["nonfinite_count"] == state.nonfinite_count.item()
            assert got["casts"] == state.casts.item() == 3
    # history of the weight role has length 1 and stays a list
    assert isinstance(stats["layers"]["0"]["weight"]["amax_history"], list)


def test_summary_is_min_max_over_layers():
    model = _trained()
    stats = fp8_stats(model)
    for role in ROLES:
        scales = [model[i].fp8_scaling[role].scale.item() for i in (0, 2)]
        amaxes = [model[i].fp8_scaling[role].amax.item() for i in (0, 2)]
        summary = stats["summary"][role]
        assert summary["scale_min"] == min(scales) and summary["scale_max"] == max(scales)
        assert summary["amax_max"] == max(amaxes)
        assert summary["nonfinite_count"] == 0


def test_saturation_and_nonfinite_are_reported():
    layer = FP8Linear(32, 16, recipe="fp8-lm")
    layer(torch.randn(5, 32))  # first cast: scale from this amax, nothing saturates
    x = torch.randn(5, 32) * 1e4  # delayed scale from the small history: this cast saturates
    layer(x)
    bad = torch.randn(5, 32)
    bad[0, 0] = float("inf")
    layer(bad)
    stats = fp8_stats(layer)["layers"]["root"]["input"]
    assert stats["nonfinite_count"] == 1
    assert fp8_stats(layer)["summary"]["input"]["nonfinite_count"] == 1
    layer.fp8_scaling["input"].reset()
    layer(torch.randn(5, 32))
    layer(x)
    assert fp8_stats(layer)["layers"]["root"]["input"]["saturation"] > 0.5


def test_optimizer_scales_are_collected_by_name():
    model = _trained(1)
    opt = torch.optim.AdamW(model.parameters())
    # An optimizer following DESIGN.md's state layout: one 0-dim fp32 scale per low-precision state tensor.
    w = model[0].weight
    opt.state[w] = {
        "exp_avg_scale": torch.tensor(0.25),
        "exp_avg_sq_scale": torch.tensor(8.0),
        "step": torch.tensor(3.0),
    }
    opt.state[model[2].weight] = {"exp_avg_scale": torch.tensor(4.0)}
    stats = fp8_stats(model, optimizer=opt)["optimizer"]
    assert stats["states"]["0.weight"] == {"exp_avg_scale": 0.25, "exp_avg_sq_scale": 8.0}  # "step" is no scale
    assert stats["summary"]["exp_avg_scale"] == {"min": 0.25, "max": 4.0}


def test_grad_scaler_stats():
    class Scaler:  # the read-only part of the FP8GradScaler contract
        scale = torch.tensor(1024.0)
        skipped_steps = 3
        last_saturation = 2e-6
        nonfinite_events = 1

    stats = fp8_stats(_trained(1), grad_scaler=Scaler())["grad_scaler"]
    assert stats == {"scale": 1024.0, "skipped_steps": 3, "last_saturation": 2e-6, "nonfinite_events": 1}


def test_one_element_tensors_of_any_shape_are_numbers():
    """mu may be any one-element tensor (documented): one of shape (1,) came back as a list, which the Lightning
    scale monitor then failed to log and the Accelerate log values dropped."""

    class Scaler:
        scale = torch.tensor([1024.0])
        skipped_steps = torch.tensor([[3]])
        nonfinite_events = torch.tensor(1)

    stats = fp8_stats(_trained(1), grad_scaler=Scaler())["grad_scaler"]
    assert stats == {"scale": 1024.0, "skipped_steps": 3, "nonfinite_events": 1}
    assert all(type(v) in (int, float) for v in stats.values())


def test_an_fp8_grad_scaler_is_read():
    stats = fp8_stats(_trained(1), grad_scaler=FP8GradScaler(init_scale=2.0**10))["grad_scaler"]
    assert stats == {"scale": 1024.0, "skipped_steps": 0, "last_saturation": 0.0, "nonfinite_events": 0}


def test_torch_grad_scaler_is_refused_up_front_with_what_to_pass():
    """torch.amp.GradScaler has a `scale` too, but a method: refused before anything is read, saying what to pass."""
    with pytest.raises(TypeError) as info:
        fp8_stats(_trained(1), grad_scaler=torch.amp.GradScaler("cpu"))
    message = str(info.value)
    for words in ("fp8_stats(grad_scaler=...)", "torch.amp.GradScaler", "method", "FP8GradScaler", "grad_scaler=None"):
        assert words in message, (words, message)


@pytest.mark.parametrize(
    ("scale", "words"), [(lambda: 1.0, "method"), ("1024", "str"), (torch.ones(2), "shape (2,)"), (True, "bool")]
)
def test_a_scaler_whose_scale_is_not_a_number_is_refused(scale, words):
    class Scaler:
        pass

    scaler = Scaler()
    scaler.scale = scale
    with pytest.raises(TypeError, match="expects an FP8GradScaler") as info:
        fp8_stats(_trained(1), grad_scaler=scaler)
    assert words in str(info.value)


def test_wrapper_names_are_cleaned_and_bad_input_is_rejected():
    assert clean_name("module._fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.attn") == "blocks.0.attn"
    assert set(fp8_stats(nn.DataParallel(_trained(1)))["layers"]) == {"0", "2"}  # DDP's "module." as well
    with pytest.raises(TypeError, match="nn.Module"):
        fp8_stats("model")
    with pytest.raises(TypeError, match="FP8GradScaler"):
        fp8_stats(_trained(1), grad_scaler=object())


def test_stats_do_not_modify_the_model():
    model = _trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from lightning_fp8 import fp8_state_dict

    fp8_before = fp8_state_dict(model)
    stats = fp8_stats(model)
    stats["layers"]["0"]["input"]["amax_history"].clear()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    for k, v in fp8_state_dict(model).items():
        assert torch.equal(v, fp8_before[k])


@pytest.mark.parametrize("wrap", ["plain", "module", "compiled"])
def test_user_layer_names_ending_in_fp8_scaling_are_kept(wrap):
    # Only the "fp8_scaling" container an FP8 layer adds is stripped, never part of the user's own layer name.
    names = ["head_fp8_scaling", "head_", "fp8_scaling", "fp8_scalingx"]
    model = convert_to_fp8(nn.ModuleDict({n: nn.Linear(16, 16 * (i + 1)) for i, n in enumerate(names)}))
    for _ in range(2):
        model["head_fp8_scaling"](torch.randn(4, 16))  # only this layer runs
    model["fp8_scaling"](torch.randn(4, 16))
    # Reference: the FP8 layers named by named_modules(), each with its own buffers.
    expected = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert sorted(expected) == sorted(names)
    wrapped = {"plain": model, "module": nn.DataParallel(model), "compiled": torch.compile(model)}[wrap]
    layers = fp8_stats(wrapped)["layers"]
    assert sorted(layers) == sorted(names)
    for name, layer in expected.items():
        for role in ROLES:
            assert layers[name][role]["casts"] == layer.fp8_scaling[role].casts.item()
            assert layers[name][role]["scale"] == layer.fp8_scaling[role].scale.item()
    assert layers["head_fp8_scaling"]["input"]["casts"] == 2 and layers["head_"]["input"]["casts"] == 0


@pytest.mark.parametrize("wrap", ["plain", "module", "compiled"])
def test_a_bare_fp8_layer_is_root(wrap):
    layer = FP8Linear(16, 16, recipe="fp8-lm")
    layer(torch.randn(4, 16))
    wrapped = {"plain": layer, "module": nn.DataParallel(layer), "compiled": torch.compile(layer)}[wrap]
    assert list(fp8_stats(wrapped)["layers"]) == ["root"]


def test_layers_whose_clean_names_would_collide_keep_their_full_names():
    """A user's own child named "module" (not a DDP wrapper) beside a layer of the same name outside it: clean_name
    made both "fc", and one layer's entries overwrote the other's (the summary counted one layer of two). Wrapper
    fragments are stripped as whole path components only."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.module = nn.Sequential()
            self.module.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.module.fc(self.fc(x))

    model = convert_to_fp8(Model())
    model(torch.randn(2, 16)).sum().backward()
    assert sorted(fp8_stats(model)["layers"]) == ["fc", "module.fc"]
    assert clean_name("my_orig_mod.fc") == "my_orig_mod.fc"
    assert clean_name("module._orig_mod.blocks.0._checkpoint_wrapped_module.fc") == "blocks.0.fc"


def test_a_child_of_the_users_own_named_module_keeps_its_name(tmp_path):
    """The leading "module." is left out for a wrapper (DDP, DataParallel, compiled or not) only: a model whose own
    child is named "module" keeps it, in the layers and in the optimizer states."""
    import torch.distributed as dist

    from lightning_fp8 import FP8AdamW

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

        def forward(self, x):
            return self.module(x)

    model = convert_to_fp8(Model())
    optimizer = FP8AdamW(model.parameters(), lr=1e-3, fp8_grads=False)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    own = ["module.0", "module.2"]
    stats = fp8_stats(model, optimizer)
    assert sorted(stats["layers"]) == own
    assert sorted(stats["optimizer"]["states"]) == ["module.0.weight", "module.2.weight"]
    assert sorted(fp8_stats(nn.ModuleDict({"module": model}))["layers"]) == [f"module.{n}" for n in own]
    assert sorted(fp8_stats(torch.compile(model))["layers"]) == own
    assert sorted(fp8_stats(nn.DataParallel(model))["layers"]) == own  # the wrapper's "module." only
    assert sorted(fp8_stats(torch.compile(nn.DataParallel(model)))["layers"]) == own
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        assert sorted(fp8_stats(ddp)["layers"]) == own
        assert sorted(fp8_stats(ddp, optimizer)["optimizer"]["states"]) == ["module.0.weight", "module.2.weight"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", [[], "adam", nn.Linear(2, 2)], ids=["list", "str", "module"])
def test_an_optimizer_argument_that_is_no_optimizer_is_refused_naming_it(optimizer):
    # A list of optimizers (or a scaler, a model) failed with a bare AttributeError: 'state'.
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    with pytest.raises(TypeError, match=r"fp8_stats\(optimizer=\.\.\.\) expects one torch.optim.Optimizer"):
        fp8_stats(model, optimizer=optimizer)
