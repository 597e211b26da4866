"""HealthMonitor.load_state_dict's checks that a mutation audit of lightning_fp8/monitoring/state.py found unpinned,
against load_state_dict's contract (every entry checked before any is loaded; a refused dict changes nothing) and the
names lightning_fp8.monitoring.events writes down: 'observations' is an int >= 0 (0 taken, -1 refused), an event's
action is "+"-joined names of ACTIONS (the integrations' "skip_step+lower_mu+lower_lr" taken, an unknown part
refused)."""

import pytest

from lightning_fp8.health import HealthConfig, HealthMonitor
from lightning_fp8.monitoring.events import ACTIONS


def _saved() -> dict:
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    for step in range(3):
        monitor.observe(step, loss=2.0 - 0.1 * step, grad_norm=1.0 + step)
    monitor.observe(3, loss=float("inf"))  # a non-finite loss: one event in the state
    state = monitor.state_dict()
    assert len(state["events"]) == 1
    return state


def _refused_and_nothing_loaded(state: dict, error: type[Exception], words: str) -> None:
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    monitor.observe(0, loss=5.0, grad_norm=3.0)
    before = monitor.state_dict()
    with pytest.raises(error, match=rf"HealthMonitor.load_state_dict: .*{words}.*Nothing was loaded"):
        monitor.load_state_dict(state)
    assert monitor.state_dict() == before


def test_observations_must_be_at_least_zero():
    state = _saved()
    state["observations"] = -1
    _refused_and_nothing_loaded(state, ValueError, r"'observations' is -1, expected an int >= 0")
    state["observations"] = 0
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    monitor.load_state_dict(state)
    assert monitor.state_dict()["observations"] == 0


@pytest.mark.parametrize("action", ["reboot", "skip_step+reboot", "skip_step+", "SKIP_STEP"])
def test_an_event_whose_action_has_a_part_not_among_the_actions_is_refused(action):
    assert not set(action.split("+")) <= set(ACTIONS)  # the reference: the names events.ACTIONS lists
    state = _saved()
    state["events"][0]["action"] = action
    _refused_and_nothing_loaded(state, ValueError, "event 0 has message .* and action")


@pytest.mark.parametrize("action", ["none", "skip_step+lower_mu", "skip_step+lower_mu+lower_lr", "fallback_bf16"])
def test_an_event_with_known_actions_loads_as_it_was_saved(action):
    state = _saved()
    state["events"][0]["action"] = action
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    monitor.load_state_dict(state)
    assert monitor.state_dict()["events"] == state["events"]


@pytest.mark.parametrize("step", [1.5, 3.0, "3"])
def test_an_event_step_that_is_not_an_int_is_refused(step):
    state = _saved()
    state["events"][0]["step"] = step
    _refused_and_nothing_loaded(state, TypeError, "the step of event 0 is .*, expected an int")


@pytest.mark.parametrize("value", [{"a": 1.0}, 2.0, "1.0"])
def test_a_window_entry_that_is_not_a_list_is_refused(value):
    state = _saved()
    state["grad_norms"] = value
    _refused_and_nothing_loaded(state, TypeError, "'grad_norms' is .*, expected a list")
