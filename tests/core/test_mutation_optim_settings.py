"""FP8AdamW's constructor arguments (optim/settings.py), pinned where a mutation audit found them unpinned. The
references: the documented rules (docs/concepts/optimizer.md, FP8-LM section 2.3: FP8 masters degraded training and an
FP8 second moment diverged; fp32 masters, fp16 and E5M2 first moments and fp32 second moments are named as choices),
the dtypes the refusal itself offers (each must then be taken), and the list form of ``fp8_params`` for its other
iterables."""

import re

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW
from lightning_fp8.formats import E4M3, E5M2

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread

STATE_OF = {"master_dtype": "master", "exp_avg_dtype": "exp_avg", "exp_avg_sq_dtype": "exp_avg_sq"}


def _stepped(fp8_params=None, **kwargs) -> tuple[nn.Linear, FP8AdamW]:
    """A linear layer whose weight is given as an FP8 weight (``fp8_params``, default ``[weight]``), one step taken."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    opt = FP8AdamW(layer.parameters(), fp8_params=[layer.weight] if fp8_params is None else fp8_params(layer), **kwargs)
    layer.weight.grad, layer.bias.grad = torch.randn(16, 32), torch.randn(16)
    opt.step()
    return layer, opt


def _offered(argument: str) -> list[torch.dtype]:
    """The dtypes FP8AdamW's refusal of ``argument`` offers (``choose one of [torch.float32, ...]``)."""
    with pytest.raises(ValueError, match=rf"FP8AdamW\({argument}=torch.int8\) is not supported") as error:
        FP8AdamW([nn.Parameter(torch.randn(4))], **{argument: torch.int8})
    names = re.search(r"choose one of \[(.*)\]$", str(error.value)).group(1).split(", ")
    return [getattr(torch, name.removeprefix("torch.")) for name in names]


@pytest.mark.parametrize("argument", list(STATE_OF))
def test_every_dtype_the_refusal_offers_is_taken_as_that_state(argument):
    """A dtype the error message tells the user to choose must be accepted, and the state must be stored in it."""
    offered = _offered(argument)
    assert len(offered) >= 2, offered
    for dtype in offered:
        layer, opt = _stepped(**{argument: dtype})
        assert opt.state[layer.weight][STATE_OF[argument]].dtype == dtype, (argument, dtype)


@pytest.mark.parametrize(
    ("argument", "dtype"),
    [("master_dtype", torch.float32), ("exp_avg_dtype", torch.float16), ("exp_avg_dtype", E5M2),
     ("exp_avg_sq_dtype", torch.float32),
     # FP8AdamW's docstring lists the rest: bf16 for each state, fp16 masters and second moments
     ("master_dtype", torch.bfloat16), ("exp_avg_dtype", torch.bfloat16), ("exp_avg_sq_dtype", torch.bfloat16),
     ("master_dtype", torch.float16), ("exp_avg_sq_dtype", torch.float16)],
)  # fmt: skip
def test_the_documented_choices_are_offered(argument, dtype):
    assert dtype in _offered(argument)


@pytest.mark.parametrize("argument", ["master_dtype", "exp_avg_sq_dtype"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_masters_and_second_moments_are_refused_as_the_paper_found_them_to_fail(argument, dtype):
    with pytest.raises(ValueError, match=rf"FP8AdamW\({argument}={dtype}\) is not supported"):
        FP8AdamW([nn.Parameter(torch.randn(4))], **{argument: dtype})


def test_fp8_params_of_a_single_tensor_is_refused_not_taken_as_its_rows():
    """A bare tensor iterates over its rows (new tensors, none of them the weight): taken so, no weight would get the
    FP8 states, silently. The documented argument is an iterable of the weight tensors."""
    layer = nn.Linear(32, 16)
    with pytest.raises(TypeError, match=r"fp8_params=\.\.\.\) takes an iterable of the weight tensors.*got Parameter"):
        FP8AdamW(layer.parameters(), fp8_params=layer.weight)


@pytest.mark.parametrize(
    "iterable",
    [lambda layer: (p for p in [layer.weight]), lambda layer: iter([layer.weight]), lambda layer: {layer.weight}],
)
def test_fp8_params_of_any_iterable_are_taken_as_the_list_is(iterable):
    """A generator (``p for p in model.parameters() if ...``, the usual way to pick them) is read once: the weights it
    gave must get the states the list gives them."""
    ref_layer, ref_opt = _stepped()
    layer, opt = _stepped(fp8_params=iterable)
    reference = {key: value.dtype for key, value in ref_opt.state[ref_layer.weight].items()}
    assert {key: value.dtype for key, value in opt.state[layer.weight].items()} == reference
    assert reference["exp_avg"] == E4M3  # the default O2 states of an FP8 weight (docs/concepts/optimizer.md)
    torch.testing.assert_close(layer.weight, ref_layer.weight, rtol=0, atol=0)
