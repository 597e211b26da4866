"""FP8FSDPStrategy (``strategy="fsdp_fp8"``): Lightning's FSDP strategy with FP8-LM precision.

Lightning's ``FSDPStrategy`` only accepts its own ``FSDPPrecision`` plugin. This subclass accepts
:class:`~lightning_fp8.FP8LMPrecision` instead and keeps everything else: sharding, wrapping policies,
activation checkpointing, full (single-file) checkpoints (``state_dict_type="sharded"`` is refused). The plugin
does the FP8 work under it: FP8 layers (converted before wrapping, so FSDP shards them like ``nn.Linear``),
FP8AdamW over the sharded parameters, the FP8 gradient reduce-scatter hook, and its scaling state in the
checkpoint.

``use_orig_params=True`` is the default here: the optimizer then holds the original parameters (its states keep
their names and FP8AdamW can tell FP8 weights from the rest), which is also what ``torch.compile`` wants.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from typing_extensions import override

from lightning_fp8.integrations.lightning.comm import all_gather_state
from lightning_fp8.integrations.lightning.flavour import build_flavour
from lightning_fp8.integrations.lightning.precision import _FP8LMPrecisionLogic
from lightning_fp8.integrations.lightning.strategy_args import (
    STRATEGY_NAME,
    check_device_mesh,
    check_sharding_strategy,
    check_use_orig_params,
)
from lightning_fp8.integrations.lightning.strategy_support import (  # its import path before the split
    check_supported_strategy as check_supported_strategy,
)
from lightning_fp8.integrations.lightning.strategy_units import (
    _check_manual_optimization_units,
    _check_not_sharded_by_another,
    _finish_manual_backward,
    _mark_own_units,
    units_made_by_hand,
)
from lightning_fp8.optim.checkpoint import as_stored

# The key of this strategy's optimizer states in its checkpoints: {"per_rank": [state of rank 0, of rank 1, ...]}.
PER_RANK = "per_rank"


class _FP8FSDPStrategyLogic:
    """What FP8 changes in FSDPStrategy, shared by the ``lightning`` and ``pytorch_lightning`` flavours."""

    strategy_name = STRATEGY_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("use_orig_params", True)
        check_use_orig_params(kwargs["use_orig_params"])
        try:  # FSDPStrategy's arguments by name, however they were passed (positionally too)
            bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        except TypeError:  # FSDPStrategy's own error, below
            bound = inspect.BoundArguments(inspect.Signature(), {})
        passed = bound.arguments
        if "sharding_strategy" in passed:  # Lightning resolves one left out to FULL_SHARD
            check_sharding_strategy(passed["sharding_strategy"])
        if passed.get("mixed_precision") is not None:
            raise ValueError(
                f"{type(self).__name__}(mixed_precision=...) is not supported: FP8 layers choose their own precision "
                "and the other ops run under bf16 autocast; drop the argument"
            )
        if passed.get("device_mesh") is not None:
            passed["device_mesh"] = check_device_mesh(passed["device_mesh"])
            args, kwargs = bound.args, bound.kwargs
        super().__init__(*args, **kwargs)
        self._check_state_dict_type()  # at construction, not at the first checkpoint
        check_sharding_strategy(self.sharding_strategy)  # also as a device_mesh made it

    @override
    def setup_environment(self) -> None:
        # FSDPStrategy builds a device_mesh given as a tuple with init_device_mesh("cuda", ...), which fails on the CPU
        # (accelerator="cpu", gloo: "torch._C has no attribute _cuda_setDevice"): build it on the CPU there.
        mesh = self.kwargs.get("device_mesh")
        if not isinstance(mesh, tuple) or self.root_device.type != "cpu":
            return super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        del self.kwargs["device_mesh"]
        try:
            super().setup_environment()
        finally:
            self.kwargs["device_mesh"] = mesh
        self.kwargs["device_mesh"] = init_device_mesh("cpu", mesh)
        return None

    def _check_state_dict_type(self) -> None:
        if self._state_dict_type != "full":
            raise ValueError(
                f"strategy='{STRATEGY_NAME}' writes full (single-file) checkpoints; got state_dict_type="
                f"{self._state_dict_type!r}: use state_dict_type='full'"
            )

    @property
    @override
    def precision_plugin(self) -> Any:
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Any) -> None:
        if precision_plugin is not None and not isinstance(precision_plugin, _FP8LMPrecisionLogic):
            raise TypeError(
                f"strategy='{STRATEGY_NAME}' trains in FP8 and needs the FP8LMPrecision plugin, got "
                f"{precision_plugin}: use precision='fp8-lm' (or leave precision unset), or strategy='fsdp' for other "
                "precisions"
            )
        self._precision_plugin = precision_plugin

    @property
    @override
    def mixed_precision_config(self) -> None:
        return None  # parameters stay in their dtype; FP8 GEMMs and bf16 autocast do the low-precision work

    @override
    def _setup_model(self, model: Any) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = self.__dict__.get("_fp8_root")
        if root is not None and root.module is model:
            # validate/test/predict after fit in the same Trainer: the fit's root wrapper. FSDPStrategy would wrap
            # nothing (the units inside are FSDP already) and run the module bare, whose parameters outside the units
            # are this rank's shard views.
            return root
        _check_not_sharded_by_another(model)
        wrapped = super()._setup_model(model) if self.root_device.type != "cpu" else self._setup_model_on_cpu(model)
        if isinstance(wrapped, FullyShardedDataParallel):
            _check_manual_optimization_units(wrapped, model)
            _mark_own_units(wrapped)
            self._fp8_root = wrapped
        return wrapped

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Lightning's enables wrap() in configure_model; this strategy wraps after the FP8 conversion itself, so a
        # wrap() there is refused at the call, on every device (on the CPU FSDP1 failed in it for want of a GPU).
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=units_made_by_hand):
            yield

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if not self.lightning_module.automatic_optimization:
            _finish_manual_backward(self.model)
        return out

    def _setup_model_on_cpu(self, model: Any) -> Any:
        # FSDP1 only runs on CPU (gloo: tests, CI) when told device_id=cpu, which Lightning derives from
        # root_device.index (None on CPU); the rest is what FSDPStrategy._setup_model does.
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.cpu_offload is not None and self.cpu_offload.offload_params:
            raise ValueError(
                f"{type(self).__name__}(cpu_offload=True) moves GPU parameters to the CPU, and this run is on "
                "the CPU already (accelerator='cpu'): drop cpu_offload, or train on GPUs"
            )
        if self.kwargs.get("sync_module_states"):
            # FSDP1 broadcasts the module's states from GPU memory only: it failed asking for a device_id or a GPU.
            raise ValueError(
                f"{type(self).__name__}(sync_module_states=True) broadcasts rank 0's parameters from GPU memory, and "
                "this run is on the CPU (accelerator='cpu'): drop sync_module_states (seed the module's "
                "initialization alike on every rank, e.g. L.seed_everything), or train on GPUs"
            )

        fsdp_module = importlib.import_module(_fsdp_base(type(self)).__module__)
        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
        fsdp_module._setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    # -- checkpoints: full (single-file) checkpoints with FP8 optimizer states ---------------------------------

    def _full_state_dict(self, rank0_only: bool = True) -> Any:
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

        self._check_state_dict_type()  # the attribute may have been changed since
        # offload_to_cpu crashes FSDP1 (segfault) when the parameters already live on the CPU (gloo runs).
        config = FullStateDictConfig(offload_to_cpu=self.root_device.type != "cpu", rank0_only=rank0_only)
        return FullyShardedDataParallel.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, config)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._full_state_dict():
            return self.model.state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Every rank's own optimizer state, gathered: ``{"per_rank": [state_0, state_1, ...]}``.

        FSDP's ``optim_state_dict`` would gather FP8AdamW's states by value, in fp32
        (:func:`~lightning_fp8.optim.checkpoint.fsdp1_by_value`); here each rank's shard is saved as it is stored
        (E4M3/fp16 with its power-of-two scales, and the fp16 masters), and the resumed run continues bit for bit.
        Resuming needs this strategy, the same number of processes and the same wrapping
        (:func:`check_optimizer_states` refuses the others).
        """
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        with as_stored(optimizer):
            state = optimizer.state_dict()
        return {PER_RANK: all_gather_state(state)}

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not path.exists():  # what Lightning's other strategies raise (its CheckpointIO)
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if not path.is_file():
            raise ValueError(
                f"strategy='{STRATEGY_NAME}' loads full (single-file) checkpoints; {str(path)!r} is a directory (a "
                "sharded checkpoint of Lightning's FSDPStrategy or ModelParallelStrategy?): consolidate it into one "
                f"file with `python -m lightning.pytorch.utilities.consolidate_checkpoint {path}` and pass that file"
            )
        # None (Lightning's default) loads with weights_only=True, as torch>=2.6 does; an explicit False is kept.
        weights_only = True if weights_only is None else weights_only
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        except (EOFError, RuntimeError, KeyError, IndexError) as error:
            # torch's reader on a truncated or corrupt file: empty (EOFError), a broken zip (RuntimeError), other bytes
            # read as a legacy pickle (KeyError, IndexError). weights_only's refusal of a class (UnpicklingError) keeps
            # torch's message, which says what to allow.
            raise ValueError(
                f"the checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}): it is truncated or "
                "corrupt (a save that did not complete?). Nothing was loaded; resume from an earlier checkpoint"
            ) from error
        states = checkpoint.get("optimizer_states")
        resume = states is not None and self.lightning_module.trainer.state.fn == "fit"
        if resume:  # before anything is loaded
            check_optimizer_states(states, self, str(path))
            if len(states) != len(self.optimizers):
                raise ValueError(
                    f"the checkpoint {str(path)!r} holds the states of {len(states)} optimizer(s) and this run has "
                    f"{len(self.optimizers)} (configure_optimizers): resume with the optimizers that wrote it"
                )
            self._check_shards_fit(states, path)
        with self._full_state_dict(rank0_only=False):
            self.model.load_state_dict(checkpoint.pop("state_dict"), strict=self.lightning_module.strict_loading)
        if resume:
            for optimizer, state in zip(self.optimizers, states, strict=True):
                optimizer.load_state_dict(state[PER_RANK][self.global_rank])
        return checkpoint

    def _check_shards_fit(self, states: list[Any], path: Path) -> None:
        """Raise ValueError on every rank, before anything is loaded, unless each rank's optimizer state shards fit
        its optimizers' parameters: flat parameters of another ``auto_wrap_policy`` (or model) have other shapes."""
        error = None
        for optimizer, state in zip(self.optimizers, states, strict=True):
            check = getattr(optimizer, "check_state_dict", None)
            try:
                if check is not None:
                    check(state[PER_RANK][self.global_rank])
            except Exception as e:  # any error (a corrupt entry), or this rank would leave the others waiting below
                error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
                break
        if self.reduce_boolean_decision(error is None, all=True):
            return
        raise ValueError(
            f"the optimizer state of the checkpoint {str(path)!r} does not fit this run's sharded parameters "
            f"({f'rank {self.global_rank}: {error}' if error else 'on another rank'}). strategy='{STRATEGY_NAME}' "
            "saves each rank's shards of FSDP's flat parameters: resume with the same model, auto_wrap_policy, "
            "number of processes and sharding (sharding_strategy='NO_SHARD' keeps whole flat parameters, "
            "'FULL_SHARD' and 'SHARD_GRAD_OP' the same shards). Nothing was loaded"
        )


class FP8FSDPStrategy(_FP8FSDPStrategyLogic, FSDPStrategy):
    """FSDP with FP8-LM: ``Trainer(strategy="fsdp_fp8")`` (implies ``precision="fp8-lm"``).

    Takes the arguments of ``lightning.pytorch.strategies.FSDPStrategy`` (``auto_wrap_policy``,
    ``sharding_strategy``, ``activation_checkpointing_policy``...), except ``mixed_precision``,
    ``state_dict_type="sharded"`` and hybrid sharding; ``use_orig_params`` defaults to True. It wraps the module
    itself, after the FP8 conversion: FSDP units made in ``configure_model`` are refused.

    Example::

        trainer = L.Trainer(strategy=FP8FSDPStrategy(auto_wrap_policy={Block}), devices=8)
    """


def check_optimizer_states(states: list[Any], strategy: Any, path: str | None = None) -> None:
    """Raise a ``ValueError`` saying what resumes them, unless ``strategy`` can load the optimizer ``states`` of a
    checkpoint: FP8FSDPStrategy's per-rank shards (:meth:`FP8FSDPStrategy.optimizer_state`) need FP8FSDPStrategy
    with as many processes, which loads nothing else.

    The precision plugin calls it before loading anything, whatever the strategy; FP8FSDPStrategy when it loads.
    """
    checkpoint = f"the checkpoint {path!r}" if path else "the checkpoint"
    per_rank = [len(state[PER_RANK]) for state in states if isinstance(state, dict) and PER_RANK in state]
    fsdp_fp8 = isinstance(strategy, _FP8FSDPStrategyLogic)
    here = f"{type(strategy).__name__} with {_processes(strategy.world_size)}"
    weights_only = (
        "; or start from its weights alone (no optimizer state): model = YourModule.load_from_checkpoint(path), then "
        "trainer.fit(model) without ckpt_path"
    )
    if per_rank and (not fsdp_fp8 or per_rank[0] != strategy.world_size):
        saved = _processes(per_rank[0])
        raise ValueError(
            f"{checkpoint} holds the optimizer state of strategy='{STRATEGY_NAME}' (FP8FSDPStrategy) as the shards of "
            f"{saved}, which only FP8FSDPStrategy with {saved} (devices x num_nodes) and the same auto_wrap_policy can "
            f"load; this run is {here}. Resume it with Trainer(strategy=FP8FSDPStrategy(...), devices x num_nodes = "
            f"{per_rank[0]}){weights_only}"
        )
    if fsdp_fp8 and len(per_rank) != len(states):
        raise ValueError(
            f"{checkpoint} holds optimizer states written by another strategy (optimizer state_dicts, not the "
            f"per-rank shards that strategy='{STRATEGY_NAME}' writes), which {here} cannot load: resume it with the "
            f"strategy that wrote it{weights_only}"
        )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _fsdp_base(cls: type) -> type:
    return next(base for base in cls.__mro__ if base.__name__ == "FSDPStrategy")


@functools.cache
def strategy_class(namespace: str) -> type:
    """:class:`FP8FSDPStrategy` for ``"lightning"``, or the same strategy on ``pytorch_lightning``'s FSDP."""
    if namespace == "lightning":
        return FP8FSDPStrategy
    return build_flavour(
        _FP8FSDPStrategyLogic, f"{namespace}.strategies", "FSDPStrategy", "FP8FSDPStrategyPL", __name__,
        FP8FSDPStrategy.__doc__,
    )  # fmt: skip


def __getattr__(name: str) -> Any:
    # Makes the pytorch_lightning flavour importable by name (pickling for spawned processes).
    if name == "FP8FSDPStrategyPL":
        return strategy_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
