"""One FP8GradScaler shared by several optimizers, as torch.amp.GradScaler is: each optimizer's step decides on its own
gradients, the update backs off if any was skipped, and gradients are unscaled by the mu they were scaled with, also
where each optimizer's step() updates mu itself (FP8AdamW(grad_scaler=...), the Lightning and Accelerate integrations).
References: torch.amp.GradScaler, unscaled torch optimizers, and the same run through the other spelling."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from tests.distributed.launch import part_results, run_parts, run_workers

POISON = {1: "b", 2: "a"}  # iteration -> the model whose gradients are non-finite (that optimizer's alone)
MU0 = 2.0**4

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(seed: int = 0, fp8: bool = False) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    a, b = nn.Sequential(nn.Linear(32, 32)), nn.Sequential(nn.Linear(32, 32))
    return (convert_to_fp8(a), convert_to_fp8(b)) if fp8 else (a, b)


def _loss(a: nn.Module, b: nn.Module, x: torch.Tensor, i: int) -> torch.Tensor:
    poison = POISON.get(i)
    la, lb = a(x).square().mean(), b(x).square().mean()
    return la * (math.nan if poison == "a" else 1.0) + lb * (math.nan if poison == "b" else 1.0)


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _changed(before: list[torch.Tensor], model: nn.Module) -> bool:
    return any(not torch.equal(u, v) for u, v in zip(before, _snapshot(model), strict=True))


def _run(a, b, o1, o2, scaler, spelling: str, iterations: int = 4) -> list[tuple]:
    """Train both models on one loss per iteration; per iteration: (a stepped, b stepped, mu after the update)."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    torch_amp = isinstance(scaler, torch.amp.GradScaler)
    out = []
    for i in range(iterations):
        before_a, before_b = _snapshot(a), _snapshot(b)
        (scaler.scale(_loss(a, b, x, i)) if torch_amp else scaler.scale_loss(_loss(a, b, x, i))).backward()
        if spelling == "amp":  # torch.amp's: scaler.step(o1); scaler.step(o2); scaler.update()
            scaler.step(o1)
            scaler.step(o2)
            scaler.update()
        else:  # "own": each optimizer's step() steps and updates (FP8AdamW(grad_scaler=scaler).step())
            o1.step()
            o2.step()
        o1.zero_grad()
        o2.zero_grad()
        out.append((_changed(before_a, a), _changed(before_b, b), scaler.get_scale()))
    return out


def _torch_amp_reference() -> list[tuple]:
    a, b = _pair()
    o1, o2 = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.1)
    return _run(a, b, o1, o2, torch.amp.GradScaler("cpu", init_scale=MU0, growth_interval=1000), "amp")


def test_plain_optimizers_step_as_with_torch_amp_bit_for_bit():
    # The same SGD optimizers through torch.amp.GradScaler and FP8GradScaler: both unscale by the exact power of two
    # mu and skip the optimizer whose own gradients are non-finite, so the weights match bit for bit.
    torch.manual_seed(0)
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=MU0, growth_interval=1000),
                   FP8GradScaler(init_scale=MU0, growth_interval=1000)):  # fmt: skip
        a, b = _pair()
        o1, o2 = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.1)
        results.append((_run(a, b, o1, o2, scaler, "amp"), _snapshot(a) + _snapshot(b)))
    (ref_steps, ref_weights), (steps, weights) = results
    assert steps == ref_steps
    assert [s[:2] for s in steps] == [(True, True), (True, False), (False, True), (True, True)]
    assert all(torch.equal(u, v) for u, v in zip(weights, ref_weights, strict=True))


@pytest.mark.parametrize("fp8_grads", [True, False], ids=["fp8_grads", "param_grad"])
@pytest.mark.parametrize("spelling", ["amp", "own"])
def test_fp8adamw_pair_skips_what_torch_amp_skips(spelling, fp8_grads):
    # Two FP8AdamW (O2) over two FP8 models, one scaler: the optimizer whose gradients are non-finite is skipped, the
    # other steps, mu halves once per poisoned iteration: what torch.amp.GradScaler does with two torch optimizers.
    ref = _torch_amp_reference()
    a, b = _pair(fp8=True)
    scaler = FP8GradScaler(init_scale=MU0, growth_interval=1000)
    o1, o2 = (FP8AdamW(m.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=fp8_grads) for m in (a, b))
    steps = _run(a, b, o1, o2, scaler, spelling)
    assert steps == ref
    assert scaler.skipped_steps == scaler.nonfinite_events == len(POISON)
    assert all(torch.isfinite(t).all() for t in _snapshot(a) + _snapshot(b))


def test_each_optimizer_updating_equals_one_update_bit_for_bit():
    # FP8AdamW(grad_scaler=...).step() of each optimizer (an update after each) against scaler.step(o1);
    # scaler.step(o2); scaler.update(): mu never grows here (growth_interval), so both spellings take the same steps
    # with the same mu, and the same skips.
    runs = []
    for spelling in ("amp", "own"):
        a, b = _pair(fp8=True)
        scaler = FP8GradScaler(init_scale=MU0, growth_interval=1000)
        o1, o2 = (FP8AdamW(m.parameters(), lr=1e-2, grad_scaler=scaler) for m in (a, b))
        steps = _run(a, b, o1, o2, scaler, spelling)
        runs.append((steps, _snapshot(a) + _snapshot(b), scaler.skipped_steps))
    (steps_amp, w_amp, skipped_amp), (steps_own, w_own, skipped_own) = runs
    assert steps_own == steps_amp and skipped_own == skipped_amp == len(POISON)
    assert all(torch.equal(u, v) for u, v in zip(w_own, w_amp, strict=True))


def _sgd_pair_steps(scaler: FP8GradScaler | None, iterations: int = 3) -> list[torch.Tensor]:
    """Two SGD optimizers over one loss; with a scaler, each is stepped and updated in turn (the integrations'
    spelling), so mu changes between them."""
    a, b = _pair()
    o1, o2 = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(iterations):
        loss = a(x).square().mean() + b(x).square().mean()
        if scaler is None:
            loss.backward()
            o1.step()
            o2.step()
        else:
            scaler.scale_loss(loss).backward()
            for opt in (o1, o2):
                assert scaler.step(opt)
                scaler.update()
        o1.zero_grad()
        o2.zero_grad()
    return _snapshot(a) + _snapshot(b)


def test_gradients_are_unscaled_by_the_mu_they_were_scaled_with():
    # growth_interval=1: the update after o1's step doubles mu, but o2's gradients still carry the mu of the loss;
    # unscaled by it, both match unscaled SGD bit for bit (powers of two scale exactly).
    scaler = FP8GradScaler(init_scale=MU0, growth_interval=1)
    weights = _sgd_pair_steps(scaler)
    assert scaler.get_scale() == MU0 * 2**6  # it did change between the optimizers
    assert all(torch.equal(u, v) for u, v in zip(weights, _sgd_pair_steps(None), strict=True))


def test_fp8adamw_unscales_by_the_mu_of_its_backward_after_another_update():
    # The same with FP8AdamW updating in its own step: b's step after a's update (which doubled mu) equals b trained
    # alone with its own scaler at the same mu. eps large: Adam's first step is otherwise nearly scale-invariant.
    results = []
    for shared in (True, False):
        a, b = _pair(fp8=True)
        scaler_a = FP8GradScaler(init_scale=MU0, growth_interval=1)
        scaler_b = scaler_a if shared else FP8GradScaler(init_scale=MU0, growth_interval=1)
        o1 = FP8AdamW(a.parameters(), lr=1e-2, eps=1e-2, grad_scaler=scaler_a)
        o2 = FP8AdamW(b.parameters(), lr=1e-2, eps=1e-2, grad_scaler=scaler_b)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
        la, lb = a(x).square().mean(), b(x).square().mean()
        if shared:
            scaler_a.scale_loss(la + lb).backward()
        else:
            scaler_a.scale_loss(la).backward()
            scaler_b.scale_loss(lb).backward()
        o1.step()
        o2.step()
        assert scaler_a.get_scale() == MU0 * (4 if shared else 2)  # mu doubled after each update
        results.append(_snapshot(b))
    assert all(torch.equal(u, v) for u, v in zip(*results, strict=True))


def test_headroom_of_every_optimizer_is_judged():
    # High-precision gradients (no FP8 cast reports them): the scaler measures each stepped optimizer's. The second
    # optimizer's gradient is less than 2x under fp16's maximum, so mu must not grow, as with one optimizer holding
    # both parameters. (fp16 parameters through FP8AdamW: a plain optimizer's fp16 gradients are refused.)
    def run(split: bool) -> list[float]:
        p, q = nn.Parameter(torch.zeros(4, dtype=torch.float16)), nn.Parameter(torch.zeros(4, dtype=torch.float16))
        scaler = FP8GradScaler(init_scale=1.0, growth_interval=1)
        scaler.scale_loss(torch.zeros(()))  # the gradients planted below carry mu, as a scaled backward's do
        kwargs = {"lr": 0.0, "grad_scaler": scaler, "fp8_grads": False}
        opts = [FP8AdamW([p], **kwargs), FP8AdamW([q], **kwargs)] if split else [FP8AdamW([p, q], **kwargs)]
        scales = []
        for _ in range(3):
            p.grad = torch.full_like(p, 1.0)
            q.grad = torch.full_like(q, 40000.0)  # no headroom in fp16
            for opt in opts:
                assert scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    assert run(split=True) == run(split=False) == [1.0, 1.0, 1.0]


def _one_optimizer_keeps_failing(
    scaler: FP8GradScaler, spelling: str, iterations: int, seed: int = 0, clean_first: bool = False
) -> list:
    """Two SGD optimizers over one loss; a's gradients are non-finite every iteration, b's never. "amp": one update
    per iteration; "each": each optimizer is stepped and updated in turn (the integrations' spelling), a's first
    unless ``clean_first``. Returns the optimizers [a's, b's] (the scaler's counts of an optimizer go with it)."""
    a, b = _pair(seed)
    opts = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]
    order = opts[::-1] if clean_first else opts
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(iterations):
        scaler.scale_loss(a(x).square().mean() * math.nan + b(x).square().mean()).backward()
        for opt in order:
            scaler.step(opt)
            if spelling == "each":
                scaler.update()
        scaler.update()  # "each": nothing left to judge, so it does nothing
        for opt in opts:
            opt.zero_grad()
    return opts


@pytest.mark.parametrize("spelling", ["amp", "each"])
def test_fallback_runs_when_one_optimizer_keeps_failing(spelling):
    # Where each optimizer's step updates, b's clean update between two of a's non-finite ones restarted the one count
    # of consecutive non-finite steps (1, 0, 1, 0, ...): the fallback never ran. Counted per optimizer, it runs after
    # every fallback_after iterations of a's, on a's optimizer, in both spellings.
    iterations, after, calls = 7, 3, []
    scaler = FP8GradScaler(init_scale=MU0, fallback_after=after,
                           nonfinite_fallback=lambda scaler, opt: calls.append(opt) or "recorded")  # fmt: skip
    o1, _ = _one_optimizer_keeps_failing(scaler, spelling, iterations)
    assert calls == [o1] * (iterations // after)
    assert scaler.skipped_steps == iterations
    assert scaler.state_dict()["consecutive_nonfinite"] == iterations % after


@pytest.mark.parametrize("clean_first", [False, True])
@pytest.mark.parametrize("via", ["state_dict", "pickle"])
def test_a_resumed_scaler_continues_the_longest_nonfinite_run(via, clean_first):
    # The per-optimizer counts cannot be saved by optimizer; the longest run is, and every optimizer's run starts
    # from it after a load: the run interrupted after 2 of 3 non-finite steps falls back at the next one (lowering
    # the failing optimizer's learning rate alone), as uninterrupted; also where the clean optimizer's update comes
    # first (it restarted the restored run before the failing one was counted).
    import io
    import pickle

    scaler = FP8GradScaler(init_scale=MU0, fallback_after=3, nonfinite_fallback="lower_lr", lr_factor=0.5)
    opts = _one_optimizer_keeps_failing(scaler, "each", iterations=2, clean_first=clean_first)
    if via == "state_dict":
        buf = io.BytesIO()
        torch.save(scaler.state_dict(), buf)
        buf.seek(0)
        resumed = FP8GradScaler(init_scale=MU0, fallback_after=3, nonfinite_fallback="lower_lr", lr_factor=0.5)
        resumed.load_state_dict(torch.load(buf, weights_only=True))
    else:
        resumed = pickle.loads(pickle.dumps(scaler))
    assert resumed.state_dict()["consecutive_nonfinite"] == 2 and all(o.param_groups[0]["lr"] == 0.1 for o in opts)
    o1, o2 = _one_optimizer_keeps_failing(resumed, "each", iterations=1, seed=1, clean_first=clean_first)
    assert (o1.param_groups[0]["lr"], o2.param_groups[0]["lr"]) == (0.1 * 0.5, 0.1)


def _schedule(scaler: FP8GradScaler, schedule: list[tuple[bool, bool]], run: tuple | None = None) -> tuple:
    """Two SGD optimizers each stepped and updated in turn (the integrations' spelling); per iteration ``(a fails, b
    fails)``: that model's loss is NaN. Returns ``(a, b, [a's opt, b's opt])``, the ``run`` to continue."""
    if run is None:
        a, b = _pair()
        run = a, b, [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]
    a, b, opts = run
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for bad_a, bad_b in schedule:
        loss = a(x).square().mean() * (math.nan if bad_a else 1.0) + b(x).square().mean() * (math.nan if bad_b else 1.0)
        scaler.scale_loss(loss).backward()
        for opt in opts:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return run


def _resumed(scaler: FP8GradScaler, via: str, **kwargs) -> FP8GradScaler:
    import io
    import pickle

    if via == "pickle":
        return pickle.loads(pickle.dumps(scaler))
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    resumed = FP8GradScaler(**kwargs)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    return resumed


FAILING = {"fallback_after": 3, "nonfinite_fallback": "lower_lr", "lr_factor": 0.5}


@pytest.mark.parametrize("via", ["state_dict", "pickle"])
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([(True, False), (True, False)], [(False, True)]),  # b's first failure after a's two: no fallback
        ([(True, False), (True, False)], [(True, False)]),  # a's third: the fallback, on a's optimizer
        ([(True, False)] * 3 + [(True, True)], [(False, True), (True, True)]),  # order kept over a fallback's clear
        ([(False, True), (True, True)], [(True, True)]),  # b's run of 2 ahead of a's 1: b's optimizer falls back
    ],
    ids=["other_fails", "same_fails", "after_fallback", "b_longer"],
)
def test_a_resumed_scaler_continues_each_optimizers_own_run(via, before, after):
    # Saved as the longest run alone, every optimizer's run started there after a load: an optimizer that had never
    # failed fell back at its first non-finite step after a resume (lowering its learning rate, where the
    # uninterrupted run did not). Each optimizer's run is saved now, in the order they were first stepped.
    whole = FP8GradScaler(**FAILING)
    _, _, expected = _schedule(whole, before + after)
    first = FP8GradScaler(**FAILING)
    run = _schedule(first, before)
    resumed = _resumed(first, via, **FAILING)
    _, _, opts = _schedule(resumed, after, run)  # the same models and optimizers, new to the resumed scaler
    assert [o.param_groups[0]["lr"] for o in opts] == [o.param_groups[0]["lr"] for o in expected]
    assert [h["action"] for h in resumed.history] == [h["action"] for h in whole.history]
    assert resumed.state_dict()["nonfinite_runs"] == whole.state_dict()["nonfinite_runs"]


def _events(scaler: FP8GradScaler, opts: list, events: list[tuple]) -> None:
    """``("step", i, bad)``: optimizer i stepped (and updated) on a gradient of ones, or NaN where ``bad``;
    ``("report",)``: a non-finite report alone (an FP8 communication hook), updated with no step."""
    for kind, *args in events:
        if kind == "report":
            scaler.record_nonfinite(torch.tensor(1.0))
        else:
            (p,) = opts[args[0]].param_groups[0]["params"]
            p.grad = torch.full_like(p, math.nan if args[1] else 1.0)
            scaler.scale_loss(torch.zeros(()))  # (the planted gradient carries mu, as a scaled backward's does)
            scaler.step(opts[args[0]])
        scaler.update()


_REPORTS_ALONE = (3, [("report",), ("report",)], [("step", 0, True)])  # no optimizer counted when saved
_REPORT_AFTER_FALLBACK = (2, [("step", 0, True)] * 2 + [("report",)], [("step", 0, True)])
# A critic stepping every iteration, a generator every second one, first in the loop: resumed where the generator does
# not step, the critic comes first (by the order of first steps alone it would take the generator's run).
_UNEVEN_STEPS = (3, [("step", 0, True), ("step", 1, False), ("step", 1, False), ("step", 0, True), ("step", 1, False)],
                 [("step", 1, True), ("step", 0, False), ("step", 1, False)])  # fmt: skip


@pytest.mark.parametrize(
    ("register", "case"),
    [(False, _REPORTS_ALONE), (True, _REPORTS_ALONE), (False, _REPORT_AFTER_FALLBACK), (True, _REPORT_AFTER_FALLBACK),
     (True, _UNEVEN_STEPS)],
    ids=["reports_alone", "reports_alone_registered", "after_fallback_report", "after_fallback_report_registered",
         "uneven_steps_registered"],
)  # fmt: skip
def test_a_resume_continues_runs_of_reports_and_of_optimizers_stepping_unevenly(register, case):
    # Mends of the first version of the saved runs: a run of reports saved before any optimizer was counted was
    # dropped, and one counted after a fallback cleared the runs saved as 0 (each resumed a failure behind); with
    # the integration's order of optimizers (Lightning's trainer.optimizers) each one's run is saved at its index.
    after, before, resumed = case
    kwargs = {"fallback_after": after, "nonfinite_fallback": "lower_lr", "lr_factor": 0.5}

    def optimizers(scaler):
        opts = [torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1) for _ in range(2)]
        if register:
            scaler._set_optimizer_order(opts)
        return opts

    whole = FP8GradScaler(**kwargs)
    expected = optimizers(whole)
    _events(whole, expected, before + resumed)
    first = FP8GradScaler(**kwargs)
    opts = optimizers(first)
    _events(first, opts, before)
    again = _resumed(first, "state_dict", **kwargs)
    if register:
        again._set_optimizer_order(opts)
    _events(again, opts, resumed)
    assert [o.param_groups[0]["lr"] for o in opts] == [o.param_groups[0]["lr"] for o in expected]
    assert [h["action"] for h in again.history] == [h["action"] for h in whole.history]


def test_saved_runs_keep_the_order_of_first_steps_when_an_earlier_optimizer_is_gone():
    scaler = FP8GradScaler(fallback_after=5)
    opts = [torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1) for _ in range(4)]
    _events(scaler, opts, [("step", 0, False), ("step", 1, False), ("step", 2, True), ("step", 3, False),
                           ("step", 2, True)])  # fmt: skip
    del opts[:2]  # the first two optimizers are collected; a new one is counted after the last two
    opts.append(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))
    _events(scaler, opts, [("step", 2, True)])
    assert scaler.state_dict()["nonfinite_runs"] == [2, 0, 1]


def test_a_state_dict_saved_without_each_optimizers_run_starts_every_run_at_the_longest():
    scaler = FP8GradScaler(**FAILING)
    run = _schedule(scaler, [(True, False), (True, False)])
    state = scaler.state_dict()
    assert state["nonfinite_runs"] == [2, 0] and state["consecutive_nonfinite"] == 2
    del state["nonfinite_runs"]  # as saved before the runs were
    resumed = FP8GradScaler(**FAILING)
    resumed.load_state_dict(state)
    _, _, opts = _schedule(resumed, [(False, True)], run)
    assert [o.param_groups[0]["lr"] for o in opts] == [0.1, 0.05]  # b's run started at 2: the old rule


@pytest.mark.parametrize(("runs", "error"), [(3, TypeError), ([1, -1], ValueError), ([1, 2.5], TypeError),
                                             ([True], TypeError)])  # fmt: skip
def test_bad_saved_runs_are_refused_and_load_nothing(runs, error):
    scaler = FP8GradScaler(init_scale=2.0)
    state = FP8GradScaler(init_scale=8.0).state_dict() | {"nonfinite_runs": runs}
    with pytest.raises(error, match="nonfinite_runs"):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == 2.0


class _FailsOnce(torch.optim.SGD):
    """SGD whose first step raises before changing anything (as FP8AdamW refusing a changed storage dtype)."""

    failed = False

    def step(self, closure=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("refused; nothing was stepped")
        return super().step(closure)


@pytest.mark.parametrize("kind", ["plain", "fp8adamw"])
def test_a_step_that_raised_can_be_made_again(kind):
    # A step that raised was kept as made: its retry was refused ("already been called since the last update()"),
    # and an update() counted a clean step that never happened. Now the retry steps, the gradients unscaled once
    # (a plain optimizer's were already unscaled in place), to the weights of a run whose step did not raise, with
    # the same scaler counts.
    def run(fail: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        scaler = FP8GradScaler(init_scale=MU0)
        if kind == "plain":
            opt = (_FailsOnce if fail else torch.optim.SGD)(model.parameters(), lr=0.1)
        else:
            model = convert_to_fp8(model)
            opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
        scaler.scale_loss(
            model(torch.randn(8, 32, generator=torch.Generator().manual_seed(1))).square().mean()
        ).backward()
        if fail and kind == "plain":
            with pytest.raises(RuntimeError, match="nothing was stepped"):
                scaler.step(opt)
        elif fail:
            model.float()  # refused by FP8AdamW's step, which then leaves the weights as they were
            with pytest.raises(RuntimeError, match="nothing was stepped"):
                opt.step()
            model.half()  # the cast FP8AdamW accepts: the weights hold their fp16 masters again
        if kind == "plain":
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        state = scaler.state_dict()
        return [p.detach().float().clone() for p in model.parameters()], state

    (got, got_state), (ref, ref_state) = run(fail=True), run(fail=False)
    if kind == "fp8adamw":  # model.half() made the non-FP8 parameters fp16: they agree to fp16 rounding
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(g, r, rtol=2**-10, atol=2**-14)
    else:
        assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True))
    assert got_state == ref_state


# ------------------------------------------------------------------------------------------- several processes
def _ranks_agree_per_optimizer(rank: int) -> dict:
    """Two SGD optimizers, one scaler; o2's gradient is non-finite on rank 1 only: every rank steps o1 and skips o2."""
    p, q = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    o1, o2 = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    scaler = FP8GradScaler(init_scale=4.0)
    scaler.scale_loss(torch.zeros(()))  # the planted gradients carry mu, as a scaled backward's do
    p.grad = torch.full((4,), 4.0)
    q.grad = torch.full((4,), math.inf if rank == 1 else 4.0)
    stepped = (scaler.step(o1), scaler.step(o2))
    scaler.update()
    return {"stepped": stepped, "scale": scaler.get_scale(), "p": p.detach().clone(), "q": q.detach().clone()}


def _training_goes_on_after_a_refused_fallback(rank: int) -> dict:
    """The "bf16" fallback refused under DDP (recovery raises): the error reaches the caller, and the next finite
    step is taken on every rank, the replicas staying identical."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=1, init_scale=MU0)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    ddp = DDP(model)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    scaler.scale_loss(ddp(x).square().mean()).backward()
    model[2].weight.grad.fill_(math.inf)
    model[2].fp8_scaling["grad_output"].amax.fill_(math.inf)  # blames the layer, as a non-finite gradient would
    try:
        optimizer.step()
        error = None
    except ValueError as e:
        error = str(e)
    optimizer.zero_grad()
    before = model.state_dict()["0.weight"].clone()
    scaler.scale_loss(ddp(x).square().mean()).backward()
    optimizer.step()
    weight = model.state_dict()["0.weight"]
    gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weight)
    return {"error": error, "stepped": not torch.equal(before, weight), "skipped": scaler.skipped_steps,
            "scale": scaler.get_scale(), "identical": all(torch.equal(gathered[0], w) for w in gathered)}  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    return run_parts({"agree": lambda: _ranks_agree_per_optimizer(rank),
                      "fallback": lambda: _training_goes_on_after_a_refused_fallback(rank)})  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.slow
def test_ranks_agree_on_each_optimizers_step(two_ranks):
    reports = part_results(two_ranks, "agree")
    for report in reports:
        assert report["stepped"] == (True, False) and report["scale"] == 2.0
        torch.testing.assert_close(report["p"], torch.full((4,), 0.9))  # stepped with the gradient unscaled
        assert torch.equal(report["q"], torch.ones(4))


@pytest.mark.slow
def test_training_goes_on_after_the_fallback_is_refused_under_ddp(two_ranks):
    for report in part_results(two_ranks, "fallback"):
        assert report["error"] is not None and "cannot run with 2 processes" in report["error"], report
        assert report["stepped"] and report["identical"]
        assert report["skipped"] == 1 and report["scale"] == MU0 / 2


@pytest.mark.parametrize("spelling", ["amp", "own"])
def test_bf16_fallback_puts_back_the_layers_of_every_optimizer(spelling):
    """A non-finite loss blames every FP8 layer; each O2 FP8AdamW holds the masters of its own layers, so the fallback
    needs all of them (it failed with only the last one stepped: "an FP8AdamW (O2) that was not passed")."""
    a, b = _pair(fp8=True)
    model = nn.ModuleDict({"a": a, "b": b})
    scaler = FP8GradScaler(init_scale=MU0, nonfinite_fallback=model, fallback_after=2)
    grad_scaler = scaler if spelling == "own" else None
    o1 = FP8AdamW(a.parameters(), lr=1e-2, grad_scaler=grad_scaler)
    o2 = FP8AdamW(b.parameters(), lr=1e-2, grad_scaler=grad_scaler)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two non-finite steps: the fallback runs
        scaler.scale_loss((a(x).square().mean() + b(x).square().mean()) * math.nan).backward()
        if spelling == "amp":
            scaler.step(o1)
            scaler.step(o2)
            scaler.update()
        else:
            o1.step()
            o2.step()
        o1.zero_grad()
        o2.zero_grad()
    assert type(a[0]) is nn.Linear and type(b[0]) is nn.Linear
    assert a[0].weight.dtype == b[0].weight.dtype == torch.float32  # each master came back from its optimizer
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())  # skipped steps changed nothing
    loss = a(x).square().mean() + b(x).square().mean()
    scaler.scale_loss(loss).backward()
    if spelling == "amp":
        assert scaler.step(o1) and scaler.step(o2)
        scaler.update()
    else:
        o1.step()
        o2.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not any(torch.equal(v, expected[k]) for k, v in model.state_dict().items() if k.endswith("weight"))


def test_a_scaler_that_stepped_optimizers_pickles():
    """Lightning's spawned processes pickle the precision plugin and its scaler; the scaler's weak bookkeeping of the
    optimizers it stepped cannot be pickled and starts empty in the copy (mu and the counters travel)."""
    import pickle

    a, b = _pair()
    scaler = FP8GradScaler(init_scale=MU0)
    o1, o2 = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    _run(a, b, o1, o2, scaler, "amp", iterations=2)  # one skipped step (POISON[1])
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.state_dict() == scaler.state_dict()
    a2, b2 = _pair()
    o3, o4 = torch.optim.SGD(a2.parameters(), lr=0.1), torch.optim.SGD(b2.parameters(), lr=0.1)
    assert [r[:2] for r in _run(a2, b2, o3, o4, copy, "amp", iterations=1)] == [(True, True)]
