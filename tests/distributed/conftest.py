"""One spawn per world size for all multi-process scenarios of this directory (spawning costs seconds).

Each test module exposes worker functions ``fn(rank, world_size) -> picklable``; the session runs those of the
collected modules in one set of processes per world size and hands each module its workers' results.
"""

from __future__ import annotations

import importlib
import traceback

import pytest

from tests.distributed.launch import run_workers

# world size -> (module, worker) pairs, run in this order.
SCENARIOS = {
    1: [("test_nonfinite_and_args", "_worker1")],
    2: [("test_comm", "_worker"), ("test_gather", "_worker"), ("test_ddp", "_worker"), ("test_fsdp", "_worker2"),
        ("test_fsdp_optim", "_worker"), ("test_nonfinite_and_args", "_worker2")],
    4: [("test_comm", "_worker"), ("test_gather", "_worker"), ("test_fsdp", "_worker4"),
        ("test_nonfinite_and_args", "_worker4")],
}


def _run_scenarios(rank: int, world: int, names: list[tuple[str, str]]) -> dict:
    out = {}
    for module, fn in names:
        try:
            worker = getattr(importlib.import_module(f"tests.distributed.{module}"), fn)
            out[(module, fn)] = ("ok", worker(rank, world))
        except Exception:  # the scenario's tests report it; the others still run
            out[(module, fn)] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="session")
def spawned(request):
    """``spawned(world, module, worker)``: that worker's per-rank results (runs the world's spawn once)."""
    collected = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items}
    cache: dict[int, list[dict]] = {}

    def get(world: int, module: str, fn: str) -> list:
        if world not in cache:
            names = [s for s in SCENARIOS[world] if s[0] in collected]
            cache[world] = run_workers(_run_scenarios, world, names, timeout=600)
        results = []
        for rank, per_rank in enumerate(cache[world]):
            status, value = per_rank[(module, fn)]
            if status == "error":
                raise RuntimeError(f"{module}.{fn} failed on rank {rank} of {world}:\n{value}")
            results.append(value)
        return results

    return get
