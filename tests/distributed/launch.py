"""Run a function on N CPU processes with a gloo process group, and collect what each rank returns.

The tests spawn their own processes (no torchrun): each worker gets a fresh free TCP port, the whole run a
deadline after which every worker is killed. A worker returns a picklable value (tensors, dicts, lists); the
parent receives one per rank. Workers are module-level functions so that ``spawn`` can import them.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_parts(parts: dict[str, Callable[[], object]]) -> dict[str, tuple[str, object]]:
    """Run each of a worker's named checks: ``{name: ("ok", result) or ("error", traceback)}``. One failing part must
    not hide the others' results (the spawn is shared by several tests)."""
    reports: dict[str, tuple[str, object]] = {}
    for name, part in parts.items():
        try:
            reports[name] = ("ok", part())
        except Exception:
            reports[name] = ("error", traceback.format_exc())
    return reports


def part_results(results: list[dict], name: str) -> list:
    """Every rank's result of the part ``name`` of :func:`run_parts`; fails the test with the traceback of a rank where
    that part raised."""
    import pytest

    for rank, reports in enumerate(results):
        status, value = reports[name]
        if status == "error":
            pytest.fail(f"{name} failed on rank {rank}:\n{value}")
    return [reports[name][1] for reports in results]


def cpu_mesh():
    """A 1-D CPU device mesh over every rank: ``fully_shard``'s default mesh is CUDA wherever CUDA is, which these gloo
    workers cannot use on a GPU machine."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_worker(wait_for_all: bool = True) -> None:
    """End a worker process whose results are written, without the interpreter's teardown.

    A finished gloo worker can abort while the interpreter shuts down ("terminate called without an active
    exception": a gloo thread still holding work as Python tears down, pytorch/pytorch#179291), also after
    ``destroy_process_group`` and a barrier; its results are already saved, so skipping the teardown loses nothing.
    ``wait_for_all``: first a barrier, so that no rank leaves while another still needs it.
    """
    if wait_for_all and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple, backend: str = "gloo"
) -> None:
    init = {"init_method": f"tcp://127.0.0.1:{port}", "rank": rank, "world_size": world_size}
    if backend == "nccl":  # one GPU per rank, NVLink multicast off (the GPU machines' rule)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank)
        init["device_id"] = torch.device("cuda", rank)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)  # N processes on a 2-core machine: no oversubscription
    dist.init_process_group(backend, **init)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report the worker's traceback to the test instead of a bare exit code
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    # No barrier: a rank whose collectives returned has nothing in flight, and a failed rank must not keep the others
    # waiting (the parent reports its traceback).
    exit_worker(wait_for_all=False)


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes (gloo, or NCCL with one GPU per rank); return
    each rank's result.

    Raises:
        RuntimeError: with the worker's traceback when one fails, or when the deadline passes.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker, args=(fn, world_size, free_port(), out_dir, args, backend), nprocs=world_size, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{fn.__name__} on {world_size} processes did not finish in {timeout:.0f}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            status, value = torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False)
            if status == "error":
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            results.append(value)
        return results
