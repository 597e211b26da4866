"""The one dispatch point between Triton kernels and their PyTorch references, and the FP8 GEMM.

On a CUDA device of compute capability 8.9+ with Triton, casts run the fused Triton kernels; elsewhere (CPU in CI,
a laptop, GPUs without Triton's E4M3 type such as the A100) the references in :mod:`lightning_fp8.kernels.reference`
run the same numerics. GEMMs use
``torch._scaled_mm`` on GPUs with FP8 tensor cores (sm89+) and an emulation (dequantize, fp32 matmul)
elsewhere. ``LIGHTNING_FP8_KERNELS=reference`` forces the references (debugging); ``=triton`` forces
Triton even on CPU tensors (tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from lightning_fp8 import cast_checks
from lightning_fp8.formats import FP8_DTYPES
from lightning_fp8.kernels import reference, reference_grad_cast
from lightning_fp8.trace_marks import _tracing

# Looked up once, at import: torch.compile traces use_triton, and dynamo (torch 2.11) refuses to trace find_spec.
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_FOUND


def _kernel_mode() -> str:
    mode = os.environ.get("LIGHTNING_FP8_KERNELS", "auto")
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"LIGHTNING_FP8_KERNELS={mode!r} is not supported: use 'auto', 'triton' or 'reference'")
    return mode


def use_triton(t: torch.Tensor) -> bool:
    """Whether kernels on tensor ``t`` run in Triton (CUDA + Triton, unless overridden by the environment)."""
    mode = _kernel_mode()
    if mode == "reference":
        return False
    if not torch.compiler.is_compiling() and _tracing(t):
        # A FakeTensorMode forward or make_fx's trace runs the eager code on tensors without data: a Triton launch
        # would read their fake addresses (an illegal memory access on a GPU). The reference's ops trace (dynamo's
        # casts take their own ops: compiled_casts).
        return False
    if mode == "triton":
        if not _TRITON_FOUND:  # (the first kernel's import would fail with a bare ModuleNotFoundError)
            raise RuntimeError(
                "LIGHTNING_FP8_KERNELS=triton, but Triton is not installed: install it (pip install triton), or unset "
                "LIGHTNING_FP8_KERNELS (or set it to 'auto' or 'reference') to cast with the PyTorch references"
            )
        if t.is_cuda and not fp8_device(t.device):
            raise RuntimeError(
                f"LIGHTNING_FP8_KERNELS=triton, but {no_fp8_kernels(t.device)}: unset LIGHTNING_FP8_KERNELS (or "
                "set it to 'auto' or 'reference') to cast with the PyTorch references on this GPU"
            )
        # Forced, but not on the meta device: its tensors have no data to launch on (a model built there for shape
        # propagation runs the references' ops, as under "auto").
        return not t.is_meta
    # Below compute capability 8.9 (A100, V100) Triton has no E4M3 type: the PyTorch references cast there, as the
    # GEMMs are emulated there (has_fp8_gemm).
    return t.is_cuda and triton_available() and fp8_device(t.device)


def out_of_modes_sight() -> contextlib.AbstractContextManager:
    """Around a Triton path (never taken under a tracing mode: :func:`use_triton`): the tensors its host code makes
    (outputs, zeroed workspaces, launch tables) are made out of any dispatch mode's sight. Selective activation
    checkpointing's caching mode saw them as ops: a policy saving every op (or ``aten.zeros``) kept them from the
    forward and handed them to the recompute's kernels, which write them again (on the CPU under the interpreter
    "Tensor cached during selective activation checkpoint has been mutated", on a GPU an illegal memory access). The
    kernels themselves are no ops a mode sees: the recompute runs them again either way."""
    # Traced by dynamo (a compiled backward's recast_transposed), the Triton paths are triton_ops of the graph, and the
    # stack query cannot be traced ("torch.* op returned non-Tensor"): compiled FP8Linear backwards failed on that path.
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() == 0:  # the eager cast path's usual case
        return contextlib.nullcontext()
    return _disable_current_modes()


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Around a Triton path for CUDA tensor ``t``: ``t``'s device made the current one where it is not. Triton launches
    on the current device, with its stream: a model on another GPU than the current one (``model.to("cuda:1")``
    without ``torch.cuda.set_device(1)``) failed ("Pointer argument cannot be accessed from Triton"), where torch's
    own ops follow their tensors. Under torch.compile the compiled code guards its device itself."""
    if not t.is_cuda or torch.compiler.is_compiling() or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _triton_cast(x: torch.Tensor) -> bool:
    """Whether a cast of ``x`` runs in Triton: its kernels read 16- and 32-bit floats; float64 (a finite value past
    fp32's range saturates, where fp32 would overflow to inf) takes the reference's ops, on any device."""
    return x.dtype != torch.float64 and use_triton(x)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as 0-dim fp32 (NaN counts as inf)."""
    if _triton_cast(x):
        from lightning_fp8.kernels import cast

        with out_of_modes_sight(), on_device(x):
            return cast.amax(x)
    cast_checks.check_castable(x, "amax")  # the Triton path checks its own
    return reference.amax_ref(x)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast turned off on ``device``'s type; nothing on the meta device, which has no autocast (shape
    propagation, ``torch.device("meta")`` models)."""
    return torch.autocast(device.type, enabled=False) if device.type != "meta" else contextlib.nullcontext()


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device``'s type, or None where it is off (or the device is meta)."""
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


_AMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what check_castable accepts


def amaxes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`amax` of each tensor (the same values), in a few launches per device instead of one or two per tensor."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype not in _AMAX_DTYPES:  # as amax: the norm took complex magnitudes, and named no fix for the rest
            cast_checks.check_castable(t, f"amaxes (tensor {i})")
        if t.numel() == 0:  # an inf norm has no identity
            out[i] = torch.zeros((), dtype=torch.float32, device=t.device)
        else:
            by_device.setdefault(t.device, []).append(i)
    for device, indices in by_device.items():
        with autocast_off(device):  # an optimizer step may run under autocast (fp16 grads)
            norms = torch.stack(torch._foreach_norm([tensors[i].detach() for i in indices], float("inf"))).float()
        for i, value in zip(indices, torch.where(torch.isnan(norms), torch.inf, norms).unbind(), strict=True):
            out[i] = value  # max |x| is exact in any dtype; NaN counts as inf, as in amax
    return out


def cast_to_fp8(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating scaled FP8 cast; see :func:`lightning_fp8.kernels.reference.cast_to_fp8_ref`."""
    if _triton_cast(x):
        from lightning_fp8.kernels import cast

        with out_of_modes_sight(), on_device(x):
            return cast.cast_to_fp8(x, scale, fp8_dtype, transpose)
    cast_checks.check_cast_arguments(x, scale, fp8_dtype, transpose, "cast_to_fp8")  # the Triton path's checks
    return reference.cast_to_fp8_ref(x, scale, fp8_dtype, transpose)


def recast_transposed(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The transposed FP8 copy of 2-D ``x`` cast with ``scale``, statistics dropped: ``cast_to_fp8(x, scale, fp8_dtype,
    transpose=True)[1]`` with less work on the host (no zeroed accumulators; replayed launches)."""
    # The cast's checks on either path: the Triton launcher below checks nothing (a bool x was cast as 0/1).
    cast_checks.check_cast_arguments(x, scale, fp8_dtype, True, "recast_transposed")
    if _triton_cast(x) and x.numel():
        from lightning_fp8.kernels import quantize as fused

        with out_of_modes_sight(), on_device(x):
            return fused.recast_transposed(x.detach().contiguous(), scale.reshape(()), fp8_dtype)
    return cast_to_fp8(x, scale, fp8_dtype, transpose=True)[1]


def recast_activation_transposed(
    x_fp8: torch.Tensor, x_scale_inv: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, activation: str
) -> torch.Tensor:
    """The transposed FP8 copy of ``activation`` ("gelu") of the values FP8 2-D ``x_fp8`` stands for, cast with
    ``scale``, statistics dropped; see ``reference.recast_activation_ref``. Triton: one pass, reading a byte and
    writing a byte per element."""
    cast_checks.check_recast_activation(x_fp8, x_scale_inv, scale, fp8_dtype, activation)
    if use_triton(x_fp8) and x_fp8.numel():
        from lightning_fp8.kernels import quantize as fused

        x_scale_inv, scale = x_scale_inv.reshape(()), scale.reshape(())
        with out_of_modes_sight(), on_device(x_fp8):
            return fused.recast_transposed(x_fp8.detach().contiguous(), scale, fp8_dtype, activation, x_scale_inv)
    return reference.recast_activation_ref(x_fp8, x_scale_inv, scale, fp8_dtype, activation)


def quantize(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One cast of a scaling state (cast, statistics, next scale, optionally the column sums of ``x``); see
    ``reference.quantize_ref``.

    Triton fuses it into one launch (two with current scaling); the reference composes the kernels above.
    """
    if _triton_cast(args[0]):
        from lightning_fp8.kernels import quantize as fused

        with out_of_modes_sight(), on_device(args[0]):
            return fused.quantize_(*args, **kwargs)
    return reference.quantize_ref(*args, **kwargs)


def grad_cast(grads: list[torch.Tensor], *args, **kwargs) -> tuple:
    """Many FP8 gradient casts with current scaling at once (FP8AdamW's queued gradients); see
    ``reference_grad_cast.grad_cast_ref``. Triton casts them all in two launches; the reference, one by one."""
    if grads and use_triton(grads[0]):
        from lightning_fp8.kernels import grad_cast as batched

        with out_of_modes_sight(), on_device(grads[0]):
            return batched.grad_cast(grads, *args, **kwargs)
    if grads:  # the Triton path's checks here too: the reference cast mixed dtypes, and failed on bad states or
        # pending gradients with IndexErrors, KeyErrors or broadcasting errors
        reference_grad_cast.check_grad_cast(grads, *_grad_cast_arguments(*args, **kwargs))
    return reference_grad_cast.grad_cast_ref(grads, *args, **kwargs)


def _grad_cast_arguments(states, fp8_dtype, *, pending_data=None, pending_scale_inv=None, **_) -> tuple:
    # The arguments of grad_cast that reference_grad_cast.check_grad_cast checks, by grad_cast_ref's signature.
    return states, fp8_dtype, pending_data, pending_scale_inv


def _fp8_gemm_capability(device_index: int) -> bool:
    # A ROCm build reports AMD GPUs as "cuda" devices with their gfx version as the capability (MI300: 9.4), but
    # MI300's FP8 formats are the fnuz ones (float8_e4m3fnuz: another bias, no -0, NaN at 0x80), not the E4M3/E5M2
    # that the kernels write and torch._scaled_mm takes here: AMD GPUs take the references and the emulated GEMMs.
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 9)


_device_has_fp8_gemm = functools.cache(_fp8_gemm_capability)  # eagerly: one query per device


def fp8_device(device: torch.device) -> bool:
    """True for CUDA devices of compute capability 8.9+ (Ada, Hopper and later): FP8 tensor cores, and Triton's
    E4M3 type (``tl.float8e4nv``), which Triton refuses to compile for older GPUs. False for AMD GPUs (ROCm
    builds), whose FP8 formats are the fnuz ones."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():  # Dynamo warns of a functools.cache-wrapped call it traces; the query traces
        return _fp8_gemm_capability(index)
    return _device_has_fp8_gemm(index)


def has_fp8_gemm(device: torch.device) -> bool:
    """True where ``torch._scaled_mm`` runs real FP8 GEMMs (CUDA devices of compute capability 8.9+)."""
    return os.environ.get("LIGHTNING_FP8_EMULATE_GEMM") != "1" and fp8_device(device)


def no_fp8_kernels(device: torch.device) -> str:
    """Why CUDA ``device``, which :func:`fp8_device` refuses, runs no Triton FP8 kernel: words for an error."""
    if torch.version.hip is not None:
        return (
            f"{device} is an AMD GPU (a ROCm build), whose FP8 formats are the fnuz ones, not the E4M3/E5M2 that the "
            "Triton kernels write"
        )
    major, minor = torch.cuda.get_device_capability(device)
    return (
        f"{device} has compute capability {major}.{minor}, for which Triton has no E4M3 type (fp8e4nv needs 8.9+: "
        "Ada, Hopper)"
    )


def scaled_mm(
    a_fp8: torch.Tensor,
    b_fp8: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a_fp8 * a_scale_inv) @ (b_fp8 * b_scale_inv)`` with fp32 accumulation, returned in ``out_dtype``.

    ``a_fp8`` (M, K) must be row-major and ``b_fp8`` (K, N) column-major (``w_fp8.t()`` of a row-major
    ``w_fp8``), as ``torch._scaled_mm`` wants. N must be a multiple of 16 on the real path; M and K that
    are not are zero-padded here.

    ``bias`` (N,), rounded to ``out_dtype`` as autocast does, is added to the fp32 result before its one
    rounding to ``out_dtype``; on the real path with a bf16/fp16 output it is fused into the GEMM (no extra
    pass over the output).

    ``use_fast_accum=True`` lets Hopper's FP8 tensor cores accumulate in their faster, less precise
    mode (Transformer Engine does so for the forward GEMM only; gradients keep full fp32 accumulation).
    The emulation ignores it.

    Raises:
        TypeError: on the emulated path, for an operand that is not FP8 or an ``out_dtype`` that is not a floating
            dtype (what ``torch._scaled_mm`` refuses on the real path).
        ValueError: on the emulated path, for operands that are not 2-D with matching inner sizes, an ``a_fp8`` that
            is not row-major or ``b_fp8`` not column-major, or two E5M2 operands (what the real path refuses too).
    """
    if has_fp8_gemm(a_fp8.device):
        return _scaled_mm_cuda(a_fp8, b_fp8, a_scale_inv, b_scale_inv, out_dtype, bias, use_fast_accum)
    # What torch._scaled_mm refuses: the emulation multiplied high-precision operands and truncated to an integer dtype.
    if a_fp8.dtype not in FP8_DTYPES or b_fp8.dtype not in FP8_DTYPES or not out_dtype.is_floating_point:
        raise TypeError(
            f"scaled_mm multiplies FP8 operands into a floating-point output, got {a_fp8.dtype} @ {b_fp8.dtype} -> "
            f"{out_dtype}: cast the operands first (cast_to_fp8) and pass out_dtype=torch.float32, bfloat16 or float16"
        )
    if not torch.compiler.is_compiling():  # traced, the operands come from the FP8 layers' own casts
        cast_checks.check_gemm_operands(a_fp8, b_fp8)
    # Emulation: FP8 values and power-of-two scales are exact in fp32, so this is the exact product
    # up to fp32 accumulation order. Autocast must not downcast the fp32 matmul.
    with autocast_off(a_fp8.device):
        out = (a_fp8.float() * a_scale_inv) @ (b_fp8.float() * b_scale_inv)
        if bias is not None:
            out = out + rounded_to(bias, out_dtype)
    return narrowed(out, out_dtype)


def narrowed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, rounded as eagerly also under torch.compile: inductor fuses a conversion to bf16/fp16 into the
    ops that consume its result and drops the rounding (unless ``config.emulate_precision_casts``: a residual add or
    a sum of two gradients then adds unrounded values); traced, ``x`` is rounded through the bits first
    (:func:`rounded_to`), so the conversion left is exact.

    ``x`` itself when it has ``dtype`` already, not ``x.to(dtype)`` (the same tensor, from another op): torch 2.11's
    dynamo returns every intermediate of an autograd Function's traced forward as an extra output, and an output that
    is also an intermediate tensor takes the gradient meant for the real one (the FP8 layers' input and weight
    gradients were zero in compiled fp32 training). The FP8 layers' outputs end with this function."""
    if x.dtype == dtype:  # no op at all: see below
        return x
    if torch.compiler.is_compiling() and dtype in (torch.bfloat16, torch.float16):
        x = rounded_to(x, dtype)
    return x.to(dtype)


def rounded_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back to fp32, also under torch.compile: inductor drops a conversion to bf16 and
    back (unless ``config.emulate_precision_casts``), keeping the fp32 value unrounded; a bf16 tensor is widened
    through its bits instead (:func:`widen_bf16`), so compiled code adds the values eager code adds."""
    x = x.to(dtype)
    if dtype == torch.bfloat16:
        return widen_bf16(x)
    return widen_fp16(x) if dtype == torch.float16 else x.float()


def widen_fp16(x: torch.Tensor) -> torch.Tensor:
    """:func:`widen_bf16` for an fp16 tensor: fp32 from its bits (normal numbers re-biased, subnormals as their
    mantissa times 2**-24, inf and NaN kept), exactly ``x.float()``."""
    h = x.view(torch.int16).to(torch.int32) & 0xFFFF
    sign, exponent, mantissa = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    exponent = torch.where(exponent == 0x1F, 0xFF, exponent + 112)  # inf, NaN; else fp16's bias 15 -> fp32's 127
    normal = (sign | (exponent << 23) | (mantissa << 13)).view(torch.float32)
    subnormal = (mantissa.float() * 2.0**-24).copysign(normal)  # +-0 and subnormals (normal has x's sign)
    return torch.where((h & 0x7C00) == 0, subnormal, normal)


def widen_bf16(x: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor as fp32, exactly, through its bits: a conversion inductor cannot fold into the fp32 value that was
    rounded to ``x`` (it keeps a value converted to bf16 and back in fp32 without rounding it, unless
    ``config.emulate_precision_casts``), while eagerly the bf16 tensor is rounded."""
    return (x.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _pad_last(t_fp8: torch.Tensor, pad: int) -> torch.Tensor:
    # F.pad has no FP8 kernels; pad the bytes (a zero byte is +0.0 in both formats).
    return torch.nn.functional.pad(t_fp8.view(torch.uint8), (0, pad)).view(t_fp8.dtype)


def linear_forward_mm(
    x_fp8: torch.Tensor,
    w_fp8: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward GEMM of an FP8 linear layer, ``x @ w^T + bias`` (``w_fp8`` row-major, the weight's shape), with
    fast accumulation: for the forward GEMM only (gradients keep full fp32 accumulation), as Transformer Engine does."""
    return scaled_mm(x_fp8, w_fp8.t(), x_scale_inv, w_scale_inv, out_dtype, bias=bias, use_fast_accum=True)


def _scaled_mm_cuda(a_fp8, b_fp8, a_scale_inv, b_scale_inv, out_dtype, bias=None, use_fast_accum=False):
    # torch._scaled_mm needs M and the inner dimension K to be multiples of 16 (and N, which the layer
    # shapes guarantee). Zero padding is exact: padded rows are dropped, padded K terms add zero.
    m, k = a_fp8.shape
    pad_k = (-k) % 16
    if pad_k:
        a_fp8 = _pad_last(a_fp8, pad_k)
        b_fp8 = _pad_last(b_fp8.t(), pad_k).t()
    pad_m = (-m) % 16
    if pad_m:
        a_fp8 = _pad_last(a_fp8.t().contiguous(), pad_m).t().contiguous()
    # cuBLASLt fuses a bias of the output's dtype for bf16/fp16 outputs only; an fp32 output adds it after.
    fuse_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
    out = torch._scaled_mm(
        a_fp8,
        b_fp8,
        scale_a=a_scale_inv,
        scale_b=b_scale_inv,
        bias=bias.to(out_dtype) if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
    if bias is not None and not fuse_bias:  # an fp32 output
        out = out + bias.float()
    return out[:m] if pad_m else out
