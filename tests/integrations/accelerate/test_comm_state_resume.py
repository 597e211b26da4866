"""accelerator.save_state / load_state keep each prepared model's FP8 communication state (the DDP hook's or the FSDP2
collectives' FP8CommState: the native path's extra headroom, grown after FP8 sums that overflowed, and the collective
count). Before, Accelerate's checkpoints left it out: a resumed run started its headroom at 0 and overflowed, skipping
steps, until it had grown back. (The two-process DDP round trip is in load_state_worker.py.)"""

import io

import pytest
import torch

from lightning_fp8 import FP8GradScaler, fp8_state_dict
from lightning_fp8.distributed import FP8CommState
from lightning_fp8.integrations.accelerate import checkpoint
from lightning_fp8.recipe import resolve_recipe
from tests.integrations.accelerate.test_checkpoint_files import _models

RECIPE = resolve_recipe("fp8-lm")


def _comm(headroom: int, reductions: int) -> FP8CommState:
    state = FP8CommState()
    state.load_state_dict({"extra_headroom": headroom, "reductions": reductions})
    return state


def _saved(comm_states: list) -> dict:
    state = checkpoint.build_state(RECIPE, _models(0), 2, FP8GradScaler(), None, 5, comm_states=comm_states)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_each_models_comm_state_round_trips():
    state = _saved([_comm(3, 7), None])  # the second model has no FP8 communication (not wrapped)
    assert state["comm"] == [{"extra_headroom": 3, "reductions": 7}, None]
    resumed = [FP8CommState(), FP8CommState()]
    checkpoint.restore(state, RECIPE, _models(10), FP8GradScaler(), None, comm_states=resumed)
    assert resumed[0].state_dict() == {"extra_headroom": 3, "reductions": 7}
    assert resumed[1].state_dict() == {"extra_headroom": 0, "reductions": 0}  # nothing saved for it: left fresh


def test_a_run_without_fp8_communication_loads_a_checkpoint_with_it_and_the_reverse():
    # One process resuming a DDP run (no hook, no comm state) and a DDP run resuming a one-process checkpoint, or one
    # written before the comm state was saved: the comm state starts fresh.
    checkpoint.restore(_saved([_comm(2, 4), _comm(1, 4)]), RECIPE, _models(10), FP8GradScaler(), None)
    older = _saved([None, None])
    del older["comm"]
    resumed = [_comm(1, 9), None]
    checkpoint.restore(older, RECIPE, _models(10), FP8GradScaler(), None, comm_states=resumed)
    assert resumed[0].state_dict() == {"extra_headroom": 1, "reductions": 9}


@pytest.mark.parametrize(
    ("corrupt", "error", "match"),
    [
        (lambda s: s.__setitem__("comm", {"extra_headroom": 3}), ValueError, "not one FP8 communication state"),
        (lambda s: s.__setitem__("comm", [None]), ValueError, r"per prepared model \(2\)"),
        (lambda s: s["comm"][0].__setitem__("extra_headroom", 99), ValueError, "'extra_headroom' is 99"),
        (lambda s: s["comm"][0].__setitem__("reductions", 2.5), TypeError, "'reductions' is 2.5, not an int"),
    ],
    ids=["not a list", "one entry for two models", "headroom out of range", "float count"],
)
def test_a_corrupt_comm_state_is_refused_before_anything_loads(corrupt, error, match):
    state = _saved([_comm(3, 7), None])
    corrupt(state)
    models, scaler, comm = _models(10), FP8GradScaler(), _comm(1, 2)
    before = [fp8_state_dict(m) for m in models], scaler.state_dict()
    with pytest.raises(error, match=match):
        checkpoint.check(state, RECIPE, models, scaler, None, source="rank0.pt", comm_states=[comm, None])
    with pytest.raises(error, match=match):
        checkpoint.restore(state, RECIPE, models, scaler, None, comm_states=[comm, None])
    after = [fp8_state_dict(m) for m in models], scaler.state_dict()
    for old, new in zip(before[0], after[0], strict=True):
        assert all(torch.equal(value, new[key]) for key, value in old.items())
    assert before[1] == after[1] and comm.state_dict() == {"extra_headroom": 1, "reductions": 2}
