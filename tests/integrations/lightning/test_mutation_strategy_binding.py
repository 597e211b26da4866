"""FP8FSDPStrategy reads FSDPStrategy's arguments by name from FSDPStrategy's signature (strategy.py); a call that
signature refuses must get FSDPStrategy's own error, pinned where a mutation audit found it unpinned (the arguments of
such a call dropped, the strategy was built from none of them, silently). The reference is Lightning's FSDPStrategy
(of each Lightning package) called the same way. Also pinned: a DeviceMesh object is judged by its shape as the tuple
of that shape is (strategy_args.py)."""

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_fp8.integrations.lightning import FP8FSDPStrategy, registry
from lightning_fp8.integrations.lightning.strategy import strategy_class
from tests.distributed.launch import free_port

NAMESPACES = [ns for ns in registry.NAMESPACES if importlib.util.find_spec(ns) is not None]


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fsdp_strategy(namespace):
    root = "pytorch_lightning" if namespace == "pytorch_lightning" else "lightning.pytorch"
    return importlib.import_module(f"{root}.strategies").FSDPStrategy


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [([None] * 20, {}), ([None], {"accelerator": None}), ([None, None], {"parallel_devices": None})],
    ids=["too_many_positional", "accelerator_twice", "parallel_devices_twice"],
)
def test_a_call_fsdp_strategy_refuses_gets_its_own_error(namespace, args, kwargs):
    with pytest.raises(TypeError) as theirs:
        _fsdp_strategy(namespace)(*args, **kwargs)
    with pytest.raises(TypeError) as ours:
        strategy_class(namespace)(*args, **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_a_device_mesh_object_is_judged_by_its_shape_as_the_tuple_is(monkeypatch):
    """A (1, 2) DeviceMesh (HSDP's layout) trains the processes along its second dimension apart, as (1, 2) does."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    for shape in ((1, 2), (2, 1)):
        mesh = DeviceMesh("cpu", torch.arange(2).view(shape), _init_backend=False)  # no groups: one process here
        if shape == (2, 1):
            assert FP8FSDPStrategy(device_mesh=mesh).kwargs["device_mesh"] is mesh
            continue
        with pytest.raises(ValueError) as by_tuple:
            FP8FSDPStrategy(device_mesh=shape)
        with pytest.raises(ValueError) as by_mesh:
            FP8FSDPStrategy(device_mesh=mesh)
        assert str(by_mesh.value) == str(by_tuple.value)
