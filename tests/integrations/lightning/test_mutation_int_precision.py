"""FP8LMPrecision's clipping, unscaling and checkpoint state, pinned where a mutation audit of the integrations found
them unpinned (each mutant passed the suite), against ``torch.nn.utils.clip_grad_value_`` on the true gradients
(clipping by value must clamp at ``clip_val * mu`` on gradients that carry mu, not at ``clip_val``), the gradients a
module's own ``on_before_optimizer_step`` sees (``gradient_factor()`` is 1 while the plugin has them unscaled, and
``TrainingHealthMonitor`` divides its norm by it), nested ``unscaled_gradients`` regions (one division, one
multiplication), and the docs' rules for the checkpoint state (the scaling state keyed by names without wrappers,
compared with the core's ``fp8_state_dict`` of the same model unwrapped; a resume under another recipe warns)."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from lightning_fp8.integrations.lightning import FP8LMPrecision, TrainingHealthMonitor
from tests.integrations.lightning.gpt_tiny import GPTModule, loader

MU = 2.0**10


def _fixed_mu(mu: float = MU) -> FP8LMPrecision:
    return FP8LMPrecision(grad_scaler={"init_scale": mu, "min_scale": mu, "max_scale": mu, "growth_interval": 10**6})


@pytest.mark.parametrize("algorithm", ["value", GradClipAlgorithmType.VALUE])
def test_clipping_by_value_clamps_the_true_gradients_at_clip_val(algorithm):
    plugin = _fixed_mu()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    true = [torch.randn_like(p) * 0.3 for p in model.parameters()]
    true[0].view(-1)[3] = math.inf  # an overflow stays one, for the scaler to skip
    for p, g in zip(model.parameters(), true, strict=True):
        p.grad = g * MU
    reference = [nn.Parameter(torch.zeros_like(g)) for g in true]
    for r, g in zip(reference, true, strict=True):
        r.grad = g.clone()
    torch.nn.utils.clip_grad_value_(reference, 0.25)
    reference[0].grad.view(-1)[3] = math.inf  # torch clamps it to 0.25: kept infinite here (the docs' rule)
    plugin.clip_gradients(optimizer, clip_val=0.25, gradient_clip_algorithm=algorithm)
    assert sum(int((g.abs() > 0.25).sum()) for g in true) > 20  # there was something to clamp
    for p, r in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad / MU, r.grad, rtol=0, atol=0)


class _ReadsGradients(GPTModule):
    """A module hook that reads the gradients: the plugin unscales them for it, and the callbacks run in that region."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_norms: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.double() for p in self.parameters() if p.grad is not None]
        self.seen_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def test_health_grad_norm_is_the_true_norm_when_a_module_hook_unscales_the_gradients(tmp_path):
    torch.manual_seed(0)
    module = _ReadsGradients()
    monitor = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    trainer = L.Trainer(
        plugins=[_fixed_mu()], accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, loader(n=48))
    logged = monitor.monitor.series["grad_norm"]
    assert len(module.seen_norms) == 3 and len(logged) == 3
    # The module's hook saw the true gradients (its norm is far from mu times or 1/mu times anything near 1).
    for seen, (_, value) in zip(module.seen_norms, logged, strict=True):
        assert math.isclose(value, seen, rel_tol=1e-4), (value, seen)


def test_nested_unscaled_gradients_regions_unscale_once_and_scale_back_once():
    """``unscaled_gradients`` is public: a hook that opens it inside the plugin's own region (or twice) sees the true
    gradients, not gradients divided by mu twice, and they carry mu again, exactly, once the outer region ends."""
    plugin = _fixed_mu()
    torch.manual_seed(1)
    model = nn.Linear(8, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    true = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), true, strict=True):
        p.grad = g * MU
    with plugin.unscaled_gradients(optimizer):
        assert plugin.gradient_factor() == 1.0
        with plugin.unscaled_gradients(optimizer):
            for p, g in zip(model.parameters(), true, strict=True):
                torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
        for p, g in zip(model.parameters(), true, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    assert plugin.gradient_factor() == MU
    for p, g in zip(model.parameters(), true, strict=True):
        torch.testing.assert_close(p.grad, g * MU, rtol=0, atol=0)


def _converted_plugin(recipe: str = "fp8-lm", wrap_first: bool = False) -> tuple[FP8LMPrecision, nn.Module]:
    """A plugin and its converted model after one backward (non-trivial scaling state); ``wrap_first`` puts the first
    layer in the activation-checkpointing wrapper, which inserts ``_checkpoint_wrapped_module`` into its names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48))
    plugin = FP8LMPrecision(recipe=recipe)
    plugin.convert_module(module)
    if wrap_first:
        module[0] = checkpoint_wrapper(module[0])
    module(torch.randn(8, 32)).square().mean().backward()
    return plugin, module


def test_the_saved_scaling_state_is_keyed_by_the_layers_names_without_wrappers():
    """The docs: the scaling state is keyed by the layers' names without the FSDP, activation-checkpointing and
    torch.compile wrappers, so a run resumes under another wrapping. Reference: the names of the same model unwrapped
    (the core's fp8_state_dict), and a resume of the wrapped run's state into it."""
    from lightning_fp8 import fp8_state_dict

    wrapped_plugin, wrapped = _converted_plugin(wrap_first=True)
    assert any("_checkpoint_wrapped_module" in key for key in fp8_state_dict(wrapped))  # the premise
    plain_plugin, plain = _converted_plugin()
    state = wrapped_plugin.state_dict()
    assert set(state["fp8"]) == set(fp8_state_dict(plain))
    plain_plugin.load_state_dict(state)
    for key, value in fp8_state_dict(plain).items():
        torch.testing.assert_close(value, state["fp8"][key], rtol=0, atol=0, msg=key)


def test_resuming_under_another_recipe_warns():
    import lightning_fp8.warnings

    saver, _ = _converted_plugin("fp8-lm-current")
    loader_plugin, _ = _converted_plugin("fp8-lm")
    lightning_fp8.warnings._seen.clear()
    with pytest.warns(UserWarning, match="resuming with FP8 recipe .* from a checkpoint written with"):
        loader_plugin.load_state_dict(saver.state_dict())
