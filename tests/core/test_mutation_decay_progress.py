"""The E4M3 first moment's store toward zero (kernels/reference_adamw.py: decay_progress_ref) against its documented
rule, written here in float64 over every E4M3 code: "where the stored value would come back unchanged though the
exact one fell at least half the decay toward zero (the scale unchanged), the store takes the next code toward zero"
(docs/concepts/optimizer.md). A mutation audit found the threshold (half the decay) unpinned."""

import pytest
import torch
from lightning_fp8.kernels.reference_adamw import decay_progress_ref

from lightning_fp8.formats import E4M3

# Fractions of the stored value for the exact new value: spread from 0.5 to past 1 (a value the gradient holds), and
# just either side of the threshold (1 + beta1) / 2; none within 1e-3 of it (the step compares in fp32).
_FRACTIONS = (0.5, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.985, 0.994, 1.0, 1.01)


def _codes() -> torch.Tensor:
    """Every finite, nonzero E4M3 value, as float64."""
    values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(E4M3).double()
    return values[torch.isfinite(values) & (values != 0)]


def _toward_zero(value: float, ladder: list[float]) -> float:
    """The E4M3 value next to ``value`` toward zero (0 below the smallest)."""
    below = [v for v in ladder if v < abs(value)]
    return (max(below) if below else 0.0) * (1.0 if value > 0 else -1.0)


@pytest.mark.parametrize("beta1", [0.9, 0.8])
def test_decay_progress_follows_the_documented_rule_for_every_code(beta1):
    codes = _codes()
    ladder = sorted({abs(v) for v in codes.tolist()})
    threshold = (1.0 + beta1) / 2.0
    fractions = [f for f in _FRACTIONS if abs(f - threshold) > 1e-3] + [threshold * (1 - 3e-3), threshold * (1 + 3e-3)]
    fractions = torch.tensor(fractions, dtype=torch.float64)
    old = codes.repeat_interleave(len(fractions))
    exact = old * fractions.repeat(len(codes))  # the new value in the units of the storage (scale unchanged)
    stored_old = old.to(E4M3)
    nearest = exact.float().to(E4M3)  # round to nearest even, saturating as the store does (all values <= 448 here)
    dst = nearest.clone()
    decay_progress_ref(dst, exact.float(), stored_old, beta1)
    expected = []
    for o, x, n in zip(old.tolist(), exact.tolist(), nearest.double().tolist(), strict=True):
        held = n == o and abs(x) <= abs(o) * threshold
        expected.append(_toward_zero(o, ladder) if held else n)
    expected = torch.tensor(expected, dtype=torch.float64)
    got = dst.double()
    wrong = (got != expected).nonzero().reshape(-1)
    assert wrong.numel() == 0, [(old[i].item(), exact[i].item(), got[i].item(), expected[i].item()) for i in wrong[:5]]
    # The case exercises both branches: some values step toward zero, others keep their nearest rounding.
    nudged = (got != nearest.double()).sum().item()
    assert 0 < nudged < got.numel()
