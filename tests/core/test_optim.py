"""FP8AdamW against torch.optim.AdamW in fp32, its O2 state layout, checkpoints and bad input."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_fp8 import (
    FP8MLP,
    FP8AdamW,
    FP8GradScaler,
    FP8Linear,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
)
from lightning_fp8.formats import E4M3, E5M2
from lightning_fp8.optim import checkpoint, master
from tests.core.gpt_tiny import TinyGPT, batches, train

# Tolerances on loss curves against torch.optim.AdamW (fp32), as mean |loss - loss_ref| over all steps.
# O1 keeps fp32 states: only the operation order differs from torch's (a few ulp per step); measured ~1e-7 on the
# one-block GPT and ~5e-8 on the regression over 300 steps.
O1_LOSS_TOL = 1e-5
# O2 rounds the master to fp16 (2**-11 relative), m to E4M3 (2**-4 relative) and v to fp16 every step; the
# trajectories drift apart like two seeds of the same run: measured ~0.0015 on the one-block GPT (300 steps) and
# ~7e-4 of the initial loss on the regression (whose converged loss, ~1e-4, sits at the fp16 master's resolution, so
# it is not compared relatively). The bounds leave about 3x margin.
O2_LOSS_TOL_GPT = 0.005
O2_LOSS_TOL_REGRESSION = 2e-3  # mean |loss - loss_ref| / initial loss
# Full FP8 training (FP8 GEMMs + O2 + gradient scaler) on the one-block GPT adds the GEMMs' quantization noise:
# measured mean |loss - loss_ref| ~0.008 over 300 steps (either scale update).
FP8_LOSS_TOL = 0.02


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tests run thousands of tiny ops; an intra-op thread pool only adds contention (10-40x slower measured on
    # a loaded 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(48, 16)

    def forward(self, x, y):
        return ((self.lin(x) - y) ** 2).mean()


def _regression_data(steps):
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 48, generator=gen) * 0.3
    for _ in range(steps):
        x = torch.randn(64, 48, generator=gen)
        yield x, x @ w_true.t() + 0.01 * torch.randn(64, 16, generator=gen)


def _levels_against_adamw(base, data_fn, weights_fn, lr, weight_decay):
    ref = copy.deepcopy(base)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay), data_fn())
    deviation = {}
    for level in ("O1", "O2"):
        model = copy.deepcopy(base)
        opt = FP8AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, opt_level=level,
                       fp8_params=weights_fn(model))  # fmt: skip
        deviation[level] = (train(model, opt, data_fn()) - expected).abs()
    return expected, deviation


def test_regression_300_steps_matches_adamw():
    # The linear weight gets FP8-weight states (O2: fp16 master, E4M3 m, fp16 v) without FP8 GEMMs, so the
    # difference to torch.optim.AdamW is the optimizer's alone.
    expected, dev = _levels_against_adamw(_Regression(), lambda: _regression_data(300), lambda m: [m.lin.weight],
                                          lr=1e-2, weight_decay=0.01)  # fmt: skip
    assert expected[-1] < 0.1 * expected[0]  # it learned
    assert dev["O1"].mean() < O1_LOSS_TOL
    assert dev["O2"].mean() / expected[0] < O2_LOSS_TOL_REGRESSION
    assert dev["O1"].mean() < dev["O2"].mean() / 10


def test_gpt_300_steps_o1_tighter_than_o2():
    base = TinyGPT(n_layer=1)
    expected, dev = _levels_against_adamw(
        base, lambda: batches(300), lambda m: [p for n, p in m.named_parameters() if "blocks" in n and p.dim() == 2],
        lr=3e-3, weight_decay=0.1,
    )  # fmt: skip
    assert expected[-20:].mean() < expected[:20].mean() - 0.3  # it learned
    assert dev["O1"].mean() < O1_LOSS_TOL
    assert dev["O2"].mean() < O2_LOSS_TOL_GPT
    assert dev["O1"].mean() < dev["O2"].mean() / 10


def test_gpt_fp8_training_with_scaler_tracks_fp32():
    base = TinyGPT(n_layer=1)
    ref = copy.deepcopy(base)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1), batches(300))
    model = convert_to_fp8(copy.deepcopy(base), module_filter_fn=lambda m, fqn: "head" not in fqn)
    scaler = FP8GradScaler(model=model)
    opt = FP8AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, grad_scaler=scaler)
    losses = train(model, opt, batches(300), scaler)
    assert model.blocks[0].fc.weight.dtype == torch.float16  # the master lives in the parameter
    assert scaler.skipped_steps == 0
    assert (losses - expected).abs().mean() < FP8_LOSS_TOL
    assert losses[-10:].mean() < losses[:10].mean()  # it learned


def _fp8_mlp(seed=0):
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _mlp_step(model, opt, scaler, x, y):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale_loss(loss).backward()
    opt.step()


@pytest.mark.parametrize("moments", ["fp8_weights", "all"])
def test_a_weight_whose_gradient_vanished_stops_as_with_adamw(moments):
    # The E4M3 first moment of an element whose gradient became zero stopped decaying at a small subnormal (rounded to
    # nearest, 0.9 k of the smallest step k <= 4 gives k back) while its second moment decayed: the weight kept moving
    # by m / sqrt(v), 200x further than torch.optim.AdamW's after 2000 steps, and never stopped. The first moment now
    # decays to zero (its smallest values are lost, as documented), and the weight stops.
    torch.manual_seed(0)
    layer = FP8Linear(16, 16, bias=False) if moments == "fp8_weights" else nn.Embedding(16, 16)
    reference = nn.Parameter(layer.weight.detach().double().clone())
    start = reference.detach().clone()
    opt = FP8AdamW(layer.parameters(), lr=1e-3, weight_decay=0.0, fp8_grads=False, low_precision_moments=moments)
    torch_opt = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.0)
    moved = []
    for t in range(400):
        g = torch.full((16, 16), 1e-2, dtype=torch.float64)  # every other element: a steady gradient
        g[0, 0] = 1e-5 if t == 0 else 0.0  # one small gradient, then exactly zero
        layer.weight.grad, reference.grad = g.to(layer.weight.dtype), g.clone()
        opt.step()
        torch_opt.step()
        weight = layer.weight.detach().double()
        if moments == "fp8_weights":  # O2: the storage holds the fp16 master times its scale
            weight = weight / opt.state[layer.weight]["master_scale"].double()
        moved.append(float(weight[0, 0] - start[0, 0]))
    expected = float(reference[0, 0] - start[0, 0])  # about -0.006: Adam's steps shrink with the decaying moment
    assert abs(moved[-1]) <= 1.5 * abs(expected) and moved[-1] * expected > 0
    assert moved[-1] == moved[-100]  # stopped


def test_o2_state_layout_and_bytes():
    model = _fp8_mlp()
    w32 = model[0].weight.detach().clone()
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    weight = model[0].weight
    # The parameter's storage is the fp16 master, scaled by a power of two; the unscaled value is the weight.
    assert weight.dtype == torch.float16 and weight.element_size() == 2
    scale = master.master_scale(weight)
    assert scale.dim() == 0 and torch.frexp(scale).mantissa.item() == 0.5
    torch.testing.assert_close(master.export(weight), w32, rtol=2**-11, atol=0)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    (model(x) - y).square().mean().backward()
    # The hook turned the gradient into FP8 (E5M2 + scale) and freed the fp16 one.
    assert weight.grad is None and opt._pending[weight].data.dtype == E5M2
    assert model[0].bias.grad is not None and model[0].bias.grad.dtype == torch.float32
    opt.step()
    state = opt.state[weight]
    dtypes = {"exp_avg": E4M3, "exp_avg_sq": torch.float16}
    for key, dtype in dtypes.items():
        assert state[key].dtype == dtype and state[key].shape == weight.shape
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for suffix in ("scale", "amax"):
            assert state[f"{key}_{suffix}"].dim() == 0 and state[f"{key}_{suffix}"].dtype == torch.float32
    # O2 bytes of this weight: master 2 + m 1 + v 2 (+ FP8 gradient 1 during backward) = 6.
    n = weight.numel()
    stored = weight.element_size() * n + state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes
    assert stored == 5 * n
    bias_state = opt.state[model[0].bias]
    assert set(bias_state) == {"step", "exp_avg", "exp_avg_sq"} and bias_state["exp_avg"].dtype == torch.float32


def test_low_precision_moments_all_gives_every_parameter_o2_moments():
    # MS-AMP's choice: every parameter's moments in E4M3 / fp16 with scales; the non-FP8 parameters keep their own
    # fp32 storage as the master and their fp32 gradient.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 48), nn.GELU(),
                                         nn.Linear(48, 64)))  # fmt: skip
    plain = [model[0].weight, model[1].weight, model[1].bias, model[2].bias]
    before = [p.detach().clone() for p in plain]
    opt = FP8AdamW(model.parameters(), lr=1e-2, low_precision_moments="all")
    idx = torch.randint(0, 64, (8, 16))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    grads = [p.grad.clone() for p in plain]
    opt.step()
    for p, w0, g in zip(plain, before, grads, strict=True):
        state = opt.state[p]
        assert p.dtype == torch.float32 and "master" not in state and "master_scale" not in state
        assert state["exp_avg"].dtype == E4M3 and state["exp_avg_sq"].dtype == torch.float16
        assert state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes == 3 * p.numel()  # against 8 in fp32
        # The stored moments are (1 - beta) g and (1 - beta2) g^2, scaled by powers of two, within E4M3 / fp16.
        m, v = checkpoint.dequantize(state, "exp_avg"), checkpoint.dequantize(state, "exp_avg_sq")
        assert torch.frexp(state["exp_avg_scale"]).mantissa.item() == 0.5
        torch.testing.assert_close(m, 0.1 * g, rtol=2**-4, atol=2**-9 * 0.1 * g.abs().max())
        torch.testing.assert_close(v, 0.001 * g * g, rtol=2**-10, atol=2**-24 * 0.001 * g.square().max())
        # The first step does not read the stored moments: it is torch.optim.AdamW's.
        ref = nn.Parameter(w0.clone())
        ref.grad = g
        torch.optim.AdamW([ref], lr=1e-2).step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert opt.state[model[2].weight]["master_scale"].dim() == 0  # FP8 weights as before


def test_low_precision_moments_all_trains_like_adamw_and_loads_both_ways():
    base = TinyGPT(n_layer=1)
    ref = copy.deepcopy(base)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1), batches(150))
    model = copy.deepcopy(base)
    opt = FP8AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, low_precision_moments="all")
    losses = train(model, opt, batches(150))
    assert (losses - expected).abs().mean() < O2_LOSS_TOL_GPT  # measured 0.0018 (every parameter's moments rounded)
    assert opt.state[model.tok.weight]["exp_avg"].dtype == E4M3
    # Its state dict loads into a default FP8AdamW (fp32 moments, dequantized) and back (the same bits).
    saved = _resume_bundle(model, opt, FP8GradScaler())["opt"]
    default = FP8AdamW(model.parameters(), lr=3e-3)
    default.load_state_dict(saved)
    tok = default.state[model.tok.weight]
    assert tok["exp_avg"].dtype == torch.float32
    assert torch.equal(tok["exp_avg"], checkpoint.dequantize(opt.state[model.tok.weight], "exp_avg"))
    converted = FP8AdamW(model.parameters(), lr=3e-3, low_precision_moments="all")  # fp32 moments -> E4M3 / fp16
    converted.load_state_dict(default.state_dict())
    for key, rel in (("exp_avg", 2**-4), ("exp_avg_sq", 2**-11)):
        got, want = checkpoint.dequantize(converted.state[model.tok.weight], key), tok[key]
        assert converted.state[model.tok.weight][key].dtype == opt.state[model.tok.weight][key].dtype
        assert ((got - want).abs() <= rel * want.abs() + 2**-9 * want.abs().max()).all(), key
    again = FP8AdamW(model.parameters(), lr=3e-3, low_precision_moments="all")
    again.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = again.state[model.tok.weight], opt.state[model.tok.weight]
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))
        assert torch.equal(a[f"{key}_scale"], b[f"{key}_scale"])
    tok_weight = model.tok.weight.detach().clone()
    again.release(model.tok.weight)  # back to fp32 moments, the same values; the parameter untouched
    released = again.state[model.tok.weight]
    assert released["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in released
    assert torch.equal(released["exp_avg"], checkpoint.dequantize(opt.state[model.tok.weight], "exp_avg"))
    assert torch.equal(model.tok.weight.detach(), tok_weight) and model.tok.weight.dtype == torch.float32


def test_model_state_dict_is_unscaled_and_loads_back():
    model = _fp8_mlp()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    scaler = FP8GradScaler()
    opt.grad_scaler = scaler
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    for _ in range(3):
        _mlp_step(model, opt, scaler, x, y)
    sd = model.state_dict()
    assert sd["0.weight"].dtype == torch.float32
    torch.testing.assert_close(sd["0.weight"], checkpoint.dequantize(opt.state_dict()["state"][0], "master"))
    # An fp32 copy of the model computes the same function from that state dict.
    plain = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    plain.load_state_dict(sd)
    fresh = _fp8_mlp(seed=5)
    FP8AdamW(fresh.parameters())
    fresh.load_state_dict(sd)  # into an adopted model: stored scaled, with a fresh scale
    assert fresh[0].weight.dtype == torch.float16
    assert torch.equal(fresh.state_dict()["0.weight"], sd["0.weight"])


def _resume_bundle(model, opt, scaler):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, buf)  # fmt: skip
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(("scale_update", "moments"), [("one_pass", "fp8_weights"), ("two_pass", "fp8_weights"),
                                                     ("one_pass", "all")])  # fmt: skip
def test_checkpoint_resume_is_bit_identical(scale_update, moments):
    data = [(torch.randn(24, 32), torch.randn(24, 16)) for _ in range(8)]

    def build(seed):
        model = _fp8_mlp(seed)
        scaler = FP8GradScaler(model=model, growth_interval=2)
        opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, scale_update=scale_update,
                       low_precision_moments=moments)  # fmt: skip
        return model, opt, scaler

    model, opt, scaler = build(0)
    for x, y in data[:4]:
        _mlp_step(model, opt, scaler, x, y)
    saved = _resume_bundle(model, opt, scaler)
    resumed, ropt, rscaler = build(7)
    resumed.load_state_dict(saved["model"])
    load_fp8_state_dict(resumed, saved["fp8"])
    ropt.load_state_dict(saved["opt"])
    rscaler.load_state_dict(saved["scaler"])
    for x, y in data[4:]:
        _mlp_step(model, opt, scaler, x, y)
        _mlp_step(resumed, ropt, rscaler, x, y)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state_dict()["state"].values(), ropt.state_dict()["state"].values(), strict=True):
        for key in sa:
            assert (
                torch.equal(sa[key], sb[key])
                if sa[key].element_size() > 1
                else torch.equal(sa[key].view(torch.uint8), sb[key].view(torch.uint8))
            ), key
    assert scaler.state_dict() == rscaler.state_dict()


def test_loads_torch_adamw_state_and_exports_it_back():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    for _ in range(3):
        ref_opt.zero_grad()
        ((plain(x) - y) ** 2).mean().backward()
        ref_opt.step()
    model = convert_to_fp8(copy.deepcopy(plain))
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(ref_opt.state_dict())
    w_state, ref_state = opt.state[model[0].weight], ref_opt.state[plain[0].weight]
    assert w_state["exp_avg"].dtype == E4M3 and float(w_state["step"]) == 3.0
    for key, rel in (("exp_avg", 2**-4), ("exp_avg_sq", 2**-11)):  # E4M3 and fp16 rounding (+ subnormals)
        got, want = checkpoint.dequantize(w_state, key), ref_state[key]
        assert ((got - want).abs() <= rel * want.abs() + 1e-3 * want.abs().max()).all(), key
    assert torch.equal(opt.state[model[0].bias]["exp_avg"], ref_opt.state[plain[0].bias]["exp_avg"])
    # Export: torch.optim.AdamW loads it and continues like the original within O2's precision.
    exported = opt.to_adamw_state_dict()
    again = copy.deepcopy(plain)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    again_opt.load_state_dict(exported)
    assert again_opt.state[again[0].weight]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(again_opt.state[again[0].weight]["exp_avg_sq"], ref_state["exp_avg_sq"],
                               rtol=2**-10, atol=1e-12)  # fmt: skip


def test_a_saved_state_dict_converts_for_torch_adamw():
    """Resuming an FP8 checkpoint without FP8 (found by the twentieth session's sweep): torch.optim.AdamW loads an
    FP8AdamW state dict without a word but takes the scaled moments as they are stored (160 for a moment of 0.0098).
    ``adamw_state_dict`` of the saved dict (after a weights_only round trip, as a checkpoint file gives it) holds
    each moment divided by its scale, which AdamW then loads as the true moments."""
    from lightning_fp8.optim import adamw_state_dict

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    model = convert_to_fp8(copy.deepcopy(plain))
    opt = FP8AdamW(model.parameters(), lr=1e-2, low_precision_moments="all")
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    true = {}  # by parameter index: the moments as FP8AdamW means them, stored values over their scales
    for index, p in enumerate(model.parameters()):
        state = opt.state[p]
        true[index] = {k: state[k].float() / state[f"{k}_scale"].float() for k in ("exp_avg", "exp_avg_sq")}
    assert any(opt.state[p]["exp_avg_scale"] != 1 for p in model.parameters())  # scaled: the case that matters
    naive = torch.optim.AdamW(copy.deepcopy(plain).parameters(), lr=1e-2)
    naive.load_state_dict(saved)
    assert not torch.allclose(naive.state[next(iter(naive.state))]["exp_avg"], true[0]["exp_avg"])
    again = copy.deepcopy(plain)
    adamw = torch.optim.AdamW(again.parameters(), lr=1e-2)
    adamw.load_state_dict(adamw_state_dict(saved))
    for index, p in enumerate(again.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert adamw.state[p][key].dtype == torch.float32
            assert torch.equal(adamw.state[p][key], true[index][key]), (index, key)
        assert float(adamw.state[p]["step"]) == 3.0


@pytest.mark.parametrize("export", ["adamw_state_dict", "to_adamw_state_dict"])
def test_an_exported_state_dict_keeps_the_scheduler_keys_of_its_groups(export):
    """A scheduler's keys in the groups (OneCycleLR: initial_lr, max_lr, min_lr, base_momentum, max_momentum) and a
    user's own survive the export: a resume into torch.optim.AdamW with the scheduler's state goes on as the
    uninterrupted FP8AdamW run's schedule does (the export used to keep only AdamW's keys: KeyError 'initial_lr')."""
    from lightning_fp8.optim import adamw_state_dict

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    model = convert_to_fp8(copy.deepcopy(plain))
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    opt.param_groups[0]["note"] = "kept"
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        sched.step()
    exported = opt.to_adamw_state_dict() if export == "to_adamw_state_dict" else adamw_state_dict(opt.state_dict())
    adamw = torch.optim.AdamW(plain.parameters(), lr=1.0)  # as Lightning resumes: both built, then both loaded
    resumed = torch.optim.lr_scheduler.OneCycleLR(adamw, max_lr=1e-2, total_steps=10)
    adamw.load_state_dict(exported)
    resumed.load_state_dict(sched.state_dict())
    for _ in range(3):
        sched.step()
        resumed.step()
        for key in ("lr", "betas"):
            assert adamw.param_groups[0][key] == opt.param_groups[0][key]
    assert adamw.param_groups[0]["note"] == "kept"


@pytest.mark.parametrize(
    "bad, match",
    [
        ({}, r"expects a saved FP8AdamW state dict .*got a dict with keys \[\]"),
        (None, r"got NoneType"),
        ({"optimizer_states": [], "state_dict": {}}, r"a Lightning checkpoint: pass one of its"),
        ("optimizer", r"an optimizer: pass optimizer.state_dict\(\)"),
        ("state not a dict", r"the state of parameter 0 is a Tensor, not a dict"),
        ("fp8 moment without its scale", r"parameter 0's 'exp_avg' is torch.float8_e4m3fn without its 'exp_avg_scale'"),
    ],
)
def test_adamw_state_dict_refuses_what_is_not_a_saved_state_dict(bad, match):
    """Found by the sweep of the optimizer side: ``adamw_state_dict`` of anything but a state dict failed with
    KeyError 'state' or "'NoneType' object is not subscriptable", and an FP8 moment that had lost its scale was
    exported as its stored values (the moment times 2**k) without a word."""
    from lightning_fp8.optim import adamw_state_dict

    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48)))
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    saved = opt.state_dict()
    if bad == "optimizer":
        bad = opt
    elif bad == "state not a dict":
        bad = {**saved, "state": {0: torch.zeros(3)}}
    elif bad == "fp8 moment without its scale":
        bad = copy.deepcopy(saved)
        del bad["state"][0]["exp_avg_scale"]
    with pytest.raises(ValueError, match=match):
        adamw_state_dict(bad)


def test_release_weights_gives_the_model_its_weights_and_keeps_the_optimizer():
    """Found by the twentieth session's sweep with Hugging Face models: after O2 training the FP8 weights held the fp16
    master times 2**18, which any later optimizer or precision trained as the weight (no update at all, or NaN from
    the second step). ``release_weights`` puts the unscaled weights back; the optimizer's state dict is unchanged,
    it can go on stepping, and torch AdamW or a new FP8AdamW train the model as they would a fresh one."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(24, 32), torch.randn(24, 16)

    def train(optimizer, steps):
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    train(opt, 3)
    weights = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("weight")}
    saved = copy.deepcopy(opt.state_dict())
    assert model[0].weight.dtype == torch.float16 and master.master_scale(model[0].weight) is not None
    opt.release_weights()
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            assert p.dtype == torch.float32 and master.master_scale(p) is None and master.is_fp8_weight(p)
            assert torch.equal(p.detach(), weights[name])  # the unscaled weight itself, in the model's dtype
    again = opt.state_dict()
    for index, state in saved["state"].items():
        assert state.keys() == again["state"][index].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(again["state"][index][k])) for k, v in state.items())
    losses = train(opt, 3)  # the same optimizer goes on (its masters now apart from the parameters)
    assert losses[-1] < losses[0] and all(torch.isfinite(p).all() for p in model.parameters())
    before = model[0].weight.detach().clone()
    train(torch.optim.AdamW(model.parameters(), lr=1e-2), 1)  # a plain optimizer's first step: lr per element
    torch.testing.assert_close((model[0].weight - before).abs().max(), torch.tensor(1e-2), rtol=0.05, atol=0)
    train(FP8AdamW(model.parameters(), lr=1e-2), 1)
    assert model[0].weight.dtype == torch.float16  # a new FP8AdamW takes the storage again


def test_release_weights_drops_the_pending_gradients_casts_from_the_scaler():
    """The FP8 gradients release_weights drops (a non-finite backward not stepped) still counted in the scaler: the next
    clean step was skipped and mu halved (found reviewing release_weights)."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    scaler = FP8GradScaler(init_scale=2.0**4)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=True)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    scaler.scale_loss(((model(x) - y) ** 2).mean() * float("inf")).backward()
    opt.release_weights()
    model.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    opt.step()
    assert scaler.skipped_steps == 0 and scaler.get_scale() == 2.0**4
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_param_groups_and_lr_scheduler_match_adamw_at_o1():
    torch.manual_seed(0)
    base = _Regression()
    data = list(_regression_data(30))
    runs = []
    for cls in (torch.optim.AdamW, FP8AdamW):
        model = copy.deepcopy(base)
        groups = [{"params": [model.lin.weight]}, {"params": [model.lin.bias], "lr": 3e-2, "weight_decay": 0.0}]
        kwargs = {"opt_level": "O1"} if cls is FP8AdamW else {}
        opt = cls(groups, lr=1e-2, **kwargs)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        losses = []
        for x, y in data:
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        runs.append((torch.tensor(losses), [g["lr"] for g in opt.param_groups]))
    (ref, ref_lrs), (got, lrs) = runs
    assert lrs == pytest.approx(ref_lrs)
    assert (got - ref).abs().mean() < O1_LOSS_TOL


def test_add_param_group_and_param_without_grad():
    a, b = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))
    opt = FP8AdamW([a], lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.5})
    before = b.detach().clone()
    a.grad = torch.randn_like(a)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state  # no grad: skipped, no state
    assert opt.param_groups[1]["lr"] == 0.5


def test_frozen_fp8_weight_is_left_alone_and_trains_once_unfrozen():
    # torch.optim accepts parameters that do not require gradients and never touches them; a frozen FP8Linear weight
    # keeps its fp32 storage (no master in it, no gradient hook). Unfrozen, it trains with O2 states (the master
    # kept apart): its first step against torch.optim.AdamW's on the same gradient.
    model = _fp8_mlp()
    weight = model[0].weight
    weight.requires_grad_(False)
    opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert weight.dtype == torch.float32 and model[2].weight.dtype == torch.float16  # only the trained one adopted
    x = torch.randn(16, 32)
    before = weight.detach().clone()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert torch.equal(weight, before)
    weight.requires_grad_(True)
    model(x).square().mean().backward()
    ref = nn.Parameter(weight.detach().clone())
    ref.grad = weight.grad.clone()
    torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1).step()
    opt.step()
    state = opt.state[weight]
    assert state["exp_avg"].dtype == E4M3 and state["master"].dtype == torch.float16
    assert not torch.equal(weight, before)
    # A first Adam step moves each weight by lr * g / (|g| + eps) (+ decay): the FP8 gradient keeps the sign (tiny |g|
    # near eps move the quotient, by far less than lr / 256); the fp16 master rounds the result (2**-11 relative).
    torch.testing.assert_close(weight.detach(), ref.detach(), rtol=2**-10, atol=1e-2 / 256)


def test_model_with_adopted_weights_pickles_whole():
    # torch.save(model) (whole-module pickling, e.g. for an EMA copy or a quick snapshot) works after FP8AdamW took
    # the weights over: nothing unpicklable (no weak reference) hangs on the parameters; the copy computes the same.
    model = _fp8_mlp()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 32)
    model(x).square().mean().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded[0].weight.dtype == torch.float16  # the scaled fp16 master, as in the original
    assert torch.equal(loaded(x), model(x))


def test_params_at_different_step_counts_match_adamw():
    # A parameter that misses steps (no gradient) has its own step count and bias correction, in one param group
    # with parameters that did not: the step batches parameters by step count. O1 keeps fp32 states, so only the
    # operation order differs from torch.optim.AdamW (a few ulp).
    torch.manual_seed(0)
    init = [torch.randn(6, 5), torch.randn(9), torch.randn(4, 4)]
    grads = [[torch.randn_like(w) if (step + i) % 3 else None for i, w in enumerate(init)] for step in range(7)]
    runs = []
    for cls, kwargs in ((torch.optim.AdamW, {}), (FP8AdamW, {"opt_level": "O1"})):
        params = [nn.Parameter(w.clone()) for w in init]
        opt = cls(params, lr=0.05, weight_decay=0.1, **kwargs)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g
            opt.step()
        runs.append((params, [float(opt.state[p]["step"]) for p in params]))
    (ref, ref_steps), (got, steps) = runs
    assert steps == ref_steps and len(set(steps)) > 1
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_maximize_ascends():
    p = nn.Parameter(torch.zeros(3))
    opt = FP8AdamW([p], lr=0.1, maximize=True, weight_decay=0.0)
    p.grad = torch.tensor([1.0, -2.0, 3.0])
    opt.step()
    assert torch.equal(torch.sign(p.detach()), torch.tensor([1.0, -1.0, 1.0]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1e-3}, "Invalid learning rate"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
        ({"eps": -1.0}, "Invalid epsilon"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"opt_level": "O3"}, "opt_level='O3'"),
        ({"exp_avg_sq_dtype": E4M3}, "exp_avg_sq_dtype"),
        ({"scale_update": "delayed"}, "scale_update"),
        ({"amsgrad": True}, "amsgrad=True"),
        ({"low_precision_moments": "norms"}, "low_precision_moments='norms'"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8AdamW([nn.Parameter(torch.randn(4))], **kwargs)


@pytest.mark.parametrize("flag", ["maximize", "emit_fp8_weights", "fp8_grads"])
@pytest.mark.parametrize("value", ["no", None, 1])
def test_switches_take_true_or_false_only(flag, value):
    """bool("no") is True: FP8AdamW(maximize="no") made the step ascend the loss. fp8_grads=None is its default (on
    without torch.distributed), refused only for the other two."""
    if flag == "fp8_grads" and value is None:
        assert FP8AdamW([nn.Parameter(torch.randn(4))], fp8_grads=None).fp8_grads is True
        return
    with pytest.raises(TypeError, match=rf"FP8AdamW\({flag}={value!r}\): must be True or False"):
        FP8AdamW([nn.Parameter(torch.randn(4))], **{flag: value})


def test_a_groups_maximize_takes_true_or_false_only_and_a_refused_group_changes_nothing():
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    with pytest.raises(TypeError, match="maximize='yes'"):
        FP8AdamW([{"params": [a]}, {"params": [b], "maximize": "yes"}])
    opt = FP8AdamW([a])
    with pytest.raises(TypeError, match="maximize='yes'"):
        opt.add_param_group({"params": [b], "maximize": "yes"})
    assert len(opt.param_groups) == 1
    saved = opt.state_dict()
    saved["param_groups"][0]["maximize"] = "no"
    with pytest.raises(ValueError, match=r"parameter group 0 of the state dict: FP8AdamW\(maximize='no'\)"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["maximize"] is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"opt_level": ["O2"]}, r"opt_level=\['O2'\]\) is not supported"),
        ({"fp8_params": 5}, r"fp8_params=\.\.\.\) takes an iterable of the weight tensors.*got int$"),
        ({"fp8_params": [1]}, r"got list holding int$"),
    ],
)
def test_arguments_of_another_type_are_refused_naming_them(kwargs, match):
    # They failed with "unhashable type: 'list'" and "'int' object is not iterable".
    with pytest.raises((TypeError, ValueError), match=match):
        FP8AdamW([nn.Parameter(torch.randn(4))], **kwargs)


def test_complex_param_and_sparse_grad_raise():
    with pytest.raises(TypeError, match="complex"):
        FP8AdamW([nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    emb = nn.Embedding(10, 16, sparse=True)
    opt = FP8AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


def test_release_returns_weight_to_fp32_states():
    model = _fp8_mlp()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    _mlp_step(model, opt, FP8GradScaler(), x, y)
    weight = model[0].weight
    expected = master.export(weight)
    opt.release(weight)
    assert weight.dtype == torch.float32 and torch.equal(weight.detach(), expected)
    assert opt.state[weight]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in opt.state[weight]
    (model(x) - y).square().mean().backward()
    assert weight.grad.dtype == torch.float32
    opt.step()  # plain fp32 AdamW from here on


def test_fp8_state_stats_are_plain_numbers():
    model = _fp8_mlp()
    scaler = FP8GradScaler()
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    _mlp_step(model, opt, scaler, torch.randn(24, 32), torch.randn(24, 16))
    stats = opt.fp8_state_stats()
    assert set(stats["params"]) == {"param_0", "param_2"}  # the two FP8 weights
    entry = stats["params"]["param_0"]
    assert all(isinstance(v, float) for v in entry.values())
    assert entry["exp_avg_amax"] * entry["exp_avg_scale"] <= 448.0
    assert stats["grad_scaler"]["scale"] == 1.0 and stats["grad_scaler"]["skipped_steps"] == 0


def test_compiled_model_trains_like_eager_with_adopted_weights():
    # FP8Linear folds the master's storage scale into its weight cast, also under torch.compile(fullgraph=True).
    eager, compiled_src = _fp8_mlp(), _fp8_mlp()
    opts = [FP8AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled_src)]
    compiled = torch.compile(compiled_src, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x, y = torch.randn(24, 32), torch.randn(24, 16)
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    assert eager[0].weight.dtype == torch.float16
    for a, b in zip(eager.parameters(), compiled_src.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tensor_betas_reach_the_step_kernel_as_numbers(monkeypatch):
    """torch allows tensor betas; with beta1**2 >= beta2 the kernel's two-pass flag (a compile-time constant of the
    Triton kernel) was a 0-dim tensor. The step with tensor betas equals the one with the same numbers."""
    from lightning_fp8.optim import step as step_module

    seen = []
    real = step_module.reference_adamw.adamw_step_ref

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("beta1", "beta2", "two_pass")})
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module.reference_adamw, "adamw_step_ref", spy)
    runs = []
    for betas in ((0.99, 0.9), (torch.tensor(0.99, dtype=torch.float64), torch.tensor(0.9, dtype=torch.float64))):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
        opt = FP8AdamW(model.parameters(), lr=1e-2, betas=betas)
        for _ in range(2):
            model(torch.randn(4, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(type(s["two_pass"]) is bool and type(s["beta1"]) is float for s in seen), seen
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_state_dict_post_hooks_see_the_saved_masters():
    """The masters (and sharded scales) were added after the user's state-dict post-hooks ran, so a hook that filters
    or converts the states missed them."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level="O2")
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    seen = {}

    def hook(optimizer, state_dict):
        seen.update({index: sorted(state) for index, state in state_dict["state"].items()})
        state_dict["state"][0] = {k: v for k, v in state_dict["state"][0].items() if k != "master"}
        return state_dict

    opt.register_state_dict_post_hook(hook)
    saved = opt.state_dict()
    assert "master" in seen[0]
    assert "master" not in saved["state"][0]  # what the user's hook returned is what state_dict gives
    copy.deepcopy(opt)  # the registered hook is a plain function: the optimizer still copies and pickles


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_on_the_meta_device_makes_the_states_a_real_step_makes(opt_level):
    """torch.optim.AdamW steps meta parameters (shapes only, e.g. to size the states); FP8AdamW's O2 step raised in
    the amax of its low-precision states (autocast has no meta device)."""

    def stepped(device: str) -> dict:
        with torch.device(device):
            model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
        model = convert_to_fp8(model)
        opt = FP8AdamW(model.parameters(), opt_level=opt_level, low_precision_moments="all")
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        return {(i, key): (value.dtype, value.shape, value.device.type)
                for i, p in enumerate(model.parameters()) for key, value in opt.state[p].items()}  # fmt: skip

    meta, cpu = stepped("meta"), stepped("cpu")
    assert meta.keys() == cpu.keys()
    assert all(meta[k][:2] == cpu[k][:2] and meta[k][2] == ("cpu" if k[1] == "step" else "meta") for k in cpu)


@pytest.mark.parametrize("layer", ["linear", "mlp"])
def test_a_model_materialized_after_the_optimizer_was_created_is_refused_at_its_forward(layer):
    """FP8AdamW over a model converted on the meta device, then to_empty() + reset_parameters(): the O2 master's scale
    stayed on meta while the weight moved, and the forward failed deep in the cast ("Cannot copy out of meta tensor").
    It says what happened and what to do; the documented order (materialize, then the optimizer) trains."""

    def model():
        if layer == "linear":
            return convert_to_fp8(nn.Sequential(nn.Linear(16, 32)))
        return nn.Sequential(FP8MLP(16, 32))

    with torch.device("meta"):
        early = model()
    FP8AdamW(early.parameters(), lr=1e-2)
    early.to_empty(device="cpu")
    for m in early.modules():
        if hasattr(m, "reset_parameters") and m is not early:
            m.reset_parameters()
    with pytest.raises(RuntimeError, match="moved or materialized.*Create FP8AdamW after"):
        early(torch.randn(2, 16))

    with torch.device("meta"):
        late = model()
    late.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in late.modules():
        if hasattr(m, "reset_parameters") and m is not late:
            m.reset_parameters()
    opt = FP8AdamW(late.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    losses = []
    for _ in range(3):
        loss = late(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]
