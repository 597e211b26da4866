"""FP8GradScaler.clip_grad_norm_ of an FSDP1 model (one gloo rank in this process), of gradients below the limit or
of a tiny norm, and one FP8CommState for two FSDP1 models, from a mutation audit of today's fixes
(grad_scaling/unscaling.py, integrations/clipping.py, distributed/fsdp.py).

Each test kills mutants the existing tests let survive (tests/distributed/test_routes_fsdp1.py runs FSDP1 on 2 and 3
ranks only, with the L2 norm and finite gradients; tests/integrations/test_clipping.py clips norms far above the
limit and far above 1e-6):

- ``_refuse_fsdp1_shards``: ``get_world_size() > 1`` -> ``>= 1`` (one process holds the whole flat gradients, whose
  norm is the true one, yet FSDP1's parameters were refused).
- ``_Unscaling.clip_grad_norm_``, FSDP1 branch: ``check(total / mu)`` dropped (``error_if_nonfinite=True`` ignored:
  nothing raised); ``parameters.clip_grad_norm_(math.inf, norm_type)`` -> ``(math.inf, 2.0)`` (the L2 norm returned
  and clipped by whatever ``norm_type``); ``.float()`` dropped (a bf16 model's norm returned in bf16, not the
  documented fp32).
- ``clip_factor``: ``1e-6 * mu`` -> ``1e-6`` (torch's epsilon taken in the scaled units: a true norm near 1e-6
  clipped by another factor than torch's); ``max=1.0`` -> ``max=1.001`` (gradients below the limit scaled up).
- ``clip_grad_norm_fp32``: the ``torch.clamp(..., max=1.0)`` inside ``finite_or_one`` dropped (norm_type 3 gradients
  below the limit scaled up to it).
- ``enable_fp8_fsdp1``: ``layouts[total] = _refine(layouts[total], layout) if total in layouts else layout`` ->
  ``layouts[total] = layout`` (also killed by tests/distributed/test_mutation_dist_fsdp1_units.py for two units of
  one model; here for two models on one state, today's route: the first model's small gradients flushed to zero).

A bug this audit found, fixed with it: FP8GradScaler.clip_grad_norm_(fsdp1_root, ...) measured the norm with FSDP1's
own ``clip_grad_norm_(math.inf)``, which for a non-finite norm multiplies every gradient by ``inf / NaN`` = NaN (so the
"leave the gradients as they are" of today's clipping fix did not hold on that route, and ``error_if_nonfinite=True``
raised "nothing was clipped" after every gradient was made NaN). The ranks now agree on NaN / inf first.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import FP8GradScaler

pytestmark = pytest.mark.usefixtures("one_thread")

MU = 2.0**4


@contextlib.contextmanager
def _one_rank(tmp_path):
    """One rank of gloo in this process (FSDP1 needs a process group), destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP1 on one rank: its NO_SHARD switch and deprecation warnings
            yield
    finally:
        dist.destroy_process_group()


def _fsdp(dtype: torch.dtype = torch.float32) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    return FSDP(model, device_id=torch.device("cpu"))


def _backward(model: nn.Module, scaler: FP8GradScaler, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    scaler.scale_loss(model(x).float().square().sum()).backward()
    return [p.grad for p in model.parameters()]


def _torch_reference(
    grads: list[torch.Tensor], max_norm: float, norm_type: float, mu: float = MU
) -> tuple[torch.Tensor, list]:
    """torch's clip_grad_norm_ of the true gradients (grad / mu) in float64: (its norm, the clipped gradients)."""
    params = [nn.Parameter(torch.zeros(g.shape, dtype=torch.float64)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.double() / mu
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return norm, [p.grad for p in params]


@pytest.mark.parametrize("route", ["parameters", "root"])
@pytest.mark.parametrize("norm_type", [2.0, 3.0, math.inf])
def test_fsdp1_on_one_process_clips_as_torch_clips_the_true_gradients(tmp_path, route, norm_type):
    """On one process FSDP1's flat gradients are whole: its parameters are taken (as torch's clip_grad_norm_ takes
    them), and so is the root; both return torch's norm of the unscaled gradients and clip them by torch's factor,
    for each norm_type."""
    with _one_rank(tmp_path):
        model = _fsdp()
        scaler = FP8GradScaler(init_scale=MU)
        grads = _backward(model, scaler)
        expected_norm, expected = _torch_reference(grads, 0.05, norm_type)
        assert float(expected_norm) > 0.1  # the limit clips
        norm = scaler.clip_grad_norm_(model.parameters() if route == "parameters" else model, 0.05, norm_type)
        assert norm.dtype == torch.float32 and norm.dim() == 0
        torch.testing.assert_close(norm.double(), expected_norm, rtol=1e-5, atol=0)
        for param, grad in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(param.grad.double() / MU, grad, rtol=1e-5, atol=1e-9)


def _nonfinite_gradient(bad: float):
    """A one-rank FSDP1 model (inside ``_one_rank``), its scaler, and its flat gradient with one ``bad`` value."""
    model = _fsdp()
    scaler = FP8GradScaler(init_scale=MU)
    (grad,) = _backward(model, scaler)
    grad.view(-1)[3] = bad
    return model, scaler, grad


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_fsdp1_root_with_error_if_nonfinite_raises_as_torch_and_otherwise_returns_the_nonfinite_norm(tmp_path, bad):
    """As torch's clip_grad_norm_: a non-finite norm raises with ``error_if_nonfinite=True``; without it the norm is
    returned non-finite (the step the scaler skips)."""
    with _one_rank(tmp_path):
        model, scaler, grad = _nonfinite_gradient(bad)
        reference = nn.Parameter(torch.zeros_like(grad))
        reference.grad = grad.clone()
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_([reference], 0.05, error_if_nonfinite=True)
        with pytest.raises(RuntimeError, match="non-finite"):
            scaler.clip_grad_norm_(model, 0.05, error_if_nonfinite=True)
        assert not torch.isfinite(scaler.clip_grad_norm_(model, 0.05))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("error_if_nonfinite", [True, False])
def test_fsdp1_root_leaves_the_gradients_as_they_are_when_the_norm_is_not_finite(tmp_path, error_if_nonfinite, bad):
    """As the other routes since today's fix (finite_or_one), and torch's error_if_nonfinite ("before anything is
    clipped"): a non-finite norm leaves the finite gradients as they are, the NaN one its own."""
    with _one_rank(tmp_path):
        model, scaler, grad = _nonfinite_gradient(bad)
        before = grad.clone()
        if error_if_nonfinite:
            with pytest.raises(RuntimeError, match="nothing was clipped"):
                scaler.clip_grad_norm_(model, 0.05, error_if_nonfinite=True)
        else:
            norm = scaler.clip_grad_norm_(model, 0.05)
            assert math.isnan(norm.item()) if math.isnan(bad) else norm.item() == math.inf
        assert torch.equal(grad.nan_to_num(), before.nan_to_num())


def test_fsdp1_root_returns_the_fp32_norm_of_a_bf16_model(tmp_path):
    """The returned norm is a 0-dim fp32 tensor, as documented, where FSDP1's own clip_grad_norm_ returns a bf16
    model's norm in bf16; its value is the norm of the true gradients and they are clipped to the limit."""
    with _one_rank(tmp_path):
        model = _fsdp(torch.bfloat16)
        scaler = FP8GradScaler(init_scale=MU)
        grads = _backward(model, scaler, torch.bfloat16)
        expected_norm, expected = _torch_reference(grads, 0.05, 2.0)
        norm = scaler.clip_grad_norm_(model, 0.05)
        assert norm.dtype == torch.float32 and norm.dim() == 0
        torch.testing.assert_close(norm.double(), expected_norm, rtol=2**-7, atol=0)  # FSDP1 rounds it to bf16
        for param, grad in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(param.grad.double() / MU, grad, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, 3.0])
@pytest.mark.parametrize(("true_scale", "max_norm"), [(1.0, 100.0), (1e-7, 1e-7)], ids=["below the limit", "tiny"])
def test_clipping_by_norm_matches_torch_below_the_limit_and_for_a_norm_near_its_epsilon(
    norm_type, true_scale, max_norm
):
    """torch's clip_grad_norm_ of the true gradients (grad / mu) in float64: below the limit they stay as they are, bit
    for bit (torch multiplies by a factor clamped to 1); for a true norm of about 1e-6 its 1e-6 counts in the true
    gradients' units (max_norm / (norm + 1e-6)), not in the scaled ones'."""
    mu = 2.0**10
    generator = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.zeros(7, 5)) for _ in range(3)]
    for param in params:
        param.grad = torch.randn(7, 5, generator=generator) * true_scale * mu
    before = [p.grad.clone() for p in params]
    scaler = FP8GradScaler(init_scale=mu)
    expected_norm, expected = _torch_reference(before, max_norm, norm_type, mu)
    norm = scaler.clip_grad_norm_(params, max_norm, norm_type)
    torch.testing.assert_close(norm.double(), expected_norm, rtol=1e-5, atol=0)
    if true_scale == 1.0:
        assert float(expected_norm) < max_norm
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
    else:
        assert 1e-7 < float(expected_norm) < 1e-5  # torch's 1e-6 weighs in its factor
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad.double() / mu, grad, rtol=1e-5, atol=0)


class _TwoScales(nn.Module):
    """271 elements: 15 gradients of about 1e-6 and 256 of about 1e4, in the order given (one flat gradient of 271 in
    either order). With one FP8 scale for both sizes the small ones flush to zero."""

    def __init__(self, small_first: bool) -> None:
        super().__init__()
        self.small_first = small_first
        if small_first:
            self.small = nn.Parameter(torch.ones(15))
        self.big = nn.Parameter(torch.ones(256))
        if not small_first:
            self.small = nn.Parameter(torch.ones(15))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small, big = (x[:15], x[15:]) if self.small_first else (x[256:], x[:256])
        return (self.small * small).sum() * 1e-6 + (self.big * big).sum() * 1e4


def test_one_state_for_two_models_with_flat_gradients_of_one_size_keeps_both_models_boundaries(tmp_path):
    """Two FSDP1 models whose flat gradients have the same size (271) but other parameter boundaries, registered on
    one FP8CommState: the second's boundaries are added to the first's, not put in their place, so each model's small
    gradients keep a scale of their own. Reference: the gradients written from the forward, small = x * 1e-6."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp1

    with _one_rank(tmp_path):
        state = FP8CommState()
        models = [FSDP(_TwoScales(small_first), device_id=torch.device("cpu")) for small_first in (False, True)]
        for model in models:
            enable_fp8_fsdp1(model, state)
        x = torch.linspace(0.5, 1.5, 271, dtype=torch.float64)
        for model in models:
            model(x.float()).backward()
            flat = model._handle.flat_param
            numels = (15, 256) if model.module.small_first else (256, 15)
            small_grad = flat.grad[:15] if model.module.small_first else flat.grad[256:271]
            assert tuple(flat._numels_with_padding) == numels
            expected = (x[:15] if model.module.small_first else x[256:]) * 1e-6
            # one E5M2 rounding: 2**-3 relative at most; flushed to zero, the error is the whole value
            assert float((small_grad.double() - expected).abs().max() / expected.abs().max()) < 2**-3
        assert state.check_step()
