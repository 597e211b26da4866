"""`accelerator.load_state` is all or nothing: a corrupt or foreign checkpoint raises and leaves the live run exactly as
it was (layer types, parameters, buffers, FP8AdamW's states, mu and its counters, the health history).

Each corruption is loaded into a prepared run that has trained on its own, from a checkpoint of a run without and with
a `"bf16"` fallback (fc2 put back to `nn.Linear`, while the live run has it in FP8: the load would put it back).
"""

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_fp8 import FP8Linear
from lightning_fp8.accelerate import Accelerator
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE
from lightning_fp8.optim import master
from tests.integrations.accelerate.test_accelerator import Net
from tests.integrations.accelerate.torchrun import run_two_processes

FP8_FILE = Path("lightning_fp8") / "rank0.pt"
WORKER = Path(__file__).with_name("load_state_worker.py")


def _fresh_state() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    monkeypatch.delenv(ENV_RECIPE, raising=False)
    monkeypatch.delenv(ENV_EXCLUDE, raising=False)
    _fresh_state()
    yield
    _fresh_state()


def _batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 48, generator=generator), torch.randint(0, 10, (12,), generator=generator))
            for _ in range(n)]  # fmt: skip


def _train(seed: int, steps: int, poison_step: int | None = None):
    """A prepared run (FP8-LM, O2, the bf16 fallback after one non-finite step) after ``steps`` optimizer steps."""
    _fresh_state()
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.8)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    scaler = accelerator.fp8_grad_scaler
    scaler.nonfinite_fallback, scaler.fallback_after = "bf16", 1
    run = accelerator, model, optimizer, scheduler
    _steps(run, _batches(seed, steps), poison_step)
    return run


def _steps(run, batches, poison_step: int | None = None) -> list[float]:
    accelerator, model, optimizer, scheduler = run
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == poison_step:  # non-finite gradients reach fc2 and head, not fc1: fc2 falls back to nn.Linear
            h = model.fc2(model.norm(torch.relu(model.fc1(x))).detach())
            loss = nn.functional.cross_entropy(model.head(torch.relu(h)), y) * math.inf
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, Path]:
    """``{fallen_back: checkpoint folder}``: saved after 3 steps, with and without fc2 put back to nn.Linear."""
    saved = {}
    for fallen_back in (False, True):
        accelerator, model, _, _ = _train(seed=0, steps=3, poison_step=1 if fallen_back else None)
        assert (type(model.fc2) is nn.Linear) == fallen_back
        saved[fallen_back] = tmp_path_factory.mktemp("ckpt") / "checkpoint"
        accelerator.save_state(str(saved[fallen_back]))
    _fresh_state()
    return saved


def _edit(path: Path, change) -> None:
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:300])


def _fc1_weight_state(directory: Path) -> dict:
    return torch.load(directory / "optimizer.bin", weights_only=True)["state"][0]  # fc1.weight: FP8 at O2


def _set_moment(directory: Path, key: str, value) -> None:
    def change(state):
        moment = state["state"][0][key]  # fc1.weight's, stored scaled in a low-precision dtype
        state["state"][0][key] = value(moment.float()).to(moment.dtype)

    _edit(directory / "optimizer.bin", change)


def _reshape_model_tensor(directory: Path) -> None:
    # Another model's file: torch's load_state_dict copies every tensor that fits before it reports the one that does
    # not (fc1.weight comes first, norm.weight after it).
    tensors = load_file(directory / "model.safetensors")
    tensors["norm.weight"] = torch.ones(81)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _truncated_torch_model_file(directory: Path) -> None:
    # What save_state(safe_serialization=False) writes (and tensor parallelism does): the model as torch.save's zip.
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save(tensors, directory / "pytorch_model.bin")
    _truncate(directory / "pytorch_model.bin")


def _regroup_optimizer(directory: Path) -> None:
    def change(state):  # one parameter moved into a second group: torch refuses it, after the model was loaded
        group = state["param_groups"][0]
        state["param_groups"] = [{**group, "params": group["params"][:-1]}, {**group, "params": group["params"][-1:]}]

    _edit(directory / "optimizer.bin", change)


CORRUPTIONS = {
    "NaN FP8 scale": (
        lambda d: _edit(d / FP8_FILE, lambda s: s["models"][0].__setitem__("fc1.fp8_scaling.input.scale",
                                                                           torch.tensor(math.nan))),
        ValueError, r"'fc1.fp8_scaling.input.scale' holds nan",
    ),
    "mu not a power of two": (
        lambda d: _edit(d / FP8_FILE, lambda s: s["grad_scaler"].__setitem__("scale", 3.0)),
        ValueError, r"entry 'scale' is 3.0, expected a positive power of two",
    ),
    "bad health entry": (
        lambda d: _edit(d / FP8_FILE, lambda s: s["health"].__setitem__("observations", -5)),
        ValueError, r"observations",
    ),
    # The step count is the last thing load_state restores: a file without one, or with another value than a count,
    # was refused only after Accelerate had loaded the weights and optimizer states.
    "optimizer step count missing": (
        lambda d: _edit(d / FP8_FILE, lambda s: s.pop("optimizer_steps")),
        KeyError, r"rank0.pt lacks the entries \['optimizer_steps'\]",
    ),
    "optimizer step count not a count": (
        lambda d: _edit(d / FP8_FILE, lambda s: s.__setitem__("optimizer_steps", 2.5)),
        ValueError, r"rank0.pt: 'optimizer_steps' is 2.5, not a whole number >= 0",
    ),
    "negative optimizer step count": (
        lambda d: _edit(d / FP8_FILE, lambda s: s.__setitem__("optimizer_steps", -3)),
        ValueError, r"rank0.pt: 'optimizer_steps' is -3, not a whole number >= 0",
    ),
    "process count not a count": (
        lambda d: _edit(d / FP8_FILE, lambda s: s.__setitem__("world_size", "1")),
        ValueError, r"rank0.pt: 'world_size' is '1', not a whole number >= 1",
    ),
    "saved recipe of an unknown format": (  # was refused without naming the file
        lambda d: _edit(d / FP8_FILE, lambda s: s["recipe"].__setitem__("fp8_format", "bogus")),
        ValueError, r"rank0.pt: FP8Recipe\(fp8_format='bogus'\) is not supported",
    ),
    "truncated lightning_fp8 file": (
        lambda d: _truncate(d / FP8_FILE),
        ValueError, r"rank0.pt cannot be read .*corrupt or was not completely written",
    ),
    "negative second moment": (
        lambda d: _set_moment(d, "exp_avg_sq", lambda x: -x.abs() - 1),
        ValueError, r"parameter 0's 'exp_avg_sq' holds negative values",
    ),
    "NaN first moment": (
        lambda d: _set_moment(d, "exp_avg", lambda x: torch.full_like(x, math.nan)),
        ValueError, r"parameter 0's 'exp_avg' holds inf or NaN",
    ),
    "optimizer groups differ": (
        _regroup_optimizer,
        ValueError, r"optimizer.bin.*parameter groups of \[.*\] parameters.*prepared optimizer's are \[.*\]",
    ),
    "truncated optimizer file": (
        lambda d: _truncate(d / "optimizer.bin"),
        ValueError, r"optimizer.bin cannot be read .*corrupt or was not completely written",
    ),
    "truncated model file": (
        lambda d: _truncate(d / "model.safetensors"),
        ValueError, r"model.safetensors cannot be read .*corrupt or was not completely written",
    ),
    "truncated torch model file": (
        _truncated_torch_model_file,
        ValueError, r"pytorch_model.bin cannot be read .*corrupt or was not completely written",
    ),
    "model tensor of another shape": (
        _reshape_model_tensor,
        ValueError, r"model.safetensors.*'norm.weight' of shape \(81,\).*\(80,\)",
    ),
}  # fmt: skip


def _snapshot(accelerator, model, optimizer, scheduler) -> dict:
    """Everything a load changes, copied: layer types, parameters (their storage as it is: at O2 an FP8 weight holds
    its fp16 master times a scale), master scales, buffers (FP8 scaling states), FP8AdamW's states and groups, mu,
    the health history, the step counter, the scheduler."""
    fp8_adamw = optimizer.optimizer
    params = [p for group in fp8_adamw.param_groups for p in group["params"]]
    return {
        "types": [(name, type(module).__name__) for name, module in model.named_modules()],
        "parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
        "master_scales": {name: copy.deepcopy(master.master_scale(p)) for name, p in model.named_parameters()},
        "buffers": {name: b.clone() for name, b in model.named_buffers()},
        "optimizer_state": [copy.deepcopy(dict(fp8_adamw.state.get(p, {}))) for p in params],
        "optimizer_low_precision": [p in fp8_adamw._low_precision for p in params],
        "groups": [{k: v for k, v in group.items() if k != "params"} for group in fp8_adamw.param_groups],
        "scaler": accelerator.fp8_grad_scaler.state_dict(),
        "health": accelerator.fp8_health.state_dict(),
        "steps": accelerator._fp8_steps,
        "scheduler": scheduler.state_dict(),
    }


def _assert_same(before, after, where: str = "") -> None:
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor) and before.dtype == after.dtype, where
        assert before.shape == after.shape and torch.equal(before, after), where
    elif isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), (where, before.keys(), after)
        for key in before:
            _assert_same(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, (list, tuple)):
        assert type(before) is type(after) and len(before) == len(after), where
        for i, (old, new) in enumerate(zip(before, after, strict=True)):
            _assert_same(old, new, f"{where}[{i}]")
    else:
        assert before == after, (where, before, after)


@pytest.mark.parametrize("fallen_back", [False, True], ids=["no fallback", "fc2 fell back"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_raises_and_leaves_the_live_run_as_it_was(tmp_path, checkpoints, corruption, fallen_back):
    corrupt, error, match = CORRUPTIONS[corruption]
    directory = tmp_path / "checkpoint"
    shutil.copytree(checkpoints[fallen_back], directory)
    corrupt(directory)
    accelerator, model, optimizer, scheduler = _train(seed=7, steps=2)  # its own weights, states, mu and history
    assert isinstance(model.fc2, FP8Linear)
    before = _snapshot(accelerator, model, optimizer, scheduler)
    with pytest.raises(error, match=match):
        accelerator.load_state(str(directory))
    _assert_same(before, _snapshot(accelerator, model, optimizer, scheduler))


@pytest.mark.parametrize("strict", ["no", 0, None])
def test_a_strict_flag_that_is_no_bool_is_named_as_load_states_and_nothing_loads(checkpoints, strict):
    # It was refused by the FP8 scaling state's check, as "<checkpoint>/lightning_fp8/rank0.pt: load_fp8_state_dict(
    # strict=...)": an error that blamed a good file and named a function the script never called.
    run = _train(seed=7, steps=2)
    before = _snapshot(*run)
    with pytest.raises(TypeError, match=rf"^accelerator.load_state\(strict={strict!r}\): must be True or False"):
        run[0].load_state(str(checkpoints[False]), strict=strict)
    _assert_same(before, _snapshot(*run))


@pytest.mark.parametrize("fallen_back", [False, True], ids=["no fallback", "fc2 fell back"])
def test_after_a_refused_checkpoint_the_run_goes_on_as_if_never_loaded_and_loads_a_good_one(
    tmp_path, checkpoints, fallen_back
):
    directory = tmp_path / "checkpoint"
    shutil.copytree(checkpoints[fallen_back], directory)
    _set_moment(directory, "exp_avg_sq", lambda x: -x.abs() - 1)
    batches = _batches(3, 2)
    expected = _steps(_train(seed=7, steps=2), batches)  # the same run, never asked to load

    run = _train(seed=7, steps=2)
    accelerator, model, optimizer, _ = run
    with pytest.raises(ValueError, match="holds negative values"):
        accelerator.load_state(str(directory))
    assert _steps(run, batches) == expected

    accelerator.load_state(str(checkpoints[fallen_back]))
    saved = _fc1_weight_state(checkpoints[fallen_back])
    assert torch.equal(optimizer.optimizer.state[model.fc1.weight]["exp_avg_sq"], saved["exp_avg_sq"])
    assert (type(model.fc2) is nn.Linear) == fallen_back
    assert accelerator._fp8_steps == 3


@pytest.mark.slow
def test_a_checkpoint_bad_on_one_process_is_refused_by_every_process(tmp_path):
    # Each rank has its own FP8 state file: with rank 1's corrupt, rank 0 (whose parts are all good) must not load its
    # parts either, or the ranks would train on different weights. See load_state_worker.py.
    log = run_two_processes(WORKER, tmp_path, str(tmp_path / "ckpt"))
    assert "rank 0: refused ok" in log and "rank 1: refused ok" in log, log[-3000:]
    assert "rank 0: comm state loaded ok" in log and "rank 1: comm state loaded ok" in log, log[-3000:]


@pytest.mark.parametrize("saved_compiled", [True, False], ids=["saved_compiled", "loaded_compiled"])
def test_a_checkpoint_of_a_script_compiled_model_names_the_orig_mod_prefix(tmp_path, saved_compiled):
    """torch.compile(model) in the script names the weights '_orig_mod.<name>' in Accelerate's model file: loaded into
    a model not compiled that way (or the other way round) the refusal said only 'saved for another model'."""

    def prepared(compiled: bool):
        _fresh_state()
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model = torch.compile(model, backend="eager") if compiled else model
        return accelerator, *accelerator.prepare(model, optimizer)

    accelerator, model, _ = prepared(saved_compiled)
    accelerator.save_state(tmp_path / "ckpt")
    accelerator, model, _ = prepared(not saved_compiled)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = "compile the model the same way" if saved_compiled else "do not compile the model"
    with pytest.raises(ValueError, match=rf"differ only by torch.compile's '_orig_mod.' prefix.*{expected}"):
        accelerator.load_state(tmp_path / "ckpt")
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
