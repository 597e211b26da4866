"""FSDP1's units under FP8FSDPStrategy: the checks of a module's units, and the end of a manual backward.

FSDP1 shards a module unit by unit (``auto_wrap_policy``); a parameter outside every unit stays in the root unit.
Two setups then go wrong in FSDP1 itself, and are refused when the strategy sets the model up: a module sharded by
an earlier Trainer's fit (its parameters outside the units are that fit's shard views), and manual optimization with
parameters in the root unit (whose backward FSDP1 cannot run inside the root's forward). After a manual backward,
``_finish_manual_backward`` runs what FSDP1's end-of-backward callback would have. Apart from
:mod:`~lightning_fp8.integrations.lightning.strategy` because these reach into FSDP1's internals (its units' handles
and training states), not into Lightning's strategy.
"""

from __future__ import annotations

from typing import Any

from lightning_fp8.integrations.lightning.strategy_args import STRATEGY_NAME

_MADE_BY_HAND = (
    f"strategy='{STRATEGY_NAME}' shards the module itself, after converting its linear layers to FP8: FSDP units made "
    "by hand (wrap() or FullyShardedDataParallel(...) in configure_model) are not supported (the conversion would "
    "replace the layers inside them, and the FP8 gradient communication needs the strategy's root wrapper). Remove "
    "them and name the classes to wrap in FP8FSDPStrategy(auto_wrap_policy={...}), or use ModelParallelStrategy with "
    "convert_to_fp8 and fully_shard in configure_model (FSDP2)"
)

# Set on the FSDP units FP8FSDPStrategy made (its auto_wrap_policy's and the root): any other unit was made by hand.
_OWN_UNIT = "_lightning_fp8_unit"


def _mark_own_units(root: Any) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in root.modules():
        if isinstance(unit, FullyShardedDataParallel):
            setattr(unit, _OWN_UNIT, True)


def units_made_by_hand(module: Any, **fsdp_kwargs: Any) -> Any:
    """Raise the ValueError of :func:`_check_not_sharded_by_another` for FSDP units made by hand: what ``wrap()``
    calls in ``configure_model`` under ``strategy="fsdp_fp8"`` (``enable_wrap``'s ``wrapper_cls``)."""
    raise ValueError(_MADE_BY_HAND)


def _check_not_sharded_by_another(model: Any) -> None:
    """Raise ValueError for a module with FSDP units this strategy did not make (``wrap()`` in ``configure_model``:
    on GPUs Lightning then left the module unwrapped, the conversion replaced the layers inside them, and the first
    forward failed; converted by hand first, it trained without the FP8 gradient communication), or whose units an
    earlier Trainer's fit made (a root wrapper gone with it): its parameters outside those units are that fit's shard
    views of this rank, which no new wrapper can gather."""
    units, outside = _units_and_outside(model)
    if any(not getattr(unit, _OWN_UNIT, False) for unit in units):
        raise ValueError(_MADE_BY_HAND)
    if units and outside:
        raise ValueError(
            f"strategy='{STRATEGY_NAME}': this module was sharded by another Trainer's fit: its parameters outside "
            f"the auto_wrap_policy units ({_names(outside)}) hold only this rank's "
            "shard. Validate, test or predict with the Trainer that ran fit, or load the checkpoint into a new module "
            "(trainer.test(NewModule(), ckpt_path=...) or LitModule.load_from_checkpoint(...))"
        )


def _check_manual_optimization_units(root: Any, module: Any) -> None:
    """Raise ValueError for manual optimization with parameters in the root unit: manual_backward runs inside the
    root's forward, where FSDP1 cannot run the backward of the root's own parameters (it failed in the first
    manual_backward with "Expects BACKWARD_PRE or BACKWARD_POST state")."""
    if getattr(module, "automatic_optimization", True) or getattr(root, "_handle", None) is None:
        return
    _, outside = _units_and_outside(module)
    raise ValueError(
        f"strategy='{STRATEGY_NAME}' with manual optimization needs every parameter inside an auto_wrap_policy unit: "
        f"{_names(outside)} would stay in the root unit, whose backward FSDP1 cannot run inside its forward (where "
        "training_step and manual_backward run). Add their modules to auto_wrap_policy, use automatic "
        "optimization, or use ModelParallelStrategy (FSDP2)"
    )


def _units_and_outside(module: Any) -> tuple[list[Any], list[str]]:
    """The FSDP1 units inside ``module`` and the names of its parameters outside all of them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel) and m is not module]
    inside = {id(p) for unit in units for p in unit.parameters()}
    return units, [name for name, p in module.named_parameters() if id(p) not in inside]


def _names(names: list[str]) -> str:
    return f"{names[:3]}{' ...' if len(names) > 3 else ''}"


def _finish_manual_backward(root: Any) -> None:
    """What FSDP1's end-of-backward callback does, after a manual-optimization backward (``manual_backward``).

    That backward runs inside the root's forward (training_step is called through it), where FSDP1 queues no
    end-of-backward callback: each unit's reduced gradient shard stayed in its ``_saved_grad_shard``, so every later
    backward added to it (the optimizer stepped on the sum of all gradients since the fit began whenever zero_grad came
    after step), and the units stayed "after backward", which FSDP's state_dict refuses (every checkpoint failed)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._runtime_utils import _post_backward_final_callback

    if not isinstance(root, FullyShardedDataParallel) or getattr(root, "_post_backward_callback_queued", False):
        return
    if any(u._handle is not None and u._handle._training_state.name == "BACKWARD_POST" for u in root._all_fsdp_states):
        _post_backward_final_callback(root, root)
