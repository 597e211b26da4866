"""`accelerator.save_state` into a folder saved before by more processes, and `load_state(strict=False)` of the FP8
scaling state (lightning_fp8/integrations/accelerate/checkpoint.py, checkpointing.py)."""

import pytest
import torch
from torch import nn

from lightning_fp8 import fp8_state_dict
from lightning_fp8.accelerate import Accelerator
from lightning_fp8.integrations.accelerate import checkpoint
from tests.integrations.accelerate.test_accelerator import Net
from tests.integrations.accelerate.test_load_state_atomic import (  # noqa: F401 (the autouse fixture)
    _fresh_accelerate_state,
    _fresh_state,
)


def _prepared(model: nn.Module) -> tuple[Accelerator, nn.Module]:
    """A one-process FP8-LM run of ``model`` alone (no optimizer: the checkpoint's would not fit a bigger model)."""
    _fresh_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    return accelerator, accelerator.prepare(model)


def _trained(model: nn.Module, steps: int = 2):
    """A prepared one-process FP8-LM run of ``model`` after ``steps`` optimizer steps on fresh random batches."""
    _fresh_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(steps):
        x, y = torch.randn(12, 48), torch.randint(0, 10, (12,))
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return accelerator, model


def test_a_save_deletes_the_files_of_ranks_an_earlier_save_had_and_this_one_has_not(tmp_path):
    # A folder saved by 2 processes, then by 1: rank1.pt stayed, and a later 2-process resume gave rank 1 the old
    # mu and step count (its replica diverged from rank 0's).
    accelerator, _ = _trained(Net())
    stale = checkpoint.rank_file(tmp_path, 1)
    stale.parent.mkdir(parents=True)
    torch.save({"format_version": checkpoint.FORMAT_VERSION, "world_size": 2}, stale)
    accelerator.save_state(tmp_path)
    assert sorted(p.name for p in stale.parent.iterdir()) == ["rank0.pt"]


def test_a_rank_past_the_saved_process_count_takes_rank_0s_file_over_a_stale_own_one(tmp_path):
    # A folder written before stale files were deleted: rank 0's file says 1 process saved it.
    entries = {"recipe": {}, "models": [], "health": None, "format_version": checkpoint.FORMAT_VERSION}
    checkpoint.save(tmp_path, 0, {**entries, "world_size": 1, "grad_scaler": {"scale": 2.0**5}})
    checkpoint.save(tmp_path, 1, {**entries, "world_size": 2, "grad_scaler": {"scale": 2.0**10}})
    assert checkpoint.load(tmp_path, 1, 2)["grad_scaler"]["scale"] == 2.0**5
    # Saved by 2 processes: each rank has its own activation statistics.
    checkpoint.save(tmp_path, 0, {**entries, "world_size": 2, "grad_scaler": {"scale": 2.0**5}})
    assert checkpoint.load(tmp_path, 1, 2)["grad_scaler"]["scale"] == 2.0**10


class Bigger(Net):
    """Net with one more FP8 layer, which a checkpoint of Net has no weights or scaling state for."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.extra(x))


def test_load_state_strict_false_loads_the_scaling_state_of_the_layers_both_models_have(tmp_path):
    accelerator, model = _trained(Net())
    accelerator.save_state(tmp_path)
    saved = fp8_state_dict(accelerator.unwrap_model(model))
    accelerator, bigger = _prepared(Bigger())
    accelerator.load_state(tmp_path, strict=False)
    loaded = fp8_state_dict(accelerator.unwrap_model(bigger))
    assert any(key.startswith("extra.") for key in loaded)
    assert any(key.endswith("amax_history") for key in saved)
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)


def test_load_state_strict_true_refuses_another_models_scaling_state_naming_the_file(tmp_path):
    accelerator, _ = _trained(Net())
    accelerator.save_state(tmp_path)
    accelerator, _ = _prepared(Bigger())
    with pytest.raises(KeyError, match=r"lightning_fp8/rank0.pt: FP8 scaling state does not match the model"):
        accelerator.load_state(tmp_path)
