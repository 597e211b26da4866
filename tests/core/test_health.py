"""HealthMonitor: spikes, plateaus, non-finite events, throughput, state round trip; global_norm vs torch."""

import math
import statistics

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


def _reference_spike_steps(norms: list[float], cfg: HealthConfig) -> list[int]:
    """The documented spike rule (HealthConfig.spike_patience), written independently of HealthMonitor: a spike
    stays out of the baseline; spike_patience spikes in a row replace the baseline window; no spike while the
    window's mean is 0."""
    baseline: list[float] = []  # everything that entered the baseline; the window is its tail
    run: list[float] = []
    spikes = []
    for i, g in enumerate(norms):
        recent = baseline[-cfg.window :]
        spike = False
        if i + 1 > cfg.warmup_steps and len(recent) >= 2:
            mean, std = statistics.fmean(recent), statistics.pstdev(recent)
            spike = mean > 0 and g > mean + cfg.spike_zscore * std and g > cfg.spike_ratio * mean
        if not spike:
            run = []
            baseline.append(g)
            continue
        spikes.append(i)
        run.append(g)
        if len(run) == cfg.spike_patience:
            baseline, run = list(run), []
    return spikes


def _spike_steps(monitor: HealthMonitor, norms: list[float]) -> list[int]:
    return [e.step for s, g in enumerate(norms) for e in monitor.observe(s, grad_norm=g) if e.kind == "grad_norm_spike"]


def test_no_spike_against_a_window_of_zero_gradient_norms():
    """Zero gradient norms (nothing reached the parameters yet) give no level to compare against: the first positive
    norm after them is no spike, and no message prints a ratio against a mean of 0."""
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0, spike_zscore=2.0, spike_ratio=3.0))
    for step in range(6):
        assert monitor.observe(step, grad_norm=0.0) == []
    assert monitor.observe(6, grad_norm=1.0) == []
    assert monitor.observe(7, grad_norm=0.0) == []
    assert monitor.events == []
    # The positive norm is now in the baseline [0, 0, 1, 0]: mean 0.25, std sqrt(3)/4 ~ 0.433. 0.8 is under both
    # thresholds' larger one, max(0.25 + 2 * 0.433, 3 * 0.25) = 1.116; 5.0 is above it.
    assert monitor.observe(8, grad_norm=0.8) == []
    assert [e.kind for e in monitor.observe(9, grad_norm=5.0)] == ["grad_norm_spike"]


@pytest.mark.parametrize(("norm", "spike"), [(5.9, False), (6.1, True), (7.0, True)])
def test_a_spike_after_a_non_zero_window_is_still_reported(norm, spike):
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0, spike_zscore=2.0, spike_ratio=3.0))
    for step, g in enumerate([1.0, 3.0, 1.0, 3.0]):
        assert monitor.observe(step, grad_norm=g) == []
    # Baseline [1, 3, 1, 3]: mean 2, std 1. A spike exceeds both 2 + 2 * 1 = 4 and 3 * 2 = 6 (5.9: only the first).
    events = monitor.observe(4, grad_norm=norm)
    assert [e.kind for e in events] == (["grad_norm_spike"] if spike else [])
    if spike:
        assert events[0].value == norm and events[0].step == 4
        assert f"{norm / 2:.1f}x its recent mean 2 " in events[0].message, events[0].message


def test_zero_norms_before_training_match_the_documented_rule():
    cfg = HealthConfig(window=16, warmup_steps=4)
    norms = [0.0] * 30 + _noisy(100, 1.0, 0.05, seed=5)
    norms[80] = 30.0  # a spike once a non-zero level exists
    got = _spike_steps(HealthMonitor(cfg), norms)
    assert got == [80]
    assert got == _reference_spike_steps(norms, cfg)


@pytest.mark.parametrize("patience", [None, 1, 3, 5])
def test_a_lasting_new_level_is_reported_for_at_most_spike_patience_steps(patience):
    options = {} if patience is None else {"spike_patience": patience}
    cfg = HealthConfig(window=20, warmup_steps=5, **options)
    # the norm settles 10x higher at step 100 (and stays): a new level, not a spike on every later step
    norms = _noisy(100, 1.0, 0.01, seed=5) + _noisy(300, 10.0, 0.01, seed=6)
    monitor = HealthMonitor(cfg)
    got = _spike_steps(monitor, norms)
    assert got == list(range(100, 100 + (patience or 5)))  # default spike_patience: 5 (documented)
    assert got == _reference_spike_steps(norms, cfg)
    assert sum(monitor._grad_norms) / len(monitor._grad_norms) == pytest.approx(10.0, rel=0.02)  # new baseline


@pytest.mark.parametrize("patience", [2, 5])
def test_isolated_spikes_and_level_shifts_match_the_documented_rule(patience):
    cfg = HealthConfig(window=16, warmup_steps=8, spike_patience=patience)
    norms = _noisy(300, 1.0, 0.05, seed=7)
    for s in (40, 41, 90, 150, 152):  # isolated spikes (and a pair): each reported once, baseline kept
        norms[s] = 25.0
    norms[200:] = [8.0 * v for v in norms[200:]]  # a lasting change of level
    norms[260] = 400.0  # a spike on the new level is still seen
    got = _spike_steps(HealthMonitor(cfg), norms)
    expected = _reference_spike_steps(norms, cfg)
    assert got == expected
    if patience > 2:
        assert got == [40, 41, 90, 150, 152, *range(200, 200 + patience), 260]


def test_an_old_state_without_a_spike_run_loads():
    cfg = HealthConfig(window=10, warmup_steps=3)
    a = HealthMonitor(cfg)
    norms = _noisy(30, 1.0, 0.02, seed=8) + [9.0, 9.1, 9.0]  # a run of spikes in progress
    _spike_steps(a, norms)
    state = a.state_dict()
    assert state["spike_run"] == [9.0, 9.1, 9.0]
    b = HealthMonitor(cfg)
    b.load_state_dict(state)  # resumes mid-run: two more spikes adopt the level
    old = {k: v for k, v in state.items() if k != "spike_run"}  # as saved before spike_run existed
    c = HealthMonitor(cfg)
    c.load_state_dict(old)
    tail = [9.05, 9.0, 9.1, 9.0]
    assert [len(b.observe(100 + i, grad_norm=g)) for i, g in enumerate(tail)] == [1, 1, 0, 0]
    assert [len(c.observe(100 + i, grad_norm=g)) for i, g in enumerate(tail)] == [1, 1, 1, 1]  # its run restarts


def test_observe_takes_what_memory_gib_returns():
    monitor = HealthMonitor()
    mem = memory_gib("cpu")
    monitor.observe(0, loss=1.0, memory_gib=mem)
    monitor.observe(1, memory_gib=2.5)
    assert monitor.series["memory_gib"] == [(0, mem["peak"]), (1, 2.5)]
    with pytest.raises(TypeError, match="'peak'"):
        monitor.observe(2, memory_gib={"allocated": 1.0})
    with pytest.raises(TypeError, match="memory_gib.*list"):
        monitor.observe(3, memory_gib=[1.0])
    with pytest.raises(TypeError, match="memory_gib.*str"):  # a numeric string is not a number of GiB
        monitor.observe(3, memory_gib="1")
    # Found by the sweep of the optimizer side: a negative or non-finite amount of memory was recorded as it was.
    for bad in (-3.0, {"peak": -1.0}, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"memory_gib=.* must be a finite number of GiB >= 0; nothing was"):
            monitor.observe(4, loss=1.0, memory_gib=bad)
    assert len(monitor.series["memory_gib"]) == 2 and monitor._observations == 2  # a refused call records nothing
    assert len(monitor.series["loss"]) == 1


@pytest.mark.parametrize(
    ("values", "name"),
    [
        ({"loss": "1.0"}, "loss"),  # recorded as 1.0 before: a numeric string taken for a number
        ({"grad_norm": True}, "grad_norm"),
        ({"param_norm": [1.0, 2.0]}, "param_norm"),
        ({"samples": "8", "seconds": 1.0}, "samples"),  # a raw "unsupported operand type(s) for /" before
        ({"tokens": 8, "seconds": "1"}, "seconds"),
        ({"tokens": torch.ones(3), "seconds": 1.0}, "tokens"),  # several values: not a count
    ],
)
def test_observe_refuses_a_value_that_is_not_a_number_and_records_nothing(values, name):
    monitor = HealthMonitor()
    with pytest.raises(TypeError, match=rf"HealthMonitor.observe\({name}=.*expects a number"):
        monitor.observe(0, **values)
    assert not any(monitor.series.values()) and monitor._observations == 0
    np = pytest.importorskip("numpy")
    # Python, NumPy and one-element tensor numbers still go in.
    monitor.observe(1, loss=np.float32(0.5), samples=np.int64(8), tokens=torch.tensor(16), seconds=0.5)
    assert monitor.series["loss"] == [(1, 0.5)] and monitor.series["tokens_per_sec"] == [(1, 32.0)]
    assert monitor.series["samples_per_sec"] == [(1, 16.0)]


@pytest.mark.parametrize(
    ("name", "value"), [("seconds", -1.0), ("seconds", float("inf")), ("tokens", -8), ("samples", float("nan"))]
)
def test_observe_refuses_negative_or_non_finite_work_and_records_nothing(name, value):
    # seconds=-1 dropped the throughput silently; a negative count gave a negative rate.
    monitor = HealthMonitor()
    values = {"loss": 1.0, "samples": 4, "tokens": 64, "seconds": 0.5, name: value}
    with pytest.raises(ValueError, match=rf"observe\({name}=.*finite number >= 0"):
        monitor.observe(0, **values)
    assert not any(monitor.series.values()) and monitor._observations == 0
    monitor.observe(1, loss=1.0, tokens=64, seconds=0.0)  # no time elapsed: no rate, the rest is recorded
    assert monitor.series["loss"] == [(1, 1.0)] and not monitor.series["tokens_per_sec"]


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


def test_one_bad_batch_in_a_falling_loss_is_a_spike_not_a_plateau():
    """Found by a sweep (default HealthConfig): a 20x loss and gradient norm at one step raised grad_norm_spike and,
    later, loss_plateau, as the outlier lifted the mean loss of the window's second half above the first's."""
    monitor = HealthMonitor()
    events = []
    for step in range(400):
        loss, norm = 3.0 * 0.9997**step, 1.0 + 0.01 * (step % 3)  # the loss falls ~3% between window halves
        if step == 300:
            loss, norm = loss * 20, norm * 20
        events += monitor.observe(step, loss=loss, grad_norm=norm)
    assert [(e.step, e.kind) for e in events] == [(300, "grad_norm_spike")]
    # A loss outlier alone (the gradient norm as usual): the halves' medians still show the fall.
    monitor = HealthMonitor()
    losses = [3.0 * 0.9997**step * (20 if step == 300 else 1) for step in range(400)]
    assert not any(monitor.observe(step, loss=loss, grad_norm=1.0) for step, loss in enumerate(losses))


def test_a_rising_loss_is_reported_as_rising():
    cfg = HealthConfig(window=10, warmup_steps=5, plateau_window=40)
    monitor = HealthMonitor(cfg)
    events = [e for s in range(40) for e in monitor.observe(s, loss=3.0 * 1.01**s, grad_norm=1.0)]
    assert [e.kind for e in events] == ["loss_plateau"] and "loss rose" in events[0].message


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


@pytest.mark.parametrize(("source", "action", "words"), [
    ("los", "skip_step", "source='los'"),  # was recorded as a non-finite gradient
    ("weights", "skip_step", "source='weights'"),
    ("grad", None, "action=None"),  # was an AttributeError from None.split
    ("grad", "none+skip_step", "'none' (nothing was done) cannot be joined"),  # was recorded as that action
])  # fmt: skip
def test_record_nonfinite_refuses_an_unknown_source_or_a_non_string_action(source, action, words):
    monitor = HealthMonitor()
    with pytest.raises(ValueError, match="record_nonfinite") as info:
        monitor.record_nonfinite(1, source, action)
    assert words in str(info.value) and monitor.events == []
    assert monitor.record_nonfinite(1, "grad_norm", "skip_step").kind == "nonfinite_grad"


def test_config_takes_numpy_numbers_as_a_recipe_does():
    import numpy as np

    config = HealthConfig(window=np.int64(5), plateau_window=np.int32(8), spike_zscore=np.float32(2.5))
    assert (config.window, config.plateau_window, config.spike_zscore) == (5, 8, 2.5)
    assert type(config.window) is int and type(config.spike_zscore) is float  # plain numbers in a saved state
    with pytest.raises(ValueError, match="window"):
        HealthConfig(window=np.int64(1))


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


def test_numpy_and_tensor_steps_and_tensor_values_round_trip(tmp_path):
    """Steps from np.arange or a 0-dim tensor, and a tensor loss given to record_nonfinite, are stored as Python
    numbers: the state dict loads with torch.load(weights_only=True) and load_state_dict takes it back (a NumPy step
    failed the load, a tensor step or value the checks)."""
    np = pytest.importorskip("numpy")
    a = HealthMonitor()
    for step in np.arange(3):
        a.observe(step, loss=torch.tensor(2.0), grad_norm=1.0)
    a.observe(torch.tensor(3), loss=2.0, grad_norm=1.0)
    a.record_nonfinite(np.int64(4), "loss", "skip_step", value=torch.tensor(float("nan")))
    assert [type(s) for s, _ in a.series["loss"]] == [int] * 4 and type(a.events[-1].step) is int
    torch.save(a.state_dict(), tmp_path / "health.pt")
    b = HealthMonitor()
    b.load_state_dict(torch.load(tmp_path / "health.pt", weights_only=True))
    assert b.series == a.series and len(b.events) == 1 and math.isnan(b.events[0].value)
    with pytest.raises(TypeError, match=r"observe\(step=2.5\): the step must be an integer"):
        a.observe(2.5, loss=1.0)


def _sharded_norm_worker(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    # Rank 1 holds no shard of these tensors (FSDP1's flat parameter with use_orig_params: an optimizer's params
    # all on rank 0); the collective that follows must still pair with its own on every rank.
    mine = [torch.full((4,), 3.0)] if rank == 0 else []
    norm = global_norm(mine, sharded=True)
    # Float64 tensors on rank 0 only (summed in float64 there, in fp32 on rank 1): the ranks' sums still meet.
    wide = global_norm([torch.full((4,), 1e20, dtype=torch.float64)] if rank == 0 else [], sharded=True)
    after = torch.tensor([10.0 + rank])
    dist.all_reduce(after)
    return [norm.item(), wide.item(), after.item()]


def test_sharded_global_norm_is_a_collective_on_every_rank():
    """A rank without tensors skipped the all-reduce: the others' sum paired with the next collective."""
    from tests.distributed.launch import run_workers

    results = run_workers(_sharded_norm_worker, 2, timeout=60)
    for norm, _, after in results:
        assert norm == 6.0 and after == 21.0
    assert [wide for _, wide, _ in results] == [pytest.approx(2e20, rel=1e-12)] * 2  # fp32 on rank 1 read inf


def test_global_norm_of_complex_tensors_and_missing_gradients_matches_torch():
    # Found by a sweep: t.float() dropped the imaginary parts (|3+4j| counted as 3), a None gradient failed on
    # .detach(), and a module was iterated as its children.
    z, r = torch.tensor([3 + 4j, 1 - 2j]), torch.tensor([12.0, -1.0])
    expected = torch.linalg.vector_norm(torch.cat([z.abs(), r]))
    torch.testing.assert_close(global_norm([z, None, r]), expected)
    torch.testing.assert_close(global_norm([z]), torch.linalg.vector_norm(z))
    for wrong in (nn.Linear(2, 2), torch.ones(3)):
        with pytest.raises(TypeError, match="global_norm takes an iterable of tensors"):
            global_norm(wrong)


def test_skipped_step_action_takes_one_fallback_name_as_well():
    from lightning_fp8.health import skipped_step_action

    assert skipped_step_action("lower_lr") == skipped_step_action(["lower_lr"]) == "skip_step+lower_mu+lower_lr"
    assert skipped_step_action(["none"]) == "skip_step+lower_mu"


def test_global_norm_matches_torch():
    tensors = [torch.randn(13, 7), torch.randn(5), torch.randn(3, 2, 9).bfloat16()]
    expected = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in tensors]))
    torch.testing.assert_close(global_norm(tensors), expected)
    tensors[0][2, 3] = float("nan")
    assert math.isnan(global_norm(tensors).item())
    assert global_norm([]).item() == 0.0


def test_global_norm_of_every_float_dtype_matches_a_float64_reference():
    # One fused norm per dtype: fp16 values whose squares pass fp16's range (60000**2) are summed in fp32, float64
    # ones in float64 (a norm takes no narrowing), an empty tensor adds nothing.
    tensors = [torch.randn(5, dtype=torch.float64) * 1e3, torch.randn(0), torch.full((3,), 6e4, dtype=torch.float16),
               torch.randn(4, 3).bfloat16(), torch.randn(7), torch.randn(2, dtype=torch.float16)]  # fmt: skip
    expected = math.sqrt(sum(t.double().square().sum().item() for t in tensors))
    assert global_norm(tensors).item() == pytest.approx(expected, rel=1e-6)
    assert global_norm(reversed(tensors)).item() == pytest.approx(expected, rel=1e-6)


def test_global_norm_of_float64_tensors_is_summed_in_float64_as_torch():
    # The squares were summed in fp32: a float64 gradient of 1e20 (finite; its square passes fp32's range) had an
    # infinite norm, and the norm of float64 values lost all but fp32's precision. torch.nn.utils.get_total_norm
    # sums and returns in float64 there; fp32 and lower inputs alone still give fp32.
    big = torch.tensor([1e20, -3e19], dtype=torch.float64)
    fine = torch.full((1000,), 1.0 + 1e-9, dtype=torch.float64)
    mixed = [big, torch.randn(4, 3), torch.randn(5).bfloat16(), torch.tensor([3e19 + 4e19j], dtype=torch.complex128)]
    for tensors in ([big], [fine], mixed):
        expected = torch.nn.utils.get_total_norm([t.abs() if t.is_complex() else t for t in tensors])
        got = global_norm(tensors)
        assert got.dtype == torch.float64 == expected.dtype
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)
    assert global_norm([torch.randn(3), torch.randn(2).half()]).dtype == torch.float32


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
    for name in ("spike_zscore", "spike_ratio", "plateau_min_improvement", "plateau_grad_norm_drop"):
        with pytest.raises(ValueError, match=rf"HealthConfig\({name}=inf\) must be a finite"):
            HealthConfig(**{name: float("inf")})  # spike_ratio=inf was taken (it turned spike alerts off)
    with pytest.raises(ValueError, match="spike_patience"):
        HealthConfig(spike_patience=0)
    with pytest.raises(TypeError, match="HealthConfig"):
        HealthMonitor({"window": 3})


@pytest.mark.parametrize(("entry", "value", "error"), [
    ("events", [{"bogus": 1}], TypeError),
    ("events", [{"step": 1, "kind": "meteor", "value": 1.0, "message": ""}], ValueError),
    ("observations", -5, ValueError),
    ("observations", "abc", TypeError),
    ("grad_norms", [float("nan"), 1.0], ValueError),
    ("plateau_loss", [1.0, "x"], TypeError),
    ("series", {"loss": [[1, 2.0, 3]]}, TypeError),
    ("series", {"lost": []}, ValueError),
    ("plateau_grad", None, KeyError),  # None: the entry is missing
    ("plateau_grad", [1.0, 2.0], ValueError),  # 3 losses, 2 norms: the plateau test pairs them by step
])  # fmt: skip
def test_load_state_dict_refuses_a_bad_entry_and_changes_nothing(entry, value, error):
    # It checked nothing: some bad values loaded, others raised after `series` had been replaced.
    saved = HealthMonitor()
    for step in range(3):
        saved.observe(step, loss=2.0 - step, grad_norm=1.0 + step)
    state = saved.state_dict()
    if value is None:
        del state[entry]
    else:
        state[entry] = value
    monitor = HealthMonitor()
    monitor.observe(0, loss=5.0, grad_norm=3.0)
    before = monitor.state_dict()
    with pytest.raises(error, match="HealthMonitor.load_state_dict: .*Nothing was loaded"):
        monitor.load_state_dict(state)
    assert monitor.state_dict() == before
    monitor.load_state_dict(saved.state_dict())  # the good state still loads
    assert monitor.state_dict() == saved.state_dict()


@pytest.mark.parametrize("fallback", ["bf16", "lower_lr"])
@pytest.mark.parametrize("name", ["proj", "lr_proj", "lr", "bf16"])
def test_scaler_fallbacks_name_the_action_taken_whatever_the_layer_names(fallback, name):
    # The action is read from the scaler's description of what it did; a layer named "lr_proj" (listed in the
    # bf16 fallback's description) made a put-back read as a lowered learning rate.
    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.health import scaler_fallbacks

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.ModuleDict({name: nn.Linear(16, 16)})))
    scaler = FP8GradScaler(nonfinite_fallback=fallback, model=model, fallback_after=1)
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
    scaler.scale_loss(model[0][name](torch.randn(4, 16)).square().mean() * float("inf")).backward()
    opt.step()
    put_back = type(model[0][name]) is nn.Linear
    lowered = opt.param_groups[0]["lr"] < 1e-3
    assert put_back != lowered  # the fallback did one of the two
    assert scaler_fallbacks(scaler.history, -1)[0] == ["fallback_bf16" if put_back else "lower_lr"]


def test_bool_steps_negative_norms_and_bad_nonfinite_values_are_refused_recording_nothing():
    # Found by a sweep: observe(step=True) was step 1 (every value refuses bools), a negative gradient norm was taken
    # (and the next plateau check read "+120%"), record_nonfinite(value=None / "abc") failed in float().
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    with pytest.raises(TypeError, match=r"observe\(step=True\): the step must be an integer"):
        monitor.observe(True, loss=1.0)
    for name in ("grad_norm", "param_norm"):
        with pytest.raises(ValueError, match=rf"observe\({name}=-5.0\) must be >= 0 \(a norm\)"):
            monitor.observe(1, **{name: -5.0})
    with pytest.raises(TypeError, match=r"record_nonfinite\(value='abc'\) expects a number"):
        monitor.record_nonfinite(1, "grad", "skip_step", value="abc")
    with pytest.raises(TypeError, match=r"record_nonfinite\(value=None\)"):
        monitor.record_nonfinite(1, "grad", "skip_step", value=None)
    assert not any(monitor.series.values()) and not monitor.events
    monitor.observe(1, grad_norm=float("nan"))  # non-finite norms are events, not refusals
    assert [e.kind for e in monitor.events] == ["nonfinite_grad"]


@pytest.mark.parametrize("value", [1.5, 0.0, torch.tensor(2.0)])
def test_record_nonfinite_refuses_a_finite_value_recording_nothing(value):
    # A finite value was recorded as a non-finite event: "step 3: non-finite loss (1.5)".
    monitor = HealthMonitor()
    with pytest.raises(ValueError, match=r"record_nonfinite\(value=.*\) is finite: it records a non-finite loss"):
        monitor.record_nonfinite(3, "loss", "skip_step", value=value)
    assert not monitor.events
    for seen in (math.inf, -math.inf, math.nan):
        assert monitor.record_nonfinite(3, "loss", "skip_step", value=seen).kind == "nonfinite_loss"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a CUDA device without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_memory_gib_of_a_cuda_device_without_cuda_raises(device):
    # It returned the process's peak RSS ({"peak": ...}) as that GPU's memory.
    with pytest.raises(RuntimeError, match=r"memory_gib\('cuda.*CUDA is not available.*'cpu'"):
        memory_gib(device)


def _dtensor_norm_worker(rank: int, world: int) -> tuple[list[tuple[float, float]], float, float, int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh1, mesh2 = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))
    gen = torch.Generator().manual_seed(0)
    placed = [(mesh1, [Shard(0)]), (mesh1, [Shard(1)]), (mesh1, [Replicate()]), (mesh2, [Shard(0), Shard(1)]),
              (mesh2, [Replicate(), Shard(0)]), (mesh2, [Shard(1), Replicate()]),
              # FSDP2 over a colwise tensor-parallel weight: _StridedShard on the data-parallel dimension (no Shard
              # subclass in recent torch: taken for replicated, each data-parallel rank summed only its own rows)
              (mesh2, [_StridedShard(0, split_factor=world // 2), Shard(0)])]  # fmt: skip
    fulls = [torch.randn(8, 6, generator=gen) for _ in placed]
    placed.append((mesh1, [Shard(0)]))  # 5 rows over 4 ranks: one rank without any
    fulls.append(torch.randn(5, 3, generator=gen))
    tensors = [distribute_tensor(f, mesh, p) for f, (mesh, p) in zip(fulls, placed, strict=True)]
    partial = torch.randn(4, 4, generator=gen)  # each rank holds a quarter: a reduction pending
    tensors.append(DTensor.from_local(partial / world, mesh1, [Partial()]))
    fulls.append(partial)
    each = [(global_norm([t]).item(), f.double().norm().item()) for t, f in zip(tensors, fulls, strict=True)]
    layers = [torch.randn(12, 4, generator=gen) for _ in range(10)]  # an FSDP2 model's many parameters: one group
    tensors += [distribute_tensor(f, mesh1, [Shard(0)]) for f in layers]
    expected = torch.cat([t.double().flatten() for t in [*fulls, *layers]]).norm()
    with CommDebugMode() as comms:
        norm = global_norm(tensors)
    return each, norm.item(), expected.item(), comms.get_total_counts(), len(tensors)


def test_global_norm_of_dtensors_sums_local_shards_with_one_collective_per_placement():
    """DTensors sharded on one or two mesh dimensions (FSDP2's strided shard too), replicated, unevenly sharded and
    partial: each norm, and the norm of all, match float64 over the full tensors, with a handful of collectives (one
    per mesh and set of sharded dimensions, per dimension, plus the partial tensor's reduction), not one per tensor."""
    from tests.distributed.launch import run_workers

    for each, norm, expected, collectives, n_tensors in run_workers(_dtensor_norm_worker, 4, timeout=120):
        assert [got for got, _ in each] == pytest.approx([want for _, want in each], rel=1e-6)
        assert norm == pytest.approx(expected, rel=1e-6)
        assert collectives <= 8 < n_tensors, collectives
