"""The "bf16" fallback: resuming a plain PyTorch run after layers fell back, layers of an FP8MLP (against the same MLP
built from nn.Linear layers around an nn.GELU), and DistributedDataParallel (2 gloo processes), under which it is
refused: at O2 giving a weight back its own dtype unhooks DDP's gradient averaging (measured: the next step's gradients
differ between the ranks, then DDP fails), and at O1 removing every FP8 layer's buffers trips DDP's buffer broadcast
(an internal assert in its next forward); as it is for an FP8MLP sharded by fully_shard."""

import fractions
import io
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import FP8MLP, FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8
from lightning_fp8.recovery import (
    UnfusedMLP,
    fallback_to_high_precision,
    fallen_back_layers,
    lower_lr,
    put_back_to_high_precision,
)
from lightning_fp8.state import fp8_state_dict, load_fp8_state_dict
from tests.distributed.launch import run_workers

POISONED = (1, 2)  # steps at which only the last layer gets gradients, non-finite: it falls back after the second


def _model() -> nn.Module:
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))


def _training(model: nn.Module, opt_level: str = "O2") -> tuple[FP8GradScaler, FP8AdamW]:
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2, init_scale=2.0**4)
    return scaler, FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, opt_level=opt_level)


def _train(model: nn.Module, scaler: FP8GradScaler, optimizer: FP8AdamW, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 32, generator=gen), torch.randn(24, 16, generator=gen)
        optimizer.zero_grad()
        if step in POISONED:
            hidden = model[1](model[0](x)).detach()
            loss = ((model[2](hidden) - y) ** 2).mean() * math.inf
        else:
            loss = ((model(x) - y) ** 2).mean()
        scaler.scale_loss(loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _checkpoint(model: nn.Module, scaler: FP8GradScaler, optimizer: FP8AdamW) -> dict:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "fp8": fp8_state_dict(model), "fallen_back_layers": fallen_back_layers(model)}  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_plain_pytorch_resume_after_fallback_continues_the_same_run():
    torch.manual_seed(0)
    full = _model()
    scaler, optimizer = _training(full)
    losses = _train(full, scaler, optimizer, range(4))
    assert type(full[2]) is nn.Linear and isinstance(full[0], FP8Linear)
    ckpt = _checkpoint(full, scaler, optimizer)
    assert ckpt["fallen_back_layers"] == ["2"]
    losses += _train(full, scaler, optimizer, range(4, 8))

    torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
    resumed = _model()
    resumed_scaler, resumed_optimizer = _training(resumed)
    assert put_back_to_high_precision(resumed, ckpt["fallen_back_layers"], resumed_optimizer) == ["2"]
    resumed.load_state_dict(ckpt["model"])
    resumed_optimizer.load_state_dict(ckpt["optimizer"])
    resumed_scaler.load_state_dict(ckpt["scaler"])
    load_fp8_state_dict(resumed, ckpt["fp8"])
    assert type(resumed[2]) is nn.Linear and isinstance(resumed[0], FP8Linear)
    assert resumed[2].weight.dtype == torch.float32 and resumed[0].weight.dtype == torch.float16  # O2 master
    assert resumed_optimizer.state[resumed[2].weight]["exp_avg"].dtype == torch.float32

    assert _train(resumed, resumed_scaler, resumed_optimizer, range(4, 8)) == losses[4:]
    for (name, a), b in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fallen_back_layers(resumed) == ["2"]


def test_loading_a_fallen_back_checkpoint_without_putting_back_names_the_fallback():
    torch.manual_seed(0)
    full = _model()
    scaler, optimizer = _training(full)
    _train(full, scaler, optimizer, range(4))
    ckpt = _checkpoint(full, scaler, optimizer)
    resumed = _model()  # layer 2 is FP8 again: the checkpoint has no scaling state for it
    with pytest.raises(KeyError, match=r"missing \['2\.fp8_scaling.*fallen_back_layers\(model\).*put_back_to_high"):
        load_fp8_state_dict(resumed, ckpt["fp8"])


def test_put_back_is_idempotent_and_checks_before_changing_anything():
    model = _model()
    _, optimizer = _training(model)  # O2: the FP8 weights' storage holds fp16 masters
    with pytest.raises(ValueError, match=r"'0\.weight' is not an FP8Linear inside the model"):
        put_back_to_high_precision(model, ["0", "0.weight"], optimizer)
    with pytest.raises(ValueError, match="FP8AdamW \\(O2\\) that was not passed; pass that optimizer"):
        put_back_to_high_precision(model, ["0"])
    assert isinstance(model[0], FP8Linear) and model[0].weight.dtype == torch.float16  # nothing changed
    expected = model.state_dict()
    assert put_back_to_high_precision(model, ["0"], [optimizer]) == ["0"]
    assert put_back_to_high_precision(model, ["0"], optimizer) == []
    assert type(model[0]) is nn.Linear and model[0].weight.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.values(), strict=True))


def test_a_bias_less_layer_put_back_keeps_bias_registered_as_nn_linear_does():
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 16)))
    put_back_to_high_precision(model, ["0"])
    assert type(model[0]) is nn.Linear and "bias" in model[0]._parameters and model[0].bias is None
    with pytest.raises(TypeError, match="cannot assign"):
        model[0].bias = torch.zeros(32)
    assert list(model.state_dict()) == list(nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU(),
                                                          nn.Linear(32, 16)).state_dict())  # fmt: skip


def test_layers_put_back_before_the_optimizer_exists_get_fp32_states():
    model = _model()
    put_back_to_high_precision(model, ["2"])
    optimizer = FP8AdamW(model.parameters(), lr=1e-2)
    assert model[2].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float16
    model(torch.randn(8, 32)).square().mean().backward()
    optimizer.step()
    assert optimizer.state[model[2].weight]["exp_avg"].dtype == torch.float32


def test_a_layer_under_several_names_falls_back_under_all_of_them():
    lin = nn.Linear(32, 32)
    model = convert_to_fp8(nn.Sequential(lin, nn.GELU(), lin))  # one FP8Linear under the names "0" and "2"
    _, optimizer = _training(model)
    assert put_back_to_high_precision(model, ["0"], optimizer) == ["0"] and fallen_back_layers(model) == ["0"]
    assert type(model[0]) is nn.Linear and model[2] is model[0] and model[0].weight is lin.weight
    plain_lin = nn.Linear(32, 32)
    plain = nn.Sequential(plain_lin, nn.GELU(), plain_lin)  # a high-precision model with the same weights
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 32)
    assert torch.equal(model(x), plain(x))


# ------------------------------------------------------------------------------------------------------- FP8MLP
MLP_POISONED = (0, 1)  # the first steps: no update before the fallback, which both forms of the MLP then start from
BLAMED = {"both": ["0.fc", "0.proj"], "proj": ["0.proj"]}


def _mlp(fused: bool, opt_level: str = "O2", seed: int = 0) -> nn.Module:
    """One MLP in two forms: an FP8MLP, or converted nn.Linear layers around an nn.GELU, whose fallback is a plain
    linear layer's (the reference)."""
    torch.manual_seed(seed)
    fc, proj = nn.Linear(32, 64), nn.Linear(64, 16)
    recipe = "fp8-lm" if opt_level == "O2" else "fp8-lm-o1"
    if fused:
        return nn.Sequential(FP8MLP.from_modules(fc, proj, recipe))
    return convert_to_fp8(nn.Sequential(fc, nn.GELU(), proj), recipe)


def _mlp_layers(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(fc, proj)`` of either form of :func:`_mlp`, as they are now."""
    return (model[0].fc, model[0].proj) if len(model) == 1 else (model[0], model[2])


def _train_mlp(model: nn.Module, scaler, optimizer, steps: range, blamed: str) -> list[float]:
    """Steps on fixed data; at MLP_POISONED steps the gradients of the ``blamed`` layers are non-finite."""
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 32, generator=gen), torch.randn(24, 16, generator=gen)
        optimizer.zero_grad()
        if step in MLP_POISONED:
            fc, proj = _mlp_layers(model)
            hidden = F.gelu(fc(x)) if blamed == "both" else F.gelu(fc(x)).detach()
            loss = ((proj(hidden) - y) ** 2).mean() * math.inf
        else:
            loss = ((model(x) - y) ** 2).mean()
        scaler.scale_loss(loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("blamed", BLAMED)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fallback_in_an_fp8mlp_leaves_a_working_mlp(opt_level, blamed):
    fused, linears = _mlp(fused=True, opt_level=opt_level), _mlp(fused=False, opt_level=opt_level)
    params = list(fused.parameters())
    runs = {}
    for key, model in (("fused", fused), ("linears", linears)):
        scaler, optimizer = _training(model, opt_level)
        runs[key] = _train_mlp(model, scaler, optimizer, range(6), blamed)
        if key == "fused":  # the optimizer kept the parameters the model uses
            assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params, strict=True))
    assert fallen_back_layers(fused) == BLAMED[blamed] and runs["fused"] == runs["linears"]  # continued alike
    mlp = fused[0]
    assert type(mlp) is UnfusedMLP and type(mlp.proj) is nn.Linear
    assert type(mlp.fc) is (nn.Linear if blamed == "both" else FP8Linear)
    assert all(a is b for a, b in zip(fused.parameters(), params, strict=True))
    assert mlp.proj.weight.dtype == torch.float32  # an O2 master given back
    for a, b in zip(fused.state_dict().values(), linears.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    x = torch.randn(8, 32)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))  # a high-precision MLP, same weights
    plain.load_state_dict(linears.state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            y = fused(x)
            assert torch.equal(y, linears(x))
            if blamed == "both":
                assert torch.equal(y, plain(x))


@pytest.mark.parametrize("blamed", BLAMED)
def test_plain_pytorch_resume_after_an_fp8mlp_layer_fell_back(blamed):
    full = _mlp(fused=True)
    scaler, optimizer = _training(full, "O2")
    losses = _train_mlp(full, scaler, optimizer, range(4), blamed)
    ckpt = _checkpoint(full, scaler, optimizer)
    assert ckpt["fallen_back_layers"] == BLAMED[blamed]
    losses += _train_mlp(full, scaler, optimizer, range(4, 8), blamed)

    resumed = _mlp(fused=True, seed=123)  # other initial weights: everything must come from the checkpoint
    resumed_scaler, resumed_optimizer = _training(resumed, "O2")
    assert put_back_to_high_precision(resumed, ckpt["fallen_back_layers"], resumed_optimizer) == BLAMED[blamed]
    assert type(resumed[0]) is UnfusedMLP and type(resumed[0].proj) is nn.Linear
    resumed.load_state_dict(ckpt["model"])
    resumed_optimizer.load_state_dict(ckpt["optimizer"])
    resumed_scaler.load_state_dict(ckpt["scaler"])
    load_fp8_state_dict(resumed, ckpt["fp8"])

    assert _train_mlp(resumed, resumed_scaler, resumed_optimizer, range(4, 8), blamed) == losses[4:]
    for (name, a), b in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fallen_back_layers(resumed) == BLAMED[blamed]


def test_a_layer_of_an_fp8mlp_that_is_the_model_itself_is_refused_before_changing_anything():
    mlp = FP8MLP(32, 64)
    optimizer = FP8AdamW(mlp.parameters(), lr=1e-2)
    mlp(torch.randn(8, 32)).square().mean().backward()
    mlp.proj.fp8_scaling["grad_output"].amax.fill_(math.inf)  # blames proj, as a non-finite gradient would
    with pytest.raises(ValueError, match=r"'proj' is a layer of the FP8MLP that is the model itself.*nn.Sequential"):
        fallback_to_high_precision(mlp, optimizer)
    assert isinstance(mlp.proj, FP8Linear) and mlp.proj.weight.dtype == torch.float16  # nothing changed


def test_an_fp8mlp_falling_back_keeps_the_hooks_of_its_layers_and_itself():
    model = _mlp(fused=True)
    _, optimizer = _training(model, "O2")
    calls = []
    model[0].register_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    handle = model[0].proj.register_forward_pre_hook(lambda m, args: calls.append(type(m).__name__))
    put_back_to_high_precision(model, ["0.proj"], optimizer)
    model(torch.randn(8, 32))
    assert calls == ["Linear", "UnfusedMLP"]
    handle.remove()  # the handle from before the fallback removes the hook from the new layer
    model(torch.randn(8, 32))
    assert calls == ["Linear", "UnfusedMLP", "UnfusedMLP"]


# ----------------------------------------------------------------------------------- DistributedDataParallel
def _gradients_averaged(model: nn.Module, ddp: nn.Module, x: torch.Tensor) -> bool:
    """One backward through DDP: is every gradient the same on both ranks (averaged), none of them missing?"""
    ddp(x).square().mean().backward()
    same = []
    for p in model.parameters():
        grad = p.grad.float()
        gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grad)
        same.append(torch.equal(gathered[0], gathered[1]))
    return all(same)


def _ddp_fallback(rank: int, opt_level: str, blamed: tuple[str, ...], build=_model) -> dict:
    """The ``blamed`` layers' gradients made non-finite on both ranks, the fallback, then a backward on each rank's
    data (more steps if the fallback went through)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = build()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=1)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, opt_level=opt_level)
    ddp = DDP(model)  # after the optimizer, as docs/guides/pytorch.md says
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    scaler.scale_loss(ddp(x).square().mean()).backward()
    layers = [model.get_submodule(name) for name in blamed]
    for layer in layers:
        layer.weight.grad.fill_(math.inf)
        layer.fp8_scaling["grad_output"].amax.fill_(math.inf)  # blames the layer, as a non-finite gradient would
    error = None
    try:
        optimizer.step()
    except ValueError as e:
        error = str(e)
    optimizer.zero_grad()
    layers = [model.get_submodule(name) for name in blamed]
    report = {"error": error, "layers": [type(layer).__name__ for layer in layers], "averaged": [],
              "dtypes": [str(layer.weight.dtype) for layer in layers],
              "model": [type(m).__name__ for m in model]}  # fmt: skip
    for _ in range(3 if error is None else 1):  # after a refused fallback the scaler's step is not finished
        try:
            report["averaged"].append(_gradients_averaged(model, ddp, x))
        except RuntimeError as e:  # DDP's reducer found a gradient it never saw (both ranks raise alike)
            report["averaged"].append(f"RuntimeError: {str(e)[:300]}")
            break
        if error is None:
            optimizer.step()
        optimizer.zero_grad()
    return report


def _sharded_mlp_fallback() -> dict:
    """An FP8MLP sharded by fully_shard (its parameters DTensors) whose proj is blamed: the fallback raises."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _mlp(fused=True)
    fully_shard(model[0])
    fully_shard(model)
    model[0].proj.fp8_scaling["grad_output"].amax.fill_(math.inf)  # as a backward with a non-finite gradient left it
    model[0].proj.weight.grad = torch.zeros_like(model[0].proj.weight)  # the layer took part in that step
    try:
        fallback_to_high_precision(model, None)
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "layers": [isinstance(model[0], FP8MLP), type(model[0].proj).__name__]}


def _worker(rank: int, world: int) -> dict:
    return {
        "O2": _ddp_fallback(rank, "O2", ("2",)),
        "O1": _ddp_fallback(rank, "O1", ("0", "2")),
        "FP8MLP": _ddp_fallback(rank, "O2", ("0.proj",), build=lambda: _mlp(fused=True)),
        "sharded FP8MLP": _sharded_mlp_fallback(),
    }


@pytest.fixture(scope="module")
def ddp_reports() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize(("level", "dtype"), [("O2", "torch.float16"), ("O1", "torch.float32"),
                                              ("FP8MLP", "torch.float16")])  # fmt: skip
def test_ddp_fallback_is_refused_before_changing_anything(ddp_reports, level, dtype):
    for report in (r[level] for r in ddp_reports):
        # Refused on every rank by the scaler, before recovery looks at the layers (each rank would choose its own)
        assert report["error"] is not None and "cannot run with 2 processes" in report["error"], report
        assert "Use nonfinite_fallback='lower_lr'" in report["error"]
        assert set(report["layers"]) == {"FP8Linear"} and set(report["dtypes"]) == {dtype}
        assert "UnfusedMLP" not in report["model"] and "Linear" not in report["model"]
        assert report["averaged"] == [True]  # DDP still averages every gradient


@pytest.mark.slow
def test_fallback_in_an_fp8mlp_sharded_by_fully_shard_is_refused_before_changing_anything(ddp_reports):
    for report in (r["sharded FP8MLP"] for r in ddp_reports):
        assert "'0.proj' back to nn.Linear: their parameters are DTensors" in (report["error"] or ""), report
        assert report["layers"] == [True, "FP8Linear"]


def test_converting_again_keeps_the_layers_that_fell_back():
    model = _model()
    _, optimizer = _training(model)
    put_back_to_high_precision(model, ["0"], optimizer)
    expected = model.state_dict()
    assert convert_to_fp8(model) is model
    assert type(model[0]) is nn.Linear and fallen_back_layers(model) == ["0"] and isinstance(model[2], FP8Linear)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.values(), strict=True))


def _one_rank_fallback(rank: int, world: int) -> dict:
    # torch.distributed initialized with one rank, no DDP, the loss alive while the optimizer steps (its graph holds
    # the gradient accumulators, as DDP's reducer does): the fallback must still run.
    model = _model()
    scaler, optimizer = _training(model)
    x = torch.randn(24, 32)
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(x).square().mean() * math.inf
        scaler.scale_loss(loss).backward()
        optimizer.step()
    return {"layers": [type(m).__name__ for m in model if isinstance(m, nn.Linear)], "history": scaler.history}


@pytest.mark.slow
def test_fallback_with_one_rank_and_no_ddp_runs():
    """A single process with torch.distributed initialized (world size 1) is not DDP: the fallback ran there (it was
    refused as 'under DistributedDataParallel')."""
    (report,) = run_workers(_one_rank_fallback, 1)
    assert report["layers"] == ["Linear", "Linear"], report


def test_lower_lr_lowers_a_learning_rate_tensor_shared_by_groups_once():
    """torch puts one lr tensor in every group it was given to: lower_lr multiplied it once per group (factor**2
    with two groups), and once more where initial_lr is the same tensor."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=torch.tensor(0.01))
    assert opt.param_groups[0]["lr"] is opt.param_groups[1]["lr"]
    opt.param_groups[0]["initial_lr"] = opt.param_groups[0]["lr"]
    lower_lr(opt, 0.5)
    assert [float(g["lr"]) for g in opt.param_groups] == [float(torch.tensor(0.01) * 0.5)] * 2
    plain = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.2}], lr=0.1)
    lower_lr(plain, 0.5)
    assert [g["lr"] for g in plain.param_groups] == [0.05, 0.1]


def test_a_layer_an_fp8mlp_shares_with_another_module_takes_the_fp8mlp_with_it():
    """The layer is named after the other module first (``self.extra = mlp.fc``): the fallback put it back under every
    name but turned only that first name's parent into an UnfusedMLP, so the FP8MLP held an nn.Linear and its next
    forward raised AttributeError. Every FP8MLP holding it becomes an UnfusedMLP, computing what the layers compute."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            mlp = FP8MLP(32, 32)
            self.extra = mlp.fc
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x) + self.extra(x)

    torch.manual_seed(0)
    model = Model()
    assert put_back_to_high_precision(model, ["extra"]) == ["extra"]
    assert isinstance(model.mlp, UnfusedMLP) and type(model.mlp.fc) is nn.Linear and model.mlp.fc is model.extra
    x = torch.randn(4, 32)
    y = model(x)
    ref = model.mlp.proj(torch.nn.functional.gelu(model.extra(x))) + model.extra(x)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


# ------------------------------------------------------------------------------- whom the "bf16" fallback blames
def _two_optimizers(fallback: str = "bf16", fp8_grads: bool = True):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32), "head": nn.Linear(32, 10)}))
    scaler = FP8GradScaler(nonfinite_fallback=model if fallback == "bf16" else fallback, fallback_after=2)
    opt_a = FP8AdamW([*model["a"].parameters(), *model["head"].parameters()], lr=1e-3, grad_scaler=scaler,
                     fp8_grads=fp8_grads)  # fmt: skip
    opt_b = FP8AdamW(model["b"].parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=fp8_grads)
    return model, scaler, opt_a, opt_b


def _step(opt, scaler, loss) -> None:
    opt.zero_grad()
    scaler.scale_loss(loss).backward()
    opt.step()


@pytest.mark.parametrize("fp8_grads", [True, False])
def test_the_fallback_blames_only_the_layers_of_the_steps_that_triggered_it(fp8_grads):
    """b had one non-finite step long before and is clean since; a fails twice in a row: only a goes back (b was
    blamed too: its optimizer kept that old FP8 gradient, and its grad_output amax stayed inf)."""
    model, scaler, opt_a, opt_b = _two_optimizers(fp8_grads=fp8_grads)
    for step in range(7):
        x = torch.randn(8, 32)
        _step(opt_a, scaler, model["a"](x).square().mean() * (math.nan if step in (5, 6) else 1.0))
        _step(opt_b, scaler, model["b"](x).square().mean() * (math.nan if step == 1 else 1.0))
    assert fallen_back_layers(model) == ["a"]
    assert isinstance(model["b"], FP8Linear)


def test_a_fallback_without_a_layer_to_blame_lowers_the_learning_rate_of_the_skipped_optimizer_only():
    """Non-finite values from the high-precision head (no FP8 layer to put back): the learning rate of the optimizer
    that was skipped is lowered, as nonfinite_fallback="lower_lr" does, not that of every optimizer."""
    model, scaler, opt_a, opt_b = _two_optimizers()
    for step in range(4):
        x = torch.randn(8, 32)
        _step(opt_a, scaler, model["head"](x).square().mean() * (math.nan if step in (2, 3) else 1.0))
        _step(opt_b, scaler, model["b"](x).square().mean())
    assert fallen_back_layers(model) == []
    assert (opt_a.param_groups[0]["lr"], opt_b.param_groups[0]["lr"]) == (5e-4, 1e-3)


def test_the_fallback_of_a_compiled_model_names_its_layers_as_the_model_does():
    """The scaler's history named the layers of a torch.compile'd model by the wrapper's path ("_orig_mod.2"), not as
    the model and the checkpoint's fallen_back_layers name them."""
    model = _model()
    compiled = torch.compile(model)  # (never called: only its module names matter here)
    scaler = FP8GradScaler(nonfinite_fallback=compiled, fallback_after=2)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    for _ in range(2):
        _step(opt, scaler, model(torch.randn(8, 32)).square().mean() * math.nan)
    assert fallen_back_layers(model) == ["0", "2"]
    assert scaler.history[-1]["reason"].endswith("put 2 layer(s) back to high precision: 0, 2")


@pytest.mark.parametrize("bad", ["first", "last"])
def test_with_accumulation_the_fallback_blames_the_layers_of_any_micro_batch(bad):
    """The non-finite micro-batch first or last of an accumulated step: the same layers go back (with the NaN first,
    the last backward's grad_output amaxes were finite and nothing was blamed: the learning rate was lowered)."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)))
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2)
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler, fp8_grads=False)
    for _ in range(2):
        opt.zero_grad()
        for micro in range(2):
            loss = model(torch.randn(8, 32)).square().mean()
            scaler.scale_loss(loss * (math.nan if (micro == 0) == (bad == "first") else 1.0)).backward()
        opt.step()
    assert fallen_back_layers(model) == ["0", "2"]
    assert opt.param_groups[0]["lr"] == 1e-3


def _scaler_model():
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)))


def _scaled_step(model, scaler, optimizer, x, y, bad=False):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y) * (math.nan if bad else 1.0)
    scaler.scale_loss(loss).backward()
    optimizer.step()


def test_a_restored_nonfinite_run_expires_once_its_optimizers_stepped_cleanly():
    # The run saved with the scaler applied to every optimizer counted for the first time, however many clean steps
    # had come since: a new optimizer's first non-finite step, 20 clean steps after the resume, lowered the lr.
    model, (x, y) = _scaler_model(), (torch.randn(8, 32), torch.randn(8, 4))
    scaler = FP8GradScaler(nonfinite_fallback="lower_lr", model=model, fallback_after=3)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    for _ in range(2):
        _scaled_step(model, scaler, optimizer, x, y, bad=True)
    resumed = FP8GradScaler(nonfinite_fallback="lower_lr", model=model, fallback_after=3)
    resumed.load_state_dict(scaler.state_dict())
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=resumed)
    _scaled_step(model, resumed, optimizer, x, y, bad=True)  # the restored run goes on: 3, the fallback
    assert optimizer.param_groups[0]["lr"] == 5e-3
    resumed.load_state_dict(scaler.state_dict())  # the run of 2 again, then clean steps
    for _ in range(20):
        _scaled_step(model, resumed, optimizer, x, y)
    later, skipped = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=resumed), resumed.skipped_steps
    _scaled_step(model, resumed, later, x, y, bad=True)
    assert later.param_groups[0]["lr"] == 1e-2 and resumed.skipped_steps == skipped + 1  # a run of 1: a skip alone
    assert [h for h in resumed.history if h["action"] == "fallback"] == []


def test_zero_grad_keeping_gradients_after_a_skipped_step_keeps_the_fp8_weights_zero_gradients():
    # torch.optim's rule: a parameter that had a gradient keeps a zero one, and the next step decays and moves it where
    # the backward does not reach it. After a skipped step the FP8 weights' gradients (held by FP8AdamW) were lost.
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    moved = {}
    for skip in (False, True):
        model = _scaler_model()
        scaler = FP8GradScaler(model=model)
        optimizer = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, grad_scaler=scaler)
        _scaled_step(model, scaler, optimizer, x, y)
        optimizer.zero_grad(set_to_none=False)
        scaler.scale_loss(F.mse_loss(model(x), y) * (math.nan if skip else 1.0)).backward()
        optimizer.step()
        assert scaler.skipped_steps == int(skip)
        optimizer.zero_grad(set_to_none=False)
        first = model[0].weight
        assert first.grad is not None and not first.grad.any()
        before = first.detach().clone()
        with torch.no_grad():  # this backward does not reach the first layer
            hidden = model[1](model[0](x))
        scaler.scale_loss(F.mse_loss(model[2:](hidden), y)).backward()
        optimizer.step()
        moved[skip] = not torch.equal(before, first.detach())
    assert moved == {False: True, True: True}


@pytest.mark.parametrize("fallback", ["lower_lr", "bf16"])
def test_a_fallback_due_before_any_optimizer_stepped_records_that_it_had_nothing_to_change(fallback):
    scaler = FP8GradScaler(nonfinite_fallback=fallback, model=_scaler_model(), fallback_after=2)
    for _ in range(2):
        scaler.record_nonfinite(torch.tensor(1.0))
        scaler.update()
    assert scaler.skipped_steps == 2
    assert scaler.history[-1]["action"] == "fallback" and "nothing to change" in scaler.history[-1]["reason"]


def _poisoned_loss(model: nn.Module, step: int) -> torch.Tensor:
    """The loss of `_train`'s step: at the POISONED steps only the last layer gets (non-finite) gradients."""
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(24, 32, generator=gen), torch.randn(24, 16, generator=gen)
    if step in POISONED:
        return ((model[2](model[1](model[0](x)).detach()) - y) ** 2).mean() * math.inf
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", ["sgd", "fp8adamw", "fp8adamw-fp8-grads"])
def test_the_fallback_blames_the_layers_when_the_loop_zeroes_the_gradients_before_update(kind, set_to_none):
    """`scaler.step(opt); opt.zero_grad(); scaler.update()` (an order torch.amp.GradScaler takes): the fallback ran at
    the update, read param.grad, found none (or zeros) and blamed no layer (the learning rate was lowered instead). The
    reference is `_train`'s order, zero_grad first: the same layer goes back."""
    model = _model()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2, init_scale=2.0**4)
    fp8_grads = kind == "fp8adamw-fp8-grads"
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2) if kind == "sgd" else
           FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=fp8_grads))  # fmt: skip
    for step in range(4):
        scaler.scale_loss(_poisoned_loss(model, step)).backward()
        scaler.step(opt)
        opt.zero_grad(set_to_none=set_to_none)
        scaler.update()
    reference = _model()
    _train(reference, *_training(reference), range(4))
    assert fallen_back_layers(model) == fallen_back_layers(reference) == ["2"]
    assert opt.param_groups[0]["lr"] == 1e-2
    fallbacks = [entry["reason"] for entry in scaler.history if entry["action"] == "fallback"]
    assert len(fallbacks) == 1 and fallbacks[0].endswith("put 1 layer(s) back to high precision: 2")


def test_the_fallback_blames_the_layers_an_unscale_found_non_finite_when_the_loop_skips_its_step():
    """unscale_, then the loop skips its own step on a non-finite gradient and zeroes the gradients before update."""
    model = _model()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2, init_scale=2.0**4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(4):
        scaler.scale_loss(_poisoned_loss(model, step)).backward()
        scaler.unscale_(opt)
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None):
            scaler.step(opt)
        opt.zero_grad()
        scaler.update()
    assert fallen_back_layers(model) == ["2"] and opt.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("factor", [5.0, 1.0, 0.0, -1.0, float("nan"), "0.5", True])
def test_recovery_factors_outside_0_1_are_refused_and_change_nothing(factor):
    """The public recovery actions check the factor as FP8GradScaler(lr_factor=...) does: 5.0 raised the lr five-fold
    while the history said "lowered", -1 made it negative, NaN made it NaN."""
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    error = TypeError if isinstance(factor, (str, bool)) else ValueError
    with pytest.raises(error, match=r"lower_lr\(factor=\.\.\.\): must be"):
        lower_lr(opt, factor)
    with pytest.raises(error, match=r"fallback_to_high_precision\(lr_factor=\.\.\.\): must be"):
        fallback_to_high_precision(model, opt, lr_factor=factor)
    assert opt.param_groups[0]["lr"] == 0.1 and isinstance(model[0], FP8Linear)


def test_put_back_given_one_name_as_a_string_says_to_pass_a_list():
    # Iterated, a string gave 'n', 'e', 't', ... as names ("'n' is not an FP8Linear"), or, for a one-character
    # name such as "0", silently worked.
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    with pytest.raises(TypeError, match=r"pass \['0'\]"):
        put_back_to_high_precision(model, "0")
    assert isinstance(model[0], FP8Linear)
    assert put_back_to_high_precision(model, ["0"]) == ["0"] and type(model[0]) is nn.Linear


@pytest.mark.parametrize("factor", [np.float32(0.5), np.float64(0.5), fractions.Fraction(1, 2)])
def test_a_numpy_factor_leaves_the_learning_rates_python_floats_that_load_weights_only(factor):
    # The lr became factor's type: a NumPy number, which torch.load(weights_only=True) refuses in the optimizer's
    # state dict (the checkpoint written after the fallback would not load); a Fraction times an int lr, a Fraction.
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=1)
    opt.param_groups[0]["initial_lr"] = 1
    lower_lr(opt, factor)
    fallback_to_high_precision(model, opt, lr_factor=factor)  # no non-finite gradient: lowers the lr
    assert [type(opt.param_groups[0][key]) for key in ("lr", "initial_lr")] == [float, float]
    assert opt.param_groups[0]["lr"] == 0.25
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["param_groups"][0]["lr"] == 0.25


def test_recovery_refuses_what_is_not_a_model_or_an_optimizer_and_changes_nothing():
    # Each failed deep inside with an AttributeError ("'list' object has no attribute 'param_groups'"), or, for
    # put_back, claimed that an FP8AdamW holding the weight "was not passed".
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"lower_lr\(optimizer=\.\.\.\): expected an optimizer.*got list; pass one"):
        lower_lr([opt], 0.5)
    with pytest.raises(TypeError, match=r"fallback_to_high_precision\(model=\.\.\.\): expected the model.*NoneType"):
        fallback_to_high_precision(None, opt)
    with pytest.raises(TypeError, match=r"fallback_to_high_precision\(optimizer=\.\.\.\): expected an optimizer.*str"):
        fallback_to_high_precision(model, "adamw")
    with pytest.raises(TypeError, match=r"fallback_to_high_precision\(skipped=\.\.\.\): expected an optimizer.*int"):
        fallback_to_high_precision(model, opt, skipped=[3])
    with pytest.raises(TypeError, match=r"put_back_to_high_precision\(optimizer=\.\.\.\): expected an optimizer.*str"):
        put_back_to_high_precision(model, ["0"], "adamw")
    with pytest.raises(TypeError, match=r"put_back_to_high_precision\(model=\.\.\.\): expected the model.*list"):
        put_back_to_high_precision([model], ["0"], opt)
    assert opt.param_groups[0]["lr"] == 0.1 and isinstance(model[0], FP8Linear)
    # One optimizer, a list or a tuple of them, or a generator, as before.
    assert put_back_to_high_precision(model, ["0"], (o for o in [opt])) == ["0"]


def test_put_back_given_a_name_twice_puts_the_layer_back_once():
    # The layer was swapped twice (its nn.Linear replaced by another) and the name returned twice.
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    first = model[0]
    assert put_back_to_high_precision(model, ["0", "0"], opt) == ["0"]
    assert type(model[0]) is nn.Linear and model[0].weight is first.weight and fallen_back_layers(model) == ["0"]


def test_names_saved_under_another_wrapper_put_the_same_layers_back():
    # fallen_back_layers of a compiled model names "_orig_mod.1" (of a DataParallel one, "module.1"); putting those
    # back in the model converted afresh, compiled only after the load (or the other way round), raised "'_orig_mod.1'
    # is not an FP8Linear inside the model", while load_fp8_state_dict matched the FP8 state saved beside them.
    def fresh() -> tuple[nn.Module, FP8AdamW]:
        model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
        return model, FP8AdamW(model.parameters(), lr=1e-2)

    model, opt = fresh()
    assert put_back_to_high_precision(model, ["_orig_mod.1"], opt) == ["1"] and type(model[1]) is nn.Linear
    model, opt = fresh()
    assert put_back_to_high_precision(model, ["module.1"], opt) == ["1"] and fallen_back_layers(model) == ["1"]
    model, opt = fresh()
    compiled = torch.compile(model)
    assert put_back_to_high_precision(compiled, ["1"], opt) == ["_orig_mod.1"] and type(model[1]) is nn.Linear
    with pytest.raises(
        ValueError, match="'_orig_mod.2' is not an FP8Linear inside the model"
    ):  # no such layer: as before
        put_back_to_high_precision(fresh()[0], ["_orig_mod.2"])


def test_the_name_of_a_compile_wrapper_puts_back_the_layer_it_compiled():
    # Found by session 67's compile sweep, left then: put_back_to_high_precision(model, ["0"]) with model[0] a
    # torch.compile wrapper of an FP8Linear raised "'0' is not an FP8Linear inside the model" (the layer is
    # "0._orig_mod"), while the Lightning plugin's resume maps such a name to the layer.
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    layer = model[0]
    model[0] = torch.compile(model[0], backend="eager")
    assert put_back_to_high_precision(model, ["0"], opt) == ["0._orig_mod"]
    assert type(model[0]._orig_mod) is nn.Linear and model[0]._orig_mod.weight is layer.weight
    assert fallen_back_layers(model) == ["0._orig_mod"]
    assert put_back_to_high_precision(model, ["0"], opt) == []  # already put back
    x = torch.randn(4, 16)
    assert torch.equal(model[0](x), F.linear(x, layer.weight, layer.bias))
