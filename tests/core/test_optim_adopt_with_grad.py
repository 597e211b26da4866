"""FP8AdamW (O2) taking over an FP8 weight that already has a gradient: built after a backward, or the weight added
with add_param_group after one (unfreezing a layer). Taking the weight over changes its storage's dtype, and the
gradient was dropped silently: the weight missed that step (it moved only by the fp16 rounding of its master) while
its bias stepped. It is kept now: the step matches torch.optim.AdamW's on the same gradients."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8

LR, MU = 1e-2, 2.0**8


@pytest.mark.parametrize("fp8_grads", [True, False])
@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
@pytest.mark.parametrize("scaled", [False, True], ids=["no-scaler", "scaler"])
def test_a_gradient_from_before_the_takeover_is_stepped(fp8_grads, how, scaled):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    scaler = FP8GradScaler(init_scale=MU) if scaled else None
    if how == "add_param_group":
        opt = FP8AdamW(model[0].parameters(), lr=LR, fp8_grads=fp8_grads, grad_scaler=scaler)
    loss = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).square().mean()
    (scaler.scale_loss(loss) if scaled else loss).backward()
    del loss  # its graph holds the weights' gradient accumulators, which the takeover must be the only one to hold
    taken = dict(model[2].named_parameters(prefix="2")) if how == "add_param_group" else dict(model.named_parameters())
    start = {name: p.detach().clone() for name, p in taken.items()}
    grads = {name: p.grad.detach().float() / (MU if scaled else 1.0) for name, p in taken.items()}
    if how == "add_param_group":
        opt.add_param_group({"params": list(model[2].parameters())})
    else:
        opt = FP8AdamW(model.parameters(), lr=LR, fp8_grads=fp8_grads, grad_scaler=scaler)
    opt.step()
    got = {name: value.float() for name, value in model.state_dict().items()}  # the unscaled weights

    reference = {name: w.clone().requires_grad_() for name, w in start.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=LR, weight_decay=opt.defaults["weight_decay"])
    for name, w in reference.items():
        w.grad = grads[name]
    torch_opt.step()
    for name in [n for n in ("0.weight", "2.weight") if n in taken]:
        delta, want = got[name] - start[name], reference[name].detach() - start[name]
        assert delta.abs().max() > LR / 2, f"{name} did not step"
        cosine = torch.nn.functional.cosine_similarity(delta.flatten(), want.flatten(), dim=0)
        assert cosine > 0.98, (name, cosine.item())
