"""Route sweep of the monitoring core: ``fp8_stats`` and ``HealthMonitor``, every value against a reference of its own.

``fp8_stats`` is read after a few training steps reached by several routes: a plain converted model (one layer left
out of the conversion), a bf16 model, an inf in an input, ``torch.utils.checkpoint`` and ``checkpoint_wrapper``,
``torch.compile`` (aot_eager), evaluation forwards (no_grad, inference_mode) between steps, two forwards before one
backward, a second backward through a retained graph, a frozen layer, 3-D inputs, a layer registered twice, the fused
``FP8MLP`` against its unfused layers, and on a 2-rank gloo spawn DDP and FSDP2 (``fully_shard``, DTensor
parameters). The reference is computed from first principles from the tensors each layer saw (recorded by hooks; an O2
master's storage divided by its scale): ``amax = max|x|`` of the last cast's input,
``scale = 2 ** floor(log2(fp8_max / amax))`` (DESIGN.md's power-of-two rule, found here by doubling, not by the
library's bit arithmetic), delayed scaling from the history of earlier casts (the first cast from its own amax),
``saturation`` the fraction of ``|x * scale_used|`` at or above the FP8 maximum, one cast per forward (input, weight)
and per backward (grad_output), the ``grad_output`` state rescaled at each change of mu; the per-role summary is the
min/max/mean/sum of those references. The optimizer's scales are compared with its own state entries (FP8AdamW O1,
O2, ``low_precision_moments="all"``, a plain torch optimizer, two optimizers, layers put back to high precision by the
scaler's fallback), the gradient scaler's readings with mu, skipped steps and events replayed by hand over a known
sequence of finite and non-finite steps; argument routes (positional, keyword, wrong places) are checked for their
values or errors.

``HealthMonitor`` is fed hand-designed series (a lone spike, two spikes in a row, a level change longer than
``spike_patience``, NaN and inf losses and gradient norms, a plateau against convergence) and 300 random ones, and
compared with a hand-written reference of the documented rules. ``HealthMonitor`` has no batch API (one ``observe``
per step): the other routes are a monitor saved and reloaded (``torch.save`` / ``torch.load(weights_only=True)``)
mid-sequence, and the values given as NumPy numbers and tensors. ``global_norm`` is compared with
``torch.linalg.vector_norm`` on fp16, bf16 and fp32 tensors and DTensors (on the spawn).
"""

from __future__ import annotations

import copy
import io
import math
import random
import statistics
import sys
from functools import partial

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8MLP, FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8, fp8_stats
from lightning_fp8.health import HealthConfig, HealthMonitor, global_norm
from lightning_fp8.optim import master
from tests.numerics import pow2_scale

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
HISTORY = 16  # FP8Recipe's default amax_history_len
# Input gains per step: the last step's input is 8x the first, so its delayed scale (from the history) saturates.
GAINS = (1.0, 0.5, 8.0)
FIELDS = ("scale", "amax", "amax_history", "saturation", "nonfinite_count", "casts")


# ----------------------------------------------------------------------------------------------- the reference
def expected_casts(
    xs: list[torch.Tensor], fmax: float, delayed: bool, history_len: int, rescales: dict[int, float] | None = None
) -> dict:
    """The scaling state after casting ``xs`` in order, from first principles. ``rescales``: ``{i: f}``, mu changed
    by the factor ``f`` after cast ``i`` (docs/guides/monitoring.md: the ``grad_output`` amax, amax history and
    scale are then those of the gradients at the new mu: amaxes times ``f``, the scale divided by it)."""
    history, scale, initialized, nonfinite = [0.0] * history_len, 1.0, False, 0
    amax = saturation = 0.0
    for i, x in enumerate(xs):
        x64 = x.detach().double()
        finite = torch.isfinite(x64)
        amax = math.inf if not bool(finite.all()) else x64.abs().max().item()
        informative = 0 < amax < math.inf
        used = pow2_scale(amax, fmax) if informative and (not delayed or not initialized) else scale
        saturation = ((x64.abs() * used >= fmax) & finite).sum().item() / x.numel()
        history = [amax if amax < math.inf else 0.0, *history[:-1]]
        nonfinite += amax == math.inf
        if informative:
            scale = pow2_scale(max(history), fmax) if delayed else used
            initialized = True
        factor = (rescales or {}).get(i, 1.0)
        history, amax, scale = [a * factor for a in history], amax * factor, scale / factor
    return {"scale": scale, "amax": amax, "amax_history": history, "saturation": saturation,
            "nonfinite_count": nonfinite, "casts": len(xs)}  # fmt: skip


def expected_layer(seen: dict[str, list[torch.Tensor]]) -> dict[str, dict]:
    return {
        "input": expected_casts(seen["input"], E4M3_MAX, True, HISTORY),
        "weight": expected_casts(seen["weight"], E4M3_MAX, False, 1),
        "grad_output": expected_casts(seen["grad_output"], E5M2_MAX, True, HISTORY),
    }


def expected_summary(layers: dict[str, dict[str, dict]]) -> dict[str, dict]:
    out = {}
    for role in ("input", "weight", "grad_output"):
        entries = [roles[role] for roles in layers.values()]
        out[role] = {
            "scale_min": min(e["scale"] for e in entries),
            "scale_max": max(e["scale"] for e in entries),
            "amax_max": max(e["amax"] for e in entries),
            "saturation_max": max(e["saturation"] for e in entries),
            "saturation_mean": statistics.fmean(e["saturation"] for e in entries),
            "nonfinite_count": sum(e["nonfinite_count"] for e in entries),
        }
    return out


def assert_layer_matches(got: dict, want: dict, amax_rel: float = 0.0) -> None:
    """``got`` (fp8_stats of one layer) equals the reference; amaxes and saturations are fp32 values."""
    for role, fields in want.items():
        g = got[role]
        assert set(g) == set(FIELDS), g
        where = f"{role}: got {g}, want {fields}"
        assert g["scale"] == fields["scale"], where
        assert g["amax"] == pytest.approx(fields["amax"], rel=amax_rel or 1e-7), where
        assert g["amax_history"] == pytest.approx(fields["amax_history"], rel=amax_rel or 1e-7), where
        assert g["saturation"] == pytest.approx(fields["saturation"], abs=1e-6), where
        assert (g["nonfinite_count"], g["casts"]) == (fields["nonfinite_count"], fields["casts"]), where
        assert all(type(v) is float for v in (g["scale"], g["amax"], g["saturation"], *g["amax_history"]))
        assert type(g["casts"]) is int and type(g["nonfinite_count"]) is int


def assert_summary_matches(got: dict, layers: dict) -> None:
    want = expected_summary(layers)
    assert set(got) == set(want)
    for role, fields in want.items():
        assert got[role] == pytest.approx(fields, rel=1e-6, abs=1e-9), role


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Recorder:
    """Records what each FP8 layer casts: its input and weight at each forward, its output gradient at each backward
    (a tensor hook on the output). Forward hooks: an FP8MLP whose layers carry them runs them one after the other."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.seen = {name: {"input": [], "weight": [], "grad_output": []} for name in layers}
        for name, layer in layers.items():
            layer.register_forward_pre_hook(partial(self._before, name))
            layer.register_forward_hook(partial(self._after, name))

    def _before(self, name: str, layer: nn.Module, args: tuple) -> None:
        weight = layer.weight
        # An O2 master in the weight's storage holds weight * scale in fp16 (lightning_fp8/optim/master.py): the
        # weight the cast stands for is the storage divided by that scale.
        storage_scale = master.master_scale(weight)
        weight = _full(weight).detach().float().clone()  # FSDP2 frees the unsharded storage after the forward
        self.seen[name]["input"].append(args[0].detach().clone())
        self.seen[name]["weight"].append(weight if storage_scale is None else weight / storage_scale)

    def _after(self, name: str, layer: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda g: self.seen[name]["grad_output"].append(g.detach().clone()))

    def expected(self) -> dict[str, dict]:
        return {name: expected_layer(seen) for name, seen in self.seen.items()}


# ------------------------------------------------------------------------------------------------ the routes
class Net(nn.Module):
    """``body`` (two FP8 layers) then ``head``, which the conversion leaves out. ``route`` runs the body through
    ``torch.utils.checkpoint``."""

    def __init__(self, route: str = "plain") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 16)
        self.route = route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.route == "checkpoint":
            h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        else:
            h = self.body(x)
        return self.head(h)


def fp8_net(route: str = "plain", dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    model = Net(route).to(dtype)
    return convert_to_fp8(model, module_filter_fn=lambda module, fqn: fqn != "head")


def model_inputs(dtype: torch.dtype = torch.float32, nonfinite: bool = False) -> list[torch.Tensor]:
    """One input per step; with ``nonfinite`` the second step's holds an inf (and its backward NaNs)."""
    gen = torch.Generator().manual_seed(1)
    xs = [(torch.randn(8, 32, generator=gen) * gain).to(dtype) for gain in GAINS]
    if nonfinite:
        xs[1][3, 5] = math.inf
    return xs


def train(model: nn.Module, dtype: torch.dtype = torch.float32, nonfinite: bool = False) -> None:
    for x in model_inputs(dtype, nonfinite):
        model(x).float().square().mean().backward()


def plain_reference(dtype: torch.dtype = torch.float32, nonfinite: bool = False) -> tuple[Net, dict]:
    model = fp8_net(dtype=dtype)
    recorder = Recorder({"body.0": model.body[0], "body.2": model.body[2]})
    train(model, dtype, nonfinite)
    return model, recorder.expected()


@pytest.mark.parametrize(
    ("dtype", "nonfinite"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "inf-input"],
)
def test_plain_model_stats_equal_the_first_principles_reference(dtype, nonfinite):
    model, want = plain_reference(dtype, nonfinite)
    assert isinstance(model.body[0], FP8Linear) and type(model.head) is nn.Linear
    stats = fp8_stats(model)
    assert set(stats) == {"layers", "summary"}
    assert set(stats["layers"]) == {"body.0", "body.2"}  # the excluded head has no entry
    for name, roles in want.items():
        assert_layer_matches(stats["layers"][name], roles)
    assert_summary_matches(stats["summary"], want)
    # the route exercises what it should: the last input cast saturated; an inf input was counted in both layers,
    # forward and backward (its NaNs flow on)
    assert want["body.0"]["input"]["saturation"] > 0.05
    assert stats["summary"]["input"]["nonfinite_count"] == (2 if nonfinite else 0)
    assert stats["summary"]["grad_output"]["nonfinite_count"] == (2 if nonfinite else 0)


def _checkpoint_wrapped() -> Net:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = fp8_net()
    model.body = checkpoint_wrapper(model.body)
    return model


def _compiled() -> nn.Module:
    return torch.compile(fp8_net(), backend="aot_eager")


@pytest.mark.parametrize(
    "build",
    [partial(fp8_net, "checkpoint"), _checkpoint_wrapped, _compiled],
    ids=["torch.utils.checkpoint", "checkpoint_wrapper", "compile"],
)
def test_wrapped_routes_report_the_users_names_and_the_plain_routes_values(build):
    """Recomputed forwards (checkpointing) count no cast twice and change no statistic; a compiled model's casts are
    the eager ones; names carry no wrapper fragment."""
    _, want = plain_reference()
    model = build()
    train(model)
    stats = fp8_stats(model)
    assert set(stats["layers"]) == {"body.0", "body.2"}
    for name, roles in want.items():
        assert_layer_matches(stats["layers"][name], roles)
    assert_summary_matches(stats["summary"], want)


def test_fused_mlp_reports_its_layers_as_the_unfused_ones():
    """FP8MLP's fused GELU casts are reported under ``mlp.fc`` / ``mlp.proj`` with the unfused layers' values: the
    reference records an unfused twin (hooks on its layers make it run them one after the other)."""
    torch.manual_seed(0)
    fused = nn.Sequential()
    fused.add_module("mlp", FP8MLP(32, 64, 16))
    unfused = copy.deepcopy(fused)
    recorder = Recorder({"mlp.fc": unfused.mlp.fc, "mlp.proj": unfused.mlp.proj})
    gen = torch.Generator().manual_seed(1)
    for gain in GAINS:
        x = torch.randn(8, 32, generator=gen) * gain
        for model in (fused, unfused):
            model(x).square().mean().backward()
    want = recorder.expected()
    assert len(recorder.seen["mlp.proj"]["input"]) == len(GAINS)  # the twin ran its layers one by one
    for model, amax_rel in ((unfused, 0.0), (fused, 1e-6)):  # the fused GELU rounds as torch's to an ulp
        stats = fp8_stats(model)
        assert set(stats["layers"]) == {"mlp.fc", "mlp.proj"}
        for name, roles in want.items():
            assert_layer_matches(stats["layers"][name], roles, amax_rel)


def _eval_forwards(model: nn.Module, xs: list[torch.Tensor]) -> None:
    model(xs[0]).square().mean().backward()
    with torch.no_grad():
        model(xs[1])
    model.eval()
    with torch.inference_mode():
        model(xs[2] * 3)
    model.train()
    model(xs[2]).square().mean().backward()


def _one_backward_for_two_forwards(model: nn.Module, xs: list[torch.Tensor]) -> None:
    (model(xs[0]).square().mean() + model(xs[1]).square().mean()).backward()
    model(xs[2]).square().mean().backward()


def _retained_graph(model: nn.Module, xs: list[torch.Tensor]) -> None:
    loss = model(xs[0]).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()  # a second backward through the same forward: one more grad_output cast
    for x in xs[1:]:
        model(x).square().mean().backward()


def _frozen_first_layer(model: nn.Module, xs: list[torch.Tensor]) -> None:
    model.body[0].requires_grad_(False)  # its input needs no gradient either: no backward reaches it
    for x in xs:
        model(x).square().mean().backward()


def _three_dim_input(model: nn.Module, xs: list[torch.Tensor]) -> None:
    for x in xs:
        model(x.reshape(2, 4, 32)).square().mean().backward()


@pytest.mark.parametrize(
    ("run", "casts"),
    [
        (_eval_forwards, (4, 4, 2)),  # evaluation forwards cast (and record) their input and weight
        (_one_backward_for_two_forwards, (3, 3, 3)),
        (_retained_graph, (3, 3, 4)),
        (_frozen_first_layer, (3, 3, 0)),
        (_three_dim_input, (3, 3, 3)),
    ],
    ids=["eval-forwards", "two-forwards-one-backward", "retain-graph", "frozen-layer", "3d-input"],
)
def test_other_training_routes_count_every_cast_and_report_the_last(run, casts):
    model = fp8_net()
    recorder = Recorder({"body.0": model.body[0], "body.2": model.body[2]})
    run(model, model_inputs())
    want = recorder.expected()
    assert tuple(want["body.0"][role]["casts"] for role in ("input", "weight", "grad_output")) == casts
    stats = fp8_stats(model)
    for name, roles in want.items():
        assert_layer_matches(stats["layers"][name], roles)
    assert_summary_matches(stats["summary"], want)


def test_a_layer_registered_twice_is_reported_once_with_both_calls_casts():
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = convert_to_fp8(nn.Sequential(shared, nn.ReLU(), shared))
    recorder = Recorder({"0": model[0]})
    for x in model_inputs():
        model(x).square().mean().backward()
    want = recorder.expected()
    assert want["0"]["input"]["casts"] == 2 * len(GAINS)
    stats = fp8_stats(model)
    assert set(stats["layers"]) == {"0"}
    assert_layer_matches(stats["layers"]["0"], want["0"])


# ---------------------------------------------------------------------------------------------- optimizers
def _state_scales(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict[str, float]]:
    """The optimizer's own 0-dim scale entries, read here without fp8_stats."""
    out = {}
    for param, state in optimizer.state.items():
        scales = {k: v.item() for k, v in state.items() if k.endswith("_scale") and torch.is_tensor(v) and v.dim() == 0}
        if scales:
            out[names[id(param)]] = scales
    return out


def _min_max(states: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = {k for scales in states.values() for k in scales}
    return {
        k: {"min": min(s[k] for s in states.values() if k in s), "max": max(s[k] for s in states.values() if k in s)}
        for k in keys
    }


@pytest.mark.parametrize(
    ("opt_level", "moments", "holders"),
    [
        ("O1", "fp8_weights", set()),
        ("O2", "fp8_weights", {"body.0.weight", "body.2.weight"}),
        ("O2", "all", {f"{layer}.{p}" for layer in ("body.0", "body.2", "head") for p in ("weight", "bias")}),
    ],
)
def test_optimizer_scales_are_the_optimizers_own_state_entries(opt_level, moments, holders):
    model = fp8_net()
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level, low_precision_moments=moments)
    names = {id(p): n for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(8, 32, generator=gen)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    want = _state_scales(optimizer, names)
    assert set(want) == holders
    for name, scales in want.items():  # a master is kept for FP8 weights only; every scale is a power of two
        assert ("master_scale" in scales) == (name in ("body.0.weight", "body.2.weight")), (name, scales)
        assert all(math.frexp(s)[0] == 0.5 for s in scales.values()), scales
    by_keyword = fp8_stats(model, optimizer=optimizer)
    positional = fp8_stats(model, optimizer)
    assert by_keyword == positional
    assert by_keyword["optimizer"] == {"states": want, "summary": _min_max(want)}


def test_a_plain_torch_optimizer_and_two_optimizers_one_call_each():
    model = fp8_net()
    plain = torch.optim.AdamW(model.head.parameters())
    fp8 = FP8AdamW(model.body.parameters(), lr=1e-2)
    names = {id(p): n for n, p in model.named_parameters()}
    model(torch.randn(8, 32)).square().mean().backward()
    plain.step()
    fp8.step()
    assert fp8_stats(model, plain)["optimizer"] == {"states": {}, "summary": {}}  # fp32 moments: no scale
    want = _state_scales(fp8, names)
    assert set(want) == {"body.0.weight", "body.2.weight"}
    assert fp8_stats(model, fp8)["optimizer"]["states"] == want
    with pytest.raises(TypeError, match="call fp8_stats once per optimizer"):
        fp8_stats(model, [plain, fp8])


# --------------------------------------------------------------------------------------------- the scaler
def test_scaler_fields_after_a_known_sequence_of_finite_and_nonfinite_steps():
    """mu halves at each non-finite step (skipped) and doubles after ``growth_interval`` finite steps in a row (an O1
    model's fp32 gradients keep their headroom); the reference replays the sequence by hand."""
    model = fp8_net()
    recorder = Recorder({"body.0": model.body[0], "body.2": model.body[2]})
    scaler = FP8GradScaler(init_scale=2.0**8, growth_interval=2, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-3, opt_level="O1", grad_scaler=scaler, fp8_grads=False)
    mu, run, skipped, rescales = 2.0**8, 0, 0, {}
    gen = torch.Generator().manual_seed(1)
    for step, finite in enumerate((True, True, False, True, True, True, False, False, True)):
        before = mu
        loss = model(torch.randn(8, 32, generator=gen)).square().mean()
        scaler.scale_loss(loss).backward()
        if not finite:
            model.body[2].weight.grad[0, 0] = math.inf
        optimizer.step()
        optimizer.zero_grad()
        if finite:
            run += 1
            if run == 2:
                mu, run = mu * 2, 0
        else:
            mu, run, skipped = mu / 2, 0, skipped + 1
        assert scaler.get_scale() == mu
        rescales[step] = mu / before
    want = {"scale": mu, "skipped_steps": skipped, "last_saturation": 0.0, "nonfinite_events": skipped}
    assert (mu, skipped) == (2.0**7, 3)
    assert fp8_stats(model, grad_scaler=scaler)["grad_scaler"] == want
    assert fp8_stats(model, optimizer, scaler)["grad_scaler"] == want
    assert fp8_stats(model, None, scaler)["grad_scaler"] == want
    # the layers' grad_output states (the scaler was given the model) follow mu: rescaled at each change
    layers = fp8_stats(model)["layers"]
    for name, seen in recorder.seen.items():  # the recorded gradients carry the mu of their step
        got = {"grad_output": layers[name]["grad_output"]}
        assert_layer_matches(
            got, {"grad_output": expected_casts(seen["grad_output"], E5M2_MAX, True, HISTORY, rescales)}
        )


def test_layers_put_back_to_high_precision_leave_the_stats_and_the_counts_go_on():
    """``nonfinite_fallback="bf16"`` after two non-finite steps in a row puts ``body.2`` (whose gradient was NaN) back
    to ``nn.Linear``: its entries leave the layers and the optimizer states; the scaler counts both skipped steps."""
    model = fp8_net()
    scaler = FP8GradScaler(init_scale=2.0**8, nonfinite_fallback="bf16", fallback_after=2, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=False)
    names = {id(p): n for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for finite in (True, False, False, True):
        scaler.scale_loss(model(torch.randn(8, 32, generator=gen)).square().mean()).backward()
        if not finite:
            model.body[2].weight.grad[0, 0] = math.nan
        optimizer.step()
        optimizer.zero_grad()
    assert type(model.body[2]) is nn.Linear
    stats = fp8_stats(model, optimizer, scaler)
    assert set(stats["layers"]) == {"body.0"}
    assert set(stats["optimizer"]["states"]) == {"body.0.weight"}
    assert stats["optimizer"]["states"] == _state_scales(optimizer, names)
    assert stats["grad_scaler"] == {"scale": 2.0**6, "skipped_steps": 2, "last_saturation": 0.0, "nonfinite_events": 2}


# ------------------------------------------------------------------------------------------ argument routes
def test_a_model_without_fp8_layers_has_empty_stats():
    model = nn.Sequential(nn.Linear(32, 16))
    model(torch.randn(4, 32)).sum().backward()
    assert fp8_stats(model) == {"layers": {}, "summary": {}}


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        (("not a model",), {}, TypeError, "expects an nn.Module, got str"),
        ((), {"optimizer": "adam"}, TypeError, "expects one torch.optim.Optimizer, got str"),
        ((FP8GradScaler(),), {}, TypeError, "grad_scaler=..."),
        ((), {"grad_scaler": torch.amp.GradScaler("cpu")}, TypeError, "torch.amp.GradScaler"),
        ((), {"grad_scaler": object()}, TypeError, "no `scale`"),
    ],
)
def test_bad_arguments_are_refused_naming_them(args, kwargs, error, words):
    model = fp8_net()
    call_args = args if args[:1] == ("not a model",) else (model, *args)
    with pytest.raises(error) as info:
        fp8_stats(*call_args, **kwargs)
    assert words in str(info.value)


# ------------------------------------------------------------------------------------------ HealthMonitor
def reference_events(cfg: HealthConfig, steps: list[dict]) -> list[tuple]:
    """The documented rules (HealthConfig's and HealthMonitor's docstrings), written out once more: ``(step, kind,
    value, action)`` of every event of ``observe`` over ``steps`` (dicts of ``loss`` and ``grad_norm``, either may be
    missing, inf or NaN)."""
    events, baseline, run, pairs, seen = [], [], [], [], 0
    for step, values in enumerate(steps):
        seen += 1  # every observation counts toward warmup_steps
        loss, norm = values.get("loss"), values.get("grad_norm")
        for kind, value in (("nonfinite_loss", loss), ("nonfinite_grad", norm)):
            if value is not None and not math.isfinite(value):
                events.append((step, kind, value, "none"))
        if norm is None or not math.isfinite(norm):
            continue  # no finite gradient norm: the spike run neither grows nor resets, the plateau pairs wait
        spike = False
        if seen > cfg.warmup_steps and len(baseline) >= 2:
            mean = sum(baseline) / len(baseline)
            std = math.sqrt(sum((v - mean) ** 2 for v in baseline) / len(baseline))
            spike = mean > 0 and norm > mean + cfg.spike_zscore * std and norm > cfg.spike_ratio * mean
        if spike:
            events.append((step, "grad_norm_spike", norm, "none"))
            run.append(norm)
            if len(run) == cfg.spike_patience:  # a new level: it becomes the baseline
                baseline, run = run[-cfg.window :], []
        else:
            run = []
            baseline = [*baseline, norm][-cfg.window :]
        if spike or loss is None or not math.isfinite(loss):
            continue
        pairs = [*pairs, (loss, norm)][-cfg.plateau_window :]
        if seen > cfg.warmup_steps and len(pairs) == cfg.plateau_window:
            half = len(pairs) // 2
            loss_a, loss_b = (statistics.median(p[0] for p in part) for part in (pairs[:half], pairs[half:]))
            norm_a, norm_b = (statistics.median(p[1] for p in part) for part in (pairs[:half], pairs[half:]))
            # relative changes (a zero level: any change is relatively infinite)
            flat = (loss_a - loss_b) / max(abs(loss_a), 1e-12) < cfg.plateau_min_improvement
            if flat and (norm_a - norm_b) / max(abs(norm_a), 1e-12) < cfg.plateau_grad_norm_drop:
                events.append((step, "loss_plateau", loss_b, "none"))
                pairs = []
    return events


def noisy(n: int, level: float, seed: int, spread: float = 0.02) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (level * (1 + spread * torch.randn(n, generator=gen, dtype=torch.float64))).tolist()


def falling_loss(n: int, seed: int) -> list[float]:
    return [3.0 * math.exp(-i / 20) + v for i, v in enumerate(noisy(n, 0.01, seed))]


def _series(norms: list[float], losses: list[float] | None = None) -> list[dict]:
    losses = falling_loss(len(norms), 9) if losses is None else losses
    return [{"loss": loss, "grad_norm": norm} for loss, norm in zip(losses, norms, strict=True)]


def _lone_spike() -> list[dict]:
    norms = noisy(40, 1.0, 1)
    norms[25] = 20.0
    return _series(norms)


def _two_spikes_in_a_row() -> list[dict]:
    norms = noisy(40, 1.0, 2)
    norms[20:22] = [15.0, 18.0]  # fewer than spike_patience: both reported, the baseline kept (so 30 is one too)
    norms[30] = 16.0
    return _series(norms)


def _level_change() -> list[dict]:
    # 10x from step 20 on: reported on its first spike_patience steps, then the new baseline; a missing and a NaN
    # gradient norm inside the run neither count nor reset it
    norms = noisy(20, 1.0, 3) + noisy(25, 10.0, 4)
    steps = _series(norms)
    del steps[21]["grad_norm"]
    steps[22]["grad_norm"] = math.nan
    return steps


def _nonfinite() -> list[dict]:
    steps = _series(noisy(30, 1.0, 5))
    steps[12]["loss"] = math.nan
    steps[15]["grad_norm"] = math.inf
    steps[18] = {"loss": -math.inf, "grad_norm": math.nan}
    steps[24]["grad_norm"] = 40.0  # a spike after them: the non-finite norms entered no baseline
    return steps


def _plateau() -> list[dict]:
    return _series(noisy(40, 1.0, 6), noisy(40, 2.0, 7, spread=0.001))  # flat loss, flat gradient norm


def _convergence() -> list[dict]:
    # flat loss, falling gradient norm: convergence; then a loss that rises
    norms = [2.0 * math.exp(-i / 10) for i in range(24)] + noisy(16, 0.2, 8)
    losses = noisy(24, 2.0, 9, spread=0.001) + [2.0 + 0.05 * i for i in range(16)]
    return _series(norms, losses)


SEQUENCES = {
    "lone_spike": _lone_spike,
    "two_spikes_in_a_row": _two_spikes_in_a_row,
    "level_change": _level_change,
    "nonfinite": _nonfinite,
    "plateau": _plateau,
    "convergence": _convergence,
}
# What each sequence must show (checked besides the reference, so that a reference that drifts with the code is seen).
EXPECTED_KINDS = {
    "lone_spike": [(25, "grad_norm_spike")],
    "two_spikes_in_a_row": [(20, "grad_norm_spike"), (21, "grad_norm_spike"), (30, "grad_norm_spike")],
    "level_change": [(20, "grad_norm_spike"), (22, "nonfinite_grad"), (23, "grad_norm_spike"), (24, "grad_norm_spike")],
    "nonfinite": [(12, "nonfinite_loss"), (15, "nonfinite_grad"), (18, "nonfinite_loss"), (18, "nonfinite_grad")]
    + [(24, "grad_norm_spike")],
    # one alert per full window (12 pairs; the window starts afresh after each)
    "plateau": [(11, "loss_plateau"), (23, "loss_plateau"), (35, "loss_plateau")],
    # no alert while the gradient norm falls; the rising loss after it is one ("loss rose")
    "convergence": [(31, "loss_plateau")],
}
CONFIG = HealthConfig(window=8, warmup_steps=5, spike_patience=3, plateau_window=12)


def _observe(monitor: HealthMonitor, steps: list[dict], start: int = 0) -> None:
    for step, values in enumerate(steps[start:], start):
        monitor.observe(step, **values)


def _events(monitor: HealthMonitor) -> list[tuple]:
    return [(e.step, e.kind, e.value, e.action) for e in monitor.events]


def _same(a: list[tuple], b: list[tuple]) -> bool:
    # NaN values compare as equal
    return len(a) == len(b) and all(
        x[:2] == y[:2] and x[3] == y[3] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_health_events_match_the_documented_rules(name):
    steps = SEQUENCES[name]()
    monitor = HealthMonitor(CONFIG)
    _observe(monitor, steps)
    got, want = _events(monitor), reference_events(CONFIG, steps)
    assert _same(got, want), (got, want)
    assert [(e[0], e[1]) for e in got] == EXPECTED_KINDS[name]
    if name == "convergence":
        assert "loss rose" in monitor.events[0].message
    counts = monitor.summary()["events"]
    assert counts == {kind: sum(e[1] == kind for e in want) for kind in counts}
    # the series keep every value given, non-finite ones too
    for series in ("loss", "grad_norm"):
        given = [(i, s[series]) for i, s in enumerate(steps) if series in s]
        assert _same([(*p, 0, 0) for p in monitor.series[series]], [(*p, 0, 0) for p in given])


def _resumed(config: HealthConfig, steps: list[dict], split: int) -> HealthMonitor:
    """A monitor that observed ``steps[:split]``, saved (torch.save, loaded with weights_only=True) into a new one,
    which then observed the rest."""
    first = HealthMonitor(config)
    _observe(first, steps[:split])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = HealthMonitor(config)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _observe(resumed, steps, split)
    return resumed


@pytest.mark.parametrize("name", ["two_spikes_in_a_row", "level_change", "nonfinite", "plateau"])
def test_a_monitor_saved_and_loaded_mid_sequence_continues_identically(name):
    steps = SEQUENCES[name]()
    whole = HealthMonitor(CONFIG)
    _observe(whole, steps)
    for split in (3, 21, 33):  # in warmup, inside a spike run or the level change, inside a plateau window
        resumed = _resumed(CONFIG, steps, split)
        assert _same(_events(resumed), _events(whole)), split
        assert [e.message for e in resumed.events] == [e.message for e in whole.events]
        assert resumed.state_dict().keys() == whole.state_dict().keys()
        for key in ("grad_norms", "spike_run", "plateau_loss", "plateau_grad", "observations"):
            assert resumed.state_dict()[key] == whole.state_dict()[key], (split, key)


def test_numpy_and_tensor_values_give_the_events_of_python_numbers():
    """The same series given as NumPy numbers and float64 0-dim tensors (NumPy and tensor steps): the same events and
    series as with Python numbers."""
    np = pytest.importorskip("numpy")
    steps = SEQUENCES["nonfinite"]() + _level_change()
    as_python, as_numpy, as_tensor = HealthMonitor(CONFIG), HealthMonitor(CONFIG), HealthMonitor(CONFIG)
    for step, values in enumerate(steps):
        as_python.observe(step, **values)
        as_numpy.observe(np.int64(step), **{k: np.float64(v) for k, v in values.items()})
        as_tensor.observe(torch.tensor(step), **{k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})
    for other in (as_numpy, as_tensor):
        assert _same(_events(other), _events(as_python))
        assert repr(other.state_dict()) == repr(as_python.state_dict())
        assert all(type(step) is int for step, _ in other.series["grad_norm"])


def _random_sequence(seed: int) -> tuple[HealthConfig, list[dict]]:
    """A random config and series: levels that jump, spikes, zero, missing, NaN and inf norms and losses."""
    r = random.Random(seed)
    cfg = HealthConfig(window=r.randint(2, 8), warmup_steps=r.randint(0, 6), spike_zscore=r.choice([0.0, 1.0, 3.0]),
                       spike_ratio=r.choice([1.0, 1.5, 3.0]), spike_patience=r.randint(1, 4),
                       plateau_window=r.randint(2, 9), plateau_min_improvement=r.choice([0.0, 0.01, 0.5]),
                       plateau_grad_norm_drop=r.choice([0.0, 0.1, 1.0]))  # fmt: skip
    steps, level = [], 1.0
    for i in range(r.randint(5, 60)):
        level *= r.choice([0.1, 10.0]) if r.random() < 0.05 else 1.0
        values = {}
        if r.random() < 0.9:
            values["grad_norm"] = r.choice([level * abs(1 + 0.1 * r.gauss(0, 1))] * 6 + [30 * level, 0.0, math.nan,
                                                                                        math.inf])  # fmt: skip
        if r.random() < 0.9:
            values["loss"] = r.choice([2.0, 2.0 - 0.01 * i, 1.0 + r.random(), r.random() - 1.0, math.nan, -math.inf])
        steps.append(values)
    return cfg, steps


@pytest.mark.parametrize("seeds", [range(0, 150), range(150, 300)])
def test_random_series_match_the_reference_and_resume_identically(seeds):
    for seed in seeds:
        cfg, steps = _random_sequence(seed)
        whole = HealthMonitor(cfg)
        _observe(whole, steps)
        assert _same(_events(whole), reference_events(cfg, steps)), seed
        split = seed % len(steps)
        resumed = _resumed(cfg, steps, split)
        assert repr(resumed.state_dict()) == repr(whole.state_dict()), seed


def test_recovery_actions_are_recorded_and_summarized_in_order():
    monitor = HealthMonitor(CONFIG)
    monitor.observe(0, loss=math.inf, grad_norm=math.nan)
    recorded = [(1, "grad", "skip_step+lower_mu"), (2, "loss", "lower_lr"), (3, "grad_norm", "fallback_bf16"),
                (4, "grad", "none")]  # fmt: skip
    for step, source, action in recorded:
        event = monitor.record_nonfinite(step, source, action, value=-math.inf)
        kind = "nonfinite_loss" if source == "loss" else "nonfinite_grad"
        assert (event.kind, event.action, event.value) == (kind, action, -math.inf)
    summary = monitor.summary()
    assert summary["actions"] == ["skip_step+lower_mu", "lower_lr", "fallback_bf16"]  # "none" is no action
    assert summary["events"] == {"grad_norm_spike": 0, "loss_plateau": 0, "nonfinite_loss": 2, "nonfinite_grad": 4}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"window": 1}, "window=1) must be an int >= 2"),
        ({"window": 8.0}, "window=8.0) must be an int"),
        ({"warmup_steps": -1}, "warmup_steps=-1"),
        ({"plateau_window": True}, "plateau_window=True"),
        ({"spike_patience": "3"}, "spike_patience='3'"),
        ({"spike_zscore": math.nan}, "spike_zscore=nan) must be a finite number >= 0"),
        ({"spike_ratio": 0.5}, "spike_ratio=0.5) must be a finite number >= 1"),
        ({"plateau_min_improvement": 1.0}, "plateau_min_improvement=1.0) must be a finite number in [0, 1)"),
        ({"plateau_grad_norm_drop": "0.1"}, "plateau_grad_norm_drop='0.1'"),
    ],
)
def test_bad_health_config_values_are_refused_naming_the_field_and_range(kwargs, words):
    with pytest.raises(ValueError) as info:
        HealthConfig(**kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("name", ["window", "plateau_window"])
def test_a_window_longer_than_any_sequence_can_be_is_refused_by_the_config(name):
    """A window is the length of a deque: one past ``sys.maxsize`` was taken by HealthConfig, then HealthMonitor failed
    with "OverflowError: Python int too large to convert to C ssize_t", naming neither the field nor the range."""
    with pytest.raises(ValueError, match=rf"HealthConfig\({name}={sys.maxsize + 1}\) must be an int from 2 to"):
        HealthConfig(**{name: sys.maxsize + 1})
    monitor = HealthMonitor(HealthConfig(**{name: sys.maxsize}))  # the largest is taken, and works
    _observe(monitor, _lone_spike())
    assert len(monitor.series["grad_norm"]) == 40


def test_health_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        HealthConfig(8)
    with pytest.raises(AttributeError):
        CONFIG.window = 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_global_norm_matches_torch_vector_norm(dtype):
    gen = torch.Generator().manual_seed(3)
    # fp16 values whose squares sum past fp16's range (65504): the sum is taken in fp32
    tensors = [(torch.randn(shape, generator=gen) * 300).to(dtype) for shape in ((33, 17), (5,), (2, 3, 4))]
    want = torch.linalg.vector_norm(torch.cat([t.flatten().float() for t in tensors]))
    got = global_norm(tensors)
    assert got.dtype == torch.float32 and torch.isfinite(got)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(global_norm(iter(tensors)), want, rtol=1e-6, atol=0)  # any iterable
    assert global_norm([]).item() == 0.0


# --------------------------------------------------------------------------------- DDP and FSDP2 (one spawn)
def _train_rank(model: nn.Module, rank: int, optimizer: torch.optim.Optimizer | None = None) -> None:
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data: its own statistics
    for gain in GAINS:
        model(torch.randn(8, 32, generator=gen) * gain).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()


def _ddp_route(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = fp8_net()
    recorder = Recorder({"body.0": model.body[0], "body.2": model.body[2]})
    optimizer = FP8AdamW(model.parameters(), lr=1e-2)  # before DDP: O2 changes the FP8 weights' dtype
    ddp = DDP(model)
    _train_rank(ddp, rank, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    return {"stats": fp8_stats(ddp, optimizer), "want": recorder.expected(), "scales": _state_scales(optimizer, names)}


def _fsdp2_route(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8.distributed import enable_fp8_fsdp2
    from tests.distributed.launch import cpu_mesh

    model = fp8_net()
    recorder = Recorder({"body.0": model.body[0], "body.2": model.body[2]})
    mesh = cpu_mesh()
    for layer in (model.body[0], model.body[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    enable_fp8_fsdp2(model)
    assert all(hasattr(p, "full_tensor") for p in model.parameters())  # DTensor parameters
    params = list(model.parameters())
    param_norm = (global_norm(params).item(), torch.linalg.vector_norm(torch.cat([_full(p).flatten() for p in params])))
    _train_rank(model, rank)
    grads = [p.grad for p in params]
    grad_norm = (global_norm(grads).item(), torch.linalg.vector_norm(torch.cat([_full(g).flatten() for g in grads])))
    optimizer = FP8AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    _train_rank(model, rank, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    scales = {
        names[id(p)]: {k: _full(v).item() for k, v in state.items() if k.endswith("_scale")}
        for p, state in optimizer.state.items()
        if any(k.endswith("_scale") for k in state)
    }
    return {"stats": fp8_stats(model, optimizer), "want": recorder.expected(), "scales": scales,
            "norms": [param_norm[0], param_norm[1].item(), grad_norm[0], grad_norm[1].item()]}  # fmt: skip


def _dtensor_norms() -> list[tuple[float, float]]:
    """global_norm of fp16, bf16 and fp32 DTensors (sharded unevenly, replicated) beside a plain tensor, and torch's
    norm of the full tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.distributed.launch import cpu_mesh

    mesh, gen, out = cpu_mesh(), torch.Generator().manual_seed(5), []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        # values of 300: their squares pass fp16's range, which the sum must not be kept in
        fulls = [(torch.randn(shape, generator=gen) * 300).to(dtype) for shape in ((7, 5), (3, 4), (6,))]
        tensors = [distribute_tensor(fulls[0], mesh, [Shard(0)]), distribute_tensor(fulls[1], mesh, [Replicate()]),
                   fulls[2]]  # fmt: skip
        want = torch.linalg.vector_norm(torch.cat([f.flatten().float() for f in fulls]))
        out.append((global_norm(tensors).item(), want.item()))
    return out


def _distributed_worker(rank: int, world: int) -> dict:
    from tests.distributed.launch import run_parts

    return run_parts(
        {"ddp": partial(_ddp_route, rank), "fsdp2": partial(_fsdp2_route, rank), "dtensor_norms": _dtensor_norms}
    )


@pytest.fixture(scope="module")
def distributed_results() -> list[dict]:
    from tests.distributed.launch import run_workers

    return run_workers(_distributed_worker, 2, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["ddp", "fsdp2"])
def test_distributed_stats_are_each_ranks_own_under_the_users_names(distributed_results, route):
    from tests.distributed.launch import part_results

    results = part_results(distributed_results, route)
    for result in results:
        stats, want = result["stats"], result["want"]
        assert set(stats["layers"]) == {"body.0", "body.2"}, stats["layers"].keys()
        for name, roles in want.items():
            assert_layer_matches(stats["layers"][name], roles)
        assert_summary_matches(stats["summary"], want)
        assert set(result["scales"]) == {"body.0.weight", "body.2.weight"}
        assert stats["optimizer"] == {"states": result["scales"], "summary": _min_max(result["scales"])}
    # no amax sync was asked for: each rank reports the amaxes of its own data
    assert results[0]["want"]["body.0"]["input"]["amax"] != results[1]["want"]["body.0"]["input"]["amax"]
    if route == "fsdp2":
        for result in results:
            param_norm, param_want, grad_norm, grad_want = result["norms"]
            assert param_norm == pytest.approx(param_want, rel=1e-6)
            assert grad_norm == pytest.approx(grad_want, rel=1e-6)


@pytest.mark.slow
def test_global_norm_of_fp16_bf16_fp32_dtensors_matches_torch(distributed_results):
    from tests.distributed.launch import part_results

    for norms in part_results(distributed_results, "dtensor_norms"):
        assert len(norms) == 3
        for got, want in norms:
            assert math.isfinite(got) and got == pytest.approx(want, rel=1e-6)
