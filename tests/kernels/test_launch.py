"""The fast launch path (kernels/launch.py).

On CPU (``TRITON_INTERPRET=1``) there are no compiled kernels: the tests drive a real ``JITFunction`` whose dispatcher
(``run``), binder and compiled kernel are stand-ins that record what they are given, and check which launches take
which path and with which arguments. The ``gpu`` test launches the real casts both ways and compares them bit for bit.
"""

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from lightning_fp8.kernels import cast, launch, quantize  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_CHANGING = 3  # a global the stand-in kernel reads: Triton checks it has not changed since compiling


def _kernel_src(x_ptr, out_ptr, n, scale, flag, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):
    pass


class _Compiled:
    """A CompiledKernel stand-in: records each launch."""

    function, packed_metadata = "function", "packed"

    def __init__(self, name):
        self.name, self.launches = name, []

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream)

    def run(self, *launch_args):
        self.launches.append(launch_args)


class _Backend:
    def __init__(self, divisibility=16):
        self.divisibility = divisibility

    def parse_attr(self, desc):
        return [["tt.divisibility", self.divisibility]] if "D" in desc else []


@pytest.fixture
def fake(monkeypatch):
    """A JITFunction with a recording dispatcher: ``fake.normal`` lists the normal launches."""
    launch.clear()
    kernel = JITFunction(_kernel_src)
    state = type("Fake", (), {})()
    state.kernel, state.normal, state.attr = kernel, [], None

    def run(*args, grid, warmup, **kwargs):
        compiled = _Compiled(f"compiled{len(state.normal)}")
        state.normal.append((grid, args, kwargs, compiled))
        return compiled

    def binder(*args, **kwargs):
        spec = [(("*fp32", "D" if a.data_ptr() % 16 == 0 else "") if isinstance(a, torch.Tensor) else ("i32", ""))
                for a in args[:3]] + [("fp32", None), ("u1", None), ("constexpr", kwargs["BLOCK"]),
                                      ("constexpr", kwargs.get("EVEN", True))]  # fmt: skip
        if state.attr is not None:
            spec[0] = ("*fp32", state.attr)
        return dict(zip(kernel.arg_names, args, strict=False)), spec, kwargs

    monkeypatch.setattr(kernel, "run", run)
    kernel.used_global_vals = {("_CHANGING", id(globals())): (_CHANGING, globals())}
    state.backend = _Backend()
    kernel.device_caches[0] = ({}, {}, None, state.backend, binder)
    monkeypatch.setattr(launch, "_current_device_stream", lambda: (0, 777))
    yield state
    launch.clear()


def _args(n=48, offset=0):
    buf = torch.randn(n + 4)
    return buf[offset : offset + n], torch.empty(n), n, 0.5, True


def test_first_launch_normal_then_fast_with_the_same_launch(fake):
    x, out, n, scale, flag = _args()
    launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16, num_warps=4)
    assert len(fake.normal) == 1 and launch.COUNTS == {"fast": 0, "normal": 1, "replayed": 0}
    grid, args, kwargs, compiled = fake.normal[0]
    assert grid == (5,) and args == (x, out, n, scale, flag) and kwargs == {"BLOCK": 16, "num_warps": 4}
    # Same specialization, new tensors and integer: the compiled kernel directly, with every parameter in order
    # (the defaulted EVEN included, the option num_warps not), the grid padded to 3-D and the current stream.
    # (Floats and bools are keyed by value: Triton does not specialize them, but the casts pass them as constexprs.)
    x2, out2, _, _, _ = _args(64)
    launch.launch(fake.kernel, (7,), x2, out2, 64, scale, flag, BLOCK=16, num_warps=4)
    assert len(fake.normal) == 1 and launch.COUNTS == {"fast": 1, "normal": 1, "replayed": 0}
    (got,) = compiled.launches
    assert got[:7] == (7, 1, 1, 777, "function", "packed", ("meta", (7,), 777))
    assert got[9:] == (x2, out2, 64, scale, flag, 16, True)


def test_replay_launches_the_recorded_kernels_with_the_new_tensors(fake):
    """A replay of recorded launches (normal and fast ones) runs the compiled kernel with the new call's tensors in the
    slots' places, the recorded constants and non-tensor arguments kept, on the given stream."""
    x, out, n, scale, flag = _args()
    workspace = torch.zeros(4)
    with launch.recording() as recorded:
        launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)  # normal: learns the key
        launch.launch(fake.kernel, (3,), workspace, x, n, scale, flag, BLOCK=16)  # fast
    replay = launch.Replay.build(recorded, (x, out), (workspace,))
    assert replay is not None and len(fake.normal) == 1
    compiled = fake.normal[0][3]
    x2, out2, _, _, _ = _args()
    replay((x2, out2), 999)
    first, second = compiled.launches[1:]
    assert first[:4] == (5, 1, 1, 999) and first[9:] == (x2, out2, n, scale, flag, 16, True)
    assert second[:4] == (3, 1, 1, 999) and second[9:] == (workspace, x2, n, scale, flag, 16, True)
    assert launch.COUNTS == {"fast": 1, "normal": 1, "replayed": 2}


def test_replay_refuses_what_it_cannot_place(fake):
    """No replay for a launch that went through Triton unchecked, a tensor that is neither a slot nor a constant, or a
    tensor given as two slots."""
    x, out, n, scale, flag = _args()
    with launch.recording() as recorded:
        launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
    assert launch.Replay.build(recorded, (x,)) is None  # `out` unknown
    assert launch.Replay.build(recorded, (x, out, x)) is None  # x twice
    assert launch.Replay.build(recorded, (x, out)) is not None
    fake.kernel.pre_run_hooks.append(lambda *a, **k: None)  # launches normally, unchecked
    with launch.recording() as recorded:
        launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
    assert recorded == [None] and launch.Replay.build(recorded, (x, out)) is None
    fake.kernel.pre_run_hooks.clear()


def test_recording_is_per_thread(fake):
    """Launches go to the recording of the thread that makes them (a backward on the autograd engine's thread while
    another thread records must not mix in), and nothing recorded gives no replay."""
    import threading

    x, out, n, scale, flag = _args()
    launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)  # learned: later launches are fast
    theirs = []

    def worker():
        launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)  # not recording
        with launch.recording() as recorded:
            launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
        theirs.append(recorded)

    with launch.recording() as mine:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        launch.launch(fake.kernel, (6,), x, out, n, scale, flag, BLOCK=16)
    assert len(mine) == 1 and mine[0][2] == (6,)
    assert len(theirs[0]) == 1 and theirs[0][0][2] == (5,)
    assert launch.Replay.build([], (x, out)) is None


def test_replay_with_a_changed_global_launches_through_triton(fake, monkeypatch):
    x, out, n, scale, flag = _args()
    with launch.recording() as recorded:
        launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
    replay = launch.Replay.build(recorded, (x, out))
    monkeypatch.setitem(globals(), "_CHANGING", 4)  # Triton's own launch raises for this; the replay must not hide it
    replay((x, out), 777)
    assert len(fake.normal) == 2 and launch.COUNTS["replayed"] == 0


def test_clear_forgets_replays(fake):
    forgotten = []
    launch._ON_CLEAR.append(lambda: forgotten.append(True))
    try:
        launch.clear()
    finally:
        launch._ON_CLEAR.pop()
    assert forgotten == [True]


@pytest.mark.parametrize(
    "change",
    ["misaligned", "dtype", "int_divisibility", "int_one", "int_64", "constexpr", "constexpr_type", "option", "bool"],
)
def test_a_different_specialization_goes_through_triton(fake, change):
    x, out, n, scale, flag = _args()
    kw = {"BLOCK": 16, "num_warps": 4}
    launch.launch(fake.kernel, (5,), x, out, n, scale, flag, **kw)
    args, kw2 = [x, out, n, scale, flag], dict(kw)
    if change == "misaligned":
        args[0] = _args(offset=1)[0]  # 4 bytes off a 16-byte boundary
    elif change == "dtype":
        args[0] = x.double()
    elif change == "int_divisibility":
        args[2] = 47
    elif change == "int_one":
        args[2] = 1
    elif change == "int_64":
        args[2] = 2**31 + 16
    elif change == "constexpr":
        kw2["BLOCK"] = 32
    elif change == "constexpr_type":
        kw2["BLOCK"] = 16.0  # equal, but another type: another constexpr for Triton
    elif change == "option":
        kw2["num_warps"] = 8
    else:
        args[4] = 1  # an int where a bool was: another type
    launch.launch(fake.kernel, (5,), *args, **kw2)
    assert len(fake.normal) == 2 and launch.COUNTS["fast"] == 0
    launch.launch(fake.kernel, (5,), *args, **kw2)  # ... and is learned in its turn
    assert len(fake.normal) == 2 and launch.COUNTS["fast"] == 1
    assert len(fake.normal[1][3].launches) == 1 and not fake.normal[0][3].launches


def test_debug_knob_is_part_of_the_key(fake, monkeypatch):
    x, out, n, scale, flag = _args()
    launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "debug", True)  # JITFunction.run folds it into the options
    launch.launch(fake.kernel, (5,), x, out, n, scale, flag, BLOCK=16)
    assert len(fake.normal) == 2


def test_changed_global_and_disabled_path_launch_normally(fake, monkeypatch):
    args = _args()
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    # Triton's own launch raises for a changed global; the fast path must not hide that.
    monkeypatch.setitem(globals(), "_CHANGING", 4)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 2
    monkeypatch.setitem(globals(), "_CHANGING", 3)
    monkeypatch.setattr(launch, "ENABLED", False)  # LIGHTNING_FP8_FAST_LAUNCH=0
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 3 and launch.COUNTS["fast"] == 0
    monkeypatch.setattr(launch, "ENABLED", True)
    fake.kernel.pre_run_hooks.append(lambda *a, **k: None)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 4 and launch.COUNTS["fast"] == 0
    fake.kernel.pre_run_hooks.clear()
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 4 and launch.COUNTS["fast"] == 1


@pytest.mark.parametrize("unknown", ["attr", "divisibility"])
def test_unknown_specialization_is_refused_loudly(fake, unknown):
    if unknown == "attr":
        fake.attr = "DS"  # a Triton that specializes on more than divisibility by 16
    else:
        fake.backend.divisibility = 32
    args = _args()
    with pytest.warns(RuntimeWarning, match="fast launch path does not know"):
        launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    launch.launch(fake.kernel, (5,), *args, BLOCK=16)
    assert len(fake.normal) == 2 and launch.COUNTS["fast"] == 0


def test_unknown_argument_type_launches_normally(fake):
    x, out, n, scale, flag = _args()
    for _ in range(2):
        launch.launch(fake.kernel, (5,), x, out, n, scale, "text", BLOCK=16)
    assert len(fake.normal) == 2 and launch.COUNTS["fast"] == 0


def test_interpreted_kernel_launches_normally():
    """Under the interpreter the cast launches as before (the fast path has no compiled kernel to use)."""
    if not cast._interpreted(cast._cast_flat_kernel):
        pytest.skip("runs under TRITON_INTERPRET=1")
    launch.clear()
    x = torch.randn(37, 29)
    got = cast.cast_to_fp8(x, torch.tensor(4.0), torch.float8_e4m3fn)
    assert launch.COUNTS == {"fast": 0, "normal": 0, "replayed": 0} and got[0].shape == x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("speculate", [False, True])
def test_gpu_fast_launches_equal_normal_launches(monkeypatch, speculate):
    """Every cast of a scaling state and the plain casts, launched fast (the casts of a state replayed from the second
    on) and through Triton: the same bytes and state, with aligned and misaligned inputs (another specialization; not
    replayed) and both formats, with and without the fused column sums (several row groups)."""
    from tests.kernels.test_cast import _state

    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", speculate)
    launch.clear()
    gen = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(1100 * 52 + 8, device="cuda", generator=gen, dtype=torch.bfloat16) * 3.0
    for offset in (0, 1, 0):
        x = base[offset : offset + 1100 * 52].view(1100, 52)  # contiguous; 2 bytes off 16 with offset 1
        for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            kinds = ((True, True, False), (False, True, False), (False, False, False), (False, True, True),
                     (True, False, True))  # fmt: skip
            for current, transpose, column_sum in kinds:
                outs = []
                for fast in (True, False):
                    monkeypatch.setattr(launch, "ENABLED", fast)
                    state = _state(4, 2.0)
                    for _ in range(3):  # the second launch of a specialization is fast, a state's cast replayed
                        got = quantize.quantize_(x, *state, fp8_dtype, 0, True, True, current, transpose, None,
                                                 column_sum)  # fmt: skip
                    plain = cast.cast_to_fp8(x, torch.tensor(8.0, device="cuda"), fp8_dtype, transpose)
                    outs.append([*got, *state, *plain, cast.amax(x)])
                for g, r in zip(*outs, strict=True):
                    assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g, r.view(torch.uint8)
                                       if r.dtype.itemsize == 1 else r)  # fmt: skip
    assert launch.COUNTS["fast"] > 0 and launch.COUNTS["replayed"] > 0
