"""FP8AdamW reached by different routes (a route sweep): the same settings given by parameter groups at construction,
written into ``param_groups`` afterwards (as LR schedulers do) or added with ``add_param_group``; by recipe name,
``FP8Recipe`` object, ``opt_level`` or explicit state dtypes; ``low_precision_moments`` on a model of FP8Linear layers
and plain parameters (embedding, LayerNorm, biases, a 0-dim parameter); ``maximize``; parameters without gradients
at some steps; state dicts saved mid-training (through ``torch.save`` and ``torch.load(weights_only=True)``, into a
fresh optimizer) and ``torch.optim.AdamW``'s; ``grad_cast_bucket_mb`` and a gradient scaler; and the inputs
``torch.optim.AdamW`` refuses.

Each run is checked against an independent float64 AdamW written here (decoupled weight decay, bias correction as
``torch.optim.AdamW``) fed the same gradients, with tolerances from the storage formats, and routes that mean the same
settings are checked to give the same bits.
"""

import copy
import io
import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8
from lightning_fp8.formats import E4M3

# Relative (norm) deviation from float64 AdamW after STEPS steps, per state format (as in
# test_optim_reference_numerics.py, which runs 30 steps; these runs are shorter):
# - E4M3 exp_avg: <= 2**-4 per rounding (~2.4% RMS), the errors decay with beta1: 4-6% seen, 0.1 leaves margin;
# - fp16 exp_avg_sq: 2**-11 per step: 0.04% seen, 3e-3 leaves margin;
# - a weight with an E4M3 first moment: its error enters each update (lr times ~5%), plus an fp16 master's 2**-11 per
#   step: <= 2.5% seen for weights that start at 0 (a LayerNorm bias moves lr per step from 0), 0.06 leaves margin;
# - fp32 states (and an fp32 master): fp32 rounding only, 1e-5.
STEPS = 6
EXP_AVG_RTOL, EXP_AVG_SQ_RTOL, WEIGHT_RTOL, FP32_RTOL = 0.1, 3e-3, 0.06, 1e-5
# The hyper-parameters below are exact in fp32, so a 0-dim fp32 tensor and a Python float mean the same step.
LR_A, LR_B, LR_C = 2.0**-7, 2.0**-8, 2.0**-6


class Net(nn.Module):
    """FP8Linear weights (after convert_to_fp8) beside an embedding, a LayerNorm, a bias and a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 32)
        self.l1 = nn.Linear(32, 48)
        self.ln = nn.LayerNorm(48)
        self.l2 = nn.Linear(48, 16, bias=False)
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.ln(self.l1(self.emb(idx).mean(1) + x))).sum() * self.gain


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(Net())


# Three groups, each with all four hyper-parameters of its own (one without weight decay).
HYPER = [
    {"lr": LR_A, "betas": (0.75, 0.984375), "eps": 2.0**-27, "weight_decay": 0.125},
    {"lr": LR_B, "betas": (0.875, 1 - 2.0**-10), "eps": 2.0**-20, "weight_decay": 0.0},
    {"lr": LR_C, "betas": (0.5, 0.875), "eps": 2.0**-26, "weight_decay": 2.0**-6},
]


def _groups(m: nn.Module, *, tensor_lr: bool = False) -> list[dict]:
    """The groups of HYPER, each mixing FP8 weights and plain parameters (lr as a 0-dim tensor with ``tensor_lr``)."""
    params = [[m.l1.weight, m.emb.weight], [m.l1.bias, m.ln.weight, m.ln.bias], [m.l2.weight, m.gain]]
    groups = [{"params": p, **hyper} for p, hyper in zip(params, HYPER, strict=True)]
    for group in groups if tensor_lr else ():
        group["lr"] = torch.tensor(group["lr"])
    return groups


class AdamW64:
    """AdamW in float64 (decoupled weight decay, bias correction as torch.optim.AdamW), per parameter, written out:
    ``w *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= lr / (1 - b1^t) m / (sqrt(v / (1 - b2^t))
    + eps)``. A parameter without a gradient (None) is left as it is, its step count too."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.w = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.t = [0] * len(self.w)

    def step(self, grads: list, hyper: list[dict]) -> None:
        for i, (g, h) in enumerate(zip(grads, hyper, strict=True)):
            if g is None:
                continue
            g = -g.double() if h.get("maximize", False) else g.double()
            lr, (b1, b2), eps, wd = float(h["lr"]), h["betas"], h["eps"], h["weight_decay"]
            self.t[i] += 1
            t = self.t[i]
            self.w[i] *= 1 - lr * wd
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            denom = (self.v[i] / (1 - b2**t)).sqrt() + eps
            self.w[i] -= lr / (1 - b1**t) * self.m[i] / denom


def _rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference).norm() / reference.norm()).item()


def _spec(model: nn.Module, *, maximize: bool = False, lrs: tuple | None = None) -> list[dict]:
    """Each parameter's hyper-parameters (model.parameters() order) as :func:`_groups` sets them (the lrs of the
    groups replaced by ``lrs``): the reference's own copy, not read back from the optimizer."""
    by_param = {}
    for i, group in enumerate(_groups(model)):
        hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} | {"maximize": maximize}
        hyper["lr"] = hyper["lr"] if lrs is None else lrs[i]
        by_param.update({id(p): hyper for p in group["params"]})
    return [by_param[id(p)] for p in model.parameters()]


def _grad(step: int, index: int, shape, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen) + 0.3  # a steady part, so the moments do not average out


def _set_grads(params, step, gen, grad_fn=_grad) -> list:
    """Hand-set gradients (in each parameter's dtype, fp16 for O2 weights); returns them in float64 (None kept)."""
    grads = []
    for i, p in enumerate(params):
        g = grad_fn(step, i, p.shape, gen)
        p.grad = None if g is None else g.to(p.dtype)
        grads.append(None if g is None else p.grad.double())
    return grads


def _assert_near_reference(model: nn.Module, opt: FP8AdamW, ref: AdamW64) -> None:
    """Weights (``model.state_dict()``: unscaled) and moments (``to_adamw_state_dict``: unscaled fp32) within the
    tolerance of each parameter's state formats."""
    weights = model.state_dict()
    exported = opt.to_adamw_state_dict()["state"]
    order = [p for group in opt.param_groups for p in group["params"]]
    for i, (name, p) in enumerate(model.named_parameters()):
        state = opt.state[p]
        low = state["exp_avg"].dtype != torch.float32
        w_tol = WEIGHT_RTOL if low or state.get("master", p).dtype != torch.float32 else FP32_RTOL
        m_tol, v_tol = (EXP_AVG_RTOL, EXP_AVG_SQ_RTOL) if low else (FP32_RTOL, FP32_RTOL)
        saved = exported[next(j for j, q in enumerate(order) if q is p)]
        assert _rel(weights[name], ref.w[i]) < w_tol, name
        assert _rel(saved["exp_avg"], ref.m[i]) < m_tol, name
        assert _rel(saved["exp_avg_sq"], ref.v[i]) < v_tol, name
        assert int(state["step"]) == ref.t[i], name


def _assert_same_bits(a: dict, b: dict) -> None:
    """Two state dicts (or modules' state dicts) hold the same bits."""
    a, b = (x.state_dict() if isinstance(x, nn.Module) else x for x in (a, b))
    assert a.keys() == b.keys()
    assert [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))] == []


def _run(make_opt, steps=STEPS, grad_fn=_grad, before_step=None, model=None, hyper=lambda model, step: _spec(model)):
    """``steps`` steps of ``make_opt(model)`` and of AdamW64 with ``hyper(model, step)`` on the same hand-set
    gradients (``fp8_grads`` off: the optimizer must be built with ``fp8_grads=False``)."""
    model = model if model is not None else _model()
    params = list(model.parameters())
    ref = AdamW64(params)
    opt = make_opt(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if before_step is not None:
            before_step(opt, step)
        grads = _set_grads(params, step, gen, grad_fn)
        opt.step()
        ref.step(grads, hyper(model, step))
    return model, opt, ref


# ------------------------------------------------------------------------------------- 1. parameter groups and lr
def _written_after(opt, step):
    if step == 0:  # built with other values, then set as a scheduler or the user's code writes them
        for group, hyper in zip(opt.param_groups, HYPER, strict=True):
            group.update(hyper)


def _added_later(m, **kwargs):
    groups = _groups(m)
    opt = FP8AdamW(groups[:1], fp8_grads=False, **kwargs)
    for group in groups[1:]:
        opt.add_param_group(group)
    return opt


def _other_values(m, **kwargs):
    groups = [{"params": g["params"]} for g in _groups(m)]
    return FP8AdamW(groups, lr=0.5, betas=(0.5, 0.6), eps=0.1, weight_decay=2.0, fp8_grads=False, **kwargs)


GROUP_ROUTES = {
    "constructor": lambda m, **kwargs: FP8AdamW(_groups(m), fp8_grads=False, **kwargs),
    "tensor_lr": lambda m, **kwargs: FP8AdamW(_groups(m, tensor_lr=True), fp8_grads=False, **kwargs),
    "add_param_group": _added_later,
    "written_after": _other_values,
}


@pytest.mark.parametrize("lpm", ["fp8_weights", "all"])
def test_group_hyper_parameters_by_any_route_step_as_float64_adamw_and_alike(lpm):
    """Per-group lr, betas, eps and weight decay (0 for one group), set at construction, as 0-dim tensors, through
    add_param_group or written into param_groups after construction: within the formats' precision of float64
    AdamW, and the same bits by every route."""
    runs = {}
    for name, make in GROUP_ROUTES.items():
        before = _written_after if name == "written_after" else None
        model, opt, ref = _run(lambda m, make=make: make(m, low_precision_moments=lpm), before_step=before)
        _assert_near_reference(model, opt, ref)
        runs[name] = model.state_dict()
    for weights in runs.values():
        _assert_same_bits(runs["constructor"], weights)


def test_lr_written_every_step_as_a_scheduler_does_steps_with_each_steps_lr():
    """A decaying lr written into param_groups before each step (a float in one group, a 0-dim tensor updated in
    place in another), as LR schedulers do: each step uses that step's lr."""

    def schedule(opt, step):
        opt.param_groups[0]["lr"] = LR_A * 0.5**step
        opt.param_groups[2]["lr"].fill_(LR_C * 0.75**step)

    def make(m):
        groups = _groups(m)
        groups[2]["lr"] = torch.tensor(LR_C)
        return FP8AdamW(groups, fp8_grads=False, low_precision_moments="all")

    def hyper(model, step):
        return _spec(model, lrs=(LR_A * 0.5**step, LR_B, LR_C * 0.75**step))

    model, opt, ref = _run(make, before_step=schedule, hyper=hyper)
    _assert_near_reference(model, opt, ref)


# -------------------------------------------------------------------------- 2. recipe, opt_level, explicit dtypes
O2_ROUTES = {
    "default": {},
    "recipe_name": {"recipe": "fp8-lm"},
    "recipe_object": {"recipe": FP8Recipe()},
    "recipe_from_dict": {"recipe": FP8Recipe.from_dict({"opt_level": "O2"})},
    "recipe_replaced": {"recipe": FP8Recipe.from_name("fp8-lm-o1").replace(opt_level="O2")},
    "opt_level": {"opt_level": "O2"},
    "o1_recipe_opt_level_o2": {"recipe": "fp8-lm-o1", "opt_level": "O2"},
    "explicit_dtypes": {"master_dtype": torch.float16, "exp_avg_dtype": E4M3, "exp_avg_sq_dtype": torch.float16},
    "o1_with_o2_dtypes": {
        "opt_level": "O1", "master_dtype": torch.float16, "exp_avg_dtype": E4M3, "exp_avg_sq_dtype": torch.float16,
    },
}  # fmt: skip
O1_ROUTES = {
    "recipe_name": {"recipe": "fp8-lm-o1"},
    "recipe_object": {"recipe": FP8Recipe(opt_level="O1")},
    "opt_level": {"opt_level": "O1"},
    "explicit_dtypes": {
        "master_dtype": torch.float32,
        "exp_avg_dtype": torch.float32,
        "exp_avg_sq_dtype": torch.float32,
    },
}


@pytest.mark.parametrize("routes", [O2_ROUTES, O1_ROUTES], ids=["O2", "O1"])
def test_recipe_opt_level_and_dtype_routes_to_one_level_give_the_same_bits(routes):
    """The routes to one level give the same states (O2: fp16 master, E4M3 and fp16 moments; O1: fp32), the same
    bits, within the formats' precision of float64 AdamW."""
    runs = {}
    for name, kwargs in routes.items():
        model, opt, ref = _run(lambda m, kwargs=kwargs: FP8AdamW(_groups(m), fp8_grads=False, **kwargs))
        want = (E4M3, torch.float16) if routes is O2_ROUTES else (torch.float32, torch.float32)
        state = opt.state[model.l1.weight]
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == want, name
        assert (model.l1.weight.dtype == torch.float16) == (routes is O2_ROUTES), name  # the master in its storage
        _assert_near_reference(model, opt, ref)
        runs[name] = model.state_dict()
    first = next(iter(runs.values()))
    for weights in runs.values():
        _assert_same_bits(first, weights)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"opt_level": "O3"}, "opt_level='O3'"),
        ({"recipe": "fp8-lm-o3"}, "unknown FP8 recipe name"),
        ({"recipe": {"opt_level": "O1"}}, "FP8Recipe.from_dict"),
        ({"master_dtype": E4M3}, "master_dtype"),
        ({"exp_avg_sq_dtype": E4M3}, "exp_avg_sq_dtype"),
        ({"low_precision_moments": "none"}, "low_precision_moments='none'"),
        ({"scale_update": "three_pass"}, "scale_update='three_pass'"),
    ],
)
def test_settings_it_cannot_honour_are_refused_naming_the_argument(kwargs, match):
    model = _model()
    before = [p.dtype for p in model.parameters()]
    with pytest.raises((ValueError, TypeError), match=match):
        FP8AdamW(model.parameters(), **kwargs)
    assert [p.dtype for p in model.parameters()] == before  # nothing adopted


# ---------------------------------------------------------------------------------- 3. low_precision_moments
@pytest.mark.parametrize("scale_update", ["one_pass", "two_pass"])
@pytest.mark.parametrize(
    ("lpm", "extra"),
    [
        ("fp8_weights", {}),
        ("all", {}),
        ("all", {"exp_avg_dtype": torch.float16}),
        ("fp8_weights", {"master_dtype": torch.float32}),
    ],
    ids=["fp8_weights", "all", "all-fp16-m", "fp32-master"],
)
def test_low_precision_moments_keep_each_parameters_states_in_their_formats(lpm, extra, scale_update):
    """FP8 weights get the low-precision moments always; the embedding, LayerNorm, bias and 0-dim parameter only
    with "all", their master staying the fp32 parameter; each within its formats' precision of float64 AdamW."""
    model, opt, ref = _run(
        lambda m: FP8AdamW(_groups(m), fp8_grads=False, low_precision_moments=lpm, scale_update=scale_update, **extra)
    )
    moment = extra.get("exp_avg_dtype", E4M3)
    for name, p in model.named_parameters():
        fp8_weight = name in ("l1.weight", "l2.weight")
        want = moment if fp8_weight or lpm == "all" else torch.float32
        assert opt.state[p]["exp_avg"].dtype == want, name
        if not fp8_weight:
            assert p.dtype == torch.float32 and "master" not in opt.state[p], name  # its own master
    _assert_near_reference(model, opt, ref)


# ------------------------------------------------------------------------------ 4. maximize, missing gradients
def _data(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 20, (16, 4), generator=gen), torch.randn(16, 32, generator=gen)


@pytest.mark.parametrize("kwargs", [{}, {"low_precision_moments": "all"}, {"opt_level": "O1"}])
def test_maximize_is_minimizing_the_negated_loss_bit_for_bit(kwargs):
    """With FP8 gradients (the default fp8_grads) and a gradient scaler: maximize=True on the loss takes the steps of
    minimizing its negation, bit for bit (FP8 casts are symmetric in sign)."""
    models = []
    for maximize, sign in ((True, 1.0), (False, -1.0)):
        model = _model()
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(_groups(model), grad_scaler=scaler, maximize=maximize, **kwargs)
        for step in range(3):
            scaler.scale_loss(sign * model(*_data(step))).backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    _assert_same_bits(*models)


def test_maximize_steps_as_float64_adamw_on_the_negated_gradient():
    model, opt, ref = _run(
        lambda m: FP8AdamW(_groups(m), fp8_grads=False, maximize=True, low_precision_moments="all"),
        hyper=lambda model, step: _spec(model, maximize=True),
    )
    _assert_near_reference(model, opt, ref)


# The parameters (model.parameters() order) and the steps at which they get no gradient: two from the first step on
# (an FP8 weight and the embedding), two now and then (an FP8 weight and the 0-dim parameter).
NAMES = [name for name, _ in Net().named_parameters()]
MISSING = {"emb.weight": (0, 1), "l1.weight": (0, 1), "l2.weight": (1, 4), "gain": (1, 4)}


def _some_missing(step, index, shape, gen):
    g = _grad(step, index, shape, gen)
    return None if step in MISSING.get(NAMES[index], ()) else g


@pytest.mark.parametrize("kwargs", [{}, {"low_precision_moments": "all"}, {"scale_update": "two_pass"}])
def test_parameters_without_a_gradient_are_left_as_they_are_decay_included(kwargs):
    """A parameter whose gradient is None at a step is not stepped (no weight decay, no moment decay, no step
    count), as in torch.optim.AdamW; it joins at its own step count (bias correction) when its gradient comes."""
    snapshots = []
    model = _model()
    model, opt, ref = _run(
        lambda m: FP8AdamW(_groups(m), fp8_grads=False, **kwargs), grad_fn=_some_missing, model=model,
        before_step=lambda opt, step: snapshots.append({k: v.clone() for k, v in model.state_dict().items()}),
    )  # fmt: skip
    _assert_near_reference(model, opt, ref)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == ref.t
    assert ref.t == [STEPS - len(MISSING.get(name, ())) for name in NAMES]
    for step in range(STEPS - 1):  # no gradient at that step: the step left them as they were, bit for bit
        for name in NAMES:
            unchanged = torch.equal(snapshots[step][name], snapshots[step + 1][name])
            assert unchanged == (step in MISSING.get(name, ())), (step, name)


# ----------------------------------------------------------------------------------------------- 5. state dicts
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"low_precision_moments": "all"}, {"opt_level": "O1"}, {"emit_fp8_weights": True}, {"maximize": True}],
    ids=["O2", "all", "O1", "emit", "maximize"],
)
def test_state_dict_through_torch_save_into_a_fresh_optimizer_continues_bit_for_bit(kwargs):
    """Saved mid-training (some parameters without state yet), through torch.save and torch.load(weights_only=True),
    loaded into a fresh model and optimizer (built with other hyper-parameters: the saved groups' win), the run
    continues as the uninterrupted one, bit for bit; and both stay near float64 AdamW."""
    whole, whole_opt, ref = _run(
        lambda m: FP8AdamW(_groups(m), fp8_grads=False, **kwargs), grad_fn=_some_missing,
        hyper=lambda model, step: _spec(model, maximize=kwargs.get("maximize", False)),
    )  # fmt: skip
    _assert_near_reference(whole, whole_opt, ref)

    model = _model()
    params = list(model.parameters())
    opt = FP8AdamW(_groups(model), fp8_grads=False, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        _set_grads(params, step, gen, _some_missing)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert len(saved["optimizer"]["state"]) == len(NAMES) - 2  # emb and l1.weight had no gradient yet

    resumed = _model(seed=7)
    other = [{"params": g["params"], "lr": 1.0, "betas": (0.5, 0.5)} for g in _groups(resumed)]
    resumed_opt = FP8AdamW(other, fp8_grads=False, **kwargs)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    params = list(resumed.parameters())
    for step in range(2, STEPS):
        _set_grads(params, step, gen, _some_missing)
        resumed_opt.step()
    _assert_same_bits(whole, resumed)
    assert [float(g["lr"]) for g in resumed_opt.param_groups] == [LR_A, LR_B, LR_C]


@pytest.mark.parametrize("kwargs", [{}, {"low_precision_moments": "all"}, {"opt_level": "O1"}])
def test_a_torch_adamw_state_dict_loads_and_continues_as_torch_adamw(kwargs):
    """torch.optim.AdamW trained a plain copy 3 steps; its state dict (through torch.save, weights_only) loads into
    FP8AdamW over the converted model, which continues within the formats' precision of torch's own run (fp32 states
    where both keep them)."""
    torch.manual_seed(0)
    plain = Net()
    model = convert_to_fp8(copy.deepcopy(plain))
    torch_opt = torch.optim.AdamW(_groups(plain))
    gen = torch.Generator().manual_seed(1)
    grads = [[_grad(s, i, p.shape, gen) for i, p in enumerate(plain.parameters())] for s in range(STEPS)]
    for step in range(3):
        for p, g in zip(plain.parameters(), grads[step], strict=True):
            p.grad = g.clone()
        torch_opt.step()
    buffer = io.BytesIO()
    torch.save({"model": plain.state_dict(), "optimizer": torch_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model.load_state_dict(saved["model"])
    opt = FP8AdamW(_groups(model), fp8_grads=False, **kwargs)
    opt.load_state_dict(saved["optimizer"])
    for step in range(3, STEPS):
        for p, q, g in zip(plain.parameters(), model.parameters(), grads[step], strict=True):
            p.grad, q.grad = g.clone(), g.to(q.dtype)
        torch_opt.step()
        opt.step()
    want, got = plain.state_dict(), model.state_dict()
    for name, p in model.named_parameters():
        fp32 = opt.state[p]["exp_avg"].dtype == torch.float32 and p.dtype == torch.float32
        assert _rel(got[name], want[name].double()) < (FP32_RTOL if fp32 else WEIGHT_RTOL), name
    exported = opt.to_adamw_state_dict()
    theirs = torch_opt.state_dict()["state"]
    for i, p in enumerate(p for group in opt.param_groups for p in group["params"]):
        low = opt.state[p]["exp_avg"].dtype != torch.float32
        mine = exported["state"][i]
        assert _rel(mine["exp_avg"], theirs[i]["exp_avg"].double()) < (EXP_AVG_RTOL if low else FP32_RTOL), i
        assert _rel(mine["exp_avg_sq"], theirs[i]["exp_avg_sq"].double()) < (EXP_AVG_SQ_RTOL if low else FP32_RTOL), i
    back = torch.optim.AdamW(_groups(copy.deepcopy(plain)))
    back.load_state_dict(exported)  # and back into torch.optim.AdamW, as its own state
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], exported["state"][0]["exp_avg"])


# ---------------------------------------------------------------------- 6. gradient casts, scaler, emitted weights
def test_gradient_cast_buckets_scaler_and_emitted_weights_do_not_change_the_steps():
    """With FP8 gradients (accumulated over two micro-batches): grad_cast_bucket_mb 0, a bucket that flushes at every
    gradient and one that holds them all; emit_fp8_weights with two passes (the copy is the forward's cast bit for
    bit): the same bits."""

    def train(**kwargs):
        model = _model()
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(_groups(model), grad_scaler=scaler, **kwargs)
        for step in range(3):
            for micro in range(2):
                scaler.scale_loss(model(*_data(2 * step + micro))).backward()
            opt.step()
            opt.zero_grad()
        return model

    first = train(scale_update="two_pass")
    for kwargs in ({"grad_cast_bucket_mb": 1e-6}, {"grad_cast_bucket_mb": 64}, {"emit_fp8_weights": True}):
        _assert_same_bits(first, train(scale_update="two_pass", **kwargs))


# --------------------------------------------------------------------------------------------- 7. bad input
def _param() -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 4))


BAD_INPUTS = {
    "lr_nan": lambda opt: opt([_param()], lr=math.nan),
    "lr_negative": lambda opt: opt([_param()], lr=-1e-3),
    "lr_tensor_nan": lambda opt: opt([_param()], lr=torch.tensor(math.nan)),
    "lr_tensor_two_elements": lambda opt: opt([_param()], lr=torch.tensor([1e-3, 1e-3])),
    "eps_negative": lambda opt: opt([_param()], eps=-1e-8),
    "weight_decay_negative": lambda opt: opt([_param()], weight_decay=-0.1),
    "beta1_one": lambda opt: opt([_param()], betas=(1.0, 0.999)),
    "beta2_negative": lambda opt: opt([_param()], betas=(0.9, -0.1)),
    "beta_nan": lambda opt: opt([_param()], betas=(math.nan, 0.999)),
    "beta_tensor_two_elements": lambda opt: opt([_param()], betas=(torch.tensor([0.9, 0.8]), 0.999)),
    "non_leaf": lambda opt: opt([_param() * 2]),
    "empty": lambda opt: opt([]),
    "same_param_two_groups": lambda opt: (lambda p: opt([{"params": [p]}, {"params": [p]}]))(_param()),
    "same_param_added_again": lambda opt: (lambda p: opt([p]).add_param_group({"params": [p]}))(_param()),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_what_torch_adamw_refuses_fp8_adamw_refuses_saying_which_value(case):
    """Every input torch.optim.AdamW refuses, FP8AdamW refuses too, with a ValueError or TypeError that names the
    value (not an error from deep inside, such as float() of a two-element tensor)."""
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        BAD_INPUTS[case](torch.optim.AdamW)
    with pytest.raises((ValueError, TypeError)) as error:
        BAD_INPUTS[case](FP8AdamW)
    message = str(error.value)
    named = {"lr": ("learning rate", "lr"), "eps": ("epsilon",), "weight_decay": ("weight_decay",), "beta": ("beta",)}
    words = next((words for key, words in named.items() if case.startswith(key)), None)
    if words is not None:
        assert any(word in message for word in words), message


def test_complex_float64_and_sparse_are_refused_where_fp8_adamw_cannot_step_them():
    with pytest.raises(TypeError, match="complex parameter"):
        FP8AdamW([nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="float64 parameter"):
        FP8AdamW([nn.Parameter(torch.randn(4, dtype=torch.float64))])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = FP8AdamW([emb.weight])
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse gradients.*nothing was stepped"):
        opt.step()
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda g: g.update(decoupled_weight_decay=False), "decoupled_weight_decay=False and weight_decay 0.125"),
        (lambda g: g.update(betas=(torch.tensor([0.9, 0.8]), 0.99)), r"tensor betas\[0\] must have one element"),
    ],
    ids=["decoupled_weight_decay_false", "two_element_beta"],
)
def test_a_group_written_after_construction_to_what_the_constructor_refuses_is_refused_at_the_step(write, match):
    """A group given decoupled_weight_decay=False after construction was stepped with decoupled decay, where
    torch.optim.AdamW (which honours the flag) adds Adam's L2 term to the gradient; a two-element tensor beta failed
    with torch's 'only one element tensors can be converted to Python scalars'. Both are refused at the step as the
    constructor refuses them, nothing stepped."""
    model = _model()
    opt = FP8AdamW(_groups(model), fp8_grads=False)
    _set_grads(list(model.parameters()), 0, torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    write(opt.param_groups[0])
    with pytest.raises(ValueError, match=f"parameter group 0 holds a value .*{match}"):
        opt.step()
    _assert_same_bits(before, model)
    assert not opt.state  # no state made either


def test_decoupled_weight_decay_false_without_decay_steps_and_refuses_a_decay_set_later():
    """A group of torch.optim.Adam(weight_decay=0)'s (decoupled_weight_decay=False) is AdamW without decay and steps;
    a weight decay written into it later (a weight-decay schedule) is refused at the step."""
    model = _model()
    groups = _groups(model)
    groups[1]["decoupled_weight_decay"] = False  # the group without decay
    model, opt, ref = _run(lambda m: FP8AdamW(groups, fp8_grads=False), model=model)
    _assert_near_reference(model, opt, ref)
    opt.param_groups[1]["weight_decay"] = 0.01
    _set_grads(list(model.parameters()), 0, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="parameter group 1 .*decoupled_weight_decay=False and weight_decay 0.01"):
        opt.step()
