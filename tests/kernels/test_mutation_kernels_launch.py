"""What a mutation audit of kernels/launch.py found unpinned: the fast path's key against Triton's own integer
specialization (``triton.runtime.jit.mangle_type``: i32 below 2**31, i64 below 2**63, u64 above), nested recordings,
and the stage-inspection hook that must send every launch through Triton's dispatcher (the module docstring).

The stand-in JITFunction, its recording dispatcher and compiled kernel are tests/kernels/test_launch.py's ``fake``.
"""

import pytest

pytest.importorskip("triton")

from lightning_fp8.kernels import launch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from tests.kernels.test_launch import _args, fake  # noqa: E402, F401 (the fixture)

# Integers on both sides of each of Triton's type boundaries, all multiples of 16 (so only the type can tell them
# apart), and the negative side of int32's.
_BOUNDARY_INTS = [16, 2**31 - 16, 2**31, 2**31 + 16, 2**32, 2**40, 2**63 - 16, 2**63, 2**63 + 16,
                  -(2**31), -(2**31) - 16]  # fmt: skip


def test_integer_keys_are_triton_s_integer_types():
    """Two integers share a fast-path key only where Triton gives them one type (and the same divisibility and
    equality to 1): a kernel compiled for an i32 argument must not be reused for 2**31, nor an i64 one for 2**63."""
    kernel = object()
    for a in _BOUNDARY_INTS:
        for b in _BOUNDARY_INTS:
            same_key = launch._key(kernel, 0, (a,), {}) == launch._key(kernel, 0, (b,), {})
            assert same_key == (mangle_type(a) == mangle_type(b)), (a, b, mangle_type(a), mangle_type(b))


@pytest.mark.parametrize(("first", "second"), [(2**31 - 16, 2**31), (2**40, 2**63 + 16)])
def test_a_launch_past_an_integer_type_boundary_goes_through_triton(fake, first, second):  # noqa: F811
    """The same kernel launched with an integer on the other side of Triton's i32 / i64 / u64 boundary is a new
    specialization: Triton's dispatcher launches it (a fast launch would pass it to the kernel compiled for the
    narrower type)."""
    x, out, _, scale, flag = _args()
    launch.launch(fake.kernel, (5,), x, out, first, scale, flag, BLOCK=16)
    launch.launch(fake.kernel, (5,), x, out, second, scale, flag, BLOCK=16)
    assert len(fake.normal) == 2 and launch.COUNTS["fast"] == 0


def test_a_nested_recording_also_records_into_the_outer_one(fake):  # noqa: F811
    """``recording()`` inside another: the inner list gets the launches made inside it, and the outer one gets them
    too (a launcher recording its launches inside another launcher's recording must not hide them from it), and the
    outer recording goes on after the inner one ends."""
    x, out, n, scale, flag = _args()
    with launch.recording() as outer:
        launch.launch(fake.kernel, (4,), x, out, n, scale, flag, BLOCK=16)
        with launch.recording() as inner:
            launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
        launch.launch(fake.kernel, (6,), x, out, n, scale, flag, BLOCK=16)
    launch.launch(fake.kernel, (7,), x, out, n, scale, flag, BLOCK=16)  # not recording any more
    assert [entry[2] for entry in inner] == [(5,)]
    assert [entry[2] for entry in outer] == [(4,), (5,), (6,)]


def test_a_stage_inspection_hook_sends_launches_through_triton(fake, monkeypatch):  # noqa: F811
    """With Triton's ``add_stages_inspection_hook`` set, every launch goes through the dispatcher (the hook runs
    there), even one whose specialization was learned before."""
    from triton import knobs

    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        pytest.skip("this Triton has no stage-inspection hook")
    args = _args()
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", lambda *a, **k: None)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 3 and launch.COUNTS["fast"] == 0
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", None)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 3 and launch.COUNTS["fast"] == 1


def test_a_refused_kernel_warns_once_and_clear_tries_it_again(fake):  # noqa: F811
    """A kernel whose specialization the fast path cannot explain is refused once: one warning, then normal launches
    without checking (or warning) again; ``clear()`` forgets the refusal, so a later launch checks it afresh."""
    import warnings

    fake.attr = "DS"  # a Triton that specializes on more than divisibility by 16
    args = _args()
    with pytest.warns(RuntimeWarning, match="fast launch path does not know"):
        launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    launch.clear()
    fake.attr = None  # now explainable
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 3 and launch.COUNTS["fast"] == 1
