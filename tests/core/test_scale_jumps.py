"""ScaleJumps (FP8ScaleMonitor's and the Accelerate integration's scale-jump alerts) on synthetic scale series: a
one-step amax spike under delayed scaling drops the scale at once and raises it back when the spike leaves the amax
history, ``amax_history_len`` steps later; that return was alerted as a second event ("amax collapsed")."""

import pytest

from lightning_fp8.monitoring.scale_jumps import ScaleJumps


def _layers(scale: float, role: str = "input") -> dict:
    return {"net.0": {role: {"scale": scale}}}


def _run(jumps: ScaleJumps, scales: list[float], role: str = "input", mus: list[float] | None = None) -> None:
    for step, scale in enumerate(scales):
        jumps.flag(_layers(scale, role), step, mu=None if mus is None else mus[step])


def _kinds(jumps: ScaleJumps) -> list[tuple[int, str]]:
    return [(a["step"], a["kind"]) for a in jumps.alerts]


def test_a_spike_leaving_the_history_is_not_a_second_alert():
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    _run(jumps, [64.0] * 9 + [0.125] * 16 + [64.0] * 10)
    assert _kinds(jumps) == [(9, "drop")]


def test_a_rise_past_the_former_level_and_a_new_drop_are_alerted():
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    with pytest.warns(UserWarning):
        _run(jumps, [64.0] * 5 + [0.125] * 5 + [4096.0] * 5 + [8.0] * 5)
    # 0.125 -> 4096 is not back to 64 (64x above it): a rise of its own; 4096 -> 8 a drop
    assert _kinds(jumps) == [(5, "drop"), (10, "rise"), (15, "drop")]


def test_a_grad_output_return_is_judged_net_of_mu():
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    # mu halves at step 12 (a skipped step), which halves the grad_output scale without any amax moving
    mus = [1024.0] * 12 + [512.0] * 20
    scales = [8.0] * 4 + [2.0**-6] * 8 + [2.0**-7] * 8 + [16.0] * 12  # back to 8 * 1024 = 16 * 512
    _run(jumps, scales, role="grad_output", mus=mus)
    assert _kinds(jumps) == [(4, "drop")]


def test_the_level_before_a_jump_survives_a_state_dict_round_trip():
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    _run(jumps, [64.0] * 5 + [0.125] * 5)
    resumed = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    resumed.load_state_dict(jumps.state_dict())
    for step in range(10, 15):
        resumed.flag(_layers(64.0), step)
    assert _kinds(resumed) == [(5, "drop")]
    old = jumps.state_dict()
    del old["before_jumps"]  # a checkpoint written before it was saved: loads (a return is then alerted)
    resumed.load_state_dict(old)
    bad = {**jumps.state_dict(), "before_jumps": [["net.0", "input", 64.0, "up"]]}
    with pytest.raises(ValueError, match="entry 0 of 'before_jumps' has kind 'up'"):
        resumed.load_state_dict(bad)


def test_a_grad_output_jump_net_of_mu_names_mu_in_its_warning():
    # The raw scale did not move (65536 -> 65536) while mu grew 16x: a jump net of mu, whose warning showed the raw
    # scales alone ("sudden scale rise ... 65536 -> 65536"; found by a sweep). The warning now says mu moved.
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test-mu", alerts_name="alerts")
    said = r"65536 -> 65536 while the gradient scale mu went 1 -> 16 \(judged net of mu\)"
    with pytest.warns(UserWarning, match=said):
        _run(jumps, [65536.0] * 4, role="grad_output", mus=[1.0, 1.0, 16.0, 16.0])
    assert _kinds(jumps) == [(2, "rise")]
    assert (jumps.alerts[0]["from"], jumps.alerts[0]["to"]) == (65536.0, 65536.0)  # the alert keeps the raw scales


def test_a_spike_after_a_lasting_drop_ends_without_a_second_alert():
    # A lasting drop (a new level, 64 -> 4) then a one-step spike on top of it (4 -> 0.25) leaving the history (back
    # to 4): that return undoes the second drop, but was alerted as a rise ("values may underflow"), since only the
    # first alerted jump's level (64) was kept. After any lasting change of level, every later spike's end was alerted.
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    _run(jumps, [64.0] * 3 + [4.0] * 3 + [0.25] * 3 + [4.0] * 3 + [0.25] * 3 + [4.0] * 3)
    assert _kinds(jumps) == [(3, "drop"), (6, "drop"), (12, "drop")]
    # A return to the level before the first drop still ends it (and the drop inside it), whatever came between.
    _run(jumps, [4.0] * 18 + [64.0] * 3)
    assert len(jumps.alerts) == 3 and not jumps.state_dict()["before_jumps"]


def test_the_levels_before_nested_jumps_survive_a_state_dict_round_trip():
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    _run(jumps, [64.0] * 3 + [4.0] * 3 + [0.25] * 3)
    state = jumps.state_dict()
    assert state["before_jumps"] == [["net.0", "input", 64.0, "drop"], ["net.0", "input", 4.0, "drop"]]
    resumed = ScaleJumps(jump_factor=8.0, alert_after_steps=0, owner="test", alerts_name="alerts")
    resumed.load_state_dict(state)
    for step in range(9, 12):  # back to 4: the end of the second drop
        resumed.flag(_layers(4.0), step)
    for step in range(12, 15):  # back to 64: the end of the first
        resumed.flag(_layers(64.0), step)
    assert _kinds(resumed) == [(3, "drop"), (6, "drop")] and not resumed.state_dict()["before_jumps"]
