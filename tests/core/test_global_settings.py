"""FP8 layers under process-wide torch settings and with unusual tensor types, as users' scripts set and pass them.

Each test that changes a global setting restores it in a ``finally``.
"""

import io

import pytest
import torch

from lightning_fp8 import FP8MLP, FP8Linear


def test_a_layer_built_under_a_float64_default_dtype_is_refused_at_construction():
    # nn.Linear follows the default dtype: under torch.set_default_dtype(torch.float64) an FP8Linear got float64
    # parameters silently and failed only at its first forward, with a message about model.double().
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match=r"FP8Linear\(dtype=None\).*torch.float64.*set_default_dtype"):
            FP8Linear(32, 16)
        with pytest.raises(TypeError, match=r"dtype=None.*torch.float64"):
            FP8MLP(32, 64)
        assert FP8Linear(32, 16, dtype=torch.float32).weight.dtype == torch.float32  # the way out the error names
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16])
def test_a_layer_built_under_a_half_default_dtype_takes_it(default):
    torch.set_default_dtype(default)
    try:
        layer = FP8Linear(32, 16)
        assert layer.weight.dtype == default
        assert all(b.dtype in (torch.float32, torch.int64) for b in layer.fp8_scaling.buffers())  # not the default's
        assert layer(torch.randn(4, 32)).dtype == default
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_a_nested_input_is_refused_with_a_fix_that_works(layout):
    # The error said "pass x.to_dense()", which nested tensors do not have (RuntimeError for both layouts).
    layer = FP8Linear(32, 16)
    x = torch.nested.nested_tensor([torch.randn(3, 32), torch.randn(5, 32)], layout=layout)
    with pytest.raises(TypeError, match=r"nested tensor.*to_padded_tensor\(0.0\).*x.values\(\)") as info:
        layer(x)
    assert "to_dense" not in str(info.value)
    assert layer(x.to_padded_tensor(0.0)).shape == (2, 5, 16)
    if layout == torch.jagged:  # the jagged way: the rows without padding, the output rebuilt
        y = torch.nested.nested_tensor_from_jagged(layer(x.values()), x.offsets())
        assert y.is_nested and y.values().shape == (8, 16)


@pytest.mark.parametrize(("default", "step", "loads"), [
    (torch.float16, 70000.0, True),  # was inf in float16: a valid step refused
    (torch.bfloat16, 300.5, False),  # was 300 in bfloat16: a fractional step accepted, and loaded as 300.5
])  # fmt: skip
def test_an_optimizer_step_saved_as_a_python_float_is_checked_whatever_the_default_dtype(default, step, loads):
    from lightning_fp8 import FP8AdamW

    layer = FP8Linear(32, 16)
    opt = FP8AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(4, 32)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    for state in saved["state"].values():
        state["step"] = step  # a checkpoint written by hand, or through JSON
    torch.set_default_dtype(default)
    try:
        if loads:
            opt.load_state_dict(saved)
            assert all(s["step"].dtype == torch.float32 and s["step"].item() == step for s in opt.state.values())
        else:
            with pytest.raises(ValueError, match="step is 300.5, not a whole number"):
                opt.load_state_dict(saved)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"hidden_features": 64.0}, r"FP8MLP\(hidden_features=64.0\)"),  # was "FP8Linear(out_features=64.0)"
        ({"hidden_features": 64, "out_features": True}, r"FP8MLP\(out_features=True\)"),
        ({"in_features": "32"}, r"FP8MLP\(in_features='32'\)"),
    ],
)
def test_an_mlp_size_of_another_type_is_named_as_the_mlp_argument(kwargs, named):
    with pytest.raises(TypeError, match=named + ": must be an int"):
        FP8MLP(**{"in_features": 32, "hidden_features": 64, **kwargs})


def _train(recipe: str, default: torch.dtype | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three steps (a checkpoint round trip before the third) of a small FP8 model, built in float32; ``default`` is
    the default dtype from the conversion on (optimizer, scaler, loads, steps). The losses, weights and RNG state."""
    from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16))
    if default is not None:
        torch.set_default_dtype(default)
    try:
        convert_to_fp8(model, recipe=recipe)
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(model.parameters(), lr=1e-2, recipe=recipe, grad_scaler=scaler)
        gen = torch.Generator().manual_seed(1)
        out = []
        for i in range(3):
            if i == 2:
                buffer = io.BytesIO()
                torch.save([opt.state_dict(), scaler.state_dict(), model.state_dict(), fp8_state_dict(model)], buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=True)
                opt.load_state_dict(saved[0])
                scaler.load_state_dict(saved[1])
                model.load_state_dict(saved[2])
                load_fp8_state_dict(model, saved[3])
            loss = model(torch.randn(8, 32, generator=gen, dtype=torch.float32)).square().mean()
            scaler.scale_loss(loss).backward()
            scaler.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append(loss.detach())
        return [*out, *(p.detach().clone() for p in model.parameters())], torch.get_rng_state()
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_training_is_bit_identical_under_another_default_dtype(recipe):
    # The library's own tensors (scaling buffers, optimizer states and scales, step counters) name their dtypes:
    # none follows the default dtype, and the run leaves the global RNG (which dropout draws from) where it did.
    reference, rng = _train(recipe, None)
    for default in (torch.float64, torch.bfloat16, torch.float16):
        run, run_rng = _train(recipe, default)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(run, reference, strict=True)), default
        assert torch.equal(run_rng, rng)


@pytest.mark.parametrize("default", [torch.float16, torch.float64])
def test_values_the_library_makes_are_float32_whatever_the_default_dtype(default):
    """Values made from Python numbers took the default dtype: under float16 the Lightning monitors' callback_metrics
    (what EarlyStopping and ModelCheckpoint read) held a scale of 2**20 as inf; the norm of no gradients is "a 0-dim
    fp32 tensor" (its docstring). Found by the global-settings sweep."""
    from types import SimpleNamespace

    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.callbacks import FP8ScaleMonitor

    trainer = SimpleNamespace(callback_metrics={})
    torch.set_default_dtype(default)
    try:
        FP8ScaleMonitor()._publish(trainer, {"fp8/scale": 2.0**20, "fp8/amax": 0.1})
        norm = FP8GradScaler().clip_grad_norm_([torch.nn.Parameter(torch.ones(3, dtype=torch.float32))], 1.0)
    finally:
        torch.set_default_dtype(torch.float32)
    assert {k: (v.dtype, float(v)) for k, v in trainer.callback_metrics.items()} == {
        "fp8/scale": (torch.float32, 2.0**20),
        "fp8/amax": (torch.float32, float(torch.tensor(0.1))),
    }
    assert norm.dtype == torch.float32 and float(norm) == 0.0
