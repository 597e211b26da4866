"""What a mutation audit of kernels/grad_cast.py found unpinned: the batched gradient cast's FP8 outputs each start at
a multiple of 16 bytes of their shared buffer (the module docstring; the weight-gradient GEMM reads them as
``torch._scaled_mm`` operands, which need 16-byte aligned bases), and with odd sizes between them each output still
holds its own gradient's cast, checked against the cast's spec (``RNE(clamp(g * scale, +-fp8_max))`` with current
scaling's ``2 ** floor(log2(fp8_max / amax))``), under TRITON_INTERPRET=1 on CPU.
"""

import math

import pytest
import torch
from lightning_fp8.kernels import grad_cast, reference_grad_cast

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_outputs_start_16_byte_aligned_and_hold_their_own_casts(fp8_dtype):
    gen = torch.Generator().manual_seed(12)
    shapes = [(3, 5), (17,), (1,), (7, 3), (33,)]  # sizes that are not multiples of 16
    grads = [torch.randn(shape, generator=gen) * 2.0 ** (i - 2) for i, shape in enumerate(shapes)]
    states = [reference_grad_cast.new_grad_cast_state(DEVICE) for _ in grads]
    g_fp8, scale_inv, amax, _ = grad_cast.grad_cast([g.to(DEVICE) for g in grads], states, fp8_dtype)
    for g, out, s_inv, a in zip(grads, g_fp8, scale_inv, amax, strict=True):
        assert out.data_ptr() % 16 == 0, [o.data_ptr() % 16 for o in g_fp8]
        out = out.cpu()
        assert out.shape == g.shape and out.dtype == fp8_dtype
        want_amax = g.abs().max().item()
        scale = 2.0 ** math.floor(math.log2(FMAX[fp8_dtype] / want_amax))
        assert a.item() == want_amax and s_inv.item() == 1.0 / scale
        want = (g.double() * scale).clamp(-FMAX[fp8_dtype], FMAX[fp8_dtype]).float().to(fp8_dtype)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_a_gradient_at_the_format_max_saturates_once(fp8_dtype):
    """A gradient whose amax is fp8_max * 2**k exactly is cast with scale 2**-k: that one element lands on fp8_max,
    which counts as saturated (``|g * scale| >= fp8_max``); the next value below fp8_max does not. The state records
    the saturated fraction 1 / numel."""
    fmax = FMAX[fp8_dtype]
    gen = torch.Generator().manual_seed(13)
    g = (torch.rand(37, generator=gen) * 0.5 + 0.1) * fmax * 2.0**3
    g[36] = -fmax * 2.0**4  # the amax: |g * scale| == fmax with scale 2**-4
    g[5] = torch.nextafter(torch.tensor(fmax), torch.tensor(0.0)) * 2.0**4  # just below: not saturated
    state = reference_grad_cast.new_grad_cast_state(DEVICE)
    g_fp8, scale_inv, _, _ = grad_cast.grad_cast([g.to(DEVICE)], [state], fp8_dtype)
    assert scale_inv.item() == 2.0**4
    saturated = int(((g.double() * 2.0**-4).abs() >= fmax).sum())
    assert saturated == 1
    assert reference_grad_cast.grad_cast_state_buffers(state)[3].item() == pytest.approx(saturated / g.numel())
