"""What FP8AdamW refuses on every path in, not only in its constructor: AMSGrad (FP8AdamW implements AdamW without it)
through add_param_group and through a loaded state dict, before anything changes; an FP8 layer reparametrized (or
pruned) after the conversion, in the constructor and add_param_group, before any weight changes."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.optim import master
from tests.numerics import assert_same

NO_AMSGRAD = "FP8AdamW\\(amsgrad=True\\) is not supported"  # the constructor's message


def _model() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()


def _snapshot(model: nn.Module, opt: FP8AdamW) -> tuple:
    return copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())


def test_add_param_group_refuses_amsgrad_as_the_constructor_does():
    """It was kept in the group and ignored: the group stepped as AdamW."""
    a, b = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    opt = FP8AdamW([a])
    with pytest.raises(ValueError, match=NO_AMSGRAD):
        opt.add_param_group({"params": [b], "amsgrad": True})
    assert len(opt.param_groups) == 1  # not kept
    with pytest.raises(ValueError, match=NO_AMSGRAD):
        FP8AdamW([{"params": [a]}, {"params": [b], "amsgrad": True}])
    opt.add_param_group({"params": [b], "amsgrad": False})  # torch.optim.AdamW's default, spelled out
    assert opt.param_groups[1]["params"] == [b]


def test_add_param_group_refuses_coupled_weight_decay_that_torch_adamw_would_honour():
    """torch.optim.AdamW applies Adam's L2 decay to a group with decoupled_weight_decay=False; FP8AdamW kept the flag
    and decayed the group decoupled."""
    a, b = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    opt = FP8AdamW([a])
    with pytest.raises(ValueError, match="decoupled_weight_decay=False and weight_decay 0.01 .* is not supported"):
        opt.add_param_group({"params": [b], "decoupled_weight_decay": False})
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        FP8AdamW([{"params": [a]}, {"params": [b], "decoupled_weight_decay": False}])
    assert len(opt.param_groups) == 1  # not kept
    opt.add_param_group({"params": [b], "decoupled_weight_decay": True})  # AdamW's own, spelled out
    FP8AdamW([a]).add_param_group({"params": [b], "decoupled_weight_decay": False, "weight_decay": 0})  # no decay
    # a torch.optim.Adam state dict (its groups say False) still loads, as into torch.optim.AdamW: decoupled
    adam = torch.optim.Adam([a, b])
    loaded = FP8AdamW([a, b])
    loaded.load_state_dict(adam.state_dict())
    assert loaded.param_groups[0]["decoupled_weight_decay"] is True


def test_amsgrad_is_the_sixth_positional_argument_as_in_torch():
    a = nn.Parameter(torch.randn(16))
    FP8AdamW([a], 1e-3, (0.9, 0.999), 1e-8, 0.01, False)
    with pytest.raises(ValueError, match=NO_AMSGRAD):
        FP8AdamW([a], 1e-3, (0.9, 0.999), 1e-8, 0.01, True)


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_add_param_group_refuses_capturable_and_differentiable_as_the_constructor_does(flag):
    """Refused as constructor arguments, but kept in a group (given to the constructor or add_param_group), claimed
    by the group and ignored by the step."""
    a, b = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    message = f"FP8AdamW\\({flag}=True\\) is not supported"
    with pytest.raises(ValueError, match=message):
        FP8AdamW([a], **{flag: True})
    with pytest.raises(ValueError, match=message):
        FP8AdamW([{"params": [a]}, {"params": [b], flag: True}])
    opt = FP8AdamW([a])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [b], flag: True})
    assert len(opt.param_groups) == 1  # not kept
    opt.add_param_group({"params": [b], flag: False})
    assert opt.param_groups[1]["params"] == [b]
    # And from a saved group (torch.optim.AdamW's state dict carries both flags), before anything changes.
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=3e-3)
    _step(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0][flag] = True
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=f"parameter group 0 of the state dict: {message}"):
        opt.load_state_dict(saved)
    assert_same(_snapshot(model, opt), before)


@pytest.mark.parametrize("saved", ["amsgrad_adamw", "max_exp_avg_sq_only"])
def test_load_state_dict_refuses_amsgrad_before_anything_changes(saved):
    """A torch.optim.AdamW(amsgrad=True) state dict loaded with its running maximum ('max_exp_avg_sq') dropped and
    stepped on as AdamW. Refused: the optimizer and the weights are those of an optimizer that never tried."""
    source = copy.deepcopy(_model())
    adamw = torch.optim.AdamW(source.parameters(), lr=1e-2, amsgrad=True)
    for _ in range(2):
        _step(source, adamw)
    state_dict = adamw.state_dict()
    if saved == "max_exp_avg_sq_only":  # a state with AMSGrad's maximum whose groups say amsgrad=False
        for group in state_dict["param_groups"]:
            group["amsgrad"] = False
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=3e-3)
    _step(model, opt)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="AMSGrad") as raised:
        opt.load_state_dict(state_dict)
    assert "amsgrad" in str(raised.value) and "max_exp_avg_sq" in str(raised.value)  # says what to do
    assert_same(_snapshot(model, opt), before)


def test_load_state_dict_takes_torch_adamw_groups_with_amsgrad_false():
    """torch.optim.AdamW saves amsgrad=False in its groups: such a state dict loads, and FP8AdamW continues as
    torch.optim.AdamW (fp32 states of parameters that are not FP8 weights)."""
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 32)
    ref(x).square().mean().backward()
    ref_opt.step()
    assert ref_opt.state_dict()["param_groups"][0]["amsgrad"] is False
    model = copy.deepcopy(ref)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # not ref_opt's live tensors (torch's loads alias them)
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_adamw_performance_arguments_are_accepted_and_step_as_without_them():
    """Code written for torch.optim.AdamW passes foreach= or fused=: FP8AdamW raised TypeError (unexpected keyword)
    though it takes AdamW's arguments. They have no effect (the step is always fused): the same bits as without them;
    capturable=True and differentiable=True are refused, saying what to do."""
    runs = []
    for kwargs in ({}, {"foreach": True, "fused": True}, {"foreach": False, "fused": False, "capturable": False}):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))
        opt = FP8AdamW(model.parameters(), lr=1e-2, **kwargs)
        for _ in range(2):
            _step(model, opt)
        runs.append(_snapshot(model, opt))
    assert_same(runs[1], runs[0])
    assert_same(runs[2], runs[0])
    for name in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"FP8AdamW\\({name}=True\\) is not supported"):
            FP8AdamW(nn.Linear(4, 4).parameters(), **{name: True})


class _Half(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 0.5 * w


REPARAMETRIZED = {
    "parametrize": (
        lambda layer: parametrize.register_parametrization(layer, "weight", _Half()),
        "'parametrizations.weight.original'.*reparametrized after the conversion.*remove_parametrizations",
    ),
    "pruning": (
        lambda layer: prune.l1_unstructured(layer, "weight", amount=0.5),
        "'weight_orig'.*pruning of FP8 layers is not supported.*prune.remove.*before convert_to_fp8",
    ),
}


@pytest.mark.parametrize("kind", REPARAMETRIZED)
def test_constructor_refuses_a_layer_reparametrized_after_conversion_before_anything_changes(kind):
    """The FP8-weight marker stays on the parameter the weight is computed from: at O2 FP8AdamW stored its scaled fp16
    master in ``parametrizations.weight.original`` (read by the parametrization as the weight); a pruned layer's
    ``weight_orig`` was refused with a message about DistributedDataParallel. Refused, naming the parameter and the
    layer and saying what to do; no weight changed. With the reparametrization removed the layer trains."""
    reparametrize, message = REPARAMETRIZED[kind]
    model = _model()
    reparametrize(model[0])
    before = copy.deepcopy(list(model.parameters()))
    with pytest.raises(ValueError, match=f"parameter 1 of parameter group 0, the parameter {message}") as raised:
        FP8AdamW(model.parameters())
    assert "FP8Linear(in_features=32, out_features=48)" in str(raised.value)
    for p, q in zip(model.parameters(), before, strict=True):
        assert p.dtype == q.dtype and not hasattr(p, master.SCALE_ATTR)
        assert_same(p, q)
    opt = FP8AdamW([model[2].weight])
    with pytest.raises(ValueError, match="parameter 1 of parameter group 1"):  # add_param_group: the group is not kept
        opt.add_param_group({"params": list(model[0].parameters())})
    assert len(opt.param_groups) == 1
    if kind == "pruning":
        prune.remove(model[0], "weight")
    else:
        parametrize.remove_parametrizations(model[0], "weight")
    opt = FP8AdamW(model.parameters())
    assert master.master_scale(model[0].weight) is not None
    _step(model, opt)


def test_swapped_adamw_keeps_maximize_per_group():
    """Lightning and Accelerate refused AdamW(maximize=True) as having "no FP8AdamW equivalent", which FP8AdamW has:
    the swap keeps it, per group, and the swapped optimizer steps as torch's (O1, fp32 gradients: the reference)."""
    from lightning_fp8.optim.swap import to_fp8_adamw

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(16))
    a2, b2 = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    ref = torch.optim.AdamW([{"params": [a], "maximize": True}, {"params": [b]}], lr=1e-2)
    swapped = to_fp8_adamw(torch.optim.AdamW([{"params": [a2], "maximize": True}, {"params": [b2]}], lr=1e-2),
                           opt_level="O1", fp8_grads=False)  # fmt: skip
    assert [g["maximize"] for g in swapped.param_groups] == [True, False]
    for _ in range(3):
        for p, q in ((a, a2), (b, b2)):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        swapped.step()
    torch.testing.assert_close(a2, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b2, b, rtol=1e-5, atol=1e-6)


def test_swapped_capturable_adamw_steps_as_torchs():
    """AdamW(capturable=True) (torch's CUDA-graph-safe implementation of the same update) was dropped from the groups
    but passed on from the defaults, where FP8AdamW refused it: "use torch.optim.AdamW" to a user who had."""
    from lightning_fp8.optim.swap import to_fp8_adamw

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(16, 16))
    a2 = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2)
    swapped = to_fp8_adamw(torch.optim.AdamW([a2], lr=1e-2, capturable=True), opt_level="O1", fp8_grads=False)
    for _ in range(3):
        g = torch.randn_like(a)
        a.grad, a2.grad = g.clone(), g.clone()
        ref.step()
        swapped.step()
    torch.testing.assert_close(a2, a, rtol=1e-5, atol=1e-6)


def test_swap_refuses_a_differentiable_adamw():
    """differentiable=True asks for autograd through the step: not an implementation choice to drop silently."""
    from lightning_fp8.optim.swap import to_fp8_adamw

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 4))], lr=1e-2, differentiable=True)
    with pytest.raises(ValueError, match=r"differentiable=True.*set differentiable=False, or keep it"):
        to_fp8_adamw(opt)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_parameter_listed_twice_in_a_group_is_refused_and_the_other_groups_stay(opt_level):
    # torch.optim.AdamW warns (deprecated) and steps such a parameter twice; FP8AdamW advanced its one step counter
    # twice and then applied both updates with the second step's bias correction (neither one AdamW step nor two).
    model = _model()
    first, second = model[0].weight, model[2].weight
    with pytest.warns(UserWarning, match="duplicate parameters"), pytest.raises(ValueError, match="more than once"):
        FP8AdamW([first, second, first], opt_level=opt_level)
    assert first.dtype == torch.float32 and second.dtype == torch.float32  # nothing adopted at O2
    opt = FP8AdamW([first], opt_level=opt_level)
    before = _snapshot(model, opt)
    with pytest.warns(UserWarning, match="duplicate parameters"), pytest.raises(ValueError, match="parameter 1 of"):
        opt.add_param_group({"params": [second, second]})
    assert len(opt.param_groups) == 1
    assert_same(_snapshot(model, opt), before)
    _step(model, opt)  # the optimizer still steps


@pytest.mark.parametrize("name", ["fp8-lm-o1", "fp8-lm-e4m3"])
def test_an_optimizer_built_without_a_recipe_names_layers_converted_with_another(name, recwarn):
    # A model converted with "fp8-lm-o1" got O2's fp16 masters from FP8AdamW(params) without a word (the default
    # recipe is "fp8-lm"); with "fp8-lm-e4m3" its FP8 gradients were E5M2. The default stays; a warning says so.
    from lightning_fp8 import FP8Recipe

    recipe = FP8Recipe.from_name(name)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)), recipe)
    with pytest.warns(UserWarning, match="FP8AdamW was built without recipe=") as record:
        opt = FP8AdamW(model.parameters(), lr=1e-3)
    expected = "opt level O1, gradients in float8_e5m2" if name == "fp8-lm-o1" else "gradients in float8_e4m3fn"
    assert expected in str(record[0].message) and record[0].filename == __file__
    assert opt.opt_level == "O2" and model[0].weight.dtype == torch.float16  # the documented default, unchanged
    for kwargs in ({"recipe": recipe}, {"recipe": "fp8-lm"}, {"opt_level": "O1"}):  # a choice made: no warning
        recwarn.clear()
        FP8AdamW(convert_to_fp8(nn.Sequential(nn.Linear(32, 48)), recipe).parameters(), lr=1e-3, **kwargs)
        assert not [w for w in recwarn if "FP8AdamW was built without recipe=" in str(w.message)]
    recwarn.clear()
    FP8AdamW(_model().parameters(), lr=1e-3)  # layers of the default recipe
    assert not [w for w in recwarn if "FP8AdamW was built without recipe=" in str(w.message)]
    if name == "fp8-lm-e4m3":  # the gradient format alone, and this optimizer casts no gradient: nothing to say
        FP8AdamW(convert_to_fp8(nn.Sequential(nn.Linear(32, 48)), recipe).parameters(), lr=1e-3, fp8_grads=False)
        assert not [w for w in recwarn if "FP8AdamW was built without recipe=" in str(w.message)]


@pytest.mark.parametrize("scaler", ["amp", "str", "class"])
def test_a_grad_scaler_that_is_no_fp8gradscaler_is_refused_when_built(scaler):
    # Taken before: the first backward's FP8 gradient hook took the gradient out of param.grad, then failed reporting
    # the cast ("'GradScaler' object has no attribute 'record_gradient_cast'"): that gradient was lost.
    from lightning_fp8 import FP8GradScaler

    given = {"amp": torch.amp.GradScaler("cpu", enabled=False), "str": "fp8", "class": FP8GradScaler}[scaler]
    model = _model()
    with pytest.raises(TypeError, match=r"FP8AdamW\(grad_scaler=\.\.\.\) got .*: pass an FP8GradScaler instance"):
        FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=given)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing adopted


@pytest.mark.parametrize("scaled", [False, True])
def test_a_sparse_gradient_is_refused_before_any_group_is_stepped(scaled):
    # The step's loop found a sparse gradient (nn.Embedding(sparse=True)) only at its group, after the groups before it
    # were stepped: a half-applied step, and an error that did not say what to do.
    from lightning_fp8 import FP8GradScaler

    torch.manual_seed(0)
    model = _model()
    emb = nn.Embedding(10, 32, sparse=True)
    scaler = FP8GradScaler() if scaled else None
    opt = FP8AdamW([{"params": model.parameters()}, {"params": emb.parameters()}], lr=1e-2, grad_scaler=scaler)
    loss = model(emb(torch.tensor([1, 2, 3]))).square().mean()
    (scaler.scale_loss(loss) if scaled else loss).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"sparse gradients.*group 1.*sparse=False.*SparseAdam.*nothing was stepped"):
        opt.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not any("step" in state for state in opt.state.values())
