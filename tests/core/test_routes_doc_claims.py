"""The documentation's checkable claims against the code (a route sweep of three pages' prose), each test quoting the
claim it checks and naming its page. Only claims no other test checks are here; each is checked against an independent
reference: ``torch.optim.AdamW`` (float64 where the claim is about precision), ``torch.amp.GradScaler``,
``torch.nn.utils.clip_grad_norm_``, torch's own LR schedulers, torch's own FP8 conversions, or values computed by hand
from the docs' numbers.

Pages and claim groups:

- docs/concepts/optimizer.md: the bytes per parameter of the documented options (``exp_avg_dtype=torch.float16``,
  ``master_dtype=torch.float32``, O1, a ``model.half()`` model); the measured limits of the formats (an fp16 master
  drops updates under ``|w| * 2^-12``: 97% / 80% of N(0, 1) weights never moved at lr 1e-5 / 1e-4; an E4M3 first
  moment with ``beta1`` close to 1 reaches 0.97 / 0.66 / 0.29 / 0.17 of the true one; an fp16 second moment flushes
  elements some 2^40 under the tensor's largest (then a step without its gradient divides by ``eps`` alone); with
  ``low_precision_moments="all"`` a flushed first moment still takes the step's own gradient in full); an fp16
  weight gradient past 65504 at O2 (NaN without a scaler, as torch's AdamW on an inf gradient; finite at O1; a skipped
  step with one); ``step()`` using the FP8 gradients up (a second step without a backward, a loop that never zeroes);
  an evaluation detour through ``model.load_state_dict`` with ``fp8_state_dict`` restored; which gradients become FP8
  on arrival (FP8Linear weights, those added with ``add_param_group``) and which stay in ``param.grad`` (``fp8_params``,
  a weight frozen when the optimizer was built, other parameters), a ``model.half()`` model's master kept apart;
  FP8AdamW's documented defaults.
- docs/concepts/gradient-scaling.md: FP8GradScaler's documented defaults and E5M2's range; mu halves only when the
  saturated fraction exceeds ``saturation_threshold`` (exactly 1e-5 does not); gradients summed over several backwards
  by an optimizer that accumulates while another one updates mu are unscaled by the last backward's mu (the documented
  limit, shared with ``torch.amp.GradScaler``).
- docs/guides/troubleshooting.md: the ``"lower_lr"`` fallback against LR schedulers (StepLR, ExponentialLR,
  CosineAnnealingLR, LinearLR keep the cut; LambdaLR, OneCycleLR undo it); clipping by norm before a skipped step
  leaves the gradients for the ``"bf16"`` fallback to blame the one offending layer; ``LIGHTNING_FP8_KERNELS``
  values refused at the first cast (an empty one and ``AUTO`` included), float64 casts taking the references whatever
  the value; ``LIGHTNING_FP8_KERNELS=triton`` on a CPU without Triton's interpreter failing with Triton's ``0 active
  drivers``; ``LIGHTNING_FP8_EMULATE_GEMM`` taken only when exactly ``1``.

Claims of these pages checked by other tests are not repeated (refusals of a second optimizer over adopted weights,
state-dict loads and their refusals, load hooks, warnings of the scaler, ``unscale_`` / ``step`` refusals, the fp16
growth rule, the fallback's blame and resume, the weight copy, grad-cast buckets, ...).

Findings (the code runs; the docs say otherwise):

- docs/concepts/optimizer.md said ``FP8AdamW(..., master_dtype=torch.float32)`` costs "4 bytes more per parameter";
  it costs 2 (8 bytes per FP8 weight element against O2's 6): the fp32 master is the parameter's own fp32 storage,
  where the default keeps the fp16 master in place of the weight. The page says so now.
- docs/concepts/optimizer.md said of an element whose fp16 second moment flushed to 0 that "its next steps divide by
  eps alone": only a step in which its gradient is 0 does; a step with a gradient divides by the root of that step's
  share of ``v``, ``(1 - beta2) g^2`` (bias-corrected), without the history (1.39x AdamW's update at step 2 here,
  growing with the steps). The page says so now.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import (
    E4M3,
    E5M2,
    FP8AdamW,
    FP8GradScaler,
    FP8Linear,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
    ops,
)
from lightning_fp8.recovery import fallen_back_layers
from tests.numerics import assert_same

pytestmark = pytest.mark.usefixtures("one_thread")

# One fp32 AdamW step of FP8AdamW's fused reference against torch.optim.AdamW's foreach one: the same formula in another
# operation order, a few fp32 roundings apart (tests/core/test_optim_shared_weights.py).
FP32_STEP_RTOL, FP32_STEP_ATOL = 1e-6, 1e-7


def _net(seed: int = 0, *, bias: bool = True) -> nn.Module:
    """Three FP8 layers (feature sizes multiples of 16: all convert)."""
    torch.manual_seed(seed)
    return convert_to_fp8(
        nn.Sequential(
            nn.Linear(16, 32, bias=bias),
            nn.ReLU(),
            nn.Linear(32, 32, bias=bias),
            nn.ReLU(),
            nn.Linear(32, 16, bias=bias),
        )  # fmt: skip
    )


def _x(seed: int = 1, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))


# ==================================================================================== docs/concepts/optimizer.md
def _held_bytes_per_element(param: torch.Tensor, opt: FP8AdamW) -> float:
    """The bytes that ``param`` and its optimizer states hold, per element: every distinct storage counted once (a
    state that is the parameter's own storage is not counted twice)."""
    storages = {param.untyped_storage().data_ptr(): param.untyped_storage().nbytes()}
    for value in opt.state[param].values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values()) / param.numel()


def _bytes_per_param(make_model, **kwargs) -> float:
    """Bytes per element of an FP8 weight after a step: parameter and states, plus the FP8 gradient (1 byte) that the
    optimizer holds between backward and step (checked held: ``param.grad`` is None)."""
    model = make_model(convert_to_fp8(nn.Sequential(nn.Linear(64, 64, bias=False))))
    opt = FP8AdamW(model.parameters(), **kwargs)
    weight = model[0].weight
    model(torch.randn(4, 64).to(weight.dtype if weight.dtype == torch.float16 else torch.float32)).sum().backward()
    assert opt.holds_fp8_grads and weight.grad is None  # the gradient is held in FP8: 1 byte per element
    opt.step()
    return _held_bytes_per_element(weight, opt) + 1


@pytest.mark.parametrize(
    ("make_model", "kwargs", "documented"),
    [
        (lambda m: m, {}, 6),  # the table: O2, "6"
        (lambda m: m, {"exp_avg_dtype": torch.float16}, 6 + 1),  # "exp_avg_dtype=torch.float16: 1 byte more"
        (lambda m: m, {"opt_level": "O1"}, 13),  # the table: O1, "13"
        (lambda m: m.half(), {}, 6 + 2),  # "A model already in fp16 ... (2 bytes per parameter more)"
    ],
    ids=["o2", "exp_avg_fp16", "o1", "half_model"],
)
def test_bytes_per_parameter_of_the_documented_options(make_model, kwargs, documented):
    """optimizer.md, "Bytes per parameter" and the options it prices."""
    assert _bytes_per_param(make_model, **kwargs) == documented


def test_an_fp32_master_costs_two_bytes_more_per_parameter():
    """optimizer.md: "keep the master in fp32 (FP8AdamW(..., master_dtype=torch.float32): 4 bytes more per
    parameter)"."""
    # Found by this sweep (the page said 4, fixed): docs/concepts/optimizer.md, "Why these precisions": "(`FP8AdamW(...,
    # master_dtype=torch.float32)`: 4 bytes more per parameter)". It is 2 more: the weight keeps its fp32 storage, which
    # is the master (the state's "master" is that storage, not a copy), in place of the default's fp16 master: 4 + 1 + 2
    # + 1 (FP8 gradient) = 8 bytes against 6.
    default, fp32_master = _bytes_per_param(lambda m: m), _bytes_per_param(lambda m: m, master_dtype=torch.float32)
    assert (default, fp32_master) == (6, 8)
    assert fp32_master - default == 2  # the page said 4


@pytest.mark.parametrize(("lr", "documented"), [(1e-5, 0.97), (1e-4, 0.80)])
def test_an_fp16_master_drops_updates_under_its_precision_as_measured(lr, documented):
    """optimizer.md: "an update smaller than about |w| * 2^-12 still rounds away in fp16 (of weights drawn from N(0, 1),
    under a steady gradient for 100 steps, 97% never moved at lr 1e-5 and 80% at 1e-4). For fine-tuning at such
    learning rates keep the master in fp32"."""
    moved_fractions = {}
    for master_dtype in (None, torch.float32):
        torch.manual_seed(0)
        layer = FP8Linear(128, 128, bias=False)
        with torch.no_grad():
            layer.weight.normal_()
        extra = {} if master_dtype is None else {"master_dtype": master_dtype}
        opt = FP8AdamW(layer.parameters(), lr=lr, fp8_grads=False, **extra)
        start = layer.state_dict()["weight"].clone()
        for _ in range(100):
            layer.weight.grad = torch.ones_like(layer.weight)  # a steady gradient (in the storage's dtype)
            opt.step()
        moved_fractions[master_dtype] = (layer.state_dict()["weight"] == start).float().mean().item()
    # The docs' percentages, rounded to whole percents (measured here: 97.5% and 80.4%).
    assert moved_fractions[None] == pytest.approx(documented, abs=0.01)
    assert moved_fractions[torch.float32] == 0.0  # every weight moves with an fp32 master


def test_an_e4m3_first_moment_falls_behind_with_beta1_close_to_one():
    """optimizer.md: "Over 200 steps of a gradient 1 + 0.1 * randn (beta2 0.9999), the stored m reached 0.97 of the
    true one with beta1 0.9 ..., but 0.66, 0.29 and 0.17 with 0.95, 0.99 and 0.999", against float64
    torch.optim.AdamW on the same gradients."""
    documented = {0.9: 0.97, 0.95: 0.66, 0.99: 0.29, 0.999: 0.17}
    measured = {}
    for beta1 in documented:
        torch.manual_seed(0)
        layer = FP8Linear(32, 32, bias=False)
        reference = nn.Parameter(layer.weight.detach().double().clone())
        opt = FP8AdamW(layer.parameters(), lr=1e-3, betas=(beta1, 0.9999), fp8_grads=False)
        torch_opt = torch.optim.AdamW([reference], lr=1e-3, betas=(beta1, 0.9999))
        for _ in range(200):
            grad = (1 + 0.1 * torch.randn(32, 32)).half()  # O2's weight gradients are fp16
            layer.weight.grad, reference.grad = grad, grad.double()
            opt.step()
            torch_opt.step()
        stored = opt.to_adamw_state_dict()["state"][0]["exp_avg"].double()
        measured[beta1] = (stored.mean() / torch_opt.state[reference]["exp_avg"].mean()).item()
    assert measured == pytest.approx(documented, abs=0.015)


@pytest.mark.parametrize(("ratio", "flushed"), [(2.0**18, False), (2.0**22, True)])
def test_an_fp16_second_moment_flushes_an_element_about_2_40_under_the_largest(ratio, flushed):
    """optimizer.md: "v shares one scale per tensor; an element whose g^2 is some 2^40 below the tensor's largest
    flushes to 0" (2^36 under it survives, 2^44 under it flushes; torch.optim.AdamW keeps both)."""
    p = nn.Parameter(torch.ones(64))
    reference = nn.Parameter(torch.ones(64, dtype=torch.float64))
    opt = FP8AdamW([p], lr=1e-2, fp8_params=[p], exp_avg_dtype=torch.float32)
    grad = torch.full((64,), 1.0 / ratio)
    grad[0] = 1.0
    p.grad, reference.grad = grad.clone(), grad.double()
    opt.step()
    torch_opt = torch.optim.AdamW([reference], lr=1e-2)
    torch_opt.step()
    v = opt.to_adamw_state_dict()["state"][0]["exp_avg_sq"]
    assert v[0] > 0 and bool((v[1:] == 0).all() if flushed else (v[1:] > 0).all())
    assert (torch_opt.state[reference]["exp_avg_sq"] > 0).all()  # torch's (1 - beta2) g^2 keeps every element


def test_a_flushed_second_moment_divides_by_eps_alone_only_in_a_step_without_gradient():
    """optimizer.md: "an element whose g^2 is some 2^40 below the tensor's largest flushes to 0, and, if its m survived,
    its next steps divide by eps alone"."""
    # Found by this sweep (the page is fixed): docs/concepts/optimizer.md, "fp16 `v` across a range of about 2^20 in one
    # tensor": "if its m survived, its next steps divide by `eps` alone". Only a step in which the element's gradient is
    # 0 does; a step with a gradient computes v = (1 - beta2) g^2 from it (in fp32 registers) and divides by its bias-
    # corrected root: the history of v is lost, not all of v (here 1.39x AdamW's update at step 2).
    beta1, beta2, lr, eps, ratio = 0.9, 0.999, 1e-2, 1e-8, 2.0**22

    def run(second_grad_of_the_small_element: float) -> tuple[float, float]:
        p = nn.Parameter(torch.ones(64))
        opt = FP8AdamW([p], lr=lr, weight_decay=0.0, fp8_params=[p], exp_avg_dtype=torch.float32)
        grad = torch.full((64,), 1.0 / ratio)
        grad[0] = 1.0
        p.grad = grad.clone()
        opt.step()
        assert opt.to_adamw_state_dict()["state"][0]["exp_avg_sq"][1] == 0  # flushed; m (fp32) survived
        before = p.detach()[1].item()
        grad[1] = second_grad_of_the_small_element
        p.grad = grad.clone()
        opt.step()
        m = opt.to_adamw_state_dict()["state"][0]["exp_avg"][1].item()
        return before - p.detach()[1].item(), m / (1 - beta1**2)

    # A step without gradient: the update is lr * m_hat / eps, by hand.
    update, m_hat = run(0.0)
    # The weight (about 1) goes through the fp16 master before and after the step: two roundings of <= 2^-11 each.
    assert update == pytest.approx(lr * m_hat / eps, abs=2**-10)
    # A step with the same small gradient: lr * m_hat / (sqrt((1 - beta2) g^2 / (1 - beta2^2)) + eps), by hand.
    update, m_hat = run(1.0 / ratio)
    v_hat = (1 - beta2) * (1.0 / ratio) ** 2 / (1 - beta2**2)
    assert update == pytest.approx(lr * m_hat / (math.sqrt(v_hat) + eps), abs=2**-10)
    assert update < lr * m_hat / eps / 10  # not divided by eps alone


def test_all_low_precision_moments_a_flushed_first_moment_still_takes_the_steps_own_gradient():
    """optimizer.md: low_precision_moments="all": "a first moment whose values span more than E4M3's range within one
    tensor ... loses its smallest entries to zero between steps; the step's own gradient still enters each update in
    full" (the step equals torch.optim.AdamW's)."""
    p = nn.Parameter(torch.ones(64))
    reference = nn.Parameter(torch.ones(64, dtype=torch.float64))
    opt = FP8AdamW([p], lr=1e-2, low_precision_moments="all")
    torch_opt = torch.optim.AdamW([reference], lr=1e-2)
    grad = torch.ones(64)
    grad[0] = 2.0**-24  # 2^24 under the rest: past E4M3's range of about 2^17.8
    p.grad, reference.grad = grad.clone(), grad.double()
    opt.step()
    torch_opt.step()
    assert opt.to_adamw_state_dict()["state"][0]["exp_avg"][0] == 0  # lost between steps
    assert torch_opt.state[reference]["exp_avg"][0] > 0
    torch.testing.assert_close(p.detach().double(), reference.detach(), rtol=FP32_STEP_RTOL, atol=FP32_STEP_ATOL)


def test_an_fp16_weight_gradient_past_65504_at_o2():
    """optimizer.md: "The weight's gradient then comes out of its GEMM in fp16 as well ...: an element beyond 65504
    overflows to inf. An FP8GradScaler makes that a skipped step and a lower mu; a bare FP8AdamW (no grad_scaler) steps
    on it and writes NaN into the weight, as torch.optim.AdamW does with an inf gradient, where O1's fp32 gradient
    would have been finite"."""
    x, big = _x(rows=8), 1e5  # weight gradients of ~1e5 to 1e6: past fp16's 65504, far inside fp32

    def weights_after_one_step(opt_level: str, scaler: bool):
        model = _net()
        grad_scaler = FP8GradScaler(model=model) if scaler else None
        opt = FP8AdamW(model.parameters(), lr=1e-3, opt_level=opt_level, grad_scaler=grad_scaler)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loss = model(x).sum() * big
        (grad_scaler.scale_loss(loss) if scaler else loss).backward()
        opt.step()
        return before, model.state_dict(), grad_scaler

    # torch.optim.AdamW on an inf gradient: NaN.
    w = nn.Parameter(torch.ones(4))
    w.grad = torch.tensor([1.0, math.inf, 1.0, 1.0])
    torch.optim.AdamW([w], lr=1e-3).step()
    assert w.isnan().any()
    _, after, _ = weights_after_one_step("O2", scaler=False)
    assert after["0.weight"].isnan().any()
    _, after, _ = weights_after_one_step("O1", scaler=False)
    assert all(v.isfinite().all() for v in after.values())
    before, after, scaler = weights_after_one_step("O2", scaler=True)
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 0.5
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_second_step_without_a_backward_leaves_the_fp8_weights_and_steps_the_others_as_torch():
    """optimizer.md: "step() uses the FP8 gradients up, where torch.optim.AdamW leaves param.grad until it is zeroed: a
    second step() without a backward in between does not move the FP8 weights again (the other parameters take a
    second step with their gradients, as in torch)"."""
    model = _net()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    model(_x()).square().mean().backward()
    biases = [model[i].bias for i in (0, 2, 4)]
    references = [nn.Parameter(b.detach().clone()) for b in biases]
    for ref, b in zip(references, biases, strict=True):
        ref.grad = b.grad.clone()
    torch_opt = torch.optim.AdamW(references, lr=1e-2)
    opt.step()
    torch_opt.step()
    after_first = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()
    torch_opt.step()
    after_second = model.state_dict()
    for i in (0, 2, 4):
        assert torch.equal(after_first[f"{i}.weight"], after_second[f"{i}.weight"])
        assert not torch.equal(after_first[f"{i}.bias"], after_second[f"{i}.bias"])
    for b, ref in zip(biases, references, strict=True):
        torch.testing.assert_close(b.detach(), ref.detach(), rtol=FP32_STEP_RTOL, atol=FP32_STEP_ATOL)


@pytest.mark.parametrize("opt_level", ["O2", "O1"])
def test_a_loop_that_never_zeroes_does_not_sum_an_fp8_weights_gradients(opt_level):
    """optimizer.md: "a loop that never zeroes its gradients does not sum an FP8 weight's gradients over steps" (where
    torch.optim.AdamW's would: the twin nn.Linear below)."""
    runs = {}
    for zero in (True, False):
        torch.manual_seed(0)
        layer = FP8Linear(16, 16, bias=False)
        opt = FP8AdamW(layer.parameters(), lr=1e-2, opt_level=opt_level)
        for step in range(3):
            if zero:
                opt.zero_grad()
            layer(_x(step)).square().mean().backward()
            opt.step()
        runs[zero] = layer.state_dict()["weight"]
    assert torch.equal(runs[True], runs[False])
    torch_runs = {}
    for zero in (True, False):  # the same loops with torch: they differ
        torch.manual_seed(0)
        linear = nn.Linear(16, 16, bias=False)
        opt = torch.optim.AdamW(linear.parameters(), lr=1e-2)
        for step in range(3):
            if zero:
                opt.zero_grad()
            linear(_x(step)).square().mean().backward()
            opt.step()
        torch_runs[zero] = linear.weight.detach()
    assert not torch.equal(torch_runs[True], torch_runs[False])


def test_an_evaluation_detour_with_the_fp8_state_restored_continues_bit_for_bit():
    """optimizer.md: "putting the same values back, as an EMA swap for evaluation does, changes nothing in the master;
    the FP8 layers' input and gradient scaling start fresh after a weight load, and evaluation forwards record their
    amaxes too: to continue exactly as without the detour, save fp8_state_dict(model) before it and load_fp8_state_dict
    it after" (O2 FP8 weights, written with model.load_state_dict as the page says)."""

    def run(detour: bool):
        model = _net()
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
        for step in range(5):
            if detour and step == 3:
                saved, fp8 = {k: v.clone() for k, v in model.state_dict().items()}, fp8_state_dict(model)
                model.load_state_dict({k: v * 0.5 for k, v in saved.items()})  # the EMA weights
                assert model[0].fp8_scaling["input"].amax_history.max() == 0  # "start fresh after a weight load"
                with torch.no_grad():
                    model(_x(99))  # evaluation
                model.load_state_dict(saved)
                load_fp8_state_dict(model, fp8)
            opt.zero_grad()
            scaler.scale_loss(model(_x(step)).square().mean()).backward()
            opt.step()
        return model.state_dict(), opt.state_dict(), fp8_state_dict(model), scaler.state_dict()

    assert_same(run(detour=False), run(detour=True))


def test_which_gradients_become_fp8_on_arrival():
    """optimizer.md: "Only the weights of FP8Linear layers that train when the optimizer takes them get the hook; other
    parameters, fp8_params, ... and a weight frozen when the optimizer was built and unfrozen later (its fp16 master is
    kept apart too) keep their gradients in param.grad, as they arrive. To give a layer unfrozen later the hook and the
    6 bytes per parameter, leave it out of the optimizer while frozen and add it with add_param_group"; "A model
    already in fp16 (model.half()) keeps its weights as they are and the fp16 master apart"."""
    model = _net()
    extra = nn.Parameter(torch.randn(16, 16))  # an fp8_params weight (used below as a plain matrix)
    model[2].weight.requires_grad_(False)  # frozen when the optimizer is built, unfrozen later
    model[4].requires_grad_(False)  # left out while frozen, added later
    opt = FP8AdamW(
        [*model[0].parameters(), *model[2].parameters(), extra], lr=1e-2, fp8_params=[extra]
    )  # fmt: skip
    model[2].weight.requires_grad_(True)
    model[4].requires_grad_(True)
    opt.add_param_group({"params": list(model[4].parameters())})
    (model(_x()) @ extra).square().mean().backward()
    assert model[0].weight.grad is None and model[4].weight.grad is None and opt.holds_fp8_grads  # hooked
    assert model[2].weight.grad is not None and model[2].weight.grad.dtype == torch.float32  # as it arrived
    assert extra.grad is not None and all(model[i].bias.grad is not None for i in (0, 2, 4))
    opt.step()
    # The hooked weights' storage is their fp16 master; the frozen-when-built one keeps its fp32 storage and a master
    # of its own in the state.
    assert (model[0].weight.dtype, model[4].weight.dtype, model[2].weight.dtype) == (torch.float16, torch.float16,
                                                                                     torch.float32)  # fmt: skip
    assert opt.state[model[2].weight]["master"].dtype == torch.float16
    assert opt.state[extra]["master"].dtype == torch.float16 and extra.dtype == torch.float32

    half = _net().half()
    weights = {k: v.clone() for k, v in half.state_dict().items()}
    half_opt = FP8AdamW(half.parameters(), lr=1e-2)
    assert all(torch.equal(v, weights[k]) and v.dtype == torch.float16 for k, v in half.state_dict().items())
    half(_x().half()).sum().backward()
    half_opt.step()
    assert half[0].weight.dtype == torch.float16 and half_opt.state[half[0].weight]["master"].dtype == torch.float16
    assert half_opt.state[half[0].weight]["master"].data_ptr() != half[0].weight.data_ptr()  # kept apart


def test_fp8adamw_defaults_are_the_documented_ones():
    """optimizer.md: O2 is "the default" ("fp8-lm"); O2's states fp16 master, E4M3 m, fp16 v; fp8_grads "on by
    default outside torch.distributed"; grad_cast_bucket_mb "off by default (grad_cast_bucket_mb=0)"; non-FP8
    parameters keep full-precision states "by default"; the FP8 copy is opt-in (emit_fp8_weights=True); the default
    scale_update is one pass."""
    import inspect

    model = _net()
    opt = FP8AdamW(model.parameters())
    assert (opt.opt_level, opt.master_dtype, opt.exp_avg_dtype, opt.exp_avg_sq_dtype) == (
        "O2", torch.float16, E4M3, torch.float16)  # fmt: skip
    assert opt.fp8_grads is True and opt.emit_fp8_weights is False
    assert (opt.low_precision_moments, opt.scale_update) == ("fp8_weights", "one_pass")
    assert inspect.signature(FP8AdamW).parameters["grad_cast_bucket_mb"].default == 0
    o1 = FP8AdamW(_net().parameters(), recipe="fp8-lm-o1")
    assert (o1.opt_level, o1.master_dtype, o1.exp_avg_dtype, o1.exp_avg_sq_dtype) == ("O1", *(torch.float32,) * 3)


# ============================================================================== docs/concepts/gradient-scaling.md
def test_scaler_defaults_and_e5m2_range_are_the_documented_ones():
    """gradient-scaling.md: "E5M2 represents 2^-16 to 57344"; saturation_threshold "(FP8-LM uses 0.001%, 1e-5)";
    "headroom (2x)"; the example FP8GradScaler(init_scale=1.0, growth_interval=1000, saturation_threshold=1e-5);
    troubleshooting.md: "mu stops at min_scale (2^-24 by default)". Checked with torch's own conversion to E5M2."""
    assert torch.tensor(57344.0).to(E5M2).float().item() == 57344.0 == torch.finfo(E5M2).max
    assert torch.tensor(2.0**-16).to(E5M2).float().item() == 2.0**-16  # the smallest subnormal
    assert torch.tensor(2.0**-18).to(E5M2).float().item() == 0.0  # under half of it: zero
    scaler = FP8GradScaler()
    assert (scaler.get_scale(), scaler.growth_interval, scaler.saturation_threshold, scaler.headroom) == (
        1.0, 1000, 1e-5, 2.0)  # fmt: skip
    assert scaler.min_scale == 2.0**-24 and scaler.is_enabled() is True


def test_an_accumulating_optimizer_is_unscaled_by_the_last_backwards_mu_as_with_torch_amp():
    """gradient-scaling.md: "Gradients summed over several backwards (an optimizer that accumulates over micro-batches
    while another steps every batch) are all unscaled by the last backward's mu: where another optimizer's update
    changed mu inside that window, the earlier micro-batches' share comes out off by the change (a factor of 2 per
    change; torch.amp.GradScaler ... [has] the same limit)"."""
    y0, y1, x = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 4.0]), torch.tensor([3.0, 1.0])
    results = {}
    for name in ("fp8", "torch"):
        scaler = (FP8GradScaler(init_scale=2.0**4, growth_interval=1) if name == "fp8" else
                  torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1))  # fmt: skip
        scale = scaler.scale_loss if name == "fp8" else scaler.scale
        a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
        opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
        scale((a * x).sum() + (b * y0).sum()).backward()  # b accumulates: no step
        scaler.step(opt_a)
        scaler.update()  # finite, growth_interval 1: mu doubles (both scalers)
        assert scaler.get_scale() == 2.0**5
        opt_a.zero_grad()
        scale((a * x).sum() + (b * y1).sum()).backward()
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        results[name] = b.detach().clone()
    # By hand: b.grad = 2^4 y0 + 2^5 y1, unscaled by 2^-5: y0 / 2 + y1 (y0's share off by the change, 2x).
    assert torch.equal(results["fp8"], -(y0 / 2 + y1))
    assert torch.equal(results["fp8"], results["torch"])


@pytest.mark.parametrize(("n_saturated", "numel", "halved"), [(1, 100_000, False), (2, 100_000, True),
                                                             (1, 99_999, True)])  # fmt: skip
def test_mu_halves_only_when_the_saturated_fraction_exceeds_the_threshold(n_saturated, numel, halved):
    """gradient-scaling.md: "if the saturated fraction (saturated values over the values the FP8 casts held ...)
    exceeds saturation_threshold (FP8-LM uses 0.001%, 1e-5), mu is halved": a fraction of exactly 1e-5 does not
    exceed it."""
    scaler = FP8GradScaler(init_scale=2.0**8)
    scaler.record_gradient_cast(torch.tensor(57344.0), torch.tensor(n_saturated), numel, E5M2)
    scaler.update()
    assert scaler.last_saturation == n_saturated / numel
    assert scaler.get_scale() == (2.0**7 if halved else 2.0**8)
    assert [e["action"] for e in scaler.history] == (["halve"] if halved else [])


# ================================================================================= docs/guides/troubleshooting.md
_SCHEDULERS = {
    "StepLR": (lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5), 0.5),
    "ExponentialLR": (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9), 0.5),
    "CosineAnnealingLR": (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50), 0.5),
    "LinearLR": (lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=8), 0.5),
    "LambdaLR": (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)), 1.0),
    "OneCycleLR": (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=20), 1.0),
}


@pytest.mark.parametrize("name", list(_SCHEDULERS))
def test_the_lower_lr_fallback_is_kept_or_undone_by_the_scheduler_as_documented(name):
    """troubleshooting.md: 'FP8GradScaler(nonfinite_fallback="lower_lr") lowers the learning rate (every group's lr
    and initial_lr: a scheduler that steps from the current lr, such as StepLR, ExponentialLR, CosineAnnealingLR or
    LinearLR, keeps the cut; one that recomputes the lr from its own stored values at each step, such as LambdaLR or
    OneCycleLR, undoes it at its next step'. Against the same schedule without the fallback."""
    make, kept = _SCHEDULERS[name]
    lrs = {}
    for fallback in (False, True):
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        scheduler = make(opt)
        scaler = FP8GradScaler(nonfinite_fallback="lower_lr", fallback_after=1, lr_factor=0.5)
        for step in range(12):  # OneCycleLR past its warm-up (30% of 20 steps) at the fallback
            opt.zero_grad()
            bad = fallback and step == 10
            lr_before, initial_before = opt.param_groups[0]["lr"], opt.param_groups[0]["initial_lr"]
            scaler.scale_loss(p.sum() * (math.inf if bad else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            if bad:  # the cut lands once, on lr and initial_lr
                assert scaler.history[-1]["action"] == "fallback"
                assert opt.param_groups[0]["lr"] == 0.5 * lr_before
                assert opt.param_groups[0]["initial_lr"] == 0.5 * initial_before
            scheduler.step()
        lrs[fallback] = [opt.param_groups[0]["lr"]]
        for _ in range(2):
            opt.step()
            scheduler.step()
            lrs[fallback].append(opt.param_groups[0]["lr"])
    for with_cut, without in zip(lrs[True], lrs[False], strict=True):
        assert with_cut / without == pytest.approx(kept, rel=1e-9)


@pytest.mark.parametrize("fp8_grads", [False, True])
def test_clipping_by_norm_before_a_skipped_step_blames_only_the_offending_layer(fp8_grads):
    """troubleshooting.md: the "bf16" fallback puts back "the layers whose gradients were non-finite ...; clipping by
    norm before such a step leaves the gradients as they are, where torch's clip_grad_norm_ would make every one NaN
    and so blame every layer"."""
    x = _x()
    # torch's clip_grad_norm_ on the same NaN: every gradient becomes NaN.
    reference = _net()
    reference[2].weight.register_hook(lambda g: g * math.nan)
    reference(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert all(p.grad.isnan().all() for p in reference.parameters())

    model = _net()
    scaler = FP8GradScaler(model=model, nonfinite_fallback="bf16", fallback_after=1)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=fp8_grads)
    model[2].weight.register_hook(lambda g: g * math.nan)  # NaN in the middle layer's weight gradient alone
    scaler.scale_loss(model(x).sum()).backward()
    assert scaler.clip_grad_norm_(model.parameters(), 1.0).isnan()
    opt.step()
    assert scaler.skipped_steps == 1
    assert fallen_back_layers(model) == ["2"]
    assert [type(m) for m in model] == [FP8Linear, nn.ReLU, nn.Linear, nn.ReLU, FP8Linear]


@pytest.mark.parametrize("value", ["", "AUTO", "Reference", "cuda"])
def test_an_unsupported_kernels_value_raises_at_the_first_cast(value, monkeypatch):
    """troubleshooting.md: "Any other value (an empty one and AUTO included) raises ValueError: LIGHTNING_FP8_KERNELS=
    '...' is not supported: use 'auto', 'triton' or 'reference' at the first cast"; "read as the work is dispatched
    ..., not at import". And "Casts of float64 tensors take the references whatever the value"."""
    layer = FP8Linear(16, 16)  # imported and built before the variable is set
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", value)
    message = f"LIGHTNING_FP8_KERNELS={value!r} is not supported: use 'auto', 'triton' or 'reference'"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layer(torch.randn(4, 16))
    t = torch.tensor([1.5, -3.25, 2.0], dtype=torch.float64)
    assert ops.amax(t).item() == 3.25  # float64: the reference, whatever the value


@pytest.mark.parametrize(("value", "emulated"), [("1", True), ("true", False), ("yes", False), ("01", False),
                                                 (" 1", False), ("0", False), (None, False)])  # fmt: skip
def test_emulate_gemm_is_taken_only_when_exactly_1(value, emulated, monkeypatch):
    """troubleshooting.md: "LIGHTNING_FP8_EMULATE_GEMM=1 (exactly 1; any other value is ignored) turns off the FP8 GEMMs
    of a GPU that has them (compute capability 8.9+): lightning_fp8.ops.has_fp8_gemm answers False". A GPU of
    capability 9.0 is given (as tests/core/test_pre_ada_gpus.py gives one)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    ops._device_has_fp8_gemm.cache_clear()
    try:
        if value is None:
            monkeypatch.delenv("LIGHTNING_FP8_EMULATE_GEMM", raising=False)
        else:
            monkeypatch.setenv("LIGHTNING_FP8_EMULATE_GEMM", value)
        cuda = torch.device("cuda", 0)
        assert ops.fp8_device(cuda)
        assert ops.has_fp8_gemm(cuda) is not emulated
    finally:
        ops._device_has_fp8_gemm.cache_clear()


def test_forced_triton_kernels_on_a_cpu_without_the_interpreter_fail_with_tritons_error():
    """troubleshooting.md: "`triton`: Triton for every tensor ..., CPU tensors too: on a CPU only under Triton's
    interpreter (TRITON_INTERPRET=1, set before lightning_fp8 is imported, as the tests do); without it the first cast
    fails with Triton's RuntimeError: 0 active drivers". A fresh interpreter without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a CPU-only claim: with a GPU, Triton has its driver")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LIGHTNING_FP8_KERNELS"] = "triton"
    code = (
        "import torch\n"
        "from lightning_fp8 import FP8Linear\n"
        "try:\n"
        "    FP8Linear(16, 16)(torch.randn(4, 16))\n"
        "except RuntimeError as err:\n"
        "    print('RuntimeError:', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "RuntimeError: 0 active drivers" in out.stdout, out.stdout + out.stderr
