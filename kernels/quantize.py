"""A scaling state's cast in one launch (two with current scaling): the cast of :mod:`lightning_fp8.kernels.cast`
with the state's bookkeeping fused in (``RECORD``: statistics, amax history, next scale, 1 / scale).

:func:`quantize_` is what ``ScalingState.quantize`` runs eagerly on a GPU; :func:`quantize_op` is the same launches as a
``torch.library.triton_op`` for ``torch.compile``. Numerics: ``kernels/reference.py: quantize_ref``, bit for bit
(with a fused activation, within an FP8 code: see :func:`quantize_`).
"""

import functools

import torch
from lightning_fp8.kernels import cast, launch
from lightning_fp8.kernels.cast import _FP8, CONFIGS, _cast_impl, _cdiv, _fp8_outputs, _index_64, _launch
from lightning_fp8.kernels.cast_kernels import _amax_kernel
from lightning_fp8.kernels.reference import float32_exponent_mantissa


@functools.cache
def _record_fields(fp8_dtype: torch.dtype, margin: int) -> dict:
    # The bookkeeping's constexprs: the exponent and mantissa of the format's maximum as an fp32, and the margin.
    max_exp, max_mant = float32_exponent_mantissa(_FP8[fp8_dtype][0])
    return {"MAX_EXP": max_exp, "MAX_MANT": max_mant, "MARGIN": margin}


# Current scaling without the amax launch when it can: the cast speculates that this tensor's scale is the one of the
# state's last cast (weights, activations: their power-of-two scale seldom moves between steps), folds the amax as it
# casts, and its last program checks the guess against the amax; a wrong guess raises a flag on which a second launch
# casts again with the right scale. Bit for bit the two-launch cast's outputs and bookkeeping either way; one pass over
# x instead of two when the guess holds, two and a write more when it does not (benchmarks/bench_cast.py times both:
# 8192 x 8192 bf16, 186.5 -> 119.7 us on an H100). True (the default): every cast speculates, eager or traced by
# torch.compile (quantize_op); "eager": only eager casts; False: none. Compiled, the weights' casts of a GPT block at
# d=4096 took 0.43 ms of GPU time without speculation and 0.26 ms with it (bench_step_casts.py), and the compiled O2
# step 238.1 -> 233.7 ms (train_step.py, results/h100_s11.txt); its warm-up 80 -> 117 s (a redo kernel per cast).
SPECULATIVE_CURRENT_SCALING: bool | str = True
WORKSPACE = 4


def _next_power_of_2(n: int) -> int:
    # As triton.next_power_of_2 (n >= 1), without its ConstexprFunction call overhead.
    return 1 << (n - 1).bit_length()


# Per (device, stream): the zeroed workspace of the fused bookkeeping (amax bits, saturated count, arrival ticket, the
# redo flag of speculative current scaling). A launch leaves it zeroed, and launches on one stream run one after
# another, so one workspace serves every cast on that stream.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    ws = _WORKSPACES.get((device, stream))
    if ws is None:
        ws = _WORKSPACES[(device, stream)] = torch.zeros(WORKSPACE, dtype=torch.int64, device=device)
    return ws


def quantize_(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    algo_max: bool,
    delayed: bool,
    current: bool,
    transpose: bool,
    unscale: torch.Tensor | None = None,
    column_sum: bool = False,
    activation: str | None = None,
    activation_input: torch.Tensor | None = None,
    activation_scale_inv: torch.Tensor | None = None,
    keep_input: bool = False,
) -> tuple[torch.Tensor, ...]:
    """One cast of a scaling state in one launch (two with ``current``): cast, statistics, history and next scale.

    Same signature and bit-exact results as :func:`lightning_fp8.kernels.reference.quantize_ref`. ``x`` must be
    contiguous and of a supported dtype (the caller, ``ScalingState.quantize``, guarantees it). The last program
    of the cast does the bookkeeping of ``kernels/scaling.py`` (no separate launch, no zeroed accumulators); with
    ``current`` the amax launch before it writes the scale. ``column_sum`` (2-D ``x``): the cast also sums the
    columns of each row block as it reads them (the bias gradient of a linear layer), and a fourth output adds the
    blocks. ``activation`` (2-D ``x``): cast ``reference.activation_ref(x, activation, activation_input)``, computed
    as the tiles are read (``activation_input`` contiguous, of ``x``'s shape); a current-scaled one always speculates
    (the amax launch reads ``x`` as it is); an FP8 ``activation_input`` is read times ``activation_scale_inv``, and
    ``keep_input`` ("gelu") also returns ``x`` in FP8 (the reference states both). With an activation the results
    are the reference's but for an element one FP8 code apart now and then (about 0.1%; the kernel's erf and exp
    against torch's differ by an fp32 ulp at times), and the amax by an ulp. Eager; ``torch.compile`` traces the
    same launches through the triton_op :func:`quantize_op`.
    """
    args = (x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, fp8_dtype, margin, algo_max,
            delayed, current, transpose, unscale, column_sum, activation, activation_input, activation_scale_inv,
            keep_input)  # fmt: skip
    if x.numel() == 0:
        from lightning_fp8.kernels.reference import quantize_ref

        return quantize_ref(*args)
    state = (x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, unscale, activation_input,
             activation_scale_inv)  # fmt: skip
    kind = (fp8_dtype, margin, algo_max, delayed, keep_input)
    key = _replay_key(state, transpose, current, *kind, column_sum=column_sum, activation=activation)
    if key is None:  # not replayed (see _replay_key)
        x_fp8, x_fp8_t, scale_inv, partials, pre = _quantize_impl(*args, eager=True)
    else:
        replay = _REPLAYS.get(key)
        if replay is not None:  # the launches of the first cast of this kind, with this cast's tensors
            x_fp8, x_fp8_t = _fp8_outputs(x, fp8_dtype, transpose)
            scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
            partials = cast.column_partials(x) if column_sum else None
            pre = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if keep_input else None
            replay((*state, x_fp8, x_fp8_t, scale_inv, partials, pre), key[1])
        else:
            with launch.recording() as recorded:
                x_fp8, x_fp8_t, scale_inv, partials, pre = _quantize_impl(*args, eager=True)
            _remember(key, recorded, (*state, x_fp8, x_fp8_t, scale_inv, partials, pre), (_workspace(x.device),))
    if column_sum:
        return x_fp8, x_fp8_t, scale_inv, cast.column_sums(partials)
    if keep_input:
        return x_fp8, x_fp8_t, scale_inv, pre
    return x_fp8, x_fp8_t, scale_inv


def recast_transposed(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    activation: str = "",
    x_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cast_to_fp8(x, scale, fp8_dtype, transpose=True)[1]``: the transposed FP8 copy alone (the kernel writes no
    row-major copy), its statistics dropped (they go to accumulators nobody reads, not to zeroed ones allocated per
    call). The backward's weight recast (lightning_fp8/linear.py). ``x``: contiguous, 2-D, non-empty, on a CUDA
    device; ``scale``: 0-dim fp32 there. With ``activation`` ("gelu") and FP8 ``x`` and its ``x_scale_inv``:
    ``reference.recast_activation_ref`` (FP8MLP's backward recomputing its GELU output's copy)."""
    if torch.compiler.is_compiling():
        return cast._cast_transposed_op(x, scale, fp8_dtype, activation, x_scale_inv)
    sink = _sink(x.device)
    stats = (*sink, *(sink[0],) * 8, 1, x.numel())  # the rest is unread without RECORD
    launch_args = (x, scale, fp8_dtype, True, stats, cast._NO_RECORD)
    flags = {"eager": True, "write_x": False, "activation": activation, "dequant_scale_inv": x_scale_inv}
    key = _replay_key((x, scale, x_scale_inv), True, False, fp8_dtype, activation=activation)
    if key is None:  # not replayed (see _replay_key)
        return _cast_impl(*launch_args, **flags)[1]
    replay = _REPLAYS.get(key)
    if replay is not None:
        x_fp8_t = torch.empty((x.shape[1], x.shape[0]), dtype=fp8_dtype, device=x.device)
        replay((x, scale, x_scale_inv, x_fp8_t), key[1])
        return x_fp8_t
    with launch.recording() as recorded:
        x_fp8_t = _cast_impl(*launch_args, **flags)[1]
    _remember(key, recorded, (x, scale, x_scale_inv, x_fp8_t), sink)
    return x_fp8_t


# Per device: an fp32 and an int64 accumulator that casts whose statistics nobody wants fold theirs into.
_SINKS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _sink(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    sink = _SINKS.get(device)
    if sink is None:
        sink = _SINKS[device] = (torch.zeros((), device=device), torch.zeros((), dtype=torch.int64, device=device))
    return sink


# Replays of the launches of quantize_ and recast_transposed (kernels/launch.py: Replay) by _replay_key, None where a
# cast cannot be replayed: the second and later casts of a kind skip the host work of _quantize_impl, _cast_impl and
# launch.launch. A model has a few kinds of casts (shapes x roles); the bound keeps a stream of new shapes from growing
# the cache forever.
_REPLAYS: dict[tuple, launch.Replay | None] = {}
MAX_REPLAYS = 1024
REPLAY = True  # False: every cast goes through _quantize_impl / _cast_impl (benchmarks/host_overhead.py compares)
launch._ON_CLEAR.append(_REPLAYS.clear)


def _remember(key: tuple, recorded: list, slots: tuple, constants: tuple) -> None:
    if len(_REPLAYS) >= MAX_REPLAYS:
        _REPLAYS.clear()
    _REPLAYS[key] = launch.Replay.build(recorded, slots, constants)


def _replay_key(
    tensors: tuple, transpose: bool, current: bool, *kind, column_sum: bool = False, activation: str | None = None
) -> tuple | None:
    """What decides every launch of a cast (its kernels, grids, arguments other than ``tensors``, and Triton's
    specialization of them), ``kind`` being the caller's non-tensor arguments; None where the cast is not replayed:
    the fast launch path off or unavailable (the interpreter), tensor descriptors (built per call), a tensor whose
    address is not a multiple of 16 (the outputs, fresh allocations, always are)."""
    x = tensors[0]
    if not (REPLAY and launch.ENABLED and x.is_cuda) or cast._interpreted(cast._cast_flat_kernel):
        return None
    cfg = CONFIGS["transpose" if transpose or column_sum or activation else "flat"]
    if cfg.get("TMA"):
        return None
    ptrs = 0
    shapes = []
    for t in tensors:
        if t is not None:
            ptrs |= t.data_ptr()
            shapes.append(t.shape)
            shapes.append(t.dtype)
        else:
            shapes.append(None)
    if ptrs & 15:
        return None
    device, stream = launch._current_device_stream()
    # The stream also picks the workspace of quantize_, a constant of its replays. The configs and flags below are
    # read at every launch.
    return (device, stream, x.device, *shapes, transpose, current, column_sum, activation, *kind,
            SPECULATIVE_CURRENT_SCALING,
            tuple(cfg.values()), tuple(CONFIGS["amax"].values()) if current else None, cast.EXACT_ROUND_ON_GPU,
            cast.REDO_PROGRAMS_PER_SM, launch._knobs_key())  # fmt: skip


def _quantize_impl(
    x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, fp8_dtype, margin, algo_max, delayed,
    current, transpose, unscale, column_sum, activation, activation_input, activation_scale_inv, keep_input, eager,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    # Non-empty x. Eagerly the stream's cached workspace serves (a launch leaves it zeroed); traced, a fresh zeroed
    # one (a graph cannot hold on to a global buffer that its kernels mutate). The workspace also fills the pointer
    # arguments that these launches do not read: no state buffer is passed twice to a kernel that writes it.
    fields = _record_fields(fp8_dtype, margin)
    ws = _workspace(x.device) if eager else torch.zeros(WORKSPACE, dtype=torch.int64, device=x.device)
    speculate = current and (
        SPECULATIVE_CURRENT_SCALING is True or (eager and SPECULATIVE_CURRENT_SCALING == "eager") or bool(activation)
    )
    # A cast of t * unscale always speculates: the amax launch of the two-pass path keeps t's scale for an amax of 0 or
    # inf, which the cast would apply to x itself (reference.quantize_ref casts x with scale / unscale there).
    speculate = speculate or (current and unscale is not None)
    if current and not speculate:
        cfg = CONFIGS["amax"]
        blocks = _cdiv(x.numel(), cfg["BLOCK"])
        flags = {"EVEN": x.numel() % cfg["BLOCK"] == 0, "INDEX_64": _index_64(blocks * cfg["BLOCK"])}
        _launch(_amax_kernel, x, blocks, cfg, x, ws, ws, scale, x.numel(), eager=eager, CURRENT_SCALE=True,
                **flags, **fields)  # fmt: skip
    # Eagerly the launch gets the 0-dim view itself (the replays find their tensors by identity: _remember); traced,
    # the one-element tensor, viewed once written (cast.scalar_output: no fill launch; a kernel writing into a view
    # would have functionalization copy it back into its base).
    scale_inv = cast.scalar_output(torch.float32, x.device)
    scale_inv = scale_inv.view(()) if eager else scale_inv
    h = amax_history.numel()
    stats = (ws, ws, ws, amax_history, scale_inv, last_amax, saturation, nonfinite_count, casts,
             ws if unscale is None else unscale, h, x.numel())  # fmt: skip
    record = {"RECORD": True, "BLOCK_H": _next_power_of_2(h), "ALGO_MAX": algo_max, "DELAYED": delayed,
              "UNSCALE": unscale is not None, "SPECULATE": 1 if speculate else 0, **fields}  # fmt: skip
    pre = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if keep_input else None
    x_fp8, x_fp8_t, partials = _cast_impl(
        x, scale, fp8_dtype, transpose, stats, record, eager, column_sum, activation=activation or "",
        activation_input=activation_input, dequant_scale_inv=activation_scale_inv, pre=pre,
    )  # fmt: skip
    return x_fp8, x_fp8_t, scale_inv if eager else scale_inv.view(()), partials, pre


@torch.library.triton_op(
    "lightning_fp8::quantize_triton",
    mutates_args=("amax_history", "scale", "last_amax", "saturation", "nonfinite_count", "casts"),
)
def quantize_op(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    algo_max: bool,
    delayed: bool,
    current: bool,
    transpose: bool,
    unscale: torch.Tensor | None,
    column_sum: bool,
    activation: str = "",
    activation_input: torch.Tensor | None = None,
    activation_scale_inv: torch.Tensor | None = None,
    keep_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_` (non-empty CUDA ``x``) as a ``torch.library.triton_op``: ``torch.compile`` sees the kernel
    launches themselves, and inductor launches them from its generated code (no Python custom op per cast). A fixed
    schema: the fourth output is the column sums, the kept input or empty; ``activation`` "" for none."""
    x_fp8, x_fp8_t, scale_inv, partials, pre = _quantize_impl(
        x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, fp8_dtype, margin, algo_max, delayed,
        current, transpose, unscale, column_sum, activation or None, activation_input, activation_scale_inv,
        keep_input, eager=False,
    )  # fmt: skip
    if column_sum:
        return x_fp8, x_fp8_t, scale_inv, cast.column_sums(partials)
    return x_fp8, x_fp8_t, scale_inv, scale_inv.new_empty((0,)) if pre is None else pre
