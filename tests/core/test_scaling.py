import math
import re

import numpy as np
import pytest
import torch
from lightning_fp8.kernels.reference import cast_to_fp8_ref

from lightning_fp8.formats import E4M3, E5M2, fp8_max
from lightning_fp8.scaling import ScalingState, compute_scale


def _scale_by_definition(amax: float, fmax: float, margin: int) -> float:
    # Independent reference: the largest power of two 2**k with amax * 2**k <= fmax, found in float64.
    k = math.floor(math.log2(fmax / amax))
    while amax * 2.0 ** (k + 1) <= fmax:
        k += 1
    while amax * 2.0**k > fmax:
        k -= 1
    return 2.0 ** (k - margin)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_compute_scale_matches_definition(dtype, margin):
    fmax = fp8_max(dtype)
    amaxes = torch.cat(
        [
            torch.rand(200).mul(40).sub(20).exp2(),  # 2**-20 .. 2**20
            torch.tensor([fmax, fmax / 2, fmax / 4 * 1.0000001, 1.0, 3.0, 1e-30]),
        ]
    )
    for a in amaxes.tolist():
        got = compute_scale(torch.tensor(a), dtype, margin).item()
        assert got == _scale_by_definition(a, fmax, margin), a
        assert a * got <= fmax / 2**margin


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_compute_scale_keeps_previous_for_zero_and_nonfinite(bad):
    prev = torch.tensor(64.0)
    assert compute_scale(torch.tensor(bad), E4M3, 0, prev).item() == 64.0
    assert compute_scale(torch.tensor(bad), E4M3).item() == 1.0


def test_compute_scale_is_elementwise():
    a = torch.tensor([1.0, 448.0, 0.0])
    assert compute_scale(a, E4M3, 0, torch.full((3,), 8.0)).tolist() == [256.0, 1.0, 8.0]


def test_delayed_scaling_uses_history_of_earlier_casts():
    s = ScalingState(E4M3, history_len=3, margin=0, algo="max", delayed=True)
    xs = [torch.randn(32, 48) * m for m in (1.0, 10.0, 0.1, 0.1, 0.1)]
    used = []
    for i, x in enumerate(xs):
        expected_scale = s.scale.clone()
        x_fp8, _, scale_inv = s.quantize(x)
        used.append(1 / scale_inv.item())
        if i == 0:  # empty history: the first cast uses its own amax
            expected_scale = compute_scale(x.abs().amax(), E4M3)
        assert used[-1] == expected_scale.item()
        ref, _, _, _ = cast_to_fp8_ref(x, expected_scale, E4M3)
        assert torch.equal(x_fp8.view(torch.uint8), ref.view(torch.uint8))
    amaxes = [x.abs().amax() for x in xs]
    # After cast 5 the window holds casts 3..5: max over it, not the large amax of cast 2.
    assert s.scale.item() == compute_scale(torch.stack(amaxes[2:]).amax(), E4M3).item()
    assert s.casts.item() == 5 and s.nonfinite_count.item() == 0


def test_most_recent_algo():
    s = ScalingState(E5M2, history_len=4, margin=0, algo="most_recent", delayed=True)
    s.quantize(torch.randn(16, 16) * 100)
    small = torch.randn(16, 16) * 0.01
    s.quantize(small)
    assert s.scale.item() == compute_scale(small.abs().amax(), E5M2).item()


def test_current_scaling_uses_own_amax():
    s = ScalingState(E4M3, history_len=4, margin=1, algo="max", delayed=False)
    for m in (1.0, 1000.0, 0.001):
        x = torch.randn(20, 24) * m
        _, _, scale_inv = s.quantize(x)
        assert 1 / scale_inv.item() == compute_scale(x.abs().amax(), E4M3, 1).item()


def test_nonfinite_amax_keeps_scale_and_is_counted():
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True)
    s.quantize(torch.randn(8, 16))
    scale_before, history_before = s.scale.clone(), s.amax_history.clone()
    x = torch.randn(8, 16)
    x[3, 5] = float("nan")
    x_fp8, _, _ = s.quantize(x)
    assert torch.isnan(x_fp8.float()[3, 5])
    assert s.nonfinite_count.item() == 1
    assert s.amax_history[0].item() == 0.0  # not recorded as information
    assert torch.equal(s.amax_history[1:], history_before[:-1])  # the window rolls: ranks' histories stay aligned
    assert s.scale.item() == scale_before.item()
    x[3, 5] = float("inf")
    s.quantize(x)
    assert s.nonfinite_count.item() == 2 and torch.isfinite(s.scale)


def test_saturation_fraction_recorded():
    s = ScalingState(E4M3, history_len=2, margin=0, algo="max", delayed=True)
    s.quantize(torch.randn(10, 10) * 0.01)  # scale adapts to tiny values
    x = torch.randn(10, 10) * 0.01
    x[0, :4] = 1000.0  # far above what the delayed scale can represent
    x_fp8, _, _ = s.quantize(x)
    assert s.saturation.item() == pytest.approx(0.04)
    assert x_fp8.float()[0, :4].eq(448.0).all()


def test_zero_tensor_keeps_scale():
    s = ScalingState(E4M3, history_len=2, margin=0, algo="max", delayed=False)
    s.quantize(torch.randn(4, 16))
    before = s.scale.item()
    x_fp8, _, _ = s.quantize(torch.zeros(4, 16))
    assert s.scale.item() == before and x_fp8.float().eq(0).all()


@pytest.mark.parametrize(
    "first", [torch.randn(0, 16), torch.zeros(8, 16), torch.full((8, 16), float("inf")), torch.full((8, 16), math.nan)],
    ids=["empty", "zeros", "inf", "nan"],
)
def test_a_cast_without_information_does_not_use_up_the_first_cast(first):
    """An empty or all-zero tensor has amax 0 and a non-finite one enters the history as 0: none tells a scale, and
    the next delayed cast is still the first with data, with its own amax (a history of zeros would keep scale 1,
    flushing 1e-4 to 0)."""
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True)
    s.quantize(first, transpose=first.numel() == 0)
    assert not s.initialized and s.casts.item() == 1
    x = torch.randn(8, 16) * 1e-4
    x_fp8, _, scale_inv = s.quantize(x)
    expected = _scale_by_definition(x.abs().amax().item(), fp8_max(E4M3), 0)
    assert 1 / scale_inv.item() == expected and s.initialized
    ref, _, _, _ = cast_to_fp8_ref(x, torch.tensor(expected), E4M3)
    assert torch.equal(x_fp8.view(torch.uint8), ref.view(torch.uint8))


def test_a_history_synced_from_other_ranks_initializes_the_state():
    """Data parallel with enable_fp8_amax_sync: a rank whose own casts saw only zeros holds the other ranks' amaxes
    in its history after a sync; its next cast must take the shared delayed scale as theirs do, not its own amax."""
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True)
    s.quantize(torch.zeros(8, 16))
    assert not s.initialized
    s.amax_history[1] = 4e-3  # what the MAX all-reduce of the histories leaves
    s.quantize(torch.zeros(8, 16))
    assert s.initialized and not s.needs_current_scale()


@pytest.mark.gpu
def test_first_cast_rule_reads_amaxes_without_a_device_sync():
    """On a GPU the rule reads the amax without waiting (a role that sees only zeros, e.g. the output gradient of an
    auxiliary head weighted 0, would sync the device at every cast): the read is taken by a later cast once it
    arrived, and until then the casts keep their own amax."""
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True, device="cuda")
    x = torch.randn(64, 64, device="cuda") * 1e-4
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        for _ in range(3):
            s.quantize(torch.zeros(64, 64, device="cuda"))
            assert s.needs_current_scale()  # zeros: still its own amax
        s.quantize(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()  # the read has arrived: the next cast is delayed, with the history's scale
    assert not s.needs_current_scale() and s.initialized
    x_fp8, _, scale_inv = s.quantize(x)
    assert 1 / scale_inv.item() == _scale_by_definition(x.abs().amax().item(), fp8_max(E4M3), 0)


def test_reset_parameters_starts_over_from_uninitialized_memory():
    """Meta-device materialization calls reset_parameters() after to_empty(): the state is then a fresh one."""
    with torch.device("meta"):
        s = ScalingState(E5M2, history_len=4, margin=0, algo="max", delayed=True)
    s.to_empty(device="cpu")
    s.amax_history.fill_(3.0e30)  # what uninitialized memory may hold
    s.casts.fill_(123)
    s.initialized = True
    s.reset_parameters()
    fresh = ScalingState(E5M2, history_len=4, margin=0, algo="max", delayed=True)
    for name, buf in fresh.named_buffers():
        assert torch.equal(getattr(s, name), buf), name
    assert not s.initialized


# -- a non-finite or zero amax, as a cast records it (pinned against DESIGN.md / docs/concepts/formats.md) ----------


def _state(history_len: int, algo: str = "max", delayed: bool = True, device: str = "cpu") -> ScalingState:
    s = ScalingState(E4M3, history_len=history_len, margin=0, algo=algo, delayed=delayed, device=device)
    s.quantize(torch.full((4, 4), 100.0, device=device))  # its own amax first: scale 2**floor(log2(448 / 100)) = 4
    s.quantize(torch.full((4, 4), 1.0, device=device))
    return s


def _bad(kind: str, device: str = "cpu") -> torch.Tensor:
    x = torch.ones(4, 4, device=device)
    if kind == "zero":
        return torch.zeros(4, 4, device=device)
    x[0, 0] = float(kind)
    return x


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("kind", ["nan", "inf", "zero"])
@pytest.mark.parametrize(("history_len", "algo"), [(2, "max"), (4, "max"), (1, "max"), (4, "most_recent")])
def test_bad_cast_keeps_the_previous_scale(monkeypatch, kernels, kind, history_len, algo):
    """DESIGN.md: an amax of 0 or a non-finite one keeps the previous scale. Window 2, "max", after the casts 100 and
    1: history [1, 100], scale 2**floor(log2(448 / 100)) = 4. The bad cast's slot holds 0 and 100 rolls out (the
    window rolls at every cast, so that the histories of several ranks stay aligned for the amax sync), but the scale
    stays 4: recomputed from the window it would have jumped to 256 right after an overflow. Counted in
    nonfinite_count only when non-finite. The Triton cast (on a GPU, else run by the interpreter) does its
    bookkeeping in its last program."""
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    s = _state(history_len, algo, device=device)
    history, scale = s.amax_history.clone(), s.scale.item()
    assert scale == (4.0 if algo == "max" and history_len > 1 else 256.0)
    _, _, scale_inv = s.quantize(_bad(kind, device))
    assert scale_inv.item() == 1 / scale  # the cast itself used the previous scale
    rolled = ([0.0] + history.tolist())[:history_len]
    assert s.amax_history.tolist() == rolled and s.scale.item() == scale
    assert s.nonfinite_count.item() == (0 if kind == "zero" else 1) and s.casts.item() == 3
    assert s.amax.item() == (0.0 if kind == "zero" else math.inf)  # the cast's own amax is still reported
    s.quantize(torch.full((4, 4), 2.0, device=device))  # the next cast with data computes its scale as usual
    assert s.amax_history.tolist() == ([2.0] + rolled)[:history_len]
    expected = 448 / max(s.amax_history.tolist()) if algo == "max" else 448 / 2.0
    assert s.scale.item() == 2.0 ** math.floor(math.log2(expected))


@pytest.mark.parametrize("kind", ["nan", "inf", "zero"])
def test_bad_cast_under_current_scaling_uses_and_keeps_the_previous_scale(kind):
    s = _state(1, delayed=False)
    assert s.scale.item() == 256.0  # from the last cast's own amax, 1
    _, _, scale_inv = s.quantize(_bad(kind))
    assert scale_inv.item() == 1 / 256.0 and s.scale.item() == 256.0


# -- ScalingState.quantize(unscale=...) -----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["transpose", "column_sum"])
def test_quantize_refuses_a_transposed_or_summed_cast_of_a_tensor_that_is_not_2d_and_changes_nothing(flag):
    s = ScalingState(torch.float8_e4m3fn, 4, 0, "max", delayed=False)
    before = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(ValueError, match=rf"quantize\({flag}=True\) needs a 2-D tensor, got shape \(2, 3, 16\)"):
        s.quantize(torch.randn(2, 3, 16) * 10, **{flag: True})
    assert all(torch.equal(v, s.state_dict()[k]) for k, v in before.items())
    assert not s.initialized


@pytest.mark.parametrize(
    ("delayed", "history_len", "current"),
    [(True, 4, None), (True, 4, False), (True, 1, None), (False, 1, False), (False, 4, None), (True, 4, True)],
)
def test_unscale_is_refused_unless_the_cast_computes_its_own_scale_with_one_history_entry(
    delayed, history_len, current
):
    s = ScalingState(E4M3, history_len=history_len, margin=0, algo="max", delayed=delayed)
    u = torch.tensor(2.0**10)
    with pytest.raises(ValueError, match="unscale"):
        s.quantize(torch.randn(16, 16) * u, current=current, unscale=u)
    assert s.casts.item() == 0 and not s.amax_history.any()  # nothing recorded


@pytest.mark.parametrize("unscale", [torch.tensor([2.0**10, 1.0]), torch.tensor(2.0**10, dtype=torch.float64), 1024.0],
                         ids=["shape_2", "float64", "python_float"])  # fmt: skip
def test_an_unscale_that_is_no_one_element_fp32_tensor_is_refused_before_anything_is_recorded(unscale):
    # Found by a sweep: the reference path broadcast a (2,) unscale only after the state was written; the kernels read
    # its first element, or failed inside Triton on a float64 or a Python number.
    s = ScalingState(E4M3, history_len=1, margin=0, algo="max", delayed=False)
    with pytest.raises(TypeError, match=r"quantize\(unscale=\.\.\.\) must be a one-element float32 tensor"):
        s.quantize(torch.randn(16, 16), unscale=unscale)
    assert s.casts.item() == 0 and not s.amax_history.any()  # nothing recorded


@pytest.mark.parametrize(("delayed", "current"), [(False, None), (False, True), (True, True)])
def test_unscale_describes_t_cast_after_cast(delayed, current):
    """x holds t * u: each cast's scale, statistics and scale_inv are t's, by the definition of the scale."""
    torch.manual_seed(0)
    s = ScalingState(E4M3, history_len=1, margin=0, algo="max", delayed=delayed)
    u = torch.tensor(2.0**10)
    for m in (1.0, 30.0, 0.01):
        t = torch.randn(16, 16) * m
        x_fp8, _, scale_inv = s.quantize(t * u, current=current, unscale=u)
        amax = t.abs().max().item()
        expected = _scale_by_definition(amax, 448.0, 0)
        assert 1 / scale_inv.item() == expected and s.scale.item() == expected
        assert s.amax_history.tolist() == [amax] and s.amax.item() == amax and s.saturation.item() == 0.0
        ref, _, _, _ = cast_to_fp8_ref(t, torch.tensor(expected), E4M3)
        assert torch.equal(x_fp8.view(torch.uint8), ref.view(torch.uint8))


# -- compute_scale's arguments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("margin", "error"), [(1.5, TypeError), (True, TypeError), ("1", TypeError),
                                               (-1, ValueError), (17, ValueError)])  # fmt: skip
def test_compute_scale_refuses_a_bad_margin(margin, error):
    with pytest.raises(error, match="margin"):
        compute_scale(torch.tensor(1.0), E4M3, margin)


@pytest.mark.parametrize("fp8_dtype", [torch.float32, torch.float8_e4m3fnuz, "e4m3"])
def test_compute_scale_refuses_a_format_naming_every_one_it_takes(fp8_dtype):
    # Found by a sweep: the error listed the two FP8 dtypes only, while torch.float16 (scaled fp16 storage) is taken.
    with pytest.raises(ValueError, match=r"compute_scale\(fp8_dtype=.*torch.float8_e5m2 \(E5M2\) or torch.float16"):
        compute_scale(torch.tensor(1.0), fp8_dtype)
    assert compute_scale(torch.tensor(1.0), torch.float16).item() == _scale_by_definition(1.0, 65504.0, 0)


def test_compute_scale_takes_margins_up_to_the_recipes_max():
    from lightning_fp8.recipe import MAX_MARGIN

    assert MAX_MARGIN == 16
    assert compute_scale(torch.tensor(1.0), E4M3, 16).item() == _scale_by_definition(1.0, 448.0, 16)


@pytest.mark.parametrize("amax", [torch.tensor(3), torch.tensor([True]), "3.0", None])
def test_compute_scale_refuses_an_amax_that_is_not_a_float_tensor_or_number(amax):
    with pytest.raises(TypeError, match="amax"):
        compute_scale(amax, E4M3)


@pytest.mark.parametrize("amax", [3.0, 3, 1e-3, 448.000001])
def test_compute_scale_takes_a_python_number(amax):
    got = compute_scale(amax, E4M3)
    assert got.dtype == torch.float32 and got.shape == ()
    assert got.item() == _scale_by_definition(amax, 448.0, 0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 3])
def test_compute_scale_of_a_float64_amax_keeps_the_headroom(dtype, margin):
    """float64 amaxes fp32 cannot hold: rounded up to fp32, so the scale is the definition's for the value given."""
    torch.manual_seed(0)
    fmax = fp8_max(dtype)
    amaxes = torch.rand(300, dtype=torch.float64).mul(40).sub(20).exp2().tolist()
    amaxes += [fmax * (1 + 1e-12), fmax / 2 * (1 + 1e-15), 448.000001, 1 + 2**-40]
    for a in amaxes:
        got = compute_scale(torch.tensor(a, dtype=torch.float64), dtype, margin).item()
        assert got == _scale_by_definition(a, fmax, margin), a
        assert a * got <= fmax / 2**margin, a


def test_compute_scale_of_float64_amaxes_beyond_fp32():
    prev = torch.tensor(8.0)
    # Above fp32's max: inf in fp32, no information: the previous scale.
    assert compute_scale(torch.tensor(1e50, dtype=torch.float64), E4M3, 0, prev).item() == 8.0
    # Below fp32's smallest subnormal: rounded up to it (not to 0): the largest scale, 2**127.
    assert compute_scale(torch.tensor(1e-50, dtype=torch.float64), E4M3, 0, prev).item() == 2.0**127


def test_scaling_state_refuses_a_delayed_flag_that_is_not_a_bool_and_compute_scale_takes_numpy_margins():
    """A sweep found ScalingState(delayed="current") built a delayed state (and fp8_state_dict failed later), and
    compute_scale refusing the NumPy margins FP8Recipe and ScalingState take."""
    np = pytest.importorskip("numpy")
    from lightning_fp8 import E4M3, ScalingState, compute_scale

    for bad in ("current", 1, None):
        with pytest.raises(TypeError, match="must be a bool"):
            ScalingState(E4M3, 4, 0, "max", delayed=bad)
    assert ScalingState(E4M3, 4, 0, "max", delayed=np.bool_(False)).delayed is False
    assert torch.equal(compute_scale(torch.tensor(3.0), E4M3, np.int64(2)), compute_scale(torch.tensor(3.0), E4M3, 2))


@pytest.mark.parametrize("amax", [np.float32(5.0), np.float64(5.0), np.int64(5)])
def test_compute_scale_takes_numpy_numbers(amax):
    assert compute_scale(amax, E4M3).item() == _scale_by_definition(5.0, 448.0, 0)


def test_compute_scale_result_is_fp32_of_amaxs_shape_whatever_prev_scale_is():
    got = compute_scale(torch.tensor(5.0), E4M3, prev_scale=torch.tensor(2.0, dtype=torch.float64))
    assert got.dtype == torch.float32 and got.shape == () and got.item() == _scale_by_definition(5.0, 448.0, 0)
    amax = torch.tensor([5.0, 0.0, float("nan")])
    got = compute_scale(amax, E4M3, prev_scale=torch.tensor([1.0, 4.0, 8.0], dtype=torch.float64))
    assert got.dtype == torch.float32 and got.tolist() == [_scale_by_definition(5.0, 448.0, 0), 4.0, 8.0]
    with pytest.raises(ValueError, match=r"prev_scale.*shape \(2,\) does not fit amax's shape \(\)"):
        compute_scale(torch.tensor(5.0), E4M3, prev_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"prev_scale.*shape \(3,\) does not fit amax's shape \(2,\)"):
        compute_scale(torch.tensor([1.0, 2.0]), E4M3, prev_scale=torch.ones(3))


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.arange(16.0).reshape(4, 4).int(), "casts float16, bfloat16, float32 or float64 values, got torch.int32"),
        (torch.ones(4, 4, dtype=torch.bool), "casts .* got torch.bool"),
        (torch.ones(4, 4, dtype=torch.complex64), "casts .* got torch.complex64"),
        (torch.ones(4, 4).to(E4M3), "got an FP8 tensor .*cast already"),
        (torch.ones(4, 4).to_sparse(), "takes dense tensors, got a torch.sparse_coo tensor"),
    ],
)
def test_quantize_refuses_what_it_cannot_cast_and_changes_nothing(x, match):
    # Integer, bool and complex values were cast as numbers (an int32 3 became FP8 384.0 with scale 128).
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True)
    before = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(TypeError, match=f"ScalingState.quantize {match}"):
        s.quantize(x)
    assert all(torch.equal(v, s.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    ("flag", "value"), [("transpose", "no"), ("column_sum", 1), ("keep_input", np.bool_(False)), ("current", "False")]
)
def test_quantize_refuses_a_flag_that_is_not_a_bool_and_changes_nothing(flag, value):
    # A truthy string (transpose="no", current="False") switched the feature on against what was meant.
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True)
    before = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(TypeError, match=rf"ScalingState.quantize\({flag}=.*\): must be True or False"):
        s.quantize(torch.randn(4, 16), **{flag: value})
    assert all(torch.equal(v, s.state_dict()[k]) for k, v in before.items())


def test_quantize_casts_float64_as_the_reference_does():
    s = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=False)
    x = torch.randn(8, 16, dtype=torch.float64) * 3
    x_fp8, _, scale_inv = s.quantize(x)
    ref, _, _, _ = cast_to_fp8_ref(x, 1 / scale_inv, E4M3)
    assert torch.equal(x_fp8.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("amax", [-3.0, -1, np.float32(-3.0), float("-inf")])
def test_compute_scale_refuses_a_negative_number(amax):
    """A negative amax gave prev_scale (1.0) silently, as if it carried no information. Tensors are not checked: that
    would wait for the device."""
    with pytest.raises(ValueError, match=re.escape(f"compute_scale(amax={amax!r}): amax is an absolute maximum")):
        compute_scale(amax, E4M3)
    assert compute_scale(-0.0, E4M3, prev_scale=torch.tensor(8.0)).item() == 8.0  # -0.0 is 0: no information


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16])
@pytest.mark.parametrize("margin", [0, 8, 9, 16])
def test_compute_scale_of_a_subnormal_amax_matches_definition(dtype, margin):
    # fp32 subnormals (exponent field 0) have their own exponent: read as 2**-127 they gave a scale 2x-128x too small
    # once the margin brought it under the 2**127 clamp. The definition in float64 (where they are normal), clamped.
    fmax = fp8_max(dtype) if dtype != torch.float16 else 65504.0
    for a in [1e-40, 1.4e-45, 5e-39, 1.1754942e-38, 2.0**-140, 3 * 2.0**-149]:
        a32 = torch.tensor(a, dtype=torch.float32).item()  # the fp32 value
        want = min(max(_scale_by_definition(a32, fmax, margin), 2.0**-126), 2.0**127)
        assert compute_scale(torch.tensor(a32), dtype, margin).item() == want, (a32, margin)


@pytest.mark.parametrize("prev_scale", [float("nan"), 0.0, -4.0, 3.0, True, float("inf")])
def test_compute_scale_refuses_a_number_prev_scale_that_is_no_positive_power_of_two(prev_scale):
    # It is returned as the scale where amax carries no information (0, inf, NaN): 3, 0 or NaN became a cast's scale.
    with pytest.raises(ValueError, match=r"compute_scale\(prev_scale=.*\): must be a positive power of two"):
        compute_scale(torch.tensor(0.0), E4M3, prev_scale=prev_scale)
    assert compute_scale(torch.tensor(0.0), E4M3, prev_scale=2.0**-3).item() == 2.0**-3


@pytest.mark.parametrize("flag", ["False", 0, np.bool_(False)])
def test_set_initialized_takes_a_bool_only(flag):
    # bool("False") is True: the state then cast from an empty history (scale 1) as if it held earlier amaxes.
    state = ScalingState(E4M3, history_len=4, margin=0, algo="max", delayed=True)
    with pytest.raises(TypeError, match=r"set_initialized\(flag=.*\): must be True or False"):
        state.set_initialized(flag)
    assert state.initialized is False
    state.set_initialized(True)
    assert state.initialized is True
