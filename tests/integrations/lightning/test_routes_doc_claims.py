"""Claims of docs/guides/lightning.md and docs/guides/monitoring.md checked against the code's behaviour (single
device, CPU), each against an independent reference: the module before the fit, plain ``nn.Linear`` layers, a value
computed by hand, or the behaviour the page states.

Covered here (claims no other test checked; all found to hold):

- docs/guides/lightning.md, "What the plugin does to the weights and scales":
  the O2 fit rounds the trainable FP8 weights to fp16 from setup, before the first step, and code reading
  ``self.parameters()`` in ``training_step`` sees the scaled masters (values in the thousands) where
  ``self.state_dict()`` gives the weights; under ``"fp8-lm-o1"`` the weights keep their own storage; frozen weights
  keep their values; ``validate`` and ``predict`` leave every weight as it is; after a stage the layers stay
  ``FP8Linear`` (and compute with FP8 GEMMs) while ``state_dict()`` has the ``nn.Linear`` keys and loads into a fresh
  module; evaluation forwards record their amaxes into the training amax history, and so does the model summary's
  forward of ``example_input_array`` (not with ``enable_model_summary=False``); the model summary counts 4 bytes per
  parameter, with Lightning's warning.
- docs/guides/monitoring.md, the callbacks table: ``fp8/grad_scaler/scale`` is mu after the step's update (as
  ``get_scale()``), not the step's own ``loss_scale``.

Checked and already covered elsewhere (not repeated): Fabric refused (ValueError/TypeError, test_precision.py);
Adam with weight decay refused, Adam(weight_decay=0) replaced, other optimizers refused, ``replace_optimizers=False``
(test_precision.py); a kept AdamW refusing to step (test_replaced_optimizer.py); two FP8GradScalers refused and a
user FP8AdamW of another opt level warned (test_users_fp8adamw.py, test_precision.py); the recipe names as
``precision=`` strings, ``pytorch_lightning`` classes, LightningCLI, registered strategy names (test_registry*.py);
SWA/EMA refused at O2 and run at O1, ModelPruning refused (test_precision.py, test_routes_builtins.py); the Tuner
(test_routes_builtins.py, test_tuner.py); resumes bit for bit and the validation-after-train-step-checkpoint drift
(test_routes_builtins.py); ``lr-FP8AdamW`` and the named scheduler key (test_routes_builtins.py); resume under other
scaling settings (test_precision.py); DDP comm hook, FSDP hybrid sharding/``cpu_offload``/``use_orig_params``
refusals (test_registry*.py, test_strategy*.py); the monitors' keys, argument checks (TypeError also a ValueError,
``"no"``, ``inf``, NumPy numbers, plot suffix), ``log_every_n_steps=0``/``barebones``, once-per-batch counting,
``callback_metrics`` for EarlyStopping/ModelCheckpoint, skipped batches without ``grad_norm``, non-finite
``grad_norm`` published, ``nonfinite_grad`` equal to ``nonfinite_events``, resumes and two monitors' state keys,
``plot_file``/``plot_path``/matplotlib backend/``fast_dev_run``, the no-FP8-layer and fallback warnings, string
batches (test_callbacks.py, test_routes_monitoring.py, test_leftovers_lightning.py); ``fp8_stats`` wrapper names
(tests/core/test_stats.py); ``HealthConfig`` and ``observe`` argument checks, zero-mean spikes
(tests/core/test_health.py, tests/core/test_routes_bad_input.py, tests/core/test_routes_monitoring.py).

Findings: none; every claim checked here holds.
"""

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fp8 import FP8Linear
from lightning_fp8.callbacks import FP8ScaleMonitor
from lightning_fp8.integrations.lightning import FP8LMPrecision

torch.manual_seed(0)
# net.0 (16->16) is converted; net.2 (16->8) stays nn.Linear (feature sizes not multiples of 16).
_BASE = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8))
_X = torch.randn(24, 16)
_Y = torch.randn(24, 8)


def _loader(rows: int = 24) -> DataLoader:
    return DataLoader(TensorDataset(_X[:rows], _Y[:rows]), batch_size=8)


class Module(L.LightningModule):
    """The tiny net with AdamW; records what ``training_step`` reads from the FP8 layer's parameter and state dict."""

    def __init__(self, example: bool = False, freeze_first: bool = False) -> None:
        super().__init__()
        self.net = copy.deepcopy(_BASE)
        self.param_abs_max: list[float] = []
        self.state_dict_weights: list[torch.Tensor] = []
        if example:
            self.example_input_array = _X[:4]
        if freeze_first:
            self.net[0].requires_grad_(False)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.param_abs_max.append(self.net[0].weight.detach().abs().max().item())
        self.state_dict_weights.append(self.state_dict()["net.0.weight"].clone())
        return (self.net(batch[0]).float() - batch[1]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", (self.net(batch[0]).float() - batch[1]).square().mean())

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _trainer(**kwargs) -> L.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.update(kwargs)
    return L.Trainer(**args)


def _filled(history: torch.Tensor) -> int:
    return int((history != 0).sum())


# ---------------------------------------------------------------------------------------------------------------------
# docs/guides/lightning.md: "What the plugin does to the weights and scales"
# ---------------------------------------------------------------------------------------------------------------------


def test_o2_parameters_hold_scaled_fp16_masters_and_state_dict_the_fp16_rounded_weights():
    """lightning.md: at O2 "from then on the model holds those weights rounded to fp16 ..., even before the first step";
    a penalty computed from ``self.parameters()`` "gets each trainable FP8 weight's fp16 master times its power-of-two
    scale (values in the thousands)"; "Read the weights through ``self.state_dict()`` (which exports them unscaled)"."""
    module = Module()
    _trainer(precision="fp8-lm").fit(module, _loader())
    original = _BASE[0].weight
    # First training_step, before any optimizer step: the fp16 rounding of the original weight, not the weight.
    assert torch.equal(module.state_dict_weights[0], original.half().float())
    assert not torch.equal(module.state_dict_weights[0], original)
    # The parameter's storage holds the scaled master: orders of magnitude above the weight (|w| < 1 here).
    assert original.abs().max() < 1
    assert all(value > 1000 for value in module.param_abs_max)


def test_o1_weights_keep_their_own_storage_during_the_fit():
    """lightning.md: "or train with ``"fp8-lm-o1"``, where the weights keep their own storage"."""
    module = Module()
    _trainer(precision="fp8-lm-o1").fit(module, _loader())
    assert module.param_abs_max[0] == _BASE[0].weight.abs().max().item()  # before the first step: the weight itself
    assert all(value < 1 for value in module.param_abs_max)


def test_frozen_weights_keep_their_values_through_an_o2_fit():
    """lightning.md: "Frozen weights (``requires_grad=False`` when the fit starts) keep their values"."""
    module = Module(freeze_first=True)
    _trainer(precision="fp8-lm").fit(module, _loader())
    assert isinstance(module.net[0], FP8Linear)
    assert torch.equal(module.net[0].weight, _BASE[0].weight)
    assert torch.equal(module.net[0].bias, _BASE[0].bias)


def test_validate_and_predict_leave_every_weight_as_it_is():
    """lightning.md: "``validate``, ``test`` and ``predict`` leave every weight as it is"."""
    module = Module()
    before = {name: value.clone() for name, value in module.state_dict().items()}
    trainer = _trainer(precision="fp8-lm")
    trainer.validate(module, _loader(), verbose=False)
    assert isinstance(module.net[0], FP8Linear)  # the stage did convert the module
    assert module.state_dict().keys() == before.keys()
    assert all(torch.equal(before[name], value) for name, value in module.state_dict().items())
    trainer.predict(module, _loader())
    assert all(torch.equal(before[name], value) for name, value in module.state_dict().items())


def test_after_a_fit_the_layers_stay_fp8_and_the_state_dict_loads_into_a_fresh_module():
    """lightning.md: "the conversion stays: the module's linear layers are still ``FP8Linear`` and compute with FP8
    GEMMs ...  Its ``state_dict()`` has the keys and values of the ``nn.Linear`` layers ... load it into a fresh
    instance of your module: ``fresh.load_state_dict(model.state_dict())``"."""
    module = Module()
    _trainer(precision="fp8-lm").fit(module, _loader())
    assert isinstance(module.net[0], FP8Linear)
    assert module.net[0].weight.dtype == torch.float32  # its own storage back, in the model's dtype
    fresh = Module()
    assert list(module.state_dict()) == list(fresh.state_dict())
    fresh.load_state_dict(module.state_dict())  # strict
    assert type(fresh.net[0]) is nn.Linear
    with torch.no_grad():
        fp8_out, plain_out = module(_X), fresh(_X)
    # Same weights, but the fitted module still casts to FP8: close, not equal.
    assert not torch.equal(fp8_out, plain_out)
    torch.testing.assert_close(fp8_out, plain_out, rtol=0.15, atol=0.05)


def test_evaluation_forwards_record_their_amaxes_into_the_training_history():
    """lightning.md: "Evaluation forwards (the sanity check, validation, test, predict) ... record their amaxes into
    the same amax history as training forwards"."""
    module = Module()
    trainer = _trainer(precision="fp8-lm", max_steps=1, num_sanity_val_steps=0)
    trainer.fit(module, _loader())
    history = module.net[0].fp8_scaling.input.amax_history
    assert _filled(history) == 1  # the one training forward
    trainer.validate(module, _loader(rows=16), verbose=False)  # two batches
    assert _filled(module.net[0].fp8_scaling.input.amax_history) == 3


def test_the_model_summarys_forward_of_example_input_array_records_amaxes_unless_the_summary_is_off():
    """lightning.md: "So does the forward of ``example_input_array`` that Lightning's model summary runs as the fit
    starts: to reproduce the plain-PyTorch loop bit for bit, ... leave ``example_input_array`` unset (or
    ``enable_model_summary=False``)"."""
    histories = {}
    for name, example, summary in (("plain", False, True), ("example", True, True), ("summary_off", True, False)):
        module = Module(example=example)
        _trainer(precision="fp8-lm", max_steps=1, enable_model_summary=summary).fit(module, _loader())
        histories[name] = module.net[0].fp8_scaling.input.amax_history.clone()
    assert _filled(histories["plain"]) == 1
    assert _filled(histories["example"]) == 2  # the summary's forward of example_input_array, then the step
    assert torch.equal(histories["summary_off"], histories["plain"])


def test_the_model_summary_counts_4_bytes_per_parameter_with_lightnings_warning():
    """lightning.md: "The model summary's "params size" counts 4 bytes per parameter (Lightning's fallback for
    precisions it does not know, with a warning)"."""
    module = Module()
    with pytest.warns(UserWarning, match="not supported by the model summary"):
        _trainer(precision="fp8-lm", max_steps=1, enable_model_summary=True).fit(module, _loader())
    summary = ModelSummary(module)
    parameters = sum(p.numel() for p in _BASE.parameters())
    assert summary.total_parameters == parameters
    assert summary.model_size == pytest.approx(parameters * 4 / 1e6)


# ---------------------------------------------------------------------------------------------------------------------
# docs/guides/monitoring.md: the callbacks table
# ---------------------------------------------------------------------------------------------------------------------


def test_the_logged_grad_scaler_scale_is_mu_after_the_steps_update():
    """monitoring.md: "``scale`` is mu after the step's update, the one the next backward uses, as ``get_scale()``;
    the step's own is the scaler's ``loss_scale`` attribute, not logged"."""
    trainer = _trainer(
        plugins=[FP8LMPrecision(grad_scaler={"growth_interval": 1})],  # mu doubles after every finite step
        callbacks=[FP8ScaleMonitor()],
        log_every_n_steps=1,
        max_steps=2,
    )
    trainer.fit(Module(), _loader())
    scaler = trainer.precision_plugin.grad_scaler
    # mu starts at 1 and doubles after each of the two steps: the second step ran at 2, the next backward uses 4.
    assert scaler.loss_scale == 2.0
    assert scaler.get_scale() == 4.0
    assert float(trainer.callback_metrics["fp8/grad_scaler/scale"]) == 4.0
