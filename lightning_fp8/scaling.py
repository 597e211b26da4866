"""Per-tensor scaling: the power-of-two scale convention and the per-role scaling state.

Convention (DESIGN.md): ``x_fp8 = saturate(x * scale)``, ``x ~= x_fp8.float() * scale_inv`` with
``scale = 2 ** (floor(log2(fp8_max / amax)) - margin)``. Powers of two make scaling exact: multiplying by
the scale and by its inverse adds no rounding error. :func:`~lightning_fp8.scale_rule.compute_scale` (the rule
itself, re-exported here) keeps the previous scale for an amax of 0 or a non-finite amax.

What a cast records (``kernels/reference.py: record_cast_ref``; the Triton kernels do the same): its amax (inf
where it held inf or NaN), saturation and count; the amax in front of the history (the window rolls by one at
every cast); and, for delayed scaling, the scale from the history (its max, or its newest entry with
``"most_recent"``). An amax of 0 (an all-zero or empty tensor) or a non-finite one carries no information: it enters
the history as 0 and the cast keeps the previous scale (DESIGN.md); a non-finite one is counted in
``nonfinite_count``, a zero one is not. The window rolls all the same, so that the histories of the ranks of an
amax sync stay aligned (:mod:`lightning_fp8.distributed.amax_sync`).

Delayed scaling casts with the scale computed from the amax history of earlier casts, then records this
cast's amax: one pass over the data. Current scaling computes the tensor's amax first: two passes.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fp8 import compiled_casts, load_pairing, ops
from lightning_fp8.autograd_rules import check_no_functorch
from lightning_fp8.cast_checks import check_activation, check_castable, check_state_settings, check_unscale
from lightning_fp8.first_casts import _SEEN_AMAX, _FirstCasts
from lightning_fp8.recipe import as_choice, as_count, check_flag
from lightning_fp8.scale_rule import _format_max, compute_scale  # noqa: F401  (compute_scale: its public name here)
from lightning_fp8.trace_marks import _STATES

ROLES = ("input", "weight", "grad_output")
# How a cast is traced under torch.compile (lightning_fp8/compiled_casts.py says what each does and why the defaults):
# True: the delayed casts of activations and gradients as tensor ops that inductor fuses into their input's producer.
FUSED_CASTS = False
# True: a CUDA tensor's cast as kernels/quantize.py's triton_op, launched from the generated code; False: one opaque
# custom op per cast, as on the CPU.
TRACE_TRITON_CASTS = True


def _holds_no_cast(buffers: dict[str, torch.Tensor | None]) -> bool:
    """Whether a scaling state's buffers are those of :meth:`ScalingState.reset`: scale 1, everything else zero."""
    names = ("amax_history", "scale", "amax", "saturation", "nonfinite_count", "casts")
    if any(type(buffers.get(name)) is not torch.Tensor for name in names):  # missing, or a DTensor: not judged
        return False
    with torch.no_grad():
        fresh = torch.stack([
            buffers["scale"].eq(1).all(),
            *(buffers[name].eq(0).all() for name in ("amax_history", "amax", "saturation", "nonfinite_count", "casts")),
        ])  # fmt: skip
        return bool(fresh.all())


class ScalingState(_FirstCasts, nn.Module):
    """Scaling state of one tensor role (input, weight or grad_output) of one FP8 module.

    Buffers (non-persistent, so a converted model keeps ``nn.Linear``'s state_dict keys; see
    :func:`lightning_fp8.fp8_state_dict` to save them):

    - ``scale``: the scale the next delayed cast uses (0-dim fp32, a power of two);
    - ``amax_history``: the last ``amax_history_len`` amaxes, most recent first (0 where unknown, and for a cast
      whose amax was 0 or non-finite: see the module docstring);
    - ``amax``: the amax of the last cast (inf where it held a NaN); ``saturation``: fraction of its values whose
      scaled magnitude reached the FP8 maximum (clamped to it; non-finite values become NaN and do not count);
    - ``nonfinite_count``: casts whose amax was inf or NaN; ``casts``: number of casts.

    Args:
        fp8_dtype: the format of the casts: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        history_len: length of the amax history (>= 1; weights use 1).
        margin: binades of headroom, 0 to :data:`lightning_fp8.recipe.MAX_MARGIN` (as :class:`FP8Recipe`'s).
        algo: ``"max"`` over the history, or its ``"most_recent"`` entry (``FP8Recipe.amax_compute_algo``).
        delayed: delayed scaling (from the history of earlier casts) rather than current scaling.
        device: where the buffers live.

    Raises:
        TypeError: if ``history_len`` or ``margin`` is not an int, or ``algo`` not a string.
        ValueError: if ``fp8_dtype`` is not an FP8 dtype, or a value is outside what :class:`FP8Recipe` allows.
    """

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        history_len: int,
        margin: int,
        algo: str,
        delayed: bool,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        history_len, margin, algo = as_count(history_len), as_count(margin), as_choice(algo)
        check_state_settings(fp8_dtype, history_len, margin, algo)
        if type(delayed).__name__ not in ("bool", "bool_"):  # a Python or NumPy bool
            raise TypeError(
                f"ScalingState(delayed={delayed!r}) must be a bool: True for delayed scaling (FP8Recipe "
                "scaling='delayed'), False for current scaling"
            )
        delayed = bool(delayed)
        self.fp8_dtype = fp8_dtype
        self.margin = margin
        self.algo = algo
        self.delayed = delayed
        # Python flag, not a tensor: the first delayed cast has no history and uses the tensor's own amax. Set by the
        # first cast whose amax carries information, finite and > 0 (note_cast); a cast of an empty or all-zero tensor
        # (amax 0) or of one with inf or NaN (recorded in the history as 0) leaves it unset. Set again when a saved
        # state is loaded (lightning_fp8.state).
        self.initialized = False
        # Set (at run time) by a traced forward that marked this grad_output role initialized; cleared once a cast
        # recorded an amax, found by the next trace (backward_cast_pending) or eager cast (_check_traced_mark).
        self.marked_by_trace = False
        _STATES.add(self)
        f32 = {"dtype": torch.float32, "device": device}
        i64 = {"dtype": torch.int64, "device": device}
        # Ordinary tensors even when the layer is built under torch.inference_mode(): every forward updates them in
        # place, which torch refuses for inference tensors outside inference mode (nn.Linear, which only reads its
        # parameters, runs there).
        with torch.inference_mode(False):
            self.register_buffer("scale", torch.ones((), **f32), persistent=False)
            self.register_buffer("amax_history", torch.zeros(history_len, **f32), persistent=False)
            self.register_buffer("amax", torch.zeros((), **f32), persistent=False)
            self.register_buffer("saturation", torch.zeros((), **f32), persistent=False)
            self.register_buffer("nonfinite_count", torch.zeros((), **i64), persistent=False)
            self.register_buffer("casts", torch.zeros((), **i64), persistent=False)

    def __setstate__(self, state: dict) -> None:  # deepcopy, pickle: a new object
        super().__setstate__(state)
        self.__dict__.setdefault("marked_by_trace", False)  # pickled before it existed
        _STATES.add(self)

    def extra_repr(self) -> str:
        kind = "delayed" if self.delayed else "current"
        return f"{self.fp8_dtype}, {kind}, history={self.amax_history.numel()}, margin={self.margin}"

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.scale.reciprocal()

    def quantize(
        self,
        x: torch.Tensor,
        transpose: bool = False,
        current: bool | None = None,
        unscale: torch.Tensor | None = None,
        column_sum: bool = False,
        activation: str | None = None,
        activation_input: torch.Tensor | None = None,
        activation_scale_inv: torch.Tensor | None = None,
        keep_input: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Cast ``x`` to FP8 with this role's scale and record the cast's statistics.

        Delayed scaling uses the scale from earlier casts (until a cast has seen a finite amax > 0, with no history
        yet, a cast uses the tensor's own amax); current scaling computes this tensor's amax first.

        Args:
            x: the high-precision tensor (2-D when ``transpose``). The cast computes ``x.float() * scale``: a
                float64 ``x`` is rounded to fp32 first (a value within fp32 rounding of an FP8 midpoint can round
                the other way than from its float64 value).
            transpose: also return the transposed FP8 copy.
            current: force (True) or forbid (False) computing this tensor's amax first. ``None`` decides
                from :meth:`needs_current_scale` and marks the state initialized when the cast's amax is finite and
                > 0 (:meth:`note_cast`); code traced by ``torch.compile`` inside an autograd.Function passes it
                explicitly and sets ``initialized`` outside.
            unscale: a 0-dim power of two when ``x`` holds ``t * unscale`` (FP8AdamW's scaled fp16 master in a
                weight's storage): the cast reads ``x`` as it is, and the statistics, the scale and the returned
                ``scale_inv`` describe ``t``. Only for a cast that computes its own scale (``current=True``, or
                ``None`` on a current-scaling state) of a state with a history of length 1, as weights' are: the
                stored scale describes ``t``, so a later delayed cast of ``x`` would saturate, and each such cast
                divides the whole history by ``unscale``. Its value is not read here (a host sync per weight cast):
                one that is no positive power of two gives that scale and those statistics, wrong.
            column_sum: also return the fp32 column sums of 2-D ``x`` (a linear layer's bias gradient), computed by
                the cast from the values it reads (``kernels/reference.py: column_sum_ref`` fixes the order).
            activation: cast an activation of 2-D ``x`` instead of ``x``, computed in fp32 as the cast reads ``x``
                (its high-precision result is never written): ``"gelu"`` casts ``gelu(x)`` (the exact, erf GELU);
                ``"gelu_backward"`` casts ``x * gelu'(activation_input)``, ``x`` being the gradient of a GELU's output
                and ``activation_input`` (``x``'s shape) that GELU's input. Statistics, scale and column sums are
                those of the activation. :class:`lightning_fp8.FP8MLP` fuses its GELU this way.
            activation_scale_inv: with an FP8 ``activation_input`` (``"gelu_backward"``): its scale_inv, 0-dim fp32;
                the cast reads the values it stands for.
            keep_input: with ``activation="gelu"``: also cast ``x`` itself, in the same pass, with this cast's scale
                divided by ``2**kernels.reference.PRE_ACTIVATION_HEADROOM`` and at most ``PRE_ACTIVATION_MAX_SCALE``
                (statistics not recorded): the GELU's input kept in FP8 for the backward (``FP8MLP(fp8_hidden=True)``).

        Returns:
            ``(x_fp8, x_fp8_t, scale_inv)``: ``x_fp8_t`` is empty unless ``transpose``; with ``column_sum``,
            ``(x_fp8, x_fp8_t, scale_inv, column_sums)``; with ``keep_input``, ``(x_fp8, x_fp8_t, scale_inv,
            input_fp8)``, ``input_fp8``'s scale_inv being ``kernels.reference.kept_input_scale_inv(scale_inv)``.

        Raises:
            TypeError: for ``x`` that is not a dense (strided) tensor of float16, bfloat16, float32 or float64, or
                an ``unscale`` that is not a one-element float32 tensor, or a flag (``transpose``, ``current``,
                ``column_sum``, ``keep_input``) that is not a bool (``current`` may be None) (nothing is changed).
            ValueError: for ``x`` or ``unscale`` on another device than the state, ``column_sum`` or ``transpose``
                of a tensor that is not 2-D, an ``activation_input`` or ``activation_scale_inv`` without the
                ``activation`` that reads it (nothing is changed); for ``unscale`` with a cast that does not compute
                its own scale (``current=False``, or ``None`` on a delayed-scaling state) or a history longer than 1.
            RuntimeError: under a ``torch.func`` transform (``vmap``, ``grad``, ...) or ``torch.jit.trace``, as
                :class:`~lightning_fp8.FP8Linear` (nothing is changed).
        """
        if not torch.compiler.is_compiling():  # traced, x comes from a checked layer (a backward may not read layout)
            # As FP8Linear's: a cast updates this state in place, which functorch cannot transform (its own errors, or
            # the Triton path's "Cannot access storage of BatchedTensorImpl", said nothing of FP8).
            check_no_functorch("ScalingState.quantize")
            check_castable(x, "ScalingState.quantize")
            for name, flag in (("transpose", transpose), ("column_sum", column_sum), ("keep_input", keep_input)):
                check_flag("ScalingState.quantize", name, flag)
            if current is not None:
                check_flag("ScalingState.quantize", "current", current)
            if x.device != self._buffers["scale"].device:
                raise ValueError(
                    f"ScalingState.quantize: x is on {x.device} but the scaling state on "
                    f"{self._buffers['scale'].device}: move x, or the state (with its module) to x's device"
                )
        if unscale is not None:
            check_unscale(self, current, unscale)
        for flag, name in ((column_sum, "column_sum"), (transpose, "transpose")):
            if flag and x.dim() != 2:
                raise ValueError(
                    f"ScalingState.quantize({name}=True) needs a 2-D tensor, got shape {tuple(x.shape)}: reshape it to "
                    "(rows, columns) first"
                )
        if activation is not None or keep_input or activation_input is not None or activation_scale_inv is not None:
            activation_input = check_activation(
                x, activation, activation_input, activation_scale_inv, keep_input, column_sum
            )
        note = current is None
        if note:
            current = self.needs_current_scale()
        out = self._quantize(
            x, transpose, current, unscale, column_sum, activation, activation_input, activation_scale_inv, keep_input
        )
        if note:
            # An empty tensor (a micro-batch or an MoE expert without tokens) or an all-zero one has amax 0: it leaves
            # the history as empty as it was, so the next cast must still use its own amax (note_cast).
            self.note_cast(x.numel())
        return out

    def _quantize(
        self,
        x: torch.Tensor,
        transpose: bool,
        current: bool,
        unscale: torch.Tensor | None,
        column_sum: bool,
        activation: str | None,
        activation_input: torch.Tensor | None,
        activation_scale_inv: torch.Tensor | None,
        keep_input: bool,
    ) -> tuple[torch.Tensor, ...]:
        x, mode = x.detach().contiguous(), (self.fp8_dtype, self.margin, self.algo == "max", self.delayed)
        if torch.compiler.is_compiling():
            buffers = self.cast_buffers()
            if FUSED_CASTS and self.delayed and unscale is None and not column_sum and activation is None and x.numel():
                return compiled_casts.fused_quantize(x, buffers, *mode, current, transpose)
            out = compiled_casts.quantize_op_for(x, TRACE_TRITON_CASTS)(
                x, *buffers, *mode, current, transpose, unscale, column_sum, activation or "", activation_input,
                activation_scale_inv, keep_input,
            )  # fmt: skip
            return out if column_sum or keep_input else out[:3]
        b = self._buffers  # one dict lookup per buffer, not a Module.__getattr__ (this runs for every cast)
        buffers = (b["amax_history"], b["scale"], b["amax"], b["saturation"], b["nonfinite_count"], b["casts"])
        return ops.quantize(
            x, *buffers, *mode, current, transpose, unscale, column_sum=column_sum, activation=activation,
            activation_input=activation_input, activation_scale_inv=activation_scale_inv, keep_input=keep_input,
        )  # fmt: skip

    def cast_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers a cast updates, in the order the cast ops take them: ``(amax_history, scale, amax, saturation,
        nonfinite_count, casts)``."""
        return (self.amax_history, self.scale, self.amax, self.saturation, self.nonfinite_count, self.casts)

    def _apply(self, fn, recurse: bool = True):
        # Module.half() / .to(dtype) / .bfloat16() convert every floating buffer; scales and amaxes stay fp32 (a
        # grad_output scale of 2**20 is inf in fp16). The buffers follow the module to its device, in their dtype.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, new in self._buffers.items():
            old = before.get(name)
            if new is not None and old is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        # Made under torch.inference_mode() (.to(device), to_empty() there), they would be inference tensors, which
        # the in-place updates of every forward cannot touch outside it (see __init__): ordinary copies instead.
        if any(b is not None and b.is_inference() for b in self._buffers.values()):
            with torch.inference_mode(False):
                for name, buf in self._buffers.items():
                    if buf is not None and buf.is_inference():
                        self._buffers[name] = buf.clone()
        # Off the meta device (to_empty(), FSDP's materialization) the buffers are uninitialized memory: a garbage amax
        # history would set the scales of the next casts. load_state_dict does not fill them (they are not in the
        # state_dict) and reset_parameters() is not always called: start from a fresh state, as on a real device.
        was_meta, is_meta = ([b.is_meta for b in d.values() if b is not None] for d in (before, self._buffers))
        if any(was_meta) and not any(is_meta):
            self.reset()
        elif not any(is_meta) and any(new is not before.get(name) for name, new in self._buffers.items()):
            # A module under two parents is applied once through each: to_empty()'s second visit replaces the state
            # the first one reset with uninitialized memory again. A state that held no cast is made fresh again
            # (what any faithful copy of it holds too).
            if not self.initialized and _holds_no_cast(before):
                self.reset()
        return self

    def reset(self) -> None:
        """Forget every cast: scale 1, empty history, zero statistics; the next cast uses its own amax."""
        # The checkpoint loads recorded for this state go with the casts (its count could climb back to a recorded
        # one); a state that never cast keeps them (a fresh model moved to its device between two loads).
        held_casts = not self.casts.is_meta and bool(self.casts)
        with torch.no_grad():
            for name in ("amax_history", "amax", "saturation", "nonfinite_count", "casts"):
                getattr(self, name).zero_()
            self.scale.fill_(1.0)
        self.initialized = False
        self.marked_by_trace = False
        _SEEN_AMAX.pop(self, None)
        if held_casts:
            load_pairing.forget_state(self)

    def reset_parameters(self) -> None:
        """:meth:`reset`, under the name that meta-device materialization calls on every module with buffers after
        ``to_empty()`` (Lightning's ``_materialize_meta_tensors`` and ``_materialize_distributed_module``, FSDP1's
        materialization without a ``param_init_fn``, the FSDP2 recipe ``for m in model.modules():
        m.reset_parameters()``): ``to_empty`` leaves the buffers uninitialized memory, whose garbage amax history would
        set the scales."""
        self.reset()
