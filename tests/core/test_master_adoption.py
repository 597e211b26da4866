"""FP8AdamW (O2) takes an FP8 weight's storage for its fp16 master, changing the parameter's dtype: refused, with
nothing changed, when something already hooks the parameter's gradient accumulator (DDP's reducer does), whose hooks
would silently stop firing. tests/distributed/test_ddp_optim.py does it with DDP itself."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.optim import master


def _model() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))


def _hook_accumulator(p: torch.Tensor, fired: list) -> torch.autograd.graph.Node:
    """Hook ``p``'s gradient accumulator the way DDP's reducer does (and keep it: the reducer holds it)."""
    node = p.view_as(p).grad_fn.next_functions[0][0]
    node.register_hook(lambda *args: fired.append(True))
    return node


@pytest.mark.parametrize("grouped", [False, True], ids=["one_group", "second_group_hooked"])
def test_adoption_under_accumulator_hooks_is_refused_and_changes_nothing(grouped):
    model = _model()
    fired: list = []
    held = _hook_accumulator(model[2].weight, fired)  # kept alive, as DDP's reducer keeps it
    params = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
    with pytest.raises(RuntimeError, match="Create FP8AdamW before wrapping the model in DDP"):
        FP8AdamW(params if grouped else list(model.parameters()), lr=1e-3)
    for p in model.parameters():  # the first group's weight too: every group is checked before any is adopted
        assert p.dtype == torch.float32 and master.master_scale(p) is None
    model(torch.randn(4, 32)).sum().backward()
    assert fired, "the hook no longer fires: the accumulator was replaced"
    del held


def test_adoption_without_hooks_and_after_backward_goes_on():
    model = _model()
    model(torch.randn(4, 32)).sum().backward()  # the graph is freed: autograd keeps no accumulator alive
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    assert model[0].weight.dtype == torch.float16 and master.master_scale(model[0].weight) is not None
    model(torch.randn(4, 32)).sum().backward()
    opt.step()


def test_o1_keeps_the_storage_under_hooks():
    model = _model()
    held = _hook_accumulator(model[0].weight, [])
    FP8AdamW(model.parameters(), lr=1e-3, opt_level="O1")
    assert model[0].weight.dtype == torch.float32
    del held
