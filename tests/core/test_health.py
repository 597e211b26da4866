"""HealthMonitor: spikes, plateaus, non-finite events, throughput, state round trip; global_norm vs torch."""

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.health import HealthConfig, HealthMonitor, global_norm, memory_gib
from lightning_fp8.optim.master import master_scale


def _noisy(n: int, base: float, rel: float, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (base * (1 + rel * torch.randn(n, generator=g))).tolist()


def test_grad_norm_spike_is_flagged_once_and_not_in_the_baseline():
    monitor = HealthMonitor(HealthConfig(window=30, warmup_steps=10))
    norms = _noisy(40, 1.0, 0.05)
    for step, norm in enumerate(norms):
        assert monitor.observe(step, loss=2.0, grad_norm=norm) == []
    events = monitor.observe(40, loss=2.0, grad_norm=20.0)
    assert [e.kind for e in events] == ["grad_norm_spike"] and events[0].value == 20.0 and events[0].step == 40
    # the spike did not raise the baseline: the next ordinary value is no alert, a second spike is
    assert monitor.observe(41, loss=2.0, grad_norm=1.02) == []
    assert [e.kind for e in monitor.observe(42, loss=2.0, grad_norm=15.0)] == ["grad_norm_spike"]


def test_no_spike_alerts_during_warmup_or_for_ordinary_noise():
    monitor = HealthMonitor(HealthConfig(window=20, warmup_steps=15))
    events = [monitor.observe(s, grad_norm=v) for s, v in enumerate([1.0, 50.0, 1.0] + _noisy(200, 1.0, 0.1))]
    assert sum(map(len, events)) == 0


def test_plateau_needs_a_flat_loss_and_a_flat_grad_norm():
    cfg = HealthConfig(window=10, warmup_steps=5, plateau_window=40, plateau_min_improvement=0.01)
    flat_loss = _noisy(40, 3.0, 0.001, seed=1)
    # learning saturated: loss flat, gradient norm flat -> one plateau alert at the end of the window
    monitor = HealthMonitor(cfg)
    kinds = [
        e.kind
        for s, (lo, g) in enumerate(zip(flat_loss, _noisy(40, 1.0, 0.02, 2), strict=True))
        for e in monitor.observe(s, loss=lo, grad_norm=g)
    ]
    assert kinds == ["loss_plateau"]
    # converging: loss flat but the gradient norm falls -> no alert
    monitor = HealthMonitor(cfg)
    falling = [1.0 * 0.97**s for s in range(40)]
    assert not any(
        monitor.observe(s, loss=lo, grad_norm=g) for s, (lo, g) in enumerate(zip(flat_loss, falling, strict=True))
    )
    # learning: the loss falls -> no alert
    monitor = HealthMonitor(cfg)
    assert not any(monitor.observe(s, loss=3.0 - 0.02 * s, grad_norm=1.0) for s in range(40))


def test_nonfinite_values_and_recovery_actions():
    monitor = HealthMonitor()
    events = monitor.observe(3, loss=float("nan"), grad_norm=float("inf"))
    assert [e.kind for e in events] == ["nonfinite_loss", "nonfinite_grad"]
    event = monitor.record_nonfinite(4, "grad", "skip_step+lower_mu")
    assert event.action == "skip_step+lower_mu" and event.kind == "nonfinite_grad"
    summary = monitor.summary()
    assert summary["events"]["nonfinite_grad"] == 2 and summary["events"]["nonfinite_loss"] == 1
    assert summary["actions"] == ["skip_step+lower_mu"]
    with pytest.raises(ValueError, match="reboot"):
        monitor.record_nonfinite(5, "grad", "reboot")


def test_throughput_and_series():
    monitor = HealthMonitor()
    monitor.observe(1, loss=2.5, samples=24, tokens=24 * 37, seconds=0.5, memory_gib=1.25, param_norm=3.0)
    assert monitor.series["samples_per_sec"] == [(1, 48.0)]
    assert monitor.series["tokens_per_sec"] == [(1, 24 * 37 / 0.5)]
    assert monitor.series["memory_gib"] == [(1, 1.25)] and monitor.series["param_norm"] == [(1, 3.0)]
    assert monitor.series["grad_norm"] == []


def test_state_dict_round_trip_continues_identically(tmp_path):
    cfg = HealthConfig(window=10, warmup_steps=3, plateau_window=20)
    a = HealthMonitor(cfg)
    values = list(zip(_noisy(60, 2.0, 0.01, 3), _noisy(60, 1.0, 0.05, 4), strict=True))
    for s, (lo, g) in enumerate(values[:30]):
        a.observe(s, loss=lo, grad_norm=g)
    state = a.state_dict()
    torch.save(state, tmp_path / "health.pt")
    b = HealthMonitor(cfg)
    b.load_state_dict(torch.load(tmp_path / "health.pt", weights_only=True))
    for s, (lo, g) in enumerate(values[30:], start=30):
        assert a.observe(s, loss=lo, grad_norm=g) == b.observe(s, loss=lo, grad_norm=g)
    assert a.series == b.series and a.events == b.events


def test_global_norm_matches_torch():
    tensors = [torch.randn(13, 7), torch.randn(5), torch.randn(3, 2, 9).bfloat16()]
    expected = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in tensors]))
    torch.testing.assert_close(global_norm(tensors), expected)
    tensors[0][2, 3] = float("nan")
    assert math.isnan(global_norm(tensors).item())
    assert global_norm([]).item() == 0.0


# The O2 master is fp16 (11-bit mantissa) and the reference is the same values exported to fp32: only the fp32
# accumulation order differs, far below this.
PARAM_NORM_RTOL = 1e-3


def test_param_norm_of_o2_masters_is_the_unscaled_weights_norm():
    torch.manual_seed(3)
    model = convert_to_fp8(nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 48)))  # default recipe: O2
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(20, 48), torch.randn(20, 48)
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    weight = model[0].weight
    assert weight.dtype == torch.float16 and master_scale(weight).item() > 1e3  # the storage is scaled
    # model.state_dict()'s hooks export the unscaled weights: the independent reference.
    expected = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in model.state_dict().values()]))
    raw = torch.linalg.vector_norm(torch.cat([p.detach().double().flatten() for p in model.parameters()]))
    assert raw > 100 * expected  # what a naive norm reads
    got = global_norm(model.parameters())
    assert got.item() == pytest.approx(expected.item(), rel=PARAM_NORM_RTOL)
    # A change of the master scale (the storage rescaled with it, exactly: powers of two) leaves the norm alone.
    with torch.no_grad():
        weight.mul_(0.25)
        master_scale(weight).mul_(0.25)
    assert global_norm(model.parameters()).item() == pytest.approx(got.item(), rel=1e-6)


def test_memory_and_config_validation():
    assert memory_gib("cpu")["peak"] > 0
    with pytest.raises(ValueError, match="window"):
        HealthConfig(window=1)
    with pytest.raises(ValueError, match="spike_ratio"):
        HealthConfig(spike_ratio=-1.0)
    with pytest.raises(TypeError, match="HealthConfig"):
        HealthMonitor({"window": 3})
