"""strategy="fsdp_fp8" (FP8FSDPStrategy) checkpoints on one CPU process (gloo): what resumes where.

The FP8 scaling state is saved under the layers' clean names, so it resumes under another wrapping or on one device
(checkpoints written with the wrapped names still load); the optimizer state is per-rank shards, which only
FP8FSDPStrategy with as many processes loads: the other strategies refuse it, saying what resumes it.
"""

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_fp8 import FP8FSDPStrategy
from lightning_fp8.integrations.lightning import FP8LMPrecision
from lightning_fp8.state import fp8_state_dict
from tests.integrations.lightning.gpt_tiny import Block, GPTModule, loader

WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@pytest.fixture(autouse=True)
def _no_process_group_left():
    # FSDPStrategy initializes a process group (world size 1) that outlives the Trainer: leave none for other tests.
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _wrapped() -> FP8FSDPStrategy:
    return FP8FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})


class ScalesAtStart(L.Callback):
    """Keeps the model's FP8 scaling state as fit starts training, after the checkpoint was restored."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fp8 = {k: v.clone() for k, v in trainer.precision_plugin.state_dict()["fp8"].items()}


def _fit(strategy, steps: int, ckpt_path=None, callbacks=None) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        precision="fp8-lm",
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(GPTModule(), loader(n=48, batch_size=12), ckpt_path=ckpt_path)
    return trainer


def _assert_same_state(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def test_fp8_scaling_state_is_saved_under_clean_names_and_resumes_under_another_wrapping(tmp_path):
    path = tmp_path / "wrapped.ckpt"
    _fit(_wrapped(), steps=2).save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["FP8LMPrecision"]["fp8"]
    plain = fp8_state_dict(FP8LMPrecision().convert_module(GPTModule()))  # the names on one device
    assert saved.keys() == plain.keys()
    assert not any(w in key for key in saved for w in WRAPPERS)

    scales = ScalesAtStart()
    trainer = _fit(FP8FSDPStrategy(), steps=3, ckpt_path=path, callbacks=[scales])
    assert trainer.global_step == 3
    _assert_same_state(scales.fp8, saved)


def test_checkpoints_with_wrapped_fp8_names_still_load(tmp_path):
    # Written before the names were cleaned: "model.blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn...".
    path = tmp_path / "clean.ckpt"
    _fit(FP8FSDPStrategy(), steps=2).save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["FP8LMPrecision"]["fp8"]
    wrap = "._fsdp_wrapped_module._checkpoint_wrapped_module."
    checkpoint["FP8LMPrecision"]["fp8"] = {
        k.replace(".blocks.0.", f".blocks.0{wrap}").replace(".blocks.1.", f".blocks.1{wrap}"): v
        for k, v in saved.items()
    }
    assert checkpoint["FP8LMPrecision"]["fp8"].keys() != saved.keys()
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)

    for strategy in (FP8FSDPStrategy(), _wrapped()):
        scales = ScalesAtStart()
        _fit(strategy, steps=3, ckpt_path=old, callbacks=[scales])
        _assert_same_state(scales.fp8, saved)


def test_wrapped_fp8_names_load_on_one_device():
    # What the plugin does with a checkpoint's FP8 state on a single device (the optimizer state aside).
    plugin = FP8LMPrecision()
    plugin.convert_module(GPTModule())
    state = plugin.state_dict()
    state["fp8"] = {k.replace(".blocks.1.", ".blocks.1._fsdp_wrapped_module."): v for k, v in state["fp8"].items()}
    key = "model.blocks.1._fsdp_wrapped_module.mlp.0.fp8_scaling.input.scale"
    state["fp8"][key] = torch.tensor(0.25)
    plugin.load_state_dict(state)
    assert plugin.state_dict()["fp8"]["model.blocks.1.mlp.0.fp8_scaling.input.scale"] == 0.25


def test_fsdp_optimizer_shards_resumed_by_another_strategy_are_refused_saying_what_resumes_them(tmp_path):
    path = tmp_path / "fsdp.ckpt"
    _fit(_wrapped(), steps=2).save_checkpoint(path)
    with pytest.raises(ValueError, match=r"only FP8FSDPStrategy with 1 process .*this run is SingleDeviceStrategy"):
        _fit("auto", steps=3, ckpt_path=path)


def test_fsdp_fp8_refuses_optimizer_states_of_another_strategy_saying_so(tmp_path):
    path = tmp_path / "single.ckpt"
    _fit("auto", steps=2).save_checkpoint(path)
    with pytest.raises(ValueError, match=r"written by another strategy .*FP8FSDPStrategy with 1 process cannot load"):
        _fit(FP8FSDPStrategy(), steps=3, ckpt_path=path)


def test_fsdp_fp8_refuses_a_checkpoint_of_another_number_of_optimizers(tmp_path):
    path = tmp_path / "fsdp.ckpt"
    _fit(_wrapped(), steps=2).save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["optimizer_states"] = []  # as a run without an optimizer writes it
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=r"holds the states of 0 optimizer\(s\) and this run has 1"):
        _fit(_wrapped(), steps=3, ckpt_path=path)


def test_fsdp_fp8_optimizer_shards_that_do_not_fit_are_refused_before_loading(tmp_path):
    """Each rank's optimizer shards fit the shards of another wrapping (auto_wrap_policy) or model only by chance: the
    error named a corrupt checkpoint, on the ranks whose shards did not fit, after the weights were loaded."""
    from lightning_fp8.integrations.lightning.strategy import PER_RANK

    path = tmp_path / "fsdp.ckpt"
    _fit(_wrapped(), steps=2).save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["optimizer_states"][0][PER_RANK][0]["state"][0]
    state["exp_avg"] = torch.cat([state["exp_avg"], state["exp_avg"]])  # another shard's size
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=r"does not fit this run's sharded parameters .*same model, auto_wrap_policy"):
        _fit(_wrapped(), steps=3, ckpt_path=path)


def test_fsdp_fp8_saves_each_rank_s_optimizer_states_as_stored(tmp_path):
    """FP8AdamW.state_dict() gives FSDP1's original parameters' states as fp32 values (what torch's FSDP functions
    gather); the strategy saves each rank's states as stored, E4M3/fp16 with their scales, which resume bit for bit."""
    from lightning_fp8.integrations.lightning.strategy import PER_RANK

    path = tmp_path / "fsdp.ckpt"
    _fit(_wrapped(), steps=2).save_checkpoint(path)
    states = torch.load(path, weights_only=True)["optimizer_states"][0][PER_RANK][0]["state"].values()
    stored = [s for s in states if s["exp_avg"].dtype == torch.float8_e4m3fn]
    assert stored and all(s["exp_avg_sq"].dtype == torch.float16 and "exp_avg_scale" in s for s in stored)


def test_fallen_back_layers_resume_under_another_wrapping():
    """The layers the bf16 fallback put back to nn.Linear are saved under clean names, as the model's state_dict and
    the FP8 state are: a resume under another wrapping (here: checkpoint_wrapper on the saving side only) puts them
    back again and gives them the checkpoint's values; names saved wrapped (older checkpoints) resume as well."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from lightning_fp8 import recovery

    torch.manual_seed(0)
    saving = GPTModule()
    saving.model.blocks[1] = checkpoint_wrapper(saving.model.blocks[1])
    plugin = FP8LMPrecision()
    plugin.convert_module(saving)
    layer = "model.blocks.1._checkpoint_wrapped_module.mlp.0"
    recovery.put_back_to_high_precision(saving, [layer])
    state = plugin.state_dict()
    assert state["fallen_back_layers"] == ["model.blocks.1.mlp.0"]
    checkpoint = {"state_dict": saving.state_dict(), type(plugin).__qualname__: state}
    for names in (state["fallen_back_layers"], [layer]):  # clean, and as older checkpoints saved them
        resuming = FP8LMPrecision()
        module = GPTModule()
        resuming.convert_module(module)
        checkpoint[type(plugin).__qualname__] = {**state, "fallen_back_layers": names}
        resuming.on_load_checkpoint(checkpoint)
        fc = module.model.blocks[1].mlp[0]
        assert type(fc) is nn.Linear
        assert torch.equal(fc.weight, checkpoint["state_dict"]["model.blocks.1.mlp.0.weight"])


def test_unsupported_strategy_error_without_the_precision_is_neutral():
    from lightning_fp8.integrations.lightning.strategy import check_supported_strategy

    with pytest.raises(ValueError, match=r"^the FP8-LM precision does not support strategy='deepspeed': DeepSpeed"):
        check_supported_strategy("deepspeed")
