"""Fast launches of compiled Triton kernels: after the first launch of a specialization, skip the JIT dispatcher.

``kernel[grid](*args, **kwargs)`` binds the arguments, specializes each one (type, 16-byte alignment of pointers,
divisibility of integers), turns the specialization and the options into a cache key, looks the compiled kernel up,
checks the kernel's globals, and only then calls ``CompiledKernel.run``. For the casts of a small training step
that is most of their host time (benchmarks/results/host_overhead_h100.txt). :func:`launch` makes the same launch
(Triton's own last lines of ``JITFunction.run`` in triton 3.6 to 3.9: the same compiled kernel, arguments, grid,
stream, launch metadata and hooks) and finds the compiled kernel with a cheaper key of its own:

- per tensor argument its dtype and whether its address is a multiple of 16; per integer whether it is 1, a multiple
  of 16, and which of int32/int64 holds it; per other positional argument its type and value; the type and value of
  every keyword (constexprs and options); the current device; Triton's option knobs (debug, instrumentation);
- this key says at least as much as Triton's specialization, so two launches with equal keys get the same compiled
  kernel from Triton. A key is learned from a normal launch (which compiles or finds the kernel and returns it) only
  after checking Triton's own specialization of those arguments: its attributes must be ``""`` or ``"D"``, and ``"D"``
  must mean divisibility by 16. A Triton that specializes on anything else gets a warning and normal launches.

Normal launches remain where the fast path is unknown: the interpreter (``TRITON_INTERPRET=1``), a kernel with
pre-run hooks or a stage-inspection hook, an argument of another type, a new key, ``LIGHTNING_FP8_FAST_LAUNCH=0``.

One level up, :class:`Replay` makes a launcher's recorded launches again for a later call of the same kind (the
launcher's own key; kernels/quantize.py), without computing their configs, grids or keys: what a cast of a training
step does every step with new tensors. H100, FP8Linear forward + backward at a tiny shape (host_overhead.py,
results/h100_s7.txt): 1119 -> 968 us of host time on one host, 2437 -> 1868 us on a slower one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import torch

try:  # triton >= 3.4 (knobs); older versions launch normally
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
except ImportError:
    knobs = driver = JITFunction = None

# key -> (compiled kernel, the argument values after the positional ones, in the kernel's parameter order)
_LEARNED: dict[tuple, tuple[object, tuple]] = {}
# Kernels whose specialization :func:`_check_specialization` could not explain: normal launches only.
_REFUSED: set[int] = set()
_NOT_PRESENT = object()
# Launches by path since the last clear(): "fast" skipped the dispatcher, "normal" went through it, "replayed" were
# made by a Replay.
COUNTS = {"fast": 0, "normal": 0, "replayed": 0}


# LIGHTNING_FP8_FAST_LAUNCH=0 turns the fast path off (read at import; tests set this flag).
ENABLED = os.environ.get("LIGHTNING_FP8_FAST_LAUNCH", "1") != "0" and knobs is not None
_INT32 = (-(2**31), 2**31)


def _knobs_key() -> tuple:
    # The knobs JITFunction.run folds into the options (so into its cache key); getattr: not all exist in 3.6.
    return (
        knobs.runtime.debug,
        getattr(knobs.compilation, "instrumentation_mode", None),
        getattr(knobs.compilation, "fpsan_homomorphic_casts", None),
    )


def _key(kernel, device: int, args: tuple, kwargs: dict) -> tuple | None:
    """What Triton's specialization and options can depend on (native_specialize_impl, JITFunction.run), or None for
    an argument of another type. Inlined: this runs for every launch."""
    arg_keys = []
    for a in args:
        if isinstance(a, torch.Tensor):
            arg_keys.append((a.dtype, a.data_ptr() % 16 == 0))
        elif a.__class__ is int:
            arg_keys.append((a == 1, a % 16 == 0, _INT32[0] <= a < _INT32[1], a < 2**63))
        elif a is None or a.__class__ is bool or a.__class__ is float:
            arg_keys.append((a.__class__, a))
        else:
            return None
    # The keywords' values with their types (16, 16.0 and True are equal, but different constexprs for Triton).
    kw_key = (tuple(kwargs.items()), tuple(map(type, kwargs.values())))
    return id(kernel), device, tuple(arg_keys), kw_key, _knobs_key()


_DEVICE_STREAM: list = []  # the active driver's get_current_device and get_current_stream, looked up once


def _current_device_stream() -> tuple[int, int]:
    # The device and stream JITFunction.run launches on (the lookup of driver.active is a Python property chain).
    if not _DEVICE_STREAM:
        _DEVICE_STREAM.extend((driver.active.get_current_device, driver.active.get_current_stream))
    device = _DEVICE_STREAM[0]()
    return device, _DEVICE_STREAM[1](device)


def _check_specialization(kernel, device: int, args: tuple, kwargs: dict) -> bool:
    """True when Triton's specialization of these arguments is a function of :func:`_key`'s."""
    caches = kernel.device_caches[device]
    backend, binder = caches[3], caches[4]
    if backend.parse_attr("D") != [["tt.divisibility", 16]]:
        return False
    _, specialization, _ = binder(*args, **kwargs)
    for spec in specialization:
        if not isinstance(spec, tuple) or len(spec) != 2:
            return False
        kind, attr = spec
        if kind != "constexpr" and attr not in ("", "D", None):
            return False
    return True


def _learn(kernel, key: tuple, compiled, device: int, args: tuple, kwargs: dict) -> None:
    names = list(kernel.signature.parameters)
    if not hasattr(compiled, "packed_metadata") or not hasattr(compiled, "launch_metadata"):
        return  # not a CompiledKernel (an asynchronous compile's future): keep launching normally
    if not _check_specialization(kernel, device, args, kwargs):
        _REFUSED.add(id(kernel))
        warnings.warn(
            f"lightning_fp8: Triton specializes {kernel.fn.__name__}'s arguments in a way the fast launch path does "
            "not know (kernels/launch.py); it launches through Triton's dispatcher instead (slower, correct)",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    params = kernel.signature.parameters
    tail = tuple(kwargs[n] if n in kwargs else params[n].default for n in names[len(args) :])
    _LEARNED[key] = (compiled, tail)


def _globals_unchanged(kernel) -> bool:
    for (name, _), (val, globals_dict) in kernel.used_global_vals.items():
        if globals_dict.get(name, _NOT_PRESENT) != val:
            return False  # the normal launch raises Triton's error
    return True


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, without the JIT dispatcher once this specialization was launched before.

    ``kernel`` is a ``triton.jit`` function; anything else (an interpreted kernel) is launched normally.
    """
    if (
        not ENABLED
        or not isinstance(kernel, JITFunction)
        or kernel.pre_run_hooks
        or id(kernel) in _REFUSED
        or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None
    ):
        COUNTS["normal"] += 1
        _note(None)
        kernel[grid](*args, **kwargs)
        return
    device, stream = _current_device_stream()
    key = _key(kernel, device, args, kwargs)
    try:
        learned = None if key is None else _LEARNED.get(key)
    except TypeError:  # an unhashable keyword value
        key = learned = None
    if learned is None or not _globals_unchanged(kernel):
        COUNTS["normal"] += 1
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and compiled is not None:
            _learn(kernel, key, compiled, device, args, kwargs)
        learned = None if key is None else _LEARNED.get(key)  # replayable once Triton checked the specialization
        _note(None if learned is None else (kernel, learned[0], grid, args, kwargs, learned[1]))
        return
    compiled, tail = learned
    COUNTS["fast"] += 1
    _note((kernel, compiled, grid, args, kwargs, tail))
    _run(compiled, grid, stream, args + tail)


def _run(compiled, grid: tuple[int, ...], stream: int, full: tuple) -> None:
    # Exactly JITFunction.run's launch of a compiled kernel.
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    launch_metadata = compiled.launch_metadata(grid, stream, *full)
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, launch_metadata,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------- replays
# While a thread's _RECORDING.launches is a list, each launch of that thread appends what replaying it takes, (kernel,
# compiled kernel, grid, positional arguments, keywords, the arguments after the positional ones), or None when it
# cannot be replayed (a launch through Triton's dispatcher whose specialization was not checked).
_RECORDING = threading.local()  # .launches: this thread's list while it records (threads record apart)


def _note(entry: tuple | None) -> None:
    # Append a launch's replay entry to this thread's recording, if it is recording.
    recorded = _RECORDING.__dict__.get("launches")
    if recorded is not None:
        recorded.append(entry)


# Called by clear(): forget the launchers' cached replays.
_ON_CLEAR: list = []


@contextlib.contextmanager
def recording():
    """Record the launches this thread makes inside, for :meth:`Replay.build`; yields the list they go to."""
    outer = _RECORDING.__dict__.get("launches")
    _RECORDING.launches = launches = []
    try:
        yield launches
    finally:
        if outer is not None:
            outer.extend(launches)
        _RECORDING.launches = outer


class Replay:
    """The launches of one call of a launcher, made again for later calls of the same kind with their own tensors.

    A launcher (kernels/quantize.py: ``quantize_``) works out grids, configs, keywords and Triton's cache key for each
    of its launches; a later call that would work out the same needs none of it. The launcher's own cache key says
    what "the same" is: it must determine each launch's kernel, grid and non-tensor arguments, and Triton's
    specialization of the tensors (their dtypes and whether their addresses are multiples of 16). ``slots`` are a
    call's tensors in a fixed order (its inputs and the outputs it allocated); every tensor argument of a recorded
    launch must be one of them or one of ``constants`` (kept, e.g. a workspace), and other arguments are kept as
    recorded. A replay launches exactly what :func:`launch` would, bypassing only the host-side work.
    """

    __slots__ = ("launches", "width")

    def __init__(self, launches: tuple, width: int) -> None:
        self.launches, self.width = launches, width

    @classmethod
    def build(cls, recorded: list, slots: tuple, constants: tuple = ()) -> Replay | None:
        """A replay of ``recorded`` for calls with ``len(slots)`` tensors, or None if some launch cannot be replayed
        (or nothing was recorded)."""
        if not recorded:
            return None
        index = {}
        for i, t in enumerate(slots):
            if t is not None:
                if id(t) in index:
                    return None  # one tensor in two slots: a later call's two tensors could not both be placed
                index[id(t)] = i
        kept = {id(t) for t in constants}
        launches = []
        for entry in recorded:
            if entry is None:
                return None
            kernel, compiled, grid, args, kwargs, tail = entry
            template, values = [], []
            for a in args:
                if isinstance(a, torch.Tensor) and id(a) in index:
                    template.append(index[id(a)])
                    continue
                if isinstance(a, torch.Tensor) and id(a) not in kept:
                    return None  # a tensor the replay would not know where to find
                template.append(len(slots) + len(values))
                values.append(a)
            launches.append((kernel, compiled, grid, tuple(template), tuple(values), kwargs, tail))
        return cls(tuple(launches), len(slots))

    def __call__(self, slots: tuple, stream: int) -> None:
        """Launch again with this call's ``slots`` (as many as at :meth:`build`) on ``stream`` (the current one)."""
        for kernel, compiled, grid, template, values, kwargs, tail in self.launches:
            args = tuple(map((slots + values).__getitem__, template))
            if not _globals_unchanged(kernel):  # Triton raises its error for this
                launch(kernel, grid, *args, **kwargs)
                continue
            COUNTS["replayed"] += 1
            _run(compiled, grid, stream, args + tail)


def clear() -> None:
    """Forget every learned key (the next launch of each specialization goes through Triton again) and every replay."""
    _LEARNED.clear()
    _REFUSED.clear()
    COUNTS.update(fast=0, normal=0, replayed=0)
    for forget in _ON_CLEAR:
        forget()
