"""Sudden moves of the FP8 scales between two logs: what ``FP8ScaleMonitor`` (Lightning) and the Accelerate
integration's ``accelerator.log`` count as ``fp8/alerts/scale_drops`` and ``fp8/alerts/scale_rises``.

A scale that dropped by ``jump_factor`` or more since the previous log means its amax jumped (overflow is near); one
that rose as much means its amax collapsed (values may underflow). A ``grad_output`` scale is compared net of the
change of the gradient scale mu, which moves it without any amax moving. Scales normally move a lot while training
starts, so nothing is alerted before step ``alert_after_steps``. A jump that undoes an alerted one (the scale back
within 2x of its level before it: a one-step spike's amax leaving the delayed-scaling history ``amax_history_len``
steps later) is its end, not a new event, and is not alerted. Every alert is kept in
:attr:`ScaleJumps.alerts`;
the first drop and the first rise are also warned, once each. The state (the alerts, the scales and mu of the last
log) is plain lists, strings and numbers (``torch.load(weights_only=True)`` reads it), checked entry by entry before
any is loaded.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from lightning_fp8.scaling import ROLES
from lightning_fp8.warnings import warn_once


class ScaleJumps:
    """The scale-jump alerts of one monitor (see the module docstring).

    Args:
        jump_factor: scale ratio between two logs that counts as sudden (> 1; checked by the owner).
        alert_after_steps: the step before which nothing is alerted.
        owner: the owner's name in warnings and errors (``"FP8ScaleMonitor"``).
        alerts_name: where the owner's users find :attr:`alerts` (named in the warning).
    """

    def __init__(self, jump_factor: float, alert_after_steps: int, owner: str, alerts_name: str) -> None:
        self.jump_factor = float(jump_factor)
        self.alert_after_steps = alert_after_steps
        self.owner, self.alerts_name = owner, alerts_name
        self.alerts: list[dict[str, Any]] = []
        self._warned_kinds: set[str] = set()
        self._previous_scales: dict[tuple[str, str], float] = {}
        self._previous_mu: float | None = None  # the gradient scale mu at the last log
        # (layer, role) -> [(the scale before an alerted jump, net of mu as below; that jump's kind), ...] of the
        # alerted jumps not ended yet, oldest first: a later jump of the other kind back to within 2x of one of those
        # levels ends that jump (and those alerted after it) and is not alerted. Every one is kept, not only the first:
        # after a lasting drop (a new level), a spike on top of it and its return are a drop and its end.
        self._before_jump: dict[tuple[str, str], list[tuple[float, str]]] = {}

    def flag(
        self, layers: dict[str, dict[str, dict[str, Any]]], step: int, mu: float | None = None, record: bool = True
    ) -> list[tuple[str, str]]:
        """Compare ``layers``' scales (``fp8_stats(...)["layers"]``) with those of the last recorded call and return
        the jumps as ``(layer, kind)`` pairs, ``kind`` ``"drop"`` or ``"rise"``. With ``record`` (a log) they are
        alerted at ``step`` and these scales become the next call's baseline; without it (a look at the values)
        nothing changes."""
        # A grad_output scale is compared times mu: a change of mu (16x while fp16 gradients underflow, halvings on
        # skipped steps) moves it by 1 / the change without any amax moving. (Not where either mu is unknown: a
        # checkpoint written before mu was saved beside the scales, a run without a gradient scaler.)
        mu_change = mu / self._previous_mu if mu and self._previous_mu else 1.0
        # mu now and at the previous log (1 where unknown), to keep a grad_output scale before a jump net of mu
        mu_now = mu if mu else 1.0
        mu_before = mu_now / mu_change
        if record:
            self._previous_mu = float(mu) if mu else None
        jumps = []
        for layer, roles in layers.items():
            for role in ROLES:
                if role not in roles:
                    continue
                scale = roles[role]["scale"]
                if not math.isfinite(scale) or scale <= 0:  # no ratio to take, now or at the next log
                    continue
                previous = self._previous_scales.get((layer, role))
                if record:
                    self._previous_scales[(layer, role)] = scale
                if previous is None or step < self.alert_after_steps:
                    continue
                ratio = scale / previous * (mu_change if role == "grad_output" else 1.0)
                if ratio <= 1 / self.jump_factor or ratio >= self.jump_factor:
                    kind = "drop" if ratio < 1 else "rise"
                    grad = role == "grad_output"
                    if self._undoes(layer, role, kind, scale * (mu_now if grad else 1.0), record):
                        continue
                    jumps.append((layer, kind))
                    if record:
                        level = previous * (mu_before if grad else 1.0)
                        self._before_jump.setdefault((layer, role), []).append((level, kind))
                        mus = (mu_before, mu_now) if grad and mu_change != 1.0 else None
                        self._alert(step, layer, role, kind, previous, scale, mus)
        return jumps

    def _undoes(self, layer: str, role: str, kind: str, net: float, record: bool) -> bool:
        """Whether this jump of ``kind`` to ``net`` (the scale, net of mu) brings ``(layer, role)`` back to within 2x
        (a binade's drift) of its level before an alerted jump of the other kind not ended yet, the latest such one
        (which it then ends, with ``record``, together with the jumps alerted after it: it left them too)."""
        pending = self._before_jump.get((layer, role), [])
        for index in range(len(pending) - 1, -1, -1):
            level, pending_kind = pending[index]
            if pending_kind != kind and 0.5 <= net / level <= 2.0:
                if record:
                    del pending[index:]
                    if not pending:
                        del self._before_jump[(layer, role)]
                return True
        return False

    def _alert(
        self, step: int, layer: str, role: str, kind: str, previous: float, scale: float, mus: tuple | None = None
    ) -> None:
        """Record the alert (the raw scales); warn once per kind. ``mus``: mu at the previous log and now, where it
        changed for a ``grad_output`` scale, whose jump was judged net of it (the raw scales alone may not show one)."""
        meaning = "its amax jumped: overflow is near" if kind == "drop" else "its amax collapsed: values may underflow"
        self.alerts.append({"step": step, "layer": layer, "role": role, "kind": kind, "from": previous, "to": scale})
        if kind in self._warned_kinds:  # warn_once keys on the text, which names the step: dedupe by kind here
            return
        self._warned_kinds.add(kind)
        warn_once(
            f"{self.owner}: sudden scale {kind} in {layer} ({role}) at step {step}, {previous:g} -> {scale:g}"
            + ("" if mus is None else f" while the gradient scale mu went {mus[0]:g} -> {mus[1]:g} (judged net of mu)")
            + f"; {meaning}. Later scale {kind}s are not warned: they are counted in "
            f"fp8/alerts/scale_{kind}s and kept in {self.alerts_name}"
        )

    def state_dict(self) -> dict[str, Any]:
        """The alerts and the scales and mu of the last log, which the first log after a resume compares against."""
        previous = [[layer, role, scale] for (layer, role), scale in self._previous_scales.items()]
        before = [[layer, role, scale, kind] for (layer, role), entries in self._before_jump.items()
                  for scale, kind in entries]  # fmt: skip
        return {"alerts": [dict(a) for a in self.alerts], "previous_scales": previous, "previous_mu": self._previous_mu,
                "before_jumps": before}  # fmt: skip

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing."""
        _checked_scale_state(state_dict, self.owner)

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore what :meth:`state_dict` saved; every entry is checked before any is loaded.

        Raises:
            TypeError: when ``state_dict`` is not a dict, or an entry has the wrong type (an alert that is not a dict
                of the fields :attr:`alerts` holds, a previous scale that is not a ``[layer, role, scale]`` triple).
            ValueError: for an entry it does not hold, or a value out of range (an unknown role or alert kind, a
                scale that is not a finite positive number).
        """
        self.alerts, self._previous_scales, self._previous_mu, self._before_jump = _checked_scale_state(
            state_dict, self.owner
        )


# The fields of an alert in ScaleJumps.alerts (_alert writes them) and the kinds of jump.
_ALERT_FIELDS = ("step", "layer", "role", "kind", "from", "to")
_ALERT_KINDS = ("drop", "rise")


def _scale_state_error(kind: type[Exception], what: str, owner: str) -> Exception:
    return kind(
        f"{owner}.load_state_dict: {what}; load the dict that {owner}.state_dict() returned (the checkpoint may be "
        "corrupt). Nothing was loaded."
    )


def _checked_scale(value: Any, where: str, owner: str) -> float:
    """``value`` as a float, or raise naming ``where``: scales are finite positive numbers (powers of two)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _scale_state_error(TypeError, f"{where} is {repr(value)[:100]}, expected a number", owner)
    if not math.isfinite(value) or value <= 0:
        raise _scale_state_error(ValueError, f"{where} is {value}, expected a finite positive scale", owner)
    return float(value)


def _checked_role(role: Any, where: str, owner: str) -> str:
    if role not in ROLES:
        raise _scale_state_error(
            ValueError, f"{where} has role {repr(role)[:100]}, expected one of {list(ROLES)}", owner
        )
    return role


def _checked_alert(index: int, alert: Any, owner: str) -> dict[str, Any]:
    where = f"alert {index}"
    if not isinstance(alert, dict) or set(alert) != set(_ALERT_FIELDS):
        raise _scale_state_error(TypeError, f"{where} is {repr(alert)[:100]}, expected a dict with keys "
                                 f"{list(_ALERT_FIELDS)}", owner)  # fmt: skip
    step, layer, kind = alert["step"], alert["layer"], alert["kind"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not isinstance(layer, str):
        raise _scale_state_error(TypeError, f"{where} has step {step!r} and layer {repr(layer)[:100]}, expected an "
                                 "int >= 0 and a layer name", owner)  # fmt: skip
    if kind not in _ALERT_KINDS:
        raise _scale_state_error(ValueError, f"{where} has kind {repr(kind)[:100]}, expected one of "
                                 f"{list(_ALERT_KINDS)}", owner)  # fmt: skip
    return {"step": step, "layer": layer, "role": _checked_role(alert["role"], where, owner), "kind": kind,
            "from": _checked_scale(alert["from"], f"the 'from' scale of {where}", owner),
            "to": _checked_scale(alert["to"], f"the 'to' scale of {where}", owner)}  # fmt: skip


def _checked_scale_state(
    state: Any, owner: str
) -> tuple[
    list[dict[str, Any]], dict[tuple[str, str], float], float | None, dict[tuple[str, str], list[tuple[float, str]]]
]:
    """The alerts, previous scales, mu and scales before alerted jumps of a :meth:`ScaleJumps.state_dict`, checked
    and converted; raises as :meth:`ScaleJumps.load_state_dict` documents."""
    if not isinstance(state, dict):
        raise _scale_state_error(TypeError, f"got {type(state).__name__}, expected a dict", owner)
    unknown = sorted(set(state) - {"alerts", "previous_scales", "previous_mu", "before_jumps"}, key=repr)
    if unknown:
        raise _scale_state_error(
            ValueError,
            f"unknown entries {unknown}, expected 'alerts', 'previous_scales', 'previous_mu' and 'before_jumps'",
            owner,
        )
    # 'previous_mu' may be absent or None (checkpoints written before it was saved; no gradient scaler).
    previous_mu = state.get("previous_mu")
    previous_mu = None if previous_mu is None else _checked_scale(previous_mu, "'previous_mu'", owner)
    # Both may be absent: 'previous_scales' from checkpoints written before it was saved (the first comparison after
    # resuming is then skipped).
    # 'before_jumps' too (absent from checkpoints written before it was saved).
    alerts, previous, before = (state.get(key, []) for key in ("alerts", "previous_scales", "before_jumps"))
    for key, value in (("alerts", alerts), ("previous_scales", previous), ("before_jumps", before)):
        if not isinstance(value, (list, tuple)):
            raise _scale_state_error(TypeError, f"'{key}' is {repr(value)[:100]}, expected a list", owner)
    checked = {key: scale for key, scale, _ in _checked_scale_entries(previous, "previous_scales", owner)}
    # Several entries of one (layer, role) in 'before_jumps': the levels of its jumps not ended yet, oldest first.
    before_jumps: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for key, scale, kind in _checked_scale_entries(before, "before_jumps", owner):
        before_jumps.setdefault(key, []).append((scale, kind))
    return [_checked_alert(i, alert, owner) for i, alert in enumerate(alerts)], checked, previous_mu, before_jumps


def _checked_scale_entries(entries: Any, key: str, owner: str) -> list[tuple[tuple[str, str], float, str | None]]:
    """``[((layer, role), scale, kind), ...]`` of the entries of ``key`` in order: ``[layer, role, scale]`` (``kind``
    None) for ``previous_scales``, ``[layer, role, scale, kind]`` for ``before_jumps``; raises naming the entry."""
    with_kind = key == "before_jumps"
    size, shape = (4, "[layer, role, scale, kind]") if with_kind else (3, "[layer, role, scale]")
    checked = []
    for index, entry in enumerate(entries):
        where = f"entry {index} of '{key}'"
        if not isinstance(entry, (list, tuple)) or len(entry) != size or not isinstance(entry[0], str):
            raise _scale_state_error(TypeError, f"{where} is {repr(entry)[:100]}, expected {shape}", owner)
        kind = entry[3] if with_kind else None
        if with_kind and kind not in _ALERT_KINDS:
            raise _scale_state_error(
                ValueError, f"{where} has kind {repr(kind)[:100]}, expected one of {list(_ALERT_KINDS)}", owner
            )
        role = _checked_role(entry[1], where, owner)
        checked.append(((entry[0], role), _checked_scale(entry[2], f"the scale of {where}", owner), kind))
    return checked
