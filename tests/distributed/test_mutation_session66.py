"""enable_fp8_fsdp1's refusal of hybrid sharding on 2 gloo processes, from a mutation audit of this session's fix
(lightning_fp8/distributed/fsdp.py ``_refuse_hybrid_sharding``; the audit's list is in
tests/core/test_mutation_session66.py).

tests/distributed/test_routes_fsdp1.py refuses a root of ``HYBRID_SHARD``, which left these mutants alive:

- ``"HYBRID" in unit.sharding_strategy.name`` -> ``unit.sharding_strategy.name == "HYBRID_SHARD"``: a model sharded
  with ``_HYBRID_SHARD_ZERO2`` (FSDP1's other hybrid strategy, which takes no communication hook either) passed the
  check, and torch's ``register_comm_hook`` raised its bare AssertionError after the state recorded the model.
- ``for unit in FSDP.fsdp_modules(model)`` -> ``for unit in [model]``: a hybrid unit nested in a ``FULL_SHARD`` root
  passed the check (torch's ``register_comm_hook`` refuses every unit under the root that is hybrid).

The reference is torch's own rule (``register_comm_hook`` asserts that no FSDP1 state under the root shards with
``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2``) and the documented refusal: a ValueError before anything is recorded on
the state.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.launch import part_results, run_parts, run_workers

pytestmark = pytest.mark.slow


def _refusal(model: nn.Module) -> dict:
    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp1

    state = FP8CommState()
    try:
        enable_fp8_fsdp1(model, state)
        error = None
    except Exception as caught:  # noqa: BLE001 - the type is part of the result
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "layouts": len(state._fsdp1_layouts)}


def _hybrid(module: nn.Module, strategy, singles) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # Sharded over the world, replicated over each rank alone (as test_routes_fsdp1's HYBRID_SHARD run).
    return FSDP(module, device_id=torch.device("cpu"), sharding_strategy=strategy,
                process_group=(dist.group.WORLD, singles[dist.get_rank()]))  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates each
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero2 = _hybrid(nn.Linear(16, 16), ShardingStrategy._HYBRID_SHARD_ZERO2, singles)
        inner = _hybrid(nn.Linear(16, 16), ShardingStrategy.HYBRID_SHARD, singles)
        nested = FSDP(nn.Sequential(inner, nn.Linear(16, 4)), device_id=torch.device("cpu"),
                      sharding_strategy=ShardingStrategy.FULL_SHARD)  # fmt: skip
    strategies = [unit.sharding_strategy.name for unit in FSDP.fsdp_modules(nested)]
    return run_parts({
        "zero2": lambda: _refusal(zero2),
        "nested": lambda: {**_refusal(nested), "strategies": strategies},
    })  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(_worker, 2)


def test_hybrid_shard_zero2_is_refused_before_the_state_records_it(runs):
    for run in part_results(runs, "zero2"):
        assert (run["error"] or "").startswith("ValueError: enable_fp8_fsdp1: the model shards with "
                                               "ShardingStrategy._HYBRID_SHARD_ZERO2"), run  # fmt: skip
        assert run["layouts"] == 0, run


def test_a_hybrid_unit_inside_a_full_shard_root_is_refused_before_the_state_records_it(runs):
    for run in part_results(runs, "nested"):
        assert run["strategies"] == ["FULL_SHARD", "HYBRID_SHARD"], run  # the root first, as fsdp_modules lists them
        assert (run["error"] or "").startswith("ValueError: enable_fp8_fsdp1: the model shards with "
                                               "ShardingStrategy.HYBRID_SHARD"), run  # fmt: skip
        assert run["layouts"] == 0, run
