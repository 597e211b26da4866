"""ScaleJumps boundaries that a mutation audit found unpinned, against the module's documented rules: a scale that
moved by ``jump_factor`` "or more" is a jump, "nothing is alerted before step ``alert_after_steps``" (so at that step
it is), and a jump back "within 2x" of the level before an alerted one ends it (further away, it is a jump of its
own)."""

import warnings

import pytest

from lightning_fp8.monitoring.scale_jumps import ScaleJumps


def _kinds(scales: list[float], alert_after_steps: int = 0) -> list[tuple[int, str]]:
    jumps = ScaleJumps(jump_factor=8.0, alert_after_steps=alert_after_steps, owner="test", alerts_name="alerts")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first drop and rise are warned; the alerts are what is checked
        for step, scale in enumerate(scales):
            jumps.flag({"net.0": {"input": {"scale": scale}}}, step)
    return [(a["step"], a["kind"]) for a in jumps.alerts]


@pytest.mark.parametrize(("factor", "alerted"), [(8.0, True), (4.0, False)])
def test_a_move_of_exactly_jump_factor_is_a_jump(factor, alerted):
    assert _kinds([64.0, 64.0, 64.0 / factor]) == ([(2, "drop")] if alerted else [])
    assert _kinds([64.0, 64.0, 64.0 * factor]) == ([(2, "rise")] if alerted else [])


def test_a_jump_at_step_alert_after_steps_is_alerted_and_one_before_it_is_not():
    assert _kinds([64.0, 64.0, 64.0, 1.0], alert_after_steps=3) == [(3, "drop")]
    assert _kinds([64.0, 64.0, 1.0, 1.0], alert_after_steps=3) == []


def test_a_return_within_2x_ends_the_jump_and_one_further_away_is_a_jump_of_its_own():
    # 64 -> 1 is an alerted drop; back to 32 (2x under 64) ends it; back to 16 (4x under 64, a rise of 16x) does not.
    assert _kinds([64.0, 64.0, 1.0, 32.0]) == [(2, "drop")]
    assert _kinds([64.0, 64.0, 1.0, 16.0]) == [(2, "drop"), (3, "rise")]
