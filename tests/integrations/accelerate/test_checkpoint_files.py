"""The FP8 state files that `accelerator.save_state` writes (lightning_fp8/integrations/accelerate/checkpoint.py):
written whole or not at all, and a corrupt one refused with what to do."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8GradScaler, convert_to_fp8, fp8_state_dict
from lightning_fp8.health import HealthMonitor
from lightning_fp8.integrations.accelerate import checkpoint
from lightning_fp8.recipe import resolve_recipe


def _state(mu: float) -> dict:
    # The entries load() requires (what build_state writes); only mu matters here.
    entries = {"recipe": {}, "models": [], "health": None}
    return {"format_version": checkpoint.FORMAT_VERSION, "world_size": 1, "grad_scaler": {"scale": mu}, **entries}


def test_a_save_that_fails_while_writing_leaves_the_previous_file(tmp_path, monkeypatch):
    path = checkpoint.save(tmp_path, 0, _state(2.0**10))
    real_save = torch.save

    def crash(obj, f):  # half a file, then the process "dies"
        real_save(obj, f)
        with open(f, "r+b") as handle:
            handle.truncate(100)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 0, _state(2.0**5))
    monkeypatch.undo()
    assert checkpoint.load(tmp_path, 0, 1)["grad_scaler"]["scale"] == 2.0**10
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank0.pt"]


def test_a_corrupt_or_foreign_file_is_refused_saying_what_to_do(tmp_path):
    path = checkpoint.save(tmp_path, 0, _state(1.0))
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="corrupt or was not completely written; load an earlier checkpoint"):
        checkpoint.load(tmp_path, 0, 1)
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="holds a list, not lightning_fp8's FP8 state"):
        checkpoint.load(tmp_path, 0, 1)


def _models(seed: int) -> list:
    # Two converted models, one backward each: non-trivial scaling states.
    models = []
    for i in range(2):
        torch.manual_seed(seed + i)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))
        model(torch.randn(8, 32)).square().mean().backward()
        models.append(model)
    return models


def _full_state() -> dict:
    health = HealthMonitor()
    health.observe(0, loss=1.0, grad_norm=2.0)
    return checkpoint.build_state(resolve_recipe("fp8-lm"), _models(0), 1, FP8GradScaler(init_scale=2.0**4), health, 5)


@pytest.mark.parametrize("corrupt", [
    lambda s: s["models"][1].__setitem__("0.fp8_scaling.input.scale", torch.tensor(3.0)),
    lambda s: s["grad_scaler"].__setitem__("scale", 3.0),
    lambda s: s["health"].__setitem__("observations", -5),
], ids=["second model", "grad scaler", "health"])  # fmt: skip
def test_restore_checks_every_part_before_loading_any(corrupt):
    # restore() loaded the models one by one, then mu, then the health history: a bad part left earlier ones loaded.
    state = _full_state()
    corrupt(state)
    models, scaler, health = _models(10), FP8GradScaler(), HealthMonitor()
    before = [fp8_state_dict(m) for m in models], scaler.state_dict(), health.state_dict()
    with pytest.raises(ValueError):
        checkpoint.restore(state, resolve_recipe("fp8-lm"), models, scaler, health)
    after = [fp8_state_dict(m) for m in models], scaler.state_dict(), health.state_dict()
    for old, new in zip(before[0], after[0], strict=True):
        assert all(torch.equal(value, new[key]) for key, value in old.items())
    assert before[1:] == after[1:]


@pytest.mark.parametrize("missing", ["world_size", "models", "recipe", "grad_scaler"])
def test_a_file_without_a_required_entry_is_refused_naming_it(tmp_path, missing):
    state = {key: value for key, value in _full_state().items() if key != missing}
    path = checkpoint.save(tmp_path, 0, state)
    with pytest.raises(KeyError, match=rf"rank0.pt lacks the entries \['{missing}'\].*lightning_fp8/ files"):
        checkpoint.load(tmp_path, 0, 1)
    assert path.is_file()
