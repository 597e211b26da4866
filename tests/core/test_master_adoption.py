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


def test_an_earlier_forwards_output_still_referenced_is_named_and_deleting_it_lets_adoption_go_on():
    # The kept output holds the graph and its accumulators (after the backward too): the refusal names it and what
    # to do, not only DDP; once it is deleted the same optimizer is built.
    model = _model()
    loss = model(torch.randn(4, 32)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="an output of an earlier forward is still referenced") as info:
        FP8AdamW(model.parameters(), lr=1e-3)
    assert "`del` it first" in str(info.value)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    del loss
    FP8AdamW(model.parameters(), lr=1e-3)
    assert model[0].weight.dtype == torch.float16


def test_add_param_group_with_an_earlier_output_referenced_adds_nothing_until_it_is_deleted():
    # Unfreezing layers mid-training: the last step's `loss` still holds the new group's accumulators.
    model = _model()
    opt = FP8AdamW(model[0].parameters(), lr=1e-3)
    loss = model(torch.randn(4, 32)).sum()
    loss.backward()
    opt.step()
    with pytest.raises(RuntimeError, match="before add_param_group"):
        opt.add_param_group({"params": list(model[2].parameters())})
    assert len(opt.param_groups) == 1 and all(p.dtype == torch.float32 for p in model[2].parameters())
    del loss
    opt.add_param_group({"params": list(model[2].parameters())})
    assert model[2].weight.dtype == torch.float16 and master.master_scale(model[2].weight) is not None
    before = model[2].weight.detach().clone()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert not torch.equal(before, model[2].weight)  # the added group is stepped


def test_o1_keeps_the_storage_under_hooks():
    model = _model()
    held = _hook_accumulator(model[0].weight, [])
    FP8AdamW(model.parameters(), lr=1e-3, opt_level="O1")
    assert model[0].weight.dtype == torch.float32
    del held


# The same AdamW update computed in fp32 (FP8AdamW's step, torch.optim.AdamW), rounded once to fp16: at most one fp16
# ulp apart where the two fp32 results straddle a rounding boundary (equal in practice).
FP16_ROUNDING_RTOL = 2**-10
# fp32 moments updated by the same formula in a different order of operations: torch's AdamW takes m.lerp_(g, 1 - b1),
# m + (1 - b1) (g - m), whose difference cancels bits where g and m are close (2.3e-6 seen with torch 2.11).
FP32_STATE_RTOL = 1e-5


def test_half_after_adoption_keeps_the_masters_and_steps_the_rest_in_fp16_like_adamw():
    # model.half() leaves the fp16 masters as they are; a bias becomes fp16 and keeps its fp32 moments.
    model = _model()
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = FP8AdamW(model.parameters(), **hyper)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
    storage = model[0].weight.detach().clone()
    model.half()
    assert torch.equal(model[0].weight, storage)
    bias = model[2].bias
    for _ in range(3):
        model(torch.randn(4, 32, dtype=torch.float16)).float().pow(2).sum().backward()
        ref = nn.Parameter(bias.detach().float())  # the same weights and states, stepped in fp32
        ref.grad = bias.grad.float()
        ref_opt = torch.optim.AdamW([ref], **hyper, foreach=False)
        ref_opt.state[ref] = {k: v.detach().float().clone() for k, v in opt.state[bias].items()}
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        assert bias.dtype == torch.float16 and opt.state[bias]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(bias, ref.detach().half(), rtol=FP16_ROUNDING_RTOL, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[bias][key], ref_opt.state[ref][key], rtol=FP32_STATE_RTOL, atol=0)


@pytest.mark.parametrize("cast", ["float", "bfloat16"])
def test_another_dtype_after_adoption_is_refused_saying_what_is_accepted(cast):
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    getattr(model, cast)()
    model(torch.randn(4, 32, dtype=model[0].bias.dtype)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"must stay torch.float16 \(a cast to torch.float16 is accepted\)") as info:
        opt.step()
    # What to do next: fp32 kept the masters (a cast back restores them), bf16 rounded them (a checkpoint does).
    assert "gives the masters back exactly" in str(info.value) and "load the last checkpoint" in str(info.value)


def test_a_weight_tied_after_conversion_is_not_taken_as_an_fp8_weight():
    """A Parameter assigned to an FP8Linear after construction may be another module's (Hugging Face's tie_weights()
    after conversion): an O2 master in its storage would hand the embedding the weight times its master scale (NaN
    after a step). Only the DTensor that torch's parallel styles register is marked (test_tensor_parallel.py)."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.ModuleDict({"emb": nn.Embedding(64, 32), "head": nn.Linear(32, 64, bias=False)}))
    model.head.weight = model.emb.weight
    assert not master.is_fp8_weight(model.emb.weight)
    opt = FP8AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, opt_level="O2")
    idx = torch.randint(0, 64, (4, 8))
    model.head(model.emb(idx)).logsumexp(-1).mean().backward()
    before = model.emb.weight.detach().clone()
    opt.step()
    assert model.emb.weight.dtype == torch.float32
    assert (model.emb.weight.detach() - before).abs().max() <= 1.001e-3  # an Adam step moves a weight by about lr
