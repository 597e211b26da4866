"""FP8CommState: the configuration and per-step state shared by the FP8 communication hooks.

One state serves a DDP hook, the FSDP1 hook or the FSDP2 collectives. It chooses the algorithm, reports
every gradient cast to the gradient scaler, and keeps the step's non-finite flag.

Skipping a step without a gradient scaler::

    state = enable_fp8_ddp(ddp)     # FP8CommState(ddp.process_group), registered with fp8_allreduce_hook
    for batch in loader:
        ddp(batch).sum().backward()
        if state.check_step():        # False when any rank had a non-finite gradient (same answer everywhere)
            optimizer.step()
        optimizer.zero_grad()

With ``FP8CommState(grad_scaler=scaler)`` the scaler decides instead (``scaler.step(optimizer)`` skips on every
rank); :meth:`FP8CommState.check_step` then only needs to be called to read or clear the flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.distributed.allreduce import check_amax_group
from lightning_fp8.distributed.comm import CastStats, all_reduce_max, cast_stats, check_group, local_amax
from lightning_fp8.distributed.comm_state_checks import (
    MAX_EXTRA_HEADROOM,
    check_args,
    checked_saved_state,
    param_ids,
    resolve_fused,
)
from lightning_fp8.distributed.exchange import (
    CollectiveRows,
    SymmetricRows,
    cuda_backend_is_nccl,
    symmetric_memory_reason,
)
from lightning_fp8.distributed.layout import SegmentLayout
from lightning_fp8.formats import E5M2
from lightning_fp8.warnings import warn_once

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Algorithm = Literal["auto", "portable", "native", "gather"]

# What "auto" runs per backend. The native FP8 all-reduce is chosen only where it was measured faster than the
# portable path and accurate (benchmarks/bench_comm.py, figures in docs/benchmarks.md); gloo has no FP8 reduction.
# On H200s (benchmarks/results/comm_fp8_h200x{2,4}.txt) native was faster (5.70 vs 6.44 ms for 1B elements on 2
# GPUs, 7.12 vs 7.83 on 4) but less accurate on 4 ranks (20.0 vs 22.5 dB: NCCL rounds each partial sum to FP8).
# With two ranks the FP8 sum is one addition, rounded once, as accurate as the portable path (22.1 dB both): native.
_AUTO_ALGORITHM = {"nccl": "portable", "gloo": "portable"}
_AUTO_NATIVE_MAX_RANKS = {"nccl": 2}
# Where "auto" takes the gather path when the ranks share CUDA symmetric memory (one host, peer access): on 2 H200s
# it was faster than native and more accurate (one rounding: 25.6 vs 22.1 dB), docs/benchmarks.md. Each rank
# receives N - 1 bytes per element, so on more ranks it moves more than a ring: not measured there, not chosen.
_AUTO_GATHER_MAX_RANKS = {"nccl": 2}
# The copy-engine transport's settings (exchange.SymmetricRows): its defaults (pushing on one high-priority copy
# stream), the fastest in the sweeps on 2 H200s (docs/benchmarks.md, "Twenty-first session").
_SYMMETRIC_ROWS: dict = {}


class FP8CommState:
    """State of the FP8 gradient communication hooks (DDP, FSDP1, FSDP2).

    Args:
        process_group: the data-parallel group (default: the world). Under DDP and FSDP1 it must have the ranks
            of the wrapper's ``process_group`` (:func:`~.ddp.enable_fp8_ddp` and :func:`~.fsdp.enable_fp8_fsdp1`
            check it); FSDP2 passes its own groups.
        fp8_dtype: the wire format of gradients. E5M2 (the default, the gradient format of the ``"hybrid"``
            recipe) keeps 32 binades of range inside each tensor; E4M3 has one more mantissa bit (about 6 dB
            more SQNR) but flushes values below ``amax / 2**17`` to zero.
        algorithm: ``"portable"`` (FP8 all-to-all, fp32 sum, FP8 all-gather; any backend), ``"native"``
            (NCCL's float8 all-reduce, the sum in FP8), ``"gather"`` (every rank's FP8 bytes reach every rank,
            which sums them in fp32: one rounding; on NCCL groups the bytes move by the GPUs' copy engines out of
            CUDA symmetric memory, elsewhere by all-gathers; each rank receives ``N - 1`` bytes per element, the
            bytes of a two-rank ring) or ``"auto"`` (per backend and world size; see ``_AUTO_ALGORITHM``). FSDP
            reduce-scatters are always portable.
        grad_scaler: an :class:`~lightning_fp8.FP8GradScaler`; every gradient cast is reported to it
            (``record_gradient_cast``) and so is every non-finite check (``record_nonfinite``).
        fp8_params: the parameters whose gradients travel in FP8; the others are reduced in their own dtype.
            ``None`` (the default): every gradient. The tensors themselves, not their names, taken from the model
            the hook serves: for FSDP2 after ``fully_shard``, which replaces every parameter by a sharded one.
            DDP and FSDP2 only: the FSDP1 hook sends every gradient of a unit's flat gradient in FP8.
        margin: binades of headroom in the cast scales (0: the amax maps into the top binade; at most
            :data:`~lightning_fp8.recipe.MAX_MARGIN`).
        fused: run the segmented Triton kernels (``kernels/comm.py``) instead of their PyTorch references.
            ``None`` (the default): on CUDA devices of compute capability 8.9+ (Triton has no E4M3 type below)
            where Triton is installed. ``True`` needs Triton, and on CPU gradients Triton's interpreter
            (``TRITON_INTERPRET=1``).
        slice_numel: a buffer is pipelined in slices of about this many elements (its cast and decode overlap
            the collectives of other slices); DDP buckets and FSDP units of usual sizes fit in one slice. The
            default, 2**28, cuts 1B elements into 4 slices: the fastest of 1, 4, 8 and 16 on 2 and 4 H200s
            (benchmarks/results/comm_fp8_h200x2.txt; more slices cost more in launches than they hide).
        amax_group: a second process group of the same ranks (``dist.new_group(ranks)``, created on every rank) for
            the small MAX all-reduces of the amaxes, so that they do not queue between the data collectives on
            NCCL's stream. Measured on 2 H200s (1B elements, ``benchmarks/bench_comm.py --sweep``,
            docs/benchmarks.md): 5.24 ms without it, 4.76 ms with it and a data group whose NCCL streams have high
            priority (``ProcessGroupNCCL.Options(is_high_priority_stream=True)``), against 5.92 ms for a bf16
            all-reduce. DDP hooks only (FSDP reduce-scatters take their amaxes on ``process_group``).

    When ``torch.distributed`` is initialized, the arguments that depend on the process group (``algorithm``,
    ``amax_group``) are checked here; otherwise at the first collective. An error raised inside a DDP comm hook
    leaves DDP unusable (its reducer stays mid-step), so build the state after ``init_process_group``.

    Raises:
        ValueError: for an unknown algorithm, a non-FP8 dtype, a margin outside 0 to ``MAX_MARGIN``, ``fused=True``
            without Triton, or without CUDA and without Triton's interpreter, and, once
            ``torch.distributed`` is initialized, ``algorithm="native"`` on a backend other than NCCL or an
            ``amax_group`` of other ranks than ``process_group``, or a ``process_group`` or ``amax_group`` that this
            rank is not a member of (``new_group``'s marker for the ranks it leaves out).
        TypeError: for an ``fp8_params`` that is not an iterable of tensors (e.g. names or modules), and for
            arguments of the wrong type.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        fp8_dtype: torch.dtype = E5M2,
        algorithm: Algorithm = "auto",
        grad_scaler: Any = None,
        fp8_params: Iterable[nn.Parameter] | None = None,
        margin: int = 0,
        fused: bool | None = None,
        slice_numel: int = 1 << 28,
        amax_group: dist.ProcessGroup | None = None,
    ) -> None:
        margin, slice_numel = check_args(fp8_dtype, algorithm, grad_scaler, margin, fused, slice_numel)
        not_member = "build the FP8CommState and register the hook only on the ranks of the group it reduces over"
        check_group(process_group, "FP8CommState(process_group=...)", not_member)
        check_group(amax_group, "FP8CommState(amax_group=...)", not_member, "one of the same ranks, or None")
        self.process_group = process_group
        self.amax_group = amax_group
        self.fp8_dtype = fp8_dtype
        self.algorithm = algorithm
        self.grad_scaler = grad_scaler
        self.margin = margin
        self.fused = fused
        if fused and not (torch.cuda.is_available() and ops.triton_available()):  # raise now, not in a hook
            self.use_fused(torch.device("cpu"))
        self.slice_numel = slice_numel
        self._fp8_param_ids = None if fp8_params is None else param_ids(fp8_params)
        # DDP: whether some bucket of the first backward held one of fp8_params (see ddp._check_fp8_params).
        self._fp8_params_seen, self._fp8_params_checked = False, fp8_params is None
        self._fp8_weights_left_out = False  # fp8_params empty, and the model has FP8 weights (see empty_fp8_params)
        self._found: torch.Tensor | None = None  # 0-dim bool on the gradients' device
        self._extra_headroom: torch.Tensor | None = None  # native path only
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._rows: dict[torch.device, CollectiveRows | SymmetricRows] = {}  # the gather algorithm's transports
        self._symmetric: dict[torch.device, str | None] = {}  # why symmetric memory cannot serve (None: it can)
        # FSDP1: parameter boundaries of each unit's flat gradient, by its size (see fsdp.enable_fp8_fsdp1).
        self._fsdp1_layouts: dict[int, SegmentLayout] = {}
        self.reductions = 0  # collectives run through this state (a Python counter: no sync)
        # What check_step MAX-reduces the step's flag over, beyond the groups the hooks agree it in (FSDP2 with tensor
        # parallelism, see _agree_over_mesh); empty: the hooks' groups hold every rank of the model, no collective.
        self._step_groups: list[dist.ProcessGroup] = []
        self._step_device = torch.device("cpu")
        if dist.is_available() and dist.is_initialized():
            self._check_groups()

    def __repr__(self) -> str:
        return (
            f"FP8CommState(fp8_dtype={self.fp8_dtype}, algorithm={self.algorithm!r}, "
            f"grad_scaler={type(self.grad_scaler).__name__ if self.grad_scaler is not None else None})"
        )

    # ------------------------------------------------------------------------------------------------- decisions
    def is_fp8(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient travels in FP8."""
        return self._fp8_param_ids is None or id(param) in self._fp8_param_ids

    def resolved_algorithm(self, device: torch.device | None = None) -> str:
        """``"portable"``, ``"native"`` or ``"gather"`` for this state's process group and gradients on ``device``.

        ``"auto"`` takes the gather path where its ranks share CUDA symmetric memory and it was measured fastest
        (``_AUTO_GATHER_MAX_RANKS``; deciding that is a collective, run once per device, so every rank must ask);
        without ``device`` it answers as if they did not.

        Raises:
            ValueError: when ``"native"`` is forced on a backend other than NCCL.
        """
        backend = "nccl" if cuda_backend_is_nccl(self.process_group) else dist.get_backend(self.process_group)
        if self.algorithm == "auto":
            world = dist.get_world_size(self.process_group)
            if 1 < world <= _AUTO_GATHER_MAX_RANKS.get(backend, 0) and device is not None:
                if self.symmetric_memory_reason(device) is None:
                    return "gather"
            if world <= _AUTO_NATIVE_MAX_RANKS.get(backend, 0):
                return "native"
            return _AUTO_ALGORITHM.get(backend, "portable")
        if self.algorithm == "native" and backend != "nccl":
            raise ValueError(
                f"FP8CommState(algorithm='native') needs the NCCL backend (a float8 all-reduce), but the process "
                f"group uses {backend!r}: use algorithm='portable' or 'auto'"
            )
        return self.algorithm

    def _check_groups(self) -> None:
        # What the hooks would raise at their first collective, raised while nothing depends on this state yet.
        self.resolved_algorithm()
        if self.amax_group is not None:
            check_amax_group(self.process_group, self.amax_group)

    def names_fp8_params(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether ``fp8_params`` is unset or empty, or holds one of ``params`` (e.g. a model's parameters)."""
        ids = self._fp8_param_ids
        return not ids or any(id(p) in ids for p in params)

    def leaves_out_fp8_weights(self, model_has_fp8_weights: bool) -> bool:
        """Whether ``fp8_params`` is empty while the model has FP8 layers: a list taken before ``convert_to_fp8``
        (``isinstance(m, FP8Linear)`` matched nothing yet) sends their gradients in their own dtype. An integration's
        empty list for a model without FP8 layers is no mistake and passes."""
        return self._fp8_param_ids is not None and not self._fp8_param_ids and model_has_fp8_weights

    def use_fused(self, device: torch.device) -> bool:
        """Whether the collectives on ``device`` run the Triton kernels (:func:`resolve_fused` of ``fused``)."""
        return resolve_fused(self.fused, device)

    def slices(self, numel: int) -> int:
        """Pipeline slices for a buffer of ``numel`` elements."""
        return max(1, round(numel / self.slice_numel))

    def symmetric_memory_reason(self, device: torch.device) -> str | None:
        """Why this group's ranks cannot share CUDA symmetric memory on ``device`` (``None``: they can); a collective
        the first time per device (:func:`~lightning_fp8.distributed.exchange.symmetric_memory_reason`)."""
        if device not in self._symmetric:
            self._symmetric[device] = symmetric_memory_reason(self.process_group, device)
        return self._symmetric[device]

    def gather_rows(self, device: torch.device) -> CollectiveRows | SymmetricRows:
        """The transport of the gather algorithm on ``device``: copy-engine copies out of CUDA symmetric memory where
        the ranks share it (NCCL, one host, peer access), else the process group's all-gathers."""
        rows = self._rows.get(device)
        if rows is None:
            reason = self.symmetric_memory_reason(device)
            if reason is None:
                rows = SymmetricRows(self.process_group, device, **_SYMMETRIC_ROWS)
            else:
                rows = CollectiveRows(self.process_group)
                if device.type == "cuda":
                    warn_once(
                        f"FP8CommState(algorithm='gather'): {reason}, so the FP8 rows travel by all-gathers, slower "
                        "than copy engines; algorithm='auto' picks the fastest path measured here"
                    )
            self._rows[device] = rows
        return rows

    def extra_headroom(self, device: torch.device) -> torch.Tensor:
        """Extra pre-scale binades of the native FP8 sum (0-dim int64 on ``device``), raised after overflows."""
        if self._extra_headroom is None:
            self._extra_headroom = torch.zeros((), dtype=torch.int64, device=device)
        elif self._extra_headroom.device != device:  # loaded by load_state_dict onto the CPU: moved once
            self._extra_headroom = self._extra_headroom.to(device)
        return self._extra_headroom

    # ----------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, int]:
        """What this state carries from step to step, as plain ints (``torch.load(weights_only=True)`` reads it):
        ``"extra_headroom"``, the binades the native path added to its pre-scale after FP8 sums that overflowed
        (0 to :data:`MAX_EXTRA_HEADROOM`; a fresh state starts at 0 and overflows again until it has grown back), and
        ``"reductions"``, the collectives run so far. The arguments (group, dtype, algorithm, ...) are not in it:
        build the resumed state with the same ones. Nor is the step flag: save after :meth:`check_step`. The value
        is the same on every rank, so rank 0's suffices. Reads one device value (a host synchronization).
        """
        headroom = 0 if self._extra_headroom is None else int(self._extra_headroom)
        return {"extra_headroom": headroom, "reductions": self.reductions}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every entry is checked before any is loaded: on an error this
        state is left as it was.

        Raises:
            TypeError: when ``state_dict`` is not a dict, or an entry is not an int.
            KeyError: for a missing or an unknown entry (not an FP8CommState state dict).
            ValueError: for an entry out of range (``extra_headroom`` outside 0 to ``MAX_EXTRA_HEADROOM``, a negative
                ``reductions``).
        """
        headroom, reductions = checked_saved_state(state_dict)
        if self._extra_headroom is not None:
            self._extra_headroom.fill_(headroom)
        elif headroom:  # on the CPU until the first native sum says the device (extra_headroom)
            self._extra_headroom = torch.full((), headroom, dtype=torch.int64)
        self.reductions = reductions

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing: so that a load of
        several parts checks every part before it loads any."""
        checked_saved_state(state_dict)

    # ----------------------------------------------------------------------------------------------- step state
    @property
    def found_nonfinite(self) -> torch.Tensor:
        """0-dim bool: a non-finite gradient was seen on some rank since the last :meth:`check_step`."""
        if self._found is None:
            return torch.zeros((), dtype=torch.bool)
        return self._found

    def record(self, stats: CastStats, native_overflow: bool = False) -> None:
        """Fold one collective's statistics into the step flag and report them to the gradient scaler."""
        self.reductions += 1
        found = stats.found_nonfinite
        self._found = found.clone() if self._found is None else self._found | found
        if native_overflow and self._extra_headroom is not None:
            grow = found & torch.isfinite(stats.amax)  # the sum overflowed, not the gradient
            self._extra_headroom.add_(grow.to(torch.int64)).clamp_(max=MAX_EXTRA_HEADROOM)
        if self.grad_scaler is not None and stats.numel:
            self.grad_scaler.record_gradient_cast(stats.amax, stats.n_saturated, stats.numel, self.fp8_dtype)
        if self.grad_scaler is not None:
            self.grad_scaler.record_nonfinite(found)

    def record_reduced(self, x: torch.Tensor) -> None:
        """Fold a non-finite check of ``x`` into the step flag, with no collective: ``x`` must hold the same values
        on every rank (an all-reduced gradient, or the gradient of a single rank), so every rank agrees."""
        amax = local_amax(x)
        self.record(cast_stats(amax, torch.zeros((), dtype=torch.int64, device=x.device), 0))

    def check_step(self) -> bool:
        """True when every gradient reduced since the last call was finite on every rank; clears the flag.

        The answer is the same on every rank (the non-finite check rides on the shared-amax all-reduce), so
        ranks that skip, skip together. Reads one device value (a host synchronization). Under FSDP2 with tensor
        parallelism, FSDP's collectives do not reach the tensor-parallel peers, so the flag is also MAX-reduced over
        the whole mesh here (one all-reduce of one value when the mesh is the world): every rank must call it.
        """
        found = self._found
        self._found = None
        if self._step_groups:
            flag = torch.zeros((), dtype=torch.float32, device=self._step_device) if found is None else found.float()
            for group in self._step_groups:
                all_reduce_max(flag, group)
            found = flag > 0
        return found is None or not bool(found)

    def _agree_over_mesh(self, mesh: DeviceMesh | None) -> None:
        """Make :meth:`check_step` agree over every rank of ``mesh`` (a DeviceMesh), not only over the groups of the
        hooks' collectives: one MAX all-reduce over the world where ``mesh`` spans it, else one per mesh dimension
        (a MAX over each dimension in turn is the MAX over the whole mesh). None: over the hooks' groups alone."""
        if mesh is None:
            self._step_groups = []
            return
        if mesh.size() == dist.get_world_size():
            self._step_groups = [dist.group.WORLD]
        else:
            self._step_groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        self._step_device = torch.device(mesh.device_type)

    def check_wrapper_group(self, group: dist.ProcessGroup | None, wrapper: str) -> None:
        """Raise if this state reduces over other ranks than ``group``, the process group of the wrapper (DDP,
        FSDP1) whose gradients it reduces: the gradients would be averaged, and their scales shared, over the
        wrong ranks. No collective: each rank compares global ranks, so every rank gets the same answer.

        Raises:
            ValueError: when the groups' ranks differ (in set or order). A different group of the same ranks (e.g. a
                communicator with high-priority streams) is accepted.
        """
        world = dist.group.WORLD
        mine = self.process_group if self.process_group is not None else world
        theirs = group if group is not None else world
        if mine is theirs:
            return
        ranks, want = dist.get_process_group_ranks(mine), dist.get_process_group_ranks(theirs)
        if ranks != want:
            given = "the default (the world)" if self.process_group is None else "a group"
            raise ValueError(
                f"{wrapper}: FP8CommState(process_group=...) is {given} of the ranks {ranks}, but the model's "
                f"wrapper reduces its gradients over the ranks {want}: the FP8 scales and the mean would be taken "
                "over the wrong ranks. Build the state with the wrapper's group, FP8CommState(model.process_group, "
                "...), or pass no state (one is built on it)"
            )

    def reset(self) -> None:
        """Clear the step flag without reading it."""
        self._found = None

    # ---------------------------------------------------------------------------------------------------- streams
    @contextlib.contextmanager
    def side_stream(self, device: torch.device) -> Iterator[None]:
        """On CUDA, run the enclosed collectives on a side stream that first waits for the current one.

        The hook's chain of kernels and collectives then overlaps with the rest of the backward instead of
        holding the compute stream. Elsewhere this does nothing.
        """
        if device.type != "cuda":
            yield
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield


def check_state(state: object, where: str) -> None:
    """Raise TypeError unless ``state`` is an FP8CommState (a process group passed positionally is the usual mistake:
    FP8CommState's own first argument is the group)."""
    if not isinstance(state, FP8CommState):
        raise TypeError(
            f"{where}(model, state=...) got a {type(state).__name__}: pass an FP8CommState (e.g. "
            "FP8CommState(process_group)), or leave state out for the default"
        )
