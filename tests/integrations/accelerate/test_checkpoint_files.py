"""The FP8 state files that `accelerator.save_state` writes (lightning_fp8/integrations/accelerate/checkpoint.py):
written whole or not at all, and a corrupt one refused with what to do."""

import pytest
import torch

from lightning_fp8.integrations.accelerate import checkpoint


def _state(mu: float) -> dict:
    return {"format_version": checkpoint.FORMAT_VERSION, "world_size": 1, "grad_scaler": {"scale": mu}}


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
    with pytest.raises(ValueError, match="corrupt"):
        checkpoint.put_back_fallen_back_layers(tmp_path, 0, [], [])
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="holds a list, not lightning_fp8's FP8 state"):
        checkpoint.load(tmp_path, 0, 1)
