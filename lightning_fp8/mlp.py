"""FP8MLP: ``proj(gelu(fc(x)))`` with FP8 GEMMs, the GELU fused into the casts around it.

In a transformer's MLP the GELU sits between two FP8 linear layers, and each side of it is a cast::

    forward    h = fc(x)             (bf16)   a = gelu(h)       (bf16, written)    a_fp8, a_fp8^T = cast(a)
    backward   da = dgrad of proj    (bf16)   dh = da * gelu'(h) (bf16, written)   dh_fp8, dh_fp8^T = cast(dh)

Separately, the GELU writes its output (and the backward its input gradient) in high precision and the cast reads it
back: two bytes written and two read per element, each way, of the widest activations of the model (tokens x
4 * width). Here the casts compute the GELU (and its derivative) from what they read, ``h`` (and ``da``), and write only
the FP8 copies (``ScalingState.quantize(activation=...)``, kernels/cast_kernels.py: ``_activation``). The GELU's output
is never written; the backward keeps ``h`` (as autograd keeps it for the GELU anyway) and the FP8 copies the GEMMs
need, as two FP8Linears would.

The two layers are ordinary :class:`~lightning_fp8.FP8Linear` modules (``fc``, ``proj``): their parameters, scaling
states, state_dict keys, FP8AdamW's O2 masters and weight copies, statistics and callbacks are those of the unfused
layers. Where the fused path cannot run the module calls them one after another (``proj(gelu(fc(x)))``): DTensor
weights (tensor parallelism), forward hooks on ``fc`` or ``proj`` (FSDP2's ``fully_shard`` of one of them, say),
which the fused path would skip, a layer replaced by a plain ``nn.Linear`` (kept in high precision), or one layer
serving as both ``fc`` and ``proj``. The fused path always keeps the input's transposed FP8 copy for the backward and
always takes the bias gradients from the gradient casts (matmul.py's SAVE_INPUT_TRANSPOSE_COMPILED and
FUSED_BIAS_GRAD, benchmark switches of FP8Linear, do not apply to it).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import ops, weight_cache
from lightning_fp8.autograd_rules import check_no_forward_ad, check_no_functorch, once_differentiable
from lightning_fp8.eligibility import check_wrappable
from lightning_fp8.kernels.reference import kept_input_scale_inv
from lightning_fp8.linear import (
    FP8Linear,
    _is_dtensor,
    backward_gemms,
    current_flags,
    forward_gemm,
    grad_output_current,
    note_casts,
    output_dtype,
    tokens_2d,
)
from lightning_fp8.linear_checks import _ACTIVATION_DTYPES, check_input, check_not_reparametrized, check_shapes
from lightning_fp8.optim import master
from lightning_fp8.recipe import FP8Recipe, check_flag, resolve_recipe
from lightning_fp8.recompute import (
    ForwardCall,
    backward_ran,
    cast_current,
    forward_call,
    replay_scales,
    restore_buffers,
)


class _FP8GeluMLP(torch.autograd.Function):
    """``y = gelu(x @ w1^T + b1) @ w2^T + b2`` with FP8 operands; ``x`` is 2-D (tokens, in_features)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor | None,
        w2: torch.Tensor,
        b2: torch.Tensor | None,
        fc: nn.ModuleDict,
        proj: nn.ModuleDict,
        out_dtype: torch.dtype,
        current_fc: tuple[bool, bool],
        current_proj: tuple[bool, bool],
        master_scale_fc: torch.Tensor | None,
        master_scale_proj: torch.Tensor | None,
        cache_key_fc: int | None = None,
        cache_key_proj: int | None = None,
        call: tuple[ForwardCall | None, bool] = (None, False),
        fp8_hidden: bool = False,
        grad_enabled: bool = True,
    ):
        # `current_*`: that layer's (input, grad_output) casts use their tensor's own amax (linear.current_flags).
        # `call`: recompute.forward_call (an activation-checkpoint recompute repeats the forward's casts).
        # `fp8_hidden`: keep h in FP8 for the backward, which recomputes gelu(h)'s transposed copy from it.
        # `grad_enabled`: as matmul._FP8Matmul's: without it no backward runs, and nothing is cast for one.
        record, replaying = call
        need_x, need_w1, need_w2 = (t.requires_grad and grad_enabled for t in (x, w1, w2))
        need_h = need_x or need_w1 or (b1 is not None and b1.requires_grad and grad_enabled)
        states = (fc["input"], proj["input"], fc["weight"], proj["weight"])
        saved = replay_scales(record, states) if replaying else None
        x_fp8, x_fp8_t, x_scale_inv = fc["input"].quantize(x, need_w1, cast_current(current_fc[0], call))
        h, w1_saved, w1_meta = forward_gemm(
            x_fp8, x_scale_inv, w1, b1, fc, need_x, master_scale_fc, out_dtype, cache_key_fc
        )
        # gelu(h), cast as it is computed: the GELU's high-precision output is never written.
        keep = fp8_hidden and need_h  # without fc's gradients only gelu(h)'s copy is kept: one byte already
        a_fp8, a_fp8_t, a_scale_inv, *kept = proj["input"].quantize(
            h, need_w2 and not keep, cast_current(current_proj[0], call), activation="gelu", keep_input=keep
        )
        y, w2_saved, w2_meta = forward_gemm(
            a_fp8, a_scale_inv, w2, b2, proj, need_h, master_scale_proj, out_dtype, cache_key_proj
        )
        restore_buffers(saved)
        if record is not None and not replaying:
            record.scale_invs = (x_scale_inv, a_scale_inv)
        ctx.record = None if replaying else record
        if keep:  # h as FP8 (scale_inv: reference.kept_input_scale_inv) in place of h and gelu(h)'s FP8 copy
            h, a_fp8_t = kept[0], None
        ctx.save_for_backward(x_fp8_t, x_scale_inv, h if need_h else None, a_fp8_t, a_scale_inv, *w1_saved, *w2_saved)
        ctx.hidden_fp8_dtype = proj["input"].fp8_dtype if keep else None
        ctx.split = len(w1_saved)
        ctx.states = (fc["grad_output"], proj["grad_output"])
        ctx.grad_current = (current_fc[1], current_proj[1])
        ctx.weight_metas = (w1_meta, w2_meta)
        ctx.dtypes = (x.dtype, w1.dtype, out_dtype, w2.dtype)
        ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        return y

    @staticmethod
    @once_differentiable  # the FP8 casts are not differentiable: differentiating the gradients again raises
    def backward(ctx: Any, dy: torch.Tensor):
        x_fp8_t, x_scale_inv, h, a_fp8_t, a_scale_inv, *w_saved = ctx.saved_tensors
        backward_ran(ctx.record)
        w1_saved, w2_saved = w_saved[: ctx.split], w_saved[ctx.split :]
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_h = any(ctx.needs_input_grad[:3])
        h_scale_inv = None
        if ctx.hidden_fp8_dtype is not None:  # h kept in FP8: gelu(h)'s transposed copy again, from it (one pass)
            h_scale_inv = kept_input_scale_inv(a_scale_inv)
            if need_w2:
                a_fp8_t = ops.recast_activation_transposed(
                    h, h_scale_inv, torch.reciprocal(a_scale_inv), ctx.hidden_fp8_dtype, "gelu"
                )
        # proj: the bias gradient (fp32 column sums of dy) from the cast, which reads dy anyway.
        dy_fp8, dy_fp8_t, dy_scale_inv, db2 = ctx.states[1].quantize(
            dy.contiguous(), need_w2, grad_output_current(ctx.grad_current[1]), column_sum=True
        )
        da, dw2 = backward_gemms(
            (dy_fp8, dy_fp8_t, dy_scale_inv), a_fp8_t, a_scale_inv, w2_saved, ctx.weight_metas[1], need_h,
            need_w2, ctx.dtypes[2:],
        )  # fmt: skip
        dx = dw1 = db1 = None
        if need_h:  # fc: its output gradient da * gelu'(h), cast as it is computed, with b1's gradient (column sums)
            current = grad_output_current(ctx.grad_current[0])
            dh_fp8, dh_fp8_t, dh_scale_inv, db1 = ctx.states[0].quantize(
                da, need_w1, current, column_sum=True, activation="gelu_backward", activation_input=h,
                activation_scale_inv=h_scale_inv,
            )  # fmt: skip
            dx, dw1 = backward_gemms(
                (dh_fp8, dh_fp8_t, dh_scale_inv), x_fp8_t, x_scale_inv, w1_saved, ctx.weight_metas[0], need_x,
                need_w1, ctx.dtypes[:2],
            )  # fmt: skip
            db1 = ops.narrowed(db1, ctx.bias_dtypes[0]) if need_b1 else None
        db2 = ops.narrowed(db2, ctx.bias_dtypes[1]) if need_b2 else None
        return dx, dw1, db1, dw2, db2, None, None, None, None, None, None, None, None, None, None, None, None


def _has_hooks(module: nn.Module) -> bool:
    # The fused path calls neither layer: hooks registered on them run only through the layers themselves.
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)  # fmt: skip


class FP8MLP(nn.Module):
    """A transformer MLP, ``proj(gelu(fc(x)))``, with FP8 GEMMs and the GELU fused into the FP8 casts around it.

    The layers are :class:`~lightning_fp8.FP8Linear` modules ``fc`` (``in_features -> hidden_features``) and ``proj``
    (``hidden_features -> out_features``): the same parameters, state_dict keys and FP8 scaling states as the unfused
    MLP (``fc.fp8_scaling["input"]``... ; ``proj.fp8_scaling["input"]`` records the GELU's output). The GELU is the
    exact one (``nn.GELU()``, ``approximate="none"``), computed in fp32 by the casts: its output is never rounded to the
    activation dtype before its FP8 cast. Build one from an existing MLP's layers with :meth:`from_modules`.

    Where the fused path cannot run (DTensor weights, forward or backward hooks on ``fc`` or ``proj``, a layer that is
    not an FP8Linear: ``mlp.fc = nn.Linear(...)`` keeps it in high precision, one layer as both ``fc`` and ``proj``),
    the module computes
    ``proj(F.gelu(fc(x)))`` with the same layers (and ``fp8_hidden`` does not apply). First casts, double backward and
    activation checkpointing behave as in :class:`~lightning_fp8.FP8Linear` (see there), with one gap: the fused
    backward keeps no graph of the GELU's input, so a second-order term taken with respect to the input alone of a loss
    linear in the MLP's output (``torch.autograd.functional.hessian(lambda t: mlp(t).sum(), x)``) comes out zero
    instead of raising.

    ``fp8_hidden=True`` keeps less for the backward: the GELU's input ``h`` (tokens x hidden) in FP8 (the GELU output's
    format, its scale divided by ``2**4`` and at most ``2**5``: negative inputs down to -16 times that scale's amax, and
    at least down to -14, where GELU and its derivative are 0 in fp32, stay unsaturated), one
    byte per element in place of ``h`` in the activation dtype and ``gelu(h)``'s transposed FP8 copy (three bytes in
    bf16). The forward writes that copy in the pass that casts ``gelu(h)``; the backward takes ``gelu'`` of the FP8
    values and recomputes ``gelu(h)``'s transposed copy from them (a pass reading and writing a byte per element), so
    ``proj``'s weight gradient and ``fc``'s output gradient see ``h`` rounded to FP8 (the forward is unchanged, bit
    for bit). As DeepSeek-V3 keeps its SwiGLU inputs in FP8 to save activation memory. The scale's cap of ``2**5``
    keeps ``h`` to steps of ``2**-14``: pre-activations under about ``5e-4`` lose precision in the backward (most of
    it near ``1e-4``; an input scaled far down), and values under ``2**-15`` are 0; keep ``fp8_hidden=False`` there.

    Args:
        in_features, hidden_features: as the two ``nn.Linear`` layers; every size must be a multiple of 16.
        out_features: ``proj``'s output size (default ``in_features``).
        bias, device, dtype: as ``nn.Linear``, for both layers.
        recipe: an :class:`~lightning_fp8.FP8Recipe` or recipe name (default ``"fp8-lm"``), for both layers.
        fp8_hidden: keep the GELU's input in FP8 for the backward (default False: in the activation dtype).

    Example:
        >>> mlp = FP8MLP(64, 256)
        >>> mlp(torch.randn(4, 10, 64)).shape
        torch.Size([4, 10, 64])
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: FP8Recipe | str | None = None,
        fp8_hidden: bool = False,
    ) -> None:
        super().__init__()
        out = in_features if out_features is None else out_features
        # Named here, type and value: FP8Linear's own errors would name its out_features for hidden_features=20 or 64.0.
        for name, size in (("in_features", in_features), ("hidden_features", hidden_features), ("out_features", out)):
            if isinstance(size, bool) or not isinstance(size, numbers.Integral):
                raise TypeError(f"FP8MLP({name}={size!r}): must be an int (a multiple of 16)")
            if size < 0 or size % 16:
                raise ValueError(f"FP8MLP({name}={size}): FP8 GEMMs need sizes that are multiples of 16 (and >= 0)")
        if dtype is not None and dtype not in _ACTIVATION_DTYPES:  # FP8Linear's own error would name FP8Linear
            raise TypeError(
                f"FP8MLP(dtype={dtype!r}): FP8 layers keep float32, bfloat16 or float16 parameters; pass one of them "
                f"(for a float64 MLP keep nn.Linear layers: convert_to_fp8 leaves them as they are)"
            )
        check_flag("FP8MLP", "bias", bias)  # as the sizes: FP8Linear's checks would name FP8Linear(bias=...)
        recipe = resolve_recipe(recipe, "FP8MLP(recipe=...)")
        self.fc = FP8Linear(in_features, hidden_features, bias, device, dtype, recipe=recipe)
        self.proj = FP8Linear(hidden_features, out, bias, device, dtype, recipe=recipe)
        self.fp8_hidden = fp8_hidden

    @classmethod
    def from_modules(
        cls, fc: nn.Linear, proj: nn.Linear, recipe: FP8Recipe | str | None = None, *, fp8_hidden: bool = False
    ) -> FP8MLP:
        """An FP8MLP computing ``proj(gelu(fc(x)))`` with these layers: ``nn.Linear`` layers are wrapped by
        :meth:`FP8Linear.from_linear` (sharing their parameters: optimizers that hold them keep working), FP8Linear
        layers are taken as they are (with their recipe and scaling state; ``recipe`` applies to the wrapped ones).
        ``fp8_hidden`` as in the constructor. One layer passed as both is wrapped once; each layer keeps its
        train / eval mode.

        The activation is always the exact (erf) GELU: this sees only the two layers, not what the MLP computed
        between them. Do not use it for an MLP with another activation (ReLU, SwiGLU: its outputs would change
        silently); a tanh-approximated GELU (GPT-2) changes by less than FP8's rounding.

        Forward and backward hooks of a wrapped layer carry over to its FP8Linear (the module then calls the layers one
        after another, so that they run).

        Raises:
            TypeError: if a layer is not an ``nn.Linear`` or has a weight that is not float32, bfloat16 or float16,
                or ``recipe`` is not a recipe, a recipe name or None.
            ValueError: for an unknown recipe name (also where both layers are FP8Linear already), if ``fc``'s
                output size is not ``proj``'s input size, a size is not a multiple of 16, or a layer to wrap is one
                :meth:`FP8Linear.from_linear` refuses (a reparametrized weight, a subclass of ``nn.Linear`` such as a
                LoRA layer, ...: the FP8 layer would drop what it adds).
        """
        for name, layer in (("fc", fc), ("proj", proj)):
            if not isinstance(layer, nn.Linear):
                raise TypeError(f"FP8MLP.from_modules: {name} must be an nn.Linear (or FP8Linear), got {type(layer)}")
        # A bad recipe is refused even where both layers are FP8Linear already.
        recipe = resolve_recipe(recipe, "FP8MLP.from_modules(recipe=...)")
        if fc.out_features != proj.in_features:
            raise ValueError(
                f"FP8MLP.from_modules: fc gives {fc.out_features} features but proj takes {proj.in_features}; "
                "pass the MLP's two layers in order (fc: width -> hidden, proj: hidden -> width)"
            )
        for name, layer in (("fc", fc), ("proj", proj)):  # both before either is wrapped
            if not isinstance(layer, FP8Linear):
                check_wrappable(layer, f"FP8MLP.from_modules ({name})")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.fc = fc if isinstance(fc, FP8Linear) else FP8Linear.from_linear(fc, recipe)
        wrapped = proj if isinstance(proj, FP8Linear) else None if proj is fc else FP8Linear.from_linear(proj, recipe)
        new.proj = new.fc if proj is fc else wrapped
        new.fp8_hidden = fp8_hidden
        new.training = fc.training  # (the module's own flag; its layers keep theirs)
        new.fc.train(fc.training)
        new.proj.train(proj.training)
        return new

    @property
    def fp8_hidden(self) -> bool:
        """Keep the GELU's input in FP8 for the backward (see the class docstring); a bool, checked when set."""
        return self._fp8_hidden

    @fp8_hidden.setter
    def fp8_hidden(self, value: bool) -> None:
        self._fp8_hidden = check_flag("FP8MLP", "fp8_hidden", value)

    def extra_repr(self) -> str:
        return "fp8_hidden=True" if self.fp8_hidden else ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, proj = self.fc, self.proj
        # A layer put back to nn.Linear (kept in high precision): the fused path needs two FP8Linear layers.
        # Each FP8Linear checks itself (reparametrization, functorch) in its own forward. One layer as both fc and
        # proj: the fused path's two input casts would share one scaling state (an activation-checkpoint recompute
        # replayed both with the last one's scale); called twice, the layer records and recomputes each call.
        if fc is proj or not (isinstance(fc, FP8Linear) and isinstance(proj, FP8Linear)):
            return proj(F.gelu(fc(x)))
        check_not_reparametrized(fc)
        check_not_reparametrized(proj)
        check_no_functorch("FP8MLP")
        w1, w2 = fc.weight, proj.weight
        if _is_dtensor(w1) or _is_dtensor(w2) or _has_hooks(fc) or _has_hooks(proj):
            return proj(F.gelu(fc(x)))
        check_input(fc, x, w1, "FP8MLP")
        check_no_forward_ad("FP8MLP", w2, proj.bias)
        check_shapes(proj, w2, "FP8MLP")
        if fc.out_features != proj.in_features:  # a layer replaced by one of another size (checked before any cast)
            raise ValueError(
                f"FP8MLP: fc gives {fc.out_features} features but proj takes {proj.in_features} (a layer was replaced "
                f"by one of another size); give proj in_features={fc.out_features}, or fc out_features="
                f"{proj.in_features}"
            )
        if w2.dtype not in _ACTIVATION_DTYPES:  # fc's is checked with the input
            raise TypeError(f"FP8MLP proj's weight has dtype {w2.dtype}: use float32, bfloat16 or float16 parameters")
        if w2.device != w1.device:
            raise ValueError(f"FP8MLP: fc's weight is on {w1.device} but proj's on {w2.device}; move the module")
        out_dtype = output_dtype(x)
        x_2d = x if x.dim() == 2 else tokens_2d(x)
        fc_states, proj_states = fc.fp8_scaling, proj.fp8_scaling
        current = (current_flags(fc_states), current_flags(proj_states))
        scales = (
            master.forward_master_scale(w1, "FP8MLP fc", fc),
            master.forward_master_scale(w2, "FP8MLP proj", proj),
        )
        keys = (weight_cache.compiled_key(w1, fc_states["weight"]),
                weight_cache.compiled_key(w2, proj_states["weight"]))  # fmt: skip
        call = forward_call(fc_states["input"])
        y = _FP8GeluMLP.apply(
            x_2d, w1, fc.bias, w2, proj.bias, fc_states, proj_states, out_dtype, *current, *scales, *keys, call,
            self.fp8_hidden, torch.is_grad_enabled(),
        )  # fmt: skip
        # proj's input is the GELU of fc's output: tokens x hidden (not empty where x is empty for in_features=0,
        # gelu(fc.bias) on every token). fc's output gradient is cast only where its input or parameters need
        # gradients (_FP8GeluMLP's need_h): else a traced forward must not use up its first cast.
        fc_backward = x_2d.requires_grad or w1.requires_grad or (fc.bias is not None and fc.bias.requires_grad)
        fc_grad = x_2d.shape[0] * fc.out_features
        note_casts(fc_states, x_2d, y, backward=y.requires_grad and fc_backward, grad_numel=fc_grad)
        note_casts(proj_states, x_2d, y, numel=x_2d.shape[0] * proj.in_features)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], proj.out_features)
