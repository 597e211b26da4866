"""Several models prepared by one lightning_fp8.accelerate.Accelerator (an encoder and a head, a frozen teacher...):
mu rescales every model's FP8 scaling states, the report covers all of them, and a model prepared after the optimizer
that trains it is refused. Checked against the same models prepared as one module."""

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8 import FP8Linear, fp8_state_dict
from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import (
    Net,
    _fresh_accelerate_state,  # noqa: F401 (autouse fixture)
)


class Both(nn.Module):
    """``net(enc(x))`` as one module: the reference a run preparing ``enc`` and ``net`` apart must match."""

    def __init__(self, enc: nn.Module, net: nn.Module) -> None:
        super().__init__()
        self.enc, self.net = enc, net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.enc(x))


def _fresh_state() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()



def _models(frozen_net: bool = False) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48))
    net = Net()
    net.requires_grad_(not frozen_net)
    trained = list(enc.parameters()) + ([] if frozen_net else list(net.parameters()))
    return enc, net, torch.optim.AdamW(trained, lr=1e-2)


def _batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 48, generator=generator), torch.randint(0, 10, (12,), generator=generator))
            for _ in range(n)]  # fmt: skip


def _train(accelerator, forward, optimizer, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(forward(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _run(how: str, frozen_net: bool = False):
    """Train ``net(enc(x))`` with mu doubling at every step; ``how``: ``"one"`` module, ``"two"`` models in one
    prepare, or ``"late"``: the (frozen) net prepared after the optimizer. Returns the losses, mu, net's FP8 state."""
    _fresh_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    enc, net, optimizer = _models(frozen_net)
    if how == "one":
        both, optimizer = accelerator.prepare(Both(enc, net), optimizer)
        forward, net = both, both.net
    elif how == "two":
        enc, net, optimizer = accelerator.prepare(enc, net, optimizer)
        forward = lambda x: net(enc(x))  # noqa: E731
    else:
        enc, optimizer = accelerator.prepare(enc, optimizer)
        net = accelerator.prepare(net)
        forward = lambda x: net(enc(x))  # noqa: E731
    accelerator.fp8_grad_scaler.growth_interval = 1  # mu doubles after every step: 2, 4, 8, ...
    losses = _train(accelerator, forward, optimizer, _batches())
    return losses, accelerator.fp8_grad_scaler.get_scale(), fp8_state_dict(net)


def _assert_same_run(run, reference) -> None:
    losses, mu, state = run
    assert losses == reference[0]  # bit for bit
    assert mu == reference[1] == 2.0 ** len(losses)
    assert state.keys() == reference[2].keys()
    for key, value in state.items():
        torch.testing.assert_close(value, reference[2][key], rtol=0, atol=0, msg=key)


def test_mu_changes_rescale_the_fp8_states_of_every_prepared_model():
    """Found by the accelerate sweep: with two FP8 models the scaler was built with no model, so no grad_output state
    followed mu: after each change up to 17% of the output-gradient casts saturated and the losses depended on mu."""
    _assert_same_run(_run("two"), _run("one"))


def test_a_model_prepared_after_the_optimizer_is_rescaled_too():
    # A frozen model between the trained one and the loss casts mu-scaled output gradients (its dgrad GEMMs): the
    # scaler, built at the first prepare, must learn of it at the second.
    _assert_same_run(_run("late", frozen_net=True), _run("one", frozen_net=True))


def test_save_and_load_state_with_two_models_continue_like_the_uninterrupted_run(tmp_path):
    # mu changes at every step; the resumed run's scaler rescales both models' states from the loaded ones.
    batches = _batches()

    def run(steps, load=None, save=None):
        _fresh_state()
        accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
        enc, net, optimizer = _models()
        enc, net, optimizer = accelerator.prepare(enc, net, optimizer)
        accelerator.fp8_grad_scaler.growth_interval = 1
        if load is not None:
            accelerator.load_state(str(load))
        losses = _train(accelerator, lambda x: net(enc(x)), optimizer, [batches[i] for i in steps])
        if save is not None:
            accelerator.save_state(str(save))
        return losses, accelerator.fp8_grad_scaler.get_scale(), fp8_state_dict(net)

    full = run(range(8))
    run(range(4), save=tmp_path / "ckpt")
    losses, mu, state = run(range(4, 8), load=tmp_path / "ckpt")
    _assert_same_run((full[0][:4] + losses, mu, state), full)


def _poisoned_loss(enc, net, batch) -> torch.Tensor:
    """A non-finite loss whose non-finite gradients reach net.fc2 (and the layers after it), no other FP8 layer."""
    x, y = batch
    h = torch.relu(net.fc1(enc(x))).detach()
    return nn.functional.cross_entropy(net.head(torch.relu(net.fc2(net.norm(h)))), y) * torch.inf


def test_bf16_fallback_puts_back_layers_of_any_prepared_model(tmp_path):
    # With several models the scaler had no model, and the fallback failed on None after skipping the step.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    enc, net, optimizer = _models()
    enc, net, optimizer = accelerator.prepare(enc, net, optimizer)
    scaler = accelerator.fp8_grad_scaler
    scaler.nonfinite_fallback, scaler.fallback_after = "bf16", 1
    batch = _batches(1)[0]
    accelerator.backward(_poisoned_loss(enc, net, batch))
    optimizer.step()
    optimizer.zero_grad()
    assert type(net.fc2) is nn.Linear and isinstance(net.fc1, FP8Linear) and isinstance(enc[2], FP8Linear)
    assert scaler.history[-1]["action"] == "fallback" and "model1.fc2" in scaler.history[-1]["reason"]
    _train(accelerator, lambda x: net(enc(x)), optimizer, [batch])
    accelerator.save_state(str(tmp_path))
    saved = torch.load(tmp_path / "lightning_fp8" / "rank0.pt", weights_only=True)
    assert saved["fallen_back_layers"] == [[], ["fc2"]]


def test_bf16_fallback_refuses_a_prepared_model_that_is_itself_an_fp8_layer():
    # In the scaler's container of the models, the fallback would replace such a model there only.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    enc, net, optimizer = _models()
    layer = nn.Linear(48, 48)
    optimizer.add_param_group({"params": layer.parameters()})
    layer, net, optimizer = accelerator.prepare(layer, net, optimizer)
    assert isinstance(layer, FP8Linear)
    loss = lambda: nn.functional.cross_entropy(net(layer(batch[0])), batch[1])  # noqa: E731
    batch = _batches(1)[0]
    accelerator.backward(loss())  # no fallback chosen: allowed
    optimizer.step()
    accelerator.fp8_grad_scaler.nonfinite_fallback = "bf16"
    with pytest.raises(ValueError, match=r"cannot put back model0 \(FP8Linear\).*nn.Sequential\(layer\).*lower_lr"):
        accelerator.backward(loss())


def test_model_prepared_after_the_optimizer_that_trains_it_is_an_error():
    """Found by the accelerate sweep: prepare(enc, optimizer) then prepare(net) converted net's layers after the
    optimizer became FP8AdamW, which trained their weights with fp32 states and no fp16 master, without a word."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    enc, net, optimizer = _models()
    enc, optimizer = accelerator.prepare(enc, optimizer)
    with pytest.raises(ValueError, match=r"prepare\(Net\) after the optimizer.*\['fc1', 'fc2'\] .*same call"):
        accelerator.prepare(net)
    with pytest.raises(ValueError, match=r"prepare\(Net\) after the optimizer"):
        accelerator.prepare_model(net)
    assert type(net.fc1) is nn.Linear and type(net.fc2) is nn.Linear  # nothing was converted
    assert accelerator.fp8_report["converted_layers"] == 2
    assert accelerator.prepare(enc) is enc  # a model prepared already may be prepared again


@pytest.mark.parametrize("why", ["sizes", "filter"])
def test_a_model_whose_layers_stay_in_high_precision_may_be_prepared_after_the_optimizer(why):
    """Only the layers the conversion converts count (the review of the refusal above): a late head of 10 outputs, or
    one the user's filter leaves out, trains as an ordinary parameter either way, as it did before the refusal."""
    kwargs = {"fp8_module_filter": lambda m, fqn: False} if why == "filter" else {}
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", **kwargs)
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48))
    head = nn.Sequential(nn.Linear(48, 10 if why == "sizes" else 16))
    optimizer = torch.optim.AdamW([*enc.parameters(), *head.parameters()], lr=1e-3)
    enc, optimizer = accelerator.prepare(enc, optimizer)
    head = accelerator.prepare(head)
    assert type(head[0]) is nn.Linear
    before = head[0].weight.detach().clone()
    accelerator.backward(head(enc(torch.randn(8, 48))).float().square().mean())
    optimizer.step()
    assert not torch.equal(head[0].weight.detach(), before)


def test_models_prepared_with_the_optimizer_get_o2_states():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    enc, net, optimizer = _models()
    enc = accelerator.prepare(enc)  # before the optimizer, or in the same call
    net, optimizer = accelerator.prepare(net, optimizer)
    weights = [enc[0].weight, enc[2].weight, net.fc1.weight, net.fc2.weight]
    assert all(w.dtype == torch.float16 for w in weights)  # the fp16 masters of FP8AdamW (O2)


def test_fp8_report_covers_every_prepared_model():
    """Found by the accelerate sweep: the report described the last model prepared only."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    enc, net, optimizer = _models()
    enc.append(nn.Linear(48, 24))  # stays high precision (24 is not a multiple of 16)
    enc, net, optimizer = accelerator.prepare(enc, net, optimizer)
    report = accelerator.fp8_report
    assert report["converted_layers"] == 4
    assert report["high_precision_linears"] == ["model0.3", "model1.head"]
    assert report["emulated_gemm"] is True and report["optimizer"] == "AdamW -> FP8AdamW"
    # Named as the logged statistics name the models.
    assert {name.split("/")[1] for name in accelerator.fp8_log_values() if name.startswith("fp8/")} == {
        "model0",
        "model1",
    }
