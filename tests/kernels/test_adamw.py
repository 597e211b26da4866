"""The multi-tensor AdamW Triton kernel against its PyTorch reference: bit for bit (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch
from lightning_fp8.kernels import adamw, reference, reference_adamw

from lightning_fp8.formats import E4M3, E5M2
from lightning_fp8.scaling import compute_scale

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
SHAPES = [(37, 19), (130,), (3, 5, 7)]  # not powers of two; one spans several interpreter chunks
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "step": 3}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tests run thousands of tiny ops; an intra-op thread pool only adds contention (10-40x slower measured on
    # a loaded 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _make(device, shapes, dtypes, *, scaled, fp8_grads, copies, copy_dtype=BF16):
    """Random states of a few steps into training, stored as the optimizer stores them."""
    p_dt, m_dt, v_dt, g_dt = dtypes
    tensors = []
    for shape in shapes:
        w, m = torch.randn(shape) * 0.05, torch.randn(shape) * 1e-3
        v, g = torch.rand(shape) * 1e-5 + 1e-9, torch.randn(shape) * 1e-2
        scales = [torch.tensor(2.0**k) for k in (16, 10, 20)]
        amaxes = [x.abs().max() for x in (w, m, v)]

        def stored(x, dt, s):
            return (x * s).to(dt) if scaled and dt in reference_adamw.SCALED_STATE_MAX else x.to(dt)

        tensors.append(
            {
                "p": stored(w, p_dt, scales[0]),
                "m": stored(m, m_dt, scales[1]),
                "v": stored(v, v_dt, scales[2]),
                "g": (g * 2**10).to(g_dt) if fp8_grads else g.to(g_dt),
                "scales": scales,
                "amaxes": amaxes,
                "gsi": torch.tensor(2.0**-10),
                "gamax": (g * 2**10).abs().max() * 2.0**-10 if fp8_grads else g.abs().max(),
                "copy": torch.zeros(shape, dtype=copy_dtype),
            }
        )
    return [{k: (v.to(device) if torch.is_tensor(v) else [x.to(device) for x in v]) for k, v in t.items()}
            for t in tensors]  # fmt: skip


def _run(fn, tensors, *, scaled, fp8_grads, copies, two_pass, grad_unscale=0.5, prepare=None, **extra):
    """One step of ``fn`` (kernel or reference) on copies of ``tensors``; ``prepare(t)`` adds per-tensor outputs and
    returns the extra keyword arguments that take them."""
    t = [{k: (v.clone() if torch.is_tensor(v) else [x.clone() for x in v]) for k, v in d.items()} for d in tensors]
    outputs = prepare(t) if prepare is not None else {}
    fn(
        [d["p"] for d in t], [d["g"] for d in t], [d["m"] for d in t], [d["v"] for d in t],
        [tuple(d["scales"]) for d in t] if scaled else None,
        [tuple(d["amaxes"]) for d in t] if scaled else None,
        [d["gsi"] for d in t] if fp8_grads else None,
        **{**HYPER, **extra}, grad_unscale=grad_unscale, two_pass=two_pass, grad_amaxes=[d["gamax"] for d in t],
        param_copies=[d["copy"] for d in t] if copies else None, **outputs,
    )  # fmt: skip
    return t


def _assert_same(a, b):
    # Bit for bit; any NaN equals any NaN (a NaN's payload carries no information).
    for x, y in zip(a, b, strict=True):
        for key in x:
            xs, ys = (x[key], y[key]) if isinstance(x[key], list) else ([x[key]], [y[key]])
            for u, w in zip(xs, ys, strict=True):
                nan = u.float().isnan()
                assert torch.equal(nan, w.float().isnan()), key
                assert torch.equal(_bits(u)[~nan], _bits(w)[~nan]), (key, (u.float() - w.float()).abs().max())


CASES = {
    # (param, exp_avg, exp_avg_sq, grad), scaled, fp8 grads, bf16 copies
    "o2_fp8_grad": ((F16, E4M3, F16, E5M2), True, True, False),
    "o2_fp16_grad": ((F16, E4M3, F16, F16), True, False, False),
    "o2_e5m2_moment_fp32_grad": ((F16, E5M2, F16, F32), True, False, False),
    # O2 with the fp16 master kept apart from the weight (FP8AdamW.release_weights(), FSDP2 shards)
    "o2_master_apart": ((F16, E4M3, F16, E5M2), True, True, True),
    "fp32": ((F32, F32, F32, F32), False, False, False),
    "fp32_master_bf16_param": ((F32, F32, F32, BF16), False, False, True),
    # FP8AdamW(low_precision_moments="all"): a high-precision master (its scale unused) with scaled moments
    "moments_only": ((F32, E4M3, F16, F32), True, False, False),
    "moments_only_bf16_param": ((F32, E4M3, F16, BF16), True, False, True),
    # O1: fp32 master and moments, the FP8Linear weights' gradients held in FP8 (FP8AdamW's fp8_grads)
    "o1_fp8_grad": ((F32, F32, F32, E5M2), False, True, False),
    "o1_fp8_grad_bf16_param": ((F32, F32, F32, E5M2), False, True, True),
}


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_bit_for_bit(case, two_pass):
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": two_pass}
    expected = _run(reference_adamw.adamw_step_ref, tensors, **kw)
    actual = _run(adamw.adamw_step, tensors, **kw)
    _assert_same(expected, actual)
    # The step did something: weights moved and (scaled) scales are powers of two.
    assert not torch.equal(_bits(expected[0]["p"]), _bits(tensors[0]["p"]))
    for d in expected:
        for s in d["scales"]:
            assert torch.frexp(s).mantissa.item() == 0.5


@pytest.mark.parametrize("copy_dtype", [BF16, F32])
@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("step", [adamw.adamw_step, reference_adamw.adamw_step_ref], ids=["kernel", "reference"])
def test_a_weight_kept_apart_from_its_scaled_master_is_the_stored_master(step, two_pass, copy_dtype):
    """The copy held the unrounded update while the fp16 master held its rounding: a model state dict and the
    optimizer's disagreed by up to an fp16 ulp, and a run resumed from them (the master put back into the weight) left
    the uninterrupted one's path."""
    dtypes, scaled, fp8_grads, copies = CASES["o2_master_apart"]
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies, copy_dtype=copy_dtype)
    for d in _run(step, tensors, scaled=scaled, fp8_grads=fp8_grads, copies=copies, two_pass=two_pass):
        stored = d["p"].float() / d["scales"][0]  # exact: a power-of-two scale
        assert torch.equal(_bits(d["copy"]), _bits(stored.to(copy_dtype)))
        assert not torch.equal(d["copy"], torch.zeros_like(d["copy"]))


def _spoil(tensors, case):
    """Edge cases on top of _make's states: "saturating" (stored amaxes far too small, so the one-pass scales
    overflow every state), "non_finite" (inf, -inf and NaN gradients) or "infinite" (inf and -inf only)."""
    for d in tensors:
        if case == "saturating":
            d["amaxes"] = [a * 1e-6 for a in d["amaxes"]]
        else:  # "non_finite"; "infinite": no NaN, so the gradient's amax is inf, not NaN
            bad = [float("inf"), -float("inf"), float("nan") if case.startswith("non_finite") else 1.0]
            d["g"].view(-1)[:3] = torch.tensor(bad, dtype=d["g"].dtype)
            d["gamax"] = d["g"].float().abs().amax()
    return tensors


# Non-finite FP8 gradients too: under the interpreter the kernel decodes FP8 bytes itself (adamw_kernels._widen; the
# interpreter's conversion read NaN and inf as finite numbers, found by a sweep).
EDGE_CASES = {"saturating": "o2_fp8_grad", "non_finite": "o2_fp16_grad", "infinite": "o2_fp16_grad",
              "non_finite_fp8": "o2_fp8_grad", "infinite_fp8": "o2_fp8_grad"}  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy under the interpreter: 0 / 0
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_kernel_matches_reference_when_saturating_or_non_finite(case):
    dtypes, scaled, fp8_grads, copies = CASES[EDGE_CASES[case]]
    tensors = _spoil(_make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies), case)
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": False}
    expected = _run(reference_adamw.adamw_step_ref, tensors, **kw)
    _assert_same(expected, _run(adamw.adamw_step, tensors, **kw))
    if case == "saturating":  # the case does what it says
        assert (expected[0]["m"].float().abs() == 448.0).any() and (expected[0]["v"].float() == 65504.0).any()
    else:
        assert expected[0]["p"].float().isnan().any() and expected[0]["amaxes"][0].isinf()
        for before, after in zip(tensors, expected, strict=True):  # the second moment keeps its scale: the other
            assert torch.equal(after["scales"][2], before["scales"][2])  # elements keep their values (not flushed)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy under the interpreter: 0 / 0
@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize(("case", "byte"), [("o2_fp8_grad", 0x7F), ("o2_fp8_grad", 0xFF),
                                            ("o2_e5m2_moment_fp32_grad", 0x7C), ("o2_e5m2_moment_fp32_grad", 0xFC),
                                            ("o2_e5m2_moment_fp32_grad", 0x7E)])  # fmt: skip
def test_a_first_moment_stored_non_finite_gives_the_references_step(case, byte, two_pass):
    """An FP8 first moment holding NaN (E4M3 0x7F, 0xFF; E5M2 0x7E) or E5M2's inf (0x7C, 0xFC) bytes: the interpreter
    decoded them as finite numbers (found by a sweep: the weights took a large finite step where the reference makes
    them NaN)."""
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    for d in tensors:
        d["m"].view(torch.uint8).view(-1)[1] = byte
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": two_pass}
    expected = _run(reference_adamw.adamw_step_ref, tensors, **kw)
    _assert_same(expected, _run(adamw.adamw_step, tensors, **kw))
    assert all(d["p"].float().view(-1)[1].isnan() for d in expected)  # the case does what it says


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", ["o2_e5m2_moment_fp32_grad", "moments_only"])
def test_a_finite_gradient_whose_square_overflows_fp32_keeps_every_state_finite(case, two_pass, device):
    """|g| > 1.8e19 (finite in fp32: an fp32 ``fp8_params`` gradient, an embedding's at
    ``low_precision_moments="all"``): g * g overflowed to inf, the scaled store wrote the second moment as NaN (the
    mark of a non-finite input) and the next step spread it into the weights. Now such a gradient saturates at
    +-2**63 before either moment takes it: every state stays finite, the huge elements step against their gradient's
    sign, and the second moment's scale drops to hold them."""
    dtypes, scaled, fp8_grads, copies = CASES[case]
    tensors = _make(device, [*SHAPES, (1000, 333)] if device == "cuda" else SHAPES, dtypes, scaled=scaled,
                    fp8_grads=fp8_grads, copies=copies)  # fmt: skip
    huge = torch.tensor([1e20, -3e19, 2e19], device=device)
    for d in tensors:
        d["g"].view(-1)[:3] = huge
        d["gamax"] = d["g"].abs().amax()
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": two_pass}
    expected = _run(reference_adamw.adamw_step_ref, tensors, **kw)
    _assert_same(expected, _run(adamw.adamw_step, tensors, **kw))
    for before, after in zip(tensors, expected, strict=True):
        for key in ("p", "m", "v"):
            assert torch.isfinite(after[key].float()).all(), key
        w0 = before["p"].float() / (before["scales"][0] if dtypes[0] == F16 else 1.0)
        w1 = after["p"].float() / (after["scales"][0] if dtypes[0] == F16 else 1.0)
        assert torch.equal(torch.sign(w1 - w0).view(-1)[:3], -torch.sign(huge))
        assert after["scales"][2] < 2.0**-100  # fits v ~ 1e35 into fp16's 65504


@pytest.mark.parametrize(
    "config",
    [{"BLOCK": 32, "ITERS": 3, "NUM_WARPS": 1}, {"BLOCK": 128, "ITERS": 1, "NUM_WARPS": 1}],
    ids=["one_per_thread", "four_per_thread_single_step"],
)
def test_kernel_launch_configs_and_unaligned_tensors(config, monkeypatch):
    # Other loop shapes than the default interpreter config; tensors that are views 2 bytes off their storage's
    # start, so the launcher must drop the 16-byte alignment hint.
    monkeypatch.setattr(adamw, "_INTERPRETER_CONFIG", config)
    dtypes, scaled, fp8_grads, copies = CASES["o2_fp16_grad"]
    tensors = _make("cpu", SHAPES, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    for d in tensors[:1]:
        for key in ("p", "v", "g"):
            shifted = torch.empty(d[key].numel() + 1, dtype=d[key].dtype)[1:].view(d[key].shape)
            d[key] = shifted.copy_(d[key])
    assert not adamw._table(*(_lists(tensors)), None, None, [t.numel() for t in _lists(tensors)[0]])[2]
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": False}
    _assert_same(_run(reference_adamw.adamw_step_ref, tensors, **kw), _run(adamw.adamw_step, tensors, **kw))


def _lists(tensors):
    return ([d["p"] for d in tensors], [d["g"] for d in tensors], [d["m"] for d in tensors], [d["v"] for d in tensors],
            [tuple(d["scales"]) for d in tensors], [tuple(d["amaxes"]) for d in tensors], None)  # fmt: skip


def _decaying(device, m_dtype, beta1, repeat=1):
    """States whose first moments (m_dtype, scale 2**10) hold every small code of the format, both signs, ``repeat``
    times, and two large values last that fix the tensor's scale; the gradients are zero but for the large values'
    and a few tiny ones."""
    codes = torch.arange(1, 40, dtype=torch.uint8)
    small = torch.cat([codes, codes | 0x80]).view(m_dtype).float() * 2.0**-10  # the stored codes, unscaled
    g_small = torch.zeros_like(small)
    g_small[10:13] = 1e-12  # a gradient far under the first moment's smallest step: the decay still moves it
    m = torch.cat([small.repeat(repeat), torch.tensor([0.3, -0.3])])
    g = torch.cat([g_small.repeat(repeat), torch.tensor([0.3, -0.3])])
    n = m.numel()
    return [{"p": (torch.full((n,), 0.05) * 2.0**16).half(), "m": (m * 2.0**10).to(m_dtype),
             "v": (torch.full((n,), 1e-4) * 2.0**20).half(), "g": g,
             "scales": [torch.tensor(2.0**k) for k in (16, 10, 20)],
             "amaxes": [torch.tensor(0.05), m.abs().max(), torch.tensor(1e-4)], "gsi": torch.tensor(1.0),
             "gamax": g.abs().max(), "copy": torch.zeros(n, dtype=BF16)}]  # fmt: skip


def _decay_steps(device, m_dtype, beta1, steps, two_pass, repeat=1):
    tensors = [{k: (v.to(device) if torch.is_tensor(v) else [x.to(device) for x in v]) for k, v in d.items()}
               for d in _decaying(device, m_dtype, beta1, repeat)]  # fmt: skip
    kw = {"scaled": True, "fp8_grads": False, "copies": False, "two_pass": two_pass, "beta1": beta1}
    history = []
    for _ in range(steps):
        expected = _run(reference_adamw.adamw_step_ref, tensors, **kw)
        _assert_same(expected, _run(adamw.adamw_step, tensors, **kw))
        tensors = expected
        history.append(tensors[0]["m"].float() / tensors[0]["scales"][1])
    return history


@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize(("m_dtype", "beta1"), [(E4M3, 0.9), (E4M3, 0.95), (E5M2, 0.9)])
def test_a_first_moment_whose_gradient_vanished_decays_to_zero(m_dtype, beta1, two_pass):
    # Rounded to nearest, 0.9 k of E4M3's smallest step k <= 4 gave k back: such a first moment never decayed while
    # the second did, and the weight kept moving by m / sqrt(v) (200x torch.optim.AdamW's total after 2000 steps).
    # Now a stored value that the decay alone cannot move steps one code toward zero: every first moment whose
    # gradient is (nearly) zero shrinks at each step and reaches 0, in the kernel as in the reference.
    history = _decay_steps("cpu", m_dtype, beta1, steps=6 if beta1 == 0.9 else 4, two_pass=two_pass)
    decaying = slice(0, -2)
    for before, after in zip(history[:-1], history[1:], strict=True):
        b, a = before[decaying].abs(), after[decaying].abs()
        assert torch.all((a < b) | (b == 0)), "a first moment with a zero gradient did not shrink"
        assert torch.all(torch.sign(after[decaying]) * torch.sign(before[decaying]) >= 0)  # toward zero, not past it


@pytest.mark.parametrize("dtype", [F16, E4M3, E5M2])
def test_reference_scale_equals_compute_scale(dtype):
    fmax = reference_adamw.SCALED_STATE_MAX[dtype]
    amax = torch.cat([torch.rand(50) * 10.0 ** torch.randint(-30, 5, (50,)), torch.tensor([0.0, 1e-42, fmax, 1.0])])
    amax = torch.cat([amax, torch.tensor([float("inf"), float("nan")])])
    prev = torch.full_like(amax, 0.25)
    for margin in (0, 1):
        expected = compute_scale(amax, dtype, margin=margin, prev_scale=prev)
        assert torch.equal(reference.pow2_scale_ref(amax, fmax, margin, prev), expected)


def test_one_pass_scales_bound_the_new_amax():
    # A gradient spike far above what the stored moments have seen: the one-pass write must not saturate (its scale
    # comes from an upper bound of the new amax) and is at most a little more conservative than the fresh scale.
    dtypes = (F16, E4M3, F16, F32)
    tensors = _make("cpu", [(40, 24)], dtypes, scaled=True, fp8_grads=False, copies=False)
    tensors[0]["g"][3, 5] = 50.0
    tensors[0]["gamax"] = tensors[0]["g"].abs().max()
    kw = {"scaled": True, "fp8_grads": False, "copies": False}
    fresh = _run(adamw.adamw_step, tensors, two_pass=True, **kw)[0]
    bound = _run(adamw.adamw_step, tensors, two_pass=False, **kw)[0]
    for j, dtype in enumerate((F16, E4M3, F16)):
        assert torch.equal(fresh["amaxes"][j], bound["amaxes"][j])  # both leave the fresh amax behind
        fmax = reference_adamw.SCALED_STATE_MAX[dtype]
        assert bound["amaxes"][j] * bound["scales"][j] <= fmax  # never saturates
        assert fresh["scales"][j] / 4 <= bound["scales"][j] <= fresh["scales"][j]  # at most two binades lower
    assert (bound["m"].float().abs() == 448.0).sum() == 0


def test_one_pass_master_bound_when_weight_decay_flips_the_sign(monkeypatch):
    # lr * weight_decay > 1 (valid for torch's AdamW): the decayed weight is 1 - lr * weight_decay < 0 times the old
    # one. The bound used decay itself (negative), below the new amax: the fp16 master saturated
    # at 65504 / scale. Now |decay|: no saturation, the same scales as two passes up to the bound's slack, and the
    # kernel still the reference bit for bit.
    monkeypatch.setitem(HYPER, "lr", 0.5)
    monkeypatch.setitem(HYPER, "weight_decay", 7.0)  # decay = 1 - 3.5 = -2.5
    tensors = _make("cpu", [(40, 24)], (F16, E4M3, F16, F32), scaled=True, fp8_grads=False, copies=False)
    d = tensors[0]  # weights of amax ~20 stored at scale 2**11 (~40000 of fp16's 65504): decayed, 2.5 times that
    d["scales"][0] = torch.tensor(2.0**11)
    d["p"] = (d["p"].float() * 2**-16 * 100 * 2**11).half()
    d["amaxes"][0] = (d["p"].float() * 2**-11).abs().max()
    kw = {"scaled": True, "fp8_grads": False, "copies": False}
    fresh = _run(adamw.adamw_step, tensors, two_pass=True, **kw)[0]
    bound = _run(adamw.adamw_step, tensors, two_pass=False, **kw)[0]
    _assert_same([_run(reference_adamw.adamw_step_ref, tensors, two_pass=False, **kw)[0]], [bound])
    assert bound["amaxes"][0] * bound["scales"][0] <= 65504.0
    assert fresh["scales"][0] / 4 <= bound["scales"][0] <= fresh["scales"][0]
    want = fresh["p"].float() / fresh["scales"][0]  # two passes: the fresh amax's scale, never clamped
    got = bound["p"].float() / bound["scales"][0]
    assert (got - want).abs().max() <= 2**-8 * want.abs().max()  # fp16 rounding at scales <= 2 binades apart


def test_one_pass_needs_gradient_amaxes():
    tensors = _make("cpu", [(8, 8)], (F16, E4M3, F16, F32), scaled=True, fp8_grads=False, copies=False)[0]
    with pytest.raises(ValueError, match="grad_amaxes"):
        adamw.adamw_step([tensors["p"]], [tensors["g"]], [tensors["m"]], [tensors["v"]], [tuple(tensors["scales"])],
                         [tuple(tensors["amaxes"])], None, **HYPER, two_pass=False)  # fmt: skip


def test_kernel_rejects_mismatched_lists():
    p = [torch.zeros(4, dtype=F32)]
    with pytest.raises(ValueError, match="exp_avgs has 0 tensors"):
        adamw.adamw_step(p, p, [], p, None, None, None, **HYPER)
    with pytest.raises(ValueError, match="share one dtype"):
        adamw.adamw_step(p * 2, [p[0], p[0].half()], p * 2, p * 2, None, None, None, **HYPER)


@pytest.mark.parametrize(
    "bad", ["short_copy", "f64_scale", "two_scales", "short_gsi", "vector_amax", "scale_elsewhere", "gsi_elsewhere",
            "grad_elsewhere", "copy_elsewhere"],
)  # fmt: skip
def test_kernel_refuses_what_it_would_read_or_write_out_of_place(bad):
    """The kernel reads and writes every tensor by its address: a copy smaller than its param was written past its end,
    a float64 scale read as fp32 bits (NaN weights), a scale or gradient scale_inv on another device (the meta device
    here; a CPU scale beside CUDA params) read from an address of other memory (found by a sweep: a segmentation
    fault); now each is refused before the launch, nothing written."""
    tensors = _make("cpu", [(8,)], (F16, E4M3, F16, E5M2), scaled=True, fp8_grads=True, copies=True)[0]
    scales, amaxes, gsi, copy = list(tensors["scales"]), list(tensors["amaxes"]), [tensors["gsi"]], tensors["copy"]
    if bad == "short_copy":
        copy = torch.full((12,), 7.0, dtype=BF16)[:4]
    elif bad == "f64_scale":
        scales[0] = scales[0].double()
    elif bad == "two_scales":
        scales = scales[:2]
    elif bad == "short_gsi":
        gsi = []
    elif bad == "scale_elsewhere":
        scales[1] = scales[1].to("meta")
    elif bad == "gsi_elsewhere":
        gsi = [gsi[0].to("meta")]
    elif bad == "grad_elsewhere":
        tensors["g"] = tensors["g"].to("meta")
    elif bad == "copy_elsewhere":
        copy = copy.to("meta")
    else:
        amaxes[1] = amaxes[1].expand(2)
    before = [t.clone() for t in (tensors["p"], tensors["m"], tensors["v"], copy)]
    with pytest.raises(ValueError, match="adamw_step"):
        adamw.adamw_step([tensors["p"]], [tensors["g"]], [tensors["m"]], [tensors["v"]], [tuple(scales)],
                         [tuple(amaxes)], gsi, **HYPER, grad_amaxes=[tensors["gamax"]],
                         param_copies=[copy])  # fmt: skip
    for t, b in zip((tensors["p"], tensors["m"], tensors["v"], copy), before, strict=True):
        assert t.is_meta or torch.equal(_bits(t), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("two_pass", [True, False], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_on_gpu(case, two_pass):
    dtypes, scaled, fp8_grads, copies = CASES[case]
    shapes = [*SHAPES, (1000, 333)]
    tensors = _make("cuda", shapes, dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": two_pass}
    _assert_same(_run(reference_adamw.adamw_step_ref, tensors, **kw), _run(adamw.adamw_step, tensors, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize(("m_dtype", "beta1"), [(E4M3, 0.9), (E4M3, 0.95), (E5M2, 0.9)])
def test_a_first_moment_whose_gradient_vanished_decays_to_zero_on_gpu(m_dtype, beta1):
    # Each step: the kernel against the reference; 1000 repeats span several whole (unmasked) blocks of the kernel.
    for two_pass in (False, True):
        _decay_steps("cuda", m_dtype, beta1, steps=6, two_pass=two_pass, repeat=1000)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_kernel_matches_reference_on_gpu_when_saturating_or_non_finite(case):
    # The GPU path differs from the interpreter's here: cvt.rn.satfinite saturates FP8 and writes NaN itself.
    dtypes, scaled, fp8_grads, copies = CASES["o2_fp8_grad"]
    tensors = _make("cuda", [*SHAPES, (1000, 333)], dtypes, scaled=scaled, fp8_grads=fp8_grads, copies=copies)
    kw = {"scaled": scaled, "fp8_grads": fp8_grads, "copies": copies, "two_pass": False}
    tensors = _spoil(tensors, case)
    _assert_same(_run(reference_adamw.adamw_step_ref, tensors, **kw), _run(adamw.adamw_step, tensors, **kw))
