"""Two FP8AdamW over the same FP8 weights. At O2 the first keeps its fp16 master in the weight's storage (the weight
times a power-of-two scale): a second O2 one takes the storage over as it is; one that keeps its masters otherwise (O1,
another master_dtype) is refused as it is built, saying what to do (release_weights() on the first), and an optimizer
whose weights another one took after it was built refuses to step them. Before, an O1 optimizer stepped the stored
values as the weight: updates 2**17 times too small, the FP8 weights stopped training without a word."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.optim import master

# One fp32 AdamW step of FP8AdamW's fused reference against torch.optim.AdamW's foreach one: the same formula in
# another operation order, a few fp32 roundings apart.
ONE_FP32_STEP_RTOL, ONE_FP32_STEP_ATOL = 1e-6, 1e-7


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 16)))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        (model(torch.randn(8, 32, generator=gen)) ** 2).mean().backward()
        opt.step()


def _raw(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' storage as it is (scaled where adopted) and the adopted masters' scales."""
    scales = [master.master_scale(p).clone() for p in model.parameters() if master.master_scale(p) is not None]
    return [p.detach().clone() for p in model.parameters()] + scales


SECOND = {
    "o1": {"opt_level": "O1"},
    "fp32_master": {"master_dtype": torch.float32},
    "bf16_master": {"master_dtype": torch.bfloat16},
}


@pytest.mark.parametrize("second", list(SECOND))
def test_an_optimizer_that_keeps_its_masters_otherwise_is_refused_over_adopted_weights(second):
    model = _model()
    first = FP8AdamW(model.parameters(), lr=1e-2)  # O2: takes the FP8 weights' storage
    _train(model, first)
    before = _raw(model)
    with pytest.raises(ValueError, match=r"parameter 0 of parameter group 0.*Call release_weights\(\) on that"):
        FP8AdamW(model.parameters(), lr=1e-2, **SECOND[second])
    assert all(torch.equal(a, b) for a, b in zip(before, _raw(model), strict=True))  # nothing changed
    _train(model, first, seed=1)  # the first goes on


def test_after_release_weights_an_o1_optimizer_steps_the_weights_as_torch_adamw():
    model = _model()
    first = FP8AdamW(model.parameters(), lr=1e-2)
    _train(model, first, steps=2)
    first.release_weights()
    reference = _model()
    reference.load_state_dict(model.state_dict())
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level="O1", fp8_grads=False)
    _train(model, opt, seed=3)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), seed=3)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=ONE_FP32_STEP_RTOL, atol=ONE_FP32_STEP_ATOL)


def test_weights_of_an_optimizer_that_is_gone_are_given_back_by_a_new_one():
    """What the message says where the first optimizer was dropped without release_weights()."""
    model = _model()
    first = FP8AdamW(model.parameters(), lr=1e-2)
    _train(model, first)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    del first
    FP8AdamW(model.parameters()).release_weights()
    assert all(master.master_scale(p) is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]) and value.dtype == torch.float32
    FP8AdamW(model.parameters(), lr=1e-2, opt_level="O1")  # no longer refused


@pytest.mark.parametrize("first_level", ["O1", "O2_released"])
def test_an_optimizer_whose_weights_another_one_took_since_refuses_to_step(first_level):
    """The first keeps its masters apart from the storage (O1: the weight itself; O2 after release_weights(): in its
    state), then a second (O2) takes the storage: the first's step would take the stored values for the weight (O1),
    or write its unscaled master over them. It raises before anything is stepped."""
    model = _model()
    level = "O1" if first_level == "O1" else "O2"
    first = FP8AdamW(model.parameters(), lr=1e-2, opt_level=level, fp8_grads=False)
    _train(model, first)
    if first_level == "O2_released":
        first.release_weights()
    second = FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=False)
    assert master.master_scale(model[0].weight) is not None
    first.zero_grad()
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    before = _raw(model)
    with pytest.raises(RuntimeError, match="parameter 0 of parameter group 0.*created after this one"):
        first.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _raw(model), strict=True))
    second.step()  # the one that took the weights steps them
