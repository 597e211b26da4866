"""FP8GradScaler: the high-precision gradients mu can overflow (fp16) are measured also when FP8 gradient casts are
reported, the saturated fraction is that of the cast values, and a plain optimizer's fp16 gradients are refused (as
torch.amp.GradScaler refuses them) rather than unscaled in fp16."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from lightning_fp8.formats import E5M2

pytestmark = pytest.mark.usefixtures("one_thread")


def _fp16_extra_run(fp8_grads: bool, steps: int) -> tuple[list[float], FP8GradScaler]:
    """An FP8 layer and an extra fp16 parameter whose gradient is 30 (e.g. a norm or bias kept in fp16): mu has
    headroom up to 1024 (30 * 2048 * 2 > 65504), and 30 * 4096 overflows fp16."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    extra = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    scaler = FP8GradScaler(init_scale=1.0, growth_interval=2)
    opt = FP8AdamW([*model.parameters(), extra], lr=1e-4, grad_scaler=scaler, fp8_grads=fp8_grads)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    mus = []
    for _ in range(steps):
        loss = model(x).float().mean() * 1e-3 + (extra.float() * 30.0).sum()
        scaler.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        mus.append(scaler.get_scale())
    return mus, scaler


def test_fp16_gradients_beside_fp8_gradient_casts_keep_their_headroom():
    # With fp8_grads=True the FP8 weights' gradients are reported by their casts, and the step measured none of the
    # optimizer's param.grad: the fp16 gradient went unjudged, so mu cycled 2048 -> 4096 -> inf -> skip forever
    # (6 of 40 steps skipped). It is measured now, so mu settles where it does with fp8_grads=False.
    steps = 30
    ref_mus, ref = _fp16_extra_run(fp8_grads=False, steps=steps)
    mus, scaler = _fp16_extra_run(fp8_grads=True, steps=steps)
    assert ref.skipped_steps == 0 and ref_mus[-8:] == [2048.0] * 8  # the reference settled
    assert scaler.skipped_steps == 0
    assert mus == ref_mus
    assert all(entry["action"] == "double" for entry in scaler.history)


def test_fp16_gradients_are_measured_beside_communication_hook_casts():
    # An FP8 communication hook reports its casts (with headroom) to the scaler; the optimizer's fp16 gradient has
    # none (40000 * 2 > 65504): mu must not grow. It grew every step, the fp16 gradient unmeasured.
    q = nn.Parameter(torch.zeros(8, dtype=torch.float16))
    scaler = FP8GradScaler(init_scale=1.0, growth_interval=1)
    scaler.scale_loss(torch.zeros(()))  # the planted gradients carry mu, as a scaled backward's do
    opt = FP8AdamW([q], lr=0.0, grad_scaler=scaler, fp8_grads=False)
    for _ in range(3):
        scaler.record_gradient_cast(torch.tensor(1.0), torch.tensor(0), 100, E5M2)  # as fp8_allreduce_hook reports
        q.grad = torch.full_like(q, 40000.0)
        assert scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.growth_tracker == 0
    for _ in range(2):  # with fp16 headroom, the casts and the gradient together let mu grow
        scaler.record_gradient_cast(torch.tensor(1.0), torch.tensor(0), 100, E5M2)
        q.grad = torch.full_like(q, 100.0)
        assert scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 4.0


def test_saturated_fraction_is_of_the_cast_values_alone():
    # 5 of 1000 cast values saturated (0.5% > the 0.2% threshold): mu halves. The high-precision gradients measured
    # in the same step (another optimizer's 4000 fp32 values; fp16 ones beside the casts) cannot saturate and must
    # not dilute the fraction (5 / 5000 = 0.1% kept mu).
    a, b = nn.Parameter(torch.zeros(8)), nn.Parameter(torch.zeros(4000))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.0), torch.optim.SGD([b], lr=0.0)
    scaler = FP8GradScaler(init_scale=2.0**4, saturation_threshold=2e-3)
    scaler.scale_loss(torch.zeros(()))  # the planted gradients carry mu, as a scaled backward's do
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    scaler.record_gradient_cast(torch.tensor(57344.0), torch.tensor(5), 1000, E5M2, owner=opt_a)
    assert scaler.step(opt_a) and scaler.step(opt_b)
    scaler.update()
    assert scaler.last_saturation == pytest.approx(5e-3) and scaler.get_scale() == 2.0**3
    q = nn.Parameter(torch.zeros(4000, dtype=torch.float16))
    opt_q = FP8AdamW([q], lr=0.0, grad_scaler=scaler, fp8_grads=False)
    q.grad = torch.ones_like(q)
    scaler.record_gradient_cast(torch.tensor(57344.0), torch.tensor(5), 1000, E5M2)
    assert scaler.step(opt_q)
    scaler.update()
    assert scaler.last_saturation == pytest.approx(5e-3) and scaler.get_scale() == 2.0**2


@pytest.mark.parametrize("where", ["fp16 extra", "fp32 bias"])
def test_nonfinite_high_precision_gradients_beside_fp8_casts_skip_the_step(where):
    # Beside FP8 gradient casts only the fp16 gradients are measured for headroom; a non-finite gradient of any
    # dtype is still caught by the step's check of every param.grad.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    extra = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    scaler = FP8GradScaler(init_scale=2.0**4)
    opt = FP8AdamW([*model.parameters(), extra], lr=1e-2, grad_scaler=scaler, fp8_grads=True)
    scaler.scale_loss(model(torch.randn(8, 32)).float().mean() + extra.float().sum()).backward()
    assert model[0].weight.grad is None and model[0].bias.grad.dtype == torch.float32  # the weight's is held in FP8
    (extra.grad if where == "fp16 extra" else model[0].bias.grad)[0] = float("inf")
    before = [p.detach().clone() for p in (*model.parameters(), extra)]
    opt.step()
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**3
    assert all(torch.equal(u, p.detach()) for u, p in zip(before, (*model.parameters(), extra), strict=True))


# --------------------------------------------------------------------------------------- fp16 plain optimizers
def test_plain_optimizer_with_fp16_gradients_is_refused_and_nothing_changes():
    # Unscaling in place in fp16 flushed the true gradients below fp16's range back to zero, silently (relative
    # errors 1, 1, 1, 0.15 of logspace(-9, -5)); torch.amp.GradScaler refuses fp16 gradients. Refused before anything
    # changes: parameters, gradients, optimizer state and the scaler's counters are as they were.
    true_g = torch.logspace(-9, -5, 8, dtype=torch.float64)
    p = nn.Parameter(torch.ones(8))  # fp32 beside it: not unscaled either
    q = nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt = torch.optim.SGD([p, q], lr=1.0, momentum=0.9)
    (p.double() * true_g).sum().add((q.double() * true_g).sum()).backward()
    opt.step()  # momentum buffers exist
    opt.zero_grad()
    scaler = FP8GradScaler(init_scale=2.0**16)
    scaler.scale_loss((p.double() * true_g).sum() + (q.double() * true_g).sum()).backward()
    saved = [t.detach().clone() for t in (p, q, p.grad, q.grad)]
    momenta = [opt.state[t]["momentum_buffer"].clone() for t in (p, q)]
    state = scaler.state_dict()
    with pytest.raises(ValueError, match=r"fp16 gradients.*torch.autocast.*FP8AdamW.*Nothing was changed"):
        scaler.step(opt)
    assert all(torch.equal(u, t.detach()) for u, t in zip(saved, (p, q, p.grad, q.grad), strict=True))
    assert all(torch.equal(m, opt.state[t]["momentum_buffer"]) for m, t in zip(momenta, (p, q), strict=True))
    scaler.update()  # nothing was stepped or recorded: nothing to judge
    assert scaler.state_dict() == state and not scaler._stepped and opt not in scaler._unscaled
    # FP8AdamW takes the same fp16 parameter: it unscales in fp32, so even the smallest true gradient moves it.
    adam = FP8AdamW([q], lr=1e-2, weight_decay=0.0, grad_scaler=scaler, fp8_grads=False)
    assert adam.step() is None and scaler.skipped_steps == 0
    assert bool((q.detach() < 1.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_optimizer_with_fp32_or_bf16_gradients_is_unscaled_exactly(dtype):
    # mu is a power of two: unscaling fp32 and bf16 (fp32's range) gradients gives the true ones exactly.
    true_g = torch.logspace(-9, -5, 8, dtype=torch.float64)
    p = nn.Parameter(torch.zeros(8, dtype=dtype))
    seen = {}

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            seen["grad"] = p.grad.detach().clone()
            return super().step(closure)

    scaler = FP8GradScaler(init_scale=2.0**16)
    scaler.scale_loss((p.double() * true_g).sum()).backward()
    assert scaler.step(Probe([p], lr=1.0)) is True
    assert torch.equal(seen["grad"], true_g.to(dtype)) and torch.equal(p.detach(), -true_g.to(dtype))
