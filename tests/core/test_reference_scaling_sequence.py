"""FP8Linear over many steps against an independent float64 model of the scale convention (docs/concepts/formats.md).

The reference below is written from the docs alone: the scale ``2 ** (floor(log2(fp8_max / amax)) - margin)``, the
amax history (most recent first, a zero or non-finite amax entering as 0 and keeping the previous scale), the first
cast of a role taking its own amax, saturating round-to-nearest-even casts, and the three GEMMs on the dequantized
FP8 operands. Scales, histories and statistics must match it exactly, every step; the GEMM outputs bit for bit up to
fp32 accumulation order.
"""

import math

import numpy as np
import pytest
import torch

from lightning_fp8 import E4M3, E5M2, FP8Linear, FP8Recipe, ScalingState, compute_scale

# format: (largest value, smallest normal exponent, mantissa bits)
_FORMATS = {E4M3: (448.0, -6, 3), E5M2: (57344.0, -14, 2)}


def _scale(amax: float, dtype: torch.dtype, margin: int, prev: float) -> float:
    if not math.isfinite(amax) or amax == 0.0:
        return prev
    fmax = _FORMATS[dtype][0]
    e = math.floor(math.log2(fmax / amax)) + 2
    while math.ldexp(amax, e) > fmax:  # the largest e with amax * 2**e <= fmax, exactly
        e -= 1
    return math.ldexp(1.0, min(max(e - margin, -126), 127))


def _round(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Saturating round-to-nearest-even onto the FP8 grid; non-finite values become NaN."""
    fmax, emin, mantissa = _FORMATS[dtype]
    out = np.full_like(v, np.nan)
    finite = np.isfinite(v)
    a = np.abs(v[finite])
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.frexp(a)[1] - 1, emin)
    quantum = np.ldexp(1.0, exponent - mantissa)
    out[finite] = np.sign(v[finite]) * np.minimum(np.round(a / quantum) * quantum, fmax)
    return out


class _RefState:
    def __init__(self, dtype, history_len, margin, algo, delayed):
        self.dtype, self.margin, self.algo, self.delayed = dtype, margin, algo, delayed
        self.scale, self.history, self.initialized = 1.0, [0.0] * history_len, False
        self.amax, self.saturation, self.nonfinite, self.casts = 0.0, 0.0, 0, 0

    def cast(self, x: np.ndarray) -> np.ndarray:
        """The dequantized FP8 copy of ``x`` (float64 values of an fp32/bf16/fp16 tensor); records the cast."""
        amax = (math.inf if np.isnan(x).any() else float(np.abs(x).max())) if x.size else 0.0
        informative = math.isfinite(amax) and amax > 0
        own = not self.delayed or not self.initialized
        scale = _scale(amax, self.dtype, self.margin, self.scale) if own else self.scale
        scaled = x * scale
        self.saturation = float((np.abs(scaled[np.isfinite(x)]) >= _FORMATS[self.dtype][0]).sum()) / max(x.size, 1)
        self.amax, self.casts = amax, self.casts + 1
        self.nonfinite += not math.isfinite(amax)
        self.history = [amax if informative else 0.0] + self.history[:-1]
        if informative:
            self.initialized = True
            window = max(self.history) if self.algo == "max" else self.history[0]
            self.scale = _scale(window, self.dtype, self.margin, self.scale) if self.delayed else scale
        elif not self.delayed:
            self.scale = scale
        return _round(scaled, self.dtype) / scale

    def assert_matches(self, state: ScalingState, where: str) -> None:
        assert state.scale.item() == self.scale, where
        assert state.amax_history.tolist() == [float(np.float32(h)) for h in self.history], where
        assert state.amax.item() == float(np.float32(self.amax)), where
        assert state.saturation.item() == float(np.float32(self.saturation)), where
        assert (state.nonfinite_count.item(), state.casts.item()) == (self.nonfinite, self.casts), where
        assert state.initialized == self.initialized, where


def _assert_gemm(got: torch.Tensor, a: np.ndarray, b: np.ndarray, where: str) -> None:
    """``got`` is ``a @ b`` of dequantized FP8 operands, accumulated in fp32 and rounded once to ``got.dtype``."""
    exact = a @ b
    got64 = got.detach().double().numpy().reshape(exact.shape)
    want = torch.from_numpy(exact).to(got.dtype).double().numpy()
    # fp32 accumulation over k terms errs by at most k * 2**-24 * sum|products| (bit for bit where every partial sum
    # is an fp32 number, the usual case here); the one rounding to got.dtype may then go the other way: one ulp of it.
    bound = a.shape[1] * 2.0**-24 * (np.abs(a) @ np.abs(b)) + np.abs(want) * torch.finfo(got.dtype).eps
    same = (got64 == want) | (np.isnan(got64) & np.isnan(want))
    assert (same | (np.abs(got64 - exact) <= bound)).all(), where
    assert same.mean() > 0.9, where  # mostly bit for bit: a wrong scale or rounding would not be


def _inputs(step: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    kind = step % 7
    x = torch.randn(shape, generator=generator) * 10.0 ** ((step * 5) % 9 - 4)
    if kind == 2:
        return torch.zeros(shape)  # amax 0: keeps the scale, enters the history as 0
    if kind == 4:
        x.view(-1)[1] = float("nan")  # non-finite: counted, history 0, the NaN reaches the output
    if kind == 5:
        x.view(-1)[0] = 448.0 * 2.0 ** (step - 8)  # an amax on a power-of-two boundary
    return x


RECIPES = [
    FP8Recipe(),
    FP8Recipe(amax_history_len=1),
    FP8Recipe(amax_history_len=2, amax_compute_algo="most_recent"),
    FP8Recipe(amax_history_len=3, margin=1),
    FP8Recipe(margin=3, fp8_format="e4m3"),
    FP8Recipe(scaling="current", margin=2),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.scaling}-{r.amax_history_len}-{r.margin}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float64_reference_over_steps(recipe, dtype):
    generator = torch.Generator().manual_seed(0)
    k, n = 32, 16
    layer = FP8Linear(k, n, bias=False, recipe=recipe).to(dtype)
    refs = {
        "input": _RefState(recipe.forward_dtype, recipe.amax_history_len, recipe.margin, recipe.amax_compute_algo,
                           recipe.scaling == "delayed"),
        "weight": _RefState(recipe.forward_dtype, 1, recipe.margin, recipe.amax_compute_algo, False),
        "grad_output": _RefState(recipe.backward_dtype, recipe.amax_history_len, recipe.margin,
                                 recipe.amax_compute_algo, recipe.scaling == "delayed"),
    }  # fmt: skip
    for step in range(14):
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=generator) * 10.0 ** (step % 4 - 2))
        layer.weight.grad = None
        x = _inputs(step, (2, 3, k), generator).to(dtype).requires_grad_(True)
        dy = _inputs(step + 3, (2, 3, n), generator).to(dtype)
        y = layer(x)
        y.backward(dy)

        x_q = refs["input"].cast(x.detach().double().numpy().reshape(-1, k))
        w_q = refs["weight"].cast(layer.weight.detach().double().numpy())
        dy_q = refs["grad_output"].cast(dy.double().numpy().reshape(-1, n))
        with np.errstate(invalid="ignore"):
            _assert_gemm(y, x_q, w_q.T, f"forward, step {step}")
            _assert_gemm(x.grad, dy_q, w_q, f"dgrad, step {step}")
            _assert_gemm(layer.weight.grad, dy_q.T, x_q, f"wgrad, step {step}")
        for role, ref in refs.items():
            ref.assert_matches(layer.fp8_scaling[role], f"{role}, step {step}")


def test_quantize_refuses_activation_input_without_an_activation():
    # Without activation='gelu_backward' the cast reads x alone: the GELU input was dropped without a word.
    s = ScalingState(E5M2, 4, 0, "max", delayed=True)
    g = torch.randn(8, 16)
    with pytest.raises(ValueError, match="activation=None.*takes no activation_input"):
        s.quantize(g, activation_input=torch.randn(8, 16))
    with pytest.raises(ValueError, match="activation=None.*takes no activation_input"):
        s.quantize(g, activation_input=torch.randn(8, 16).to(E4M3), activation_scale_inv=torch.tensor(1.0))
    assert int(s.casts) == 0  # nothing was recorded by the refused calls


def test_compute_scale_of_an_int_beyond_float64_keeps_the_previous_scale():
    # "One beyond fp32's range (above 3.4e38) becomes inf and, like any non-finite amax, gives prev_scale": a Python
    # int too large for a float raised OverflowError instead.
    assert compute_scale(10**400, E4M3, prev_scale=torch.tensor(4.0)).item() == 4.0
    assert compute_scale(10**400, E5M2).item() == 1.0
    assert compute_scale(10**30, E4M3).item() == _scale(1e30, E4M3, 0, 1.0)
