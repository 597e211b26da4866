"""What a mutation audit of the AdamW Triton kernels (kernels/adamw_kernels.py, adamw_finalize.py, adamw.py) found
unpinned, each checked against AdamW written in float64 from its spec (docs/concepts/optimizer.md, DESIGN.md: Adam's
bias-corrected update with decoupled weight decay; each state stored RNE in its format with a power-of-two scale
``2 ** floor(log2(fmax / amax))`` from the fresh amax; the FP8 weight copy cast as the forward casts it, counting
``|x * scale| >= fp8_max`` as saturated), under TRITON_INTERPRET=1 on CPU. Sizes are ragged (1000 elements: the
interpreter's 128-element chunks end mid-chunk) so the masked last chunk matters.
"""

import math

import pytest
import torch
from lightning_fp8.kernels import adamw, reference_adamw

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
N = 1000
LR, B1, B2, WD, STEP = 1e-3, 0.9, 0.999, 0.01, 3


def _pow2_scale(amax: float, fmax: float, margin: int = 0) -> float:
    return 2.0 ** (math.floor(math.log2(fmax / amax)) - margin)


def _adamw64(w, m, v, g, *, eps, lr=LR, wd=WD):
    """torch.optim.AdamW's update in float64: decoupled decay, then the bias-corrected Adam step."""
    w, m, v, g = (x.double() for x in (w, m, v, g))
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    denom = (v / (1 - B2**STEP)).sqrt() + eps
    return w * (1 - lr * wd) - lr / (1 - B1**STEP) * m / denom, m, v


def _o2_states(w, m, v, scales):
    """fp16 master and second moment, E4M3 first moment, each stored as ``x * scale``; 0-dim fp32 scales, amaxes."""
    stored = [(w * scales[0]).half(), (m * scales[1]).to(E4M3), (v * scales[2]).half()]
    return stored, [torch.tensor(float(s)) for s in scales], [x.abs().max().float() for x in (w, m, v)]


def _to_device(*lists):
    return ([x.to(DEVICE) for x in xs] for xs in lists)


def _step(stored, scales, amaxes, g, **kw):
    p, m, v = stored
    adamw.adamw_step([p], [g], [m], [v], [tuple(scales)], [tuple(amaxes)], None, lr=LR, beta1=B1, beta2=B2,
                     weight_decay=WD, step=STEP, **kw)  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the masked lanes' 0 / 0
def test_a_ragged_tensor_stepped_with_eps_zero_gets_its_elements_amax_and_scale():
    """eps = 0 is a valid AdamW setting (torch.optim.AdamW takes it). The lanes past a ragged tensor's end compute
    0 / (sqrt(0) + 0) = NaN: the amax must fold only the tensor's elements, else the master's amax reads inf and its
    new scale stays the old one."""
    gen = torch.Generator().manual_seed(3)
    w, m = torch.randn(N, generator=gen) * 0.05, torch.randn(N, generator=gen) * 1e-3
    v = torch.rand(N, generator=gen) * 1e-5 + 1e-6
    g = torch.randn(N, generator=gen) * 1e-2
    stored, scales, amaxes = _o2_states(w, m, v, [2.0**8, 2.0**14, 2.0**20])  # scales far from the fresh ones
    w_in, m_in, v_in = stored[0].double() / 2.0**8, stored[1].double() / 2.0**14, stored[2].double() / 2.0**20
    stored, scales, amaxes = _to_device(stored, scales, amaxes)
    _step(stored, scales, amaxes, g.to(DEVICE), eps=0.0, two_pass=True)
    w64, m64, v64 = _adamw64(w_in, m_in, v_in, g, eps=0.0)
    for got, want in zip(amaxes, (w64, m64, v64), strict=True):
        assert math.isfinite(got.item())
        assert got.item() == pytest.approx(want.abs().max().item(), rel=1e-5)
    assert scales[0].item() == _pow2_scale(w64.abs().max().item(), 65504.0)
    torch.testing.assert_close((stored[0].double() / scales[0].double()).cpu(), w64, rtol=2**-10, atol=0)


def test_the_emitted_copy_counts_a_weight_landing_on_the_fp8_max_as_saturated():
    """With lr = 0 the step leaves an fp32 master as it is, so its FP8 copy is the forward's cast of the weight: scale
    ``2 ** floor(log2(448 / amax))``; an amax of 1.75 * 2**-3 lands exactly on 448, which the forward's cast counts
    as saturated (``>=``, kernels/reference.py), here 3 elements (+-amax) of N."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(N, generator=gen) * 0.05
    w[[10, 500, 999]] = torch.tensor([0.21875, -0.21875, 0.21875])  # 1.75 * 2**-3, the last in the masked chunk
    p, m, v = w.clone().to(DEVICE), torch.zeros(N).to(DEVICE), torch.full((N,), 1e-4).to(DEVICE)
    fp8 = torch.full((N,), float("nan"), dtype=E4M3).to(DEVICE)
    record = torch.zeros(5, dtype=torch.int64).to(DEVICE)
    adamw.adamw_step([p], [torch.randn(N, generator=gen).to(DEVICE)], [m], [v], None, None, None, lr=0.0, beta1=B1,
                     beta2=B2, eps=1e-8, weight_decay=0.0, step=STEP, fp8_weights=[fp8],
                     fp8_weight_stats=[record])  # fmt: skip
    p, fp8, record = p.cpu(), fp8.cpu(), record.cpu()
    assert torch.equal(p, w)
    scale = _pow2_scale(0.21875, 448.0)
    want = (w.double() * scale).clamp(-448, 448).to(E4M3)
    assert torch.equal(fp8.view(torch.uint8), want.view(torch.uint8))
    floats, counts = reference_adamw.fp8_weight_record_views(record)
    n_sat = int(((w.double() * scale).abs() >= 448).sum())
    assert n_sat == 3
    assert floats.tolist() == pytest.approx([1 / scale, 0.21875, scale, n_sat / N, 0.21875], rel=1e-7)
    assert counts.tolist() == [0, 1]


def test_a_first_moment_whose_scale_changes_is_stored_to_nearest():
    """The first moment's decay-progress rule (a code that rounds back to its old byte though the value fell half a
    decay toward zero steps one code toward zero) holds only while the scale stays (kernels/reference_adamw.py:
    ``decay_progress_ref``; a new scale moves every value anyway). Here the fresh amax 0.2 moves the scale from
    2**12 to 2**11 and every other element lands on its old byte at 0.947 of it: stored to nearest, they keep it."""
    codes = torch.tensor([1.125 * 2.0**e * s for e in range(-2, 6) for s in (1, -1)])  # E4M3 values, 1.125 * 2**e
    k = codes.numel()
    m_old = codes / 2.0**12
    m_target = torch.cat([0.947 * codes / 2.0**11, torch.tensor([0.2])])
    m_old = torch.cat([m_old, torch.tensor([0.0])])
    g = (m_target - B1 * m_old) / (1 - B1)  # the gradient that takes m to its target
    n = k + 1
    w, v = torch.full((n,), 0.01), torch.full((n,), 1e-2)
    stored, scales, amaxes = _o2_states(w, m_old, v, [2.0**16, 2.0**12, 2.0**12])
    assert torch.equal(stored[1].float() / 2.0**12, m_old)
    stored, scales, amaxes = _to_device(stored, scales, amaxes)
    _step(stored, scales, amaxes, g.to(DEVICE), eps=1e-8, two_pass=True)
    stored = [x.cpu() for x in stored]
    m64 = B1 * m_old.double() + (1 - B1) * g.double()
    assert scales[1].item() == _pow2_scale(m64.abs().max().item(), 448.0) == 2.0**11
    want = (m64 * 2.0**11).to(E4M3)
    assert torch.equal(stored[1][:k].view(torch.uint8), codes.to(E4M3).view(torch.uint8))  # its old bytes
    assert torch.equal(stored[1].view(torch.uint8), want.view(torch.uint8))


def test_the_emitted_copy_of_a_weight_holding_inf_counts_only_finite_values_as_saturated():
    """An fp32 master holding inf (lr = 0 keeps it): the copy's amax is inf, so the forward's cast keeps scale 1
    (the weight's), writes NaN for the inf and counts the finite values with ``|x| >= 448`` as saturated, not the
    inf (kernels/reference.py: ``n_saturated`` counts finite elements); the record flags one non-finite cast."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(N, generator=gen) * 300.0
    w[997] = float("inf")
    p, m, v = w.clone().to(DEVICE), torch.zeros(N).to(DEVICE), torch.full((N,), 1e-4).to(DEVICE)
    fp8, record = torch.zeros(N, dtype=E4M3).to(DEVICE), torch.zeros(5, dtype=torch.int64).to(DEVICE)
    adamw.adamw_step([p], [torch.randn(N, generator=gen).to(DEVICE)], [m], [v], None, None, None, lr=0.0, beta1=B1,
                     beta2=B2, eps=1e-8, weight_decay=0.0, step=STEP, fp8_weights=[fp8],
                     fp8_weight_stats=[record])  # fmt: skip
    fp8, record = fp8.cpu(), record.cpu()
    finite = w.isfinite()
    want = w.double().clamp(-448, 448).to(E4M3)
    assert torch.equal(fp8.view(torch.uint8)[finite], want.view(torch.uint8)[finite]) and fp8[997].float().isnan()
    floats, counts = reference_adamw.fp8_weight_record_views(record)
    n_sat = int(((w.abs() >= 448) & finite).sum())
    assert 0 < n_sat < N - 1
    assert floats[3].item() == pytest.approx(n_sat / N, rel=1e-7)
    assert counts.tolist() == [1, 1]


def _lists(n=N):
    gen = torch.Generator().manual_seed(9)
    w, m, v = torch.randn(n, generator=gen) * 0.05, torch.randn(n, generator=gen) * 1e-3, torch.full((n,), 1e-4)
    stored, scales, amaxes = _o2_states(w, m, v, [2.0**10, 2.0**16, 2.0**16])
    g = torch.randn(n, generator=gen) * 1e-2
    return stored, scales, amaxes, g


def test_a_one_pass_step_without_a_bound_on_the_update_is_refused():
    """The one-pass scales bound the update by ``|m| <= K sqrt(v)``, true only for ``beta1**2 < beta2``
    (reference_adamw.AdamWConstants); beyond it there is no bound and the kernel refuses, before writing anything."""
    (p, m, v), scales, amaxes, g = _lists()
    before = p.clone()
    with pytest.raises(ValueError, match=r"beta1\*\*2 < beta2"):
        adamw.adamw_step([p], [g], [m], [v], [tuple(scales)], [tuple(amaxes)], None, lr=LR, beta1=0.99, beta2=0.98,
                         eps=1e-8, weight_decay=WD, step=STEP, two_pass=False, grad_amaxes=[g.abs().max()])  # fmt: skip
    assert torch.equal(p, before)


def test_a_one_pass_fp8_weight_copy_without_the_amaxes_is_refused():
    """A one-pass copy's scale comes from a bound on the master's new amax, built from its stored amax: without
    ``amaxes`` there is none (the table would hold no address to read it from), so the step refuses."""
    gen = torch.Generator().manual_seed(4)
    p, m, v, g = torch.randn(N, generator=gen), torch.zeros(N), torch.full((N,), 1e-4), torch.randn(N, generator=gen)
    fp8, record = torch.zeros(N, dtype=E4M3), torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs the amaxes"):
        adamw.adamw_step([p], [g], [m], [v], None, None, None, lr=LR, beta1=B1, beta2=B2, eps=1e-8, weight_decay=WD,
                         step=STEP, two_pass=False, grad_amaxes=[g.abs().max()], fp8_weights=[fp8],
                         fp8_weight_stats=[record])  # fmt: skip


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
def test_a_step_over_no_tensors_does_nothing(two_pass):
    """A param group whose params all lack gradients steps over empty lists: nothing to launch, no error."""
    adamw.adamw_step([], [], [], [], [], [], None, lr=LR, beta1=B1, beta2=B2, eps=1e-8, weight_decay=WD, step=STEP,
                     two_pass=two_pass, grad_amaxes=[])  # fmt: skip


def test_fp16_states_without_scales_step_as_plain_fp16():
    """``scales=None``: every state is stored as is, in its own dtype, fp16 included (reference_adamw.adamw_step_ref
    scales a state only when scales are given): the fp16 result of AdamW in float64."""
    gen = torch.Generator().manual_seed(6)
    w, m = (torch.randn(N, generator=gen) * 0.05).half(), (torch.randn(N, generator=gen) * 1e-2).half()
    v, g = (torch.rand(N, generator=gen) * 1e-3 + 1e-4).half(), torch.randn(N, generator=gen) * 1e-2
    p, m1, v1 = w.clone().to(DEVICE), m.clone().to(DEVICE), v.clone().to(DEVICE)
    adamw.adamw_step([p], [g.to(DEVICE)], [m1], [v1], None, None, None, lr=LR, beta1=B1, beta2=B2, eps=1e-8,
                     weight_decay=WD, step=STEP)  # fmt: skip
    w64, m64, v64 = _adamw64(w, m, v, g, eps=1e-8)
    for got, want in ((p, w64), (m1, m64), (v1, v64)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=2**-10, atol=2**-24)


@pytest.mark.parametrize("which", ["params", "grads", "exp_avgs", "exp_avg_sqs"])
def test_a_non_contiguous_tensor_is_refused(which):
    """The kernel walks each tensor as one flat run of elements from its address: a strided view (a transpose) would
    be read and written in the wrong order, so the step refuses it, naming the list."""
    gen = torch.Generator().manual_seed(8)
    lists = {name: [torch.randn(17, 33, generator=gen).abs() * 1e-2 + 1e-4] for name in
             ("params", "grads", "exp_avgs", "exp_avg_sqs")}  # fmt: skip
    lists[which] = [lists[which][0].t().contiguous().t()]  # same shape, column-major
    assert not lists[which][0].is_contiguous()
    with pytest.raises(ValueError, match=f"{which} must be contiguous"):
        adamw.adamw_step(*lists.values(), None, None, None, lr=LR, beta1=B1, beta2=B2, eps=1e-8, weight_decay=WD,
                         step=STEP)  # fmt: skip
