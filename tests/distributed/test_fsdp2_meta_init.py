"""FSDP2's FP8 weight all-gather on a model sharded on the meta device and materialized afterwards (``to_empty``).

``enable_fp8_fsdp2`` picked the all-gather's kernels once, from the device the shards were on when it ran: the meta
device. On a GPU, ``FP8CommState(fused=True)`` then raised "the gradients are on meta", and the default ``fused=None``
gathered with the PyTorch references (a silent fallback) once the model lived on the GPU. The kernels are now picked
per gather from the shard's device, as the reduce-scatter picks them.

A GPU is simulated on the CPU: the Triton kernels run under the interpreter, ``ops.fp8_device`` counts the CPU as an FP8
GPU, and for ``fused=True`` ``comm_state_checks`` sees CUDA and no interpreter while the hooks are installed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.launch import cpu_mesh, run_workers

pytestmark = pytest.mark.slow


# Triton 3.6's interpreter (the GPU machine's) reads a program id used as a loop bound with int() of a 1-element array,
# which NumPy 2.4 refuses; later interpreters squeeze it first. There the interpreted kernels cannot run on CPU at all.
_OLD_INTERPRETER = "only 0-dimensional arrays can be converted to Python scalars"


def _meta_init_worker(rank: int, world: int, fused: bool | None) -> dict:
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import convert_to_fp8, ops
    from lightning_fp8.distributed import FP8CommState, comm_state_checks, enable_fp8_fsdp2, fsdp2_comms

    picked: list[bool] = []
    kernels = fsdp2_comms.segment_kernels

    def spy(use_fused: bool):
        picked.append(use_fused)
        return kernels(use_fused)

    fsdp2_comms.segment_kernels = spy
    ops.fp8_device = lambda device: device.type in ("cpu", "cuda")  # the CPU as an FP8 GPU (its kernels interpreted)
    with torch.device("meta"):
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    fully_shard(model, mesh=cpu_mesh())
    state = FP8CommState(fused=fused)
    interpreted, cuda = comm_state_checks._triton_interpreted, torch.cuda.is_available
    if fused:  # a GPU machine, as enable_fp8_fsdp2 sees it: CUDA, no interpreter
        comm_state_checks._triton_interpreted, torch.cuda.is_available = (lambda: False), (lambda: True)
    try:
        enable_fp8_fsdp2(model, state)
    except ValueError as error:
        return {"error": str(error)}
    finally:
        comm_state_checks._triton_interpreted, torch.cuda.is_available = interpreted, cuda
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    try:
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    except Exception as error:  # only the interpreter's own fault is let through, below
        if _OLD_INTERPRETER not in str(error):
            raise
        return {"error": None, "interpreter": _OLD_INTERPRETER}
    return {"error": None, "picked": picked}


@pytest.mark.parametrize("fused", [None, True], ids=["default", "fused"])
def test_the_weight_all_gather_picks_its_kernels_on_the_materialized_device(fused):
    reports = run_workers(_meta_init_worker, 2, fused)
    if any("interpreter" in report for report in reports):
        pytest.skip("this Triton's interpreter cannot run the kernels on CPU (Triton 3.6 with NumPy 2.4+); compiled on "
                    "a GPU they run in tests/distributed/test_comm_kernels.py")  # fmt: skip
    for report in reports:
        assert report["error"] is None, report["error"]
        assert report["picked"] and all(report["picked"]), report["picked"]  # the Triton kernels, every gather
