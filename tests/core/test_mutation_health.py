"""HealthMonitor rules that a mutation audit found unpinned, against the rules as HealthConfig and
docs/guides/monitoring.md state them: the warm-up's length, one plateau alert per window, a spike's step left out of
the plateau test."""

from lightning_fp8.health import HealthConfig, HealthMonitor


def _spike_steps(monitor: HealthMonitor, norms: list[float]) -> list[int]:
    return [e.step for s, g in enumerate(norms) for e in monitor.observe(s, grad_norm=g) if e.kind == "grad_norm_spike"]


def test_the_first_warmup_steps_observations_raise_no_spike_and_the_next_one_can():
    # HealthConfig(warmup_steps=4): "observations before any spike or plateau alert": the 4th observation is still in
    # the warm-up, the 5th is not. The baseline (1.0, 1.1, 0.9, ...) makes 50 a spike by both tests.
    cfg = HealthConfig(window=8, warmup_steps=4)
    assert _spike_steps(HealthMonitor(cfg), [1.0, 1.1, 0.9, 50.0]) == []
    assert _spike_steps(HealthMonitor(cfg), [1.0, 1.1, 0.9, 1.0, 50.0]) == [4]


def test_one_plateau_alert_per_window_and_a_spikes_step_left_out():
    # A flat loss with a flat gradient norm is a plateau. The window holds the steps with a finite loss and gradient
    # norm that are no spike ("a spike's step left out", docs/guides/monitoring.md): with a spike at step 12 the first
    # window of 20 fills at step 20, not 19; after an alert the window starts afresh ("one alert per window"), so the
    # next comes 20 steps later, at step 40, not at every step after the first.
    cfg = HealthConfig(window=10, warmup_steps=5, plateau_window=20)
    monitor = HealthMonitor(cfg)
    plateaus, spikes = [], []
    for step in range(45):
        norm = 50.0 if step == 12 else 1.0 + 0.01 * (step % 3)
        for event in monitor.observe(step, loss=2.0 + 0.001 * (step % 2), grad_norm=norm):
            (spikes if event.kind == "grad_norm_spike" else plateaus).append((event.kind, step))
    assert spikes == [("grad_norm_spike", 12)]
    # The reference: count the non-spike steps, an alert each time plateau_window of them have been collected.
    expected, collected = [], 0
    for step in range(45):
        if step == 12:
            continue
        collected += 1
        if collected == cfg.plateau_window:
            expected.append(("loss_plateau", step))
            collected = 0
    assert expected == [("loss_plateau", 20), ("loss_plateau", 40)]
    assert plateaus == expected
