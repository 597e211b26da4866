"""fp8_stats behaviours that a mutation audit of lightning_fp8/stats.py found unpinned, against its docstring and
docs/guides/monitoring.md, with the reference computed in Python from each layer's own buffers: the per-role summary's
saturation_mean (mean over layers), saturation_max and nonfinite_count (total over layers); names that would collide
once wrapper fragments are stripped keep their full names; a bool ``scale`` is no number; only 0-dim optimizer
entries are scales."""

import statistics

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, convert_to_fp8, fp8_stats
from lightning_fp8.scaling import ROLES


def _layers_with_buffers(saturations: list[float], nonfinite: list[int]) -> nn.Module:
    model = convert_to_fp8(nn.Sequential(*(nn.Linear(16, 16) for _ in saturations)))
    model(torch.randn(4, 16)).square().mean().backward()
    for layer, sat, bad in zip(model, saturations, nonfinite, strict=True):
        for i, role in enumerate(ROLES):  # a different value per role and layer
            layer.fp8_scaling[role].saturation.fill_(sat / (i + 1))
            layer.fp8_scaling[role].nonfinite_count.fill_(bad + i)
    return model


def test_the_summary_is_the_mean_and_max_saturation_and_the_total_nonfinite_count_over_layers():
    model = _layers_with_buffers([0.25, 0.5, 0.0], [2, 3, 0])
    summary = fp8_stats(model)["summary"]
    for role in ROLES:
        states = [layer.fp8_scaling[role] for layer in model]
        saturations = [s.saturation.item() for s in states]
        assert summary[role]["saturation_mean"] == pytest.approx(statistics.fmean(saturations), rel=1e-12)
        assert summary[role]["saturation_max"] == max(saturations)
        assert summary[role]["nonfinite_count"] == sum(s.nonfinite_count.item() for s in states)


def test_layers_whose_names_collide_once_a_wrapper_fragment_is_stripped_are_both_reported():
    # "fc" and "_checkpoint_wrapped_module.fc" both clean to "fc": each keeps its full name, so neither's entries
    # overwrite the other's.
    model = convert_to_fp8(
        nn.ModuleDict({"fc": nn.Linear(16, 16), "_checkpoint_wrapped_module": nn.ModuleDict({"fc": nn.Linear(16, 32)})})
    )
    for _ in range(2):
        model["fc"](torch.randn(4, 16))
    model["_checkpoint_wrapped_module"]["fc"](torch.randn(4, 16))
    expected = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    layers = fp8_stats(model)["layers"]
    assert sorted(layers) == sorted(expected) == ["_checkpoint_wrapped_module.fc", "fc"]
    for name, layer in expected.items():
        assert layers[name]["input"]["casts"] == layer.fp8_scaling["input"].casts.item()
    assert fp8_stats(model)["summary"]["input"]["scale_max"] == max(
        m.fp8_scaling["input"].scale.item() for m in expected.values()
    )


def test_a_scaler_whose_scale_is_a_bool_tensor_is_refused():
    class Scaler:
        scale = torch.tensor(True)

    with pytest.raises(TypeError, match=r"fp8_stats\(grad_scaler=...\) expects an FP8GradScaler.*torch.bool"):
        fp8_stats(FP8Linear(16, 16, recipe="fp8-lm"), grad_scaler=Scaler())


def test_only_zero_dim_optimizer_entries_named_scale_are_reported():
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    model(torch.randn(4, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model[0].weight] = {"exp_avg_scale": torch.tensor(0.5), "row_scales": torch.full((16,), 2.0)}
    got = fp8_stats(model, opt)["optimizer"]
    assert got["states"] == {"0.weight": {"exp_avg_scale": 0.5}}
    assert got["summary"] == {"exp_avg_scale": {"min": 0.5, "max": 0.5}}
