"""Route sweep of code that reaches an O2 model's parameters directly, not through ``state_dict()`` /
``load_state_dict()``. At O2 ``FP8AdamW`` keeps each FP8 weight's fp16 master, times a per-tensor power-of-two scale,
in the parameter's own storage (lightning_fp8/optim/master.py), so such code may see or write ``w * scale``. Each
route runs on a tiny model trained a few steps at O2 (``FP8GradScaler``, ``FP8AdamW``, ``scale_loss``) and is checked
against an independent reference: a converted model without optimizer holding the true weights (``state_dict()``) and
the FP8 state (``fp8_state_dict``), whose forward is the trained model's bit for bit; a plain ``nn.Linear`` model given
the same true weights and treated the same way; the same run through the documented route (``load_state_dict``); an
uninterrupted run. A route either works (equal values: bit for bit where nothing rounds, else to the fp16 master's
rounding) or is refused with an error saying what to do, changing nothing. Routes the documentation lists as writing or
reading the scaled storage (docs/guides/checkpoints.md, "Read weights through state_dict() during O2 training";
docs/concepts/optimizer.md) are pinned as documented, and run again after ``optimizer.release_weights()``, where they
must work.

Routes:

- ``torch.nn.utils.parameters_to_vector`` (reads the storage, documented; true after ``release_weights``);
  ``vector_to_parameters`` of its own vector (the forward stays right, the next step refuses and steps nothing) and,
  after ``release_weights``, of another vector (where the next step starts, as ``load_state_dict``);
- ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` with mu times the limit on ``fp8_grads=False`` gradients
  (the same step as the scaler's clipping); ``torch.nn.utils.get_total_norm`` with ``fp8_grads=True`` (leaves out the
  FP8-held gradients, documented);
- ``model.apply(init_fn)`` calling ``reset_parameters()`` after adoption; ``nn.init.zeros_`` and ``mul_(0.5)`` (scale
  invariant: exact); ``fill_``, ``copy_``, ``nn.init.normal_`` / ``xavier_uniform_`` (write the storage, documented);
  all of them, ``mul_(4)`` and weight tying by hand (``copy_`` of another layer's weight) after ``release_weights``,
  where the next steps continue bit for bit as after ``load_state_dict`` of the same values; a weight replaced by a new
  ``nn.Parameter`` mid-training and added with ``add_param_group``;
- ``model.cpu()``, ``share_memory()``, ``to(torch.float16)``, ``to_empty(device="cpu")`` + ``load_state_dict``,
  ``float()`` then ``half()`` after adoption (continue bit for bit); ``float()``, ``bfloat16()``,
  ``to(torch.bfloat16)`` (forward right, next step refused, nothing stepped); ``to("meta")`` (forward refused);
- ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` updated each step: averages the storage at O2
  (documented), the true EMA after ``release_weights``;
- ``torch.distributed.checkpoint.state_dict``'s ``get_model_state_dict`` / ``set_model_state_dict`` /
  ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (default, ``full_state_dict``,
  ``flatten_optimizer_state_dict``, ``cpu_offload``) in one process without a process group, and ``dcp.save`` /
  ``dcp.load`` to a directory: the resumed run continues bit for bit; ``set_model_state_dict`` of a partial dict
  (``strict=False``); ``dcp.load`` in place into ``state_dict()``
  values does not reach the FP8 weights (documented) until ``load_state_dict``;
- ``copy.deepcopy(model)`` and ``torch.save(model)`` without the optimizer, used for inference, then given back their
  own storage by a new ``FP8AdamW(...).release_weights()`` (an O1 optimizer over them is refused);
  ``torch.save(model.state_dict())`` against ``{k: v for k, v in model.named_parameters()}`` saved by hand, both loaded
  with ``weights_only=True``;
- ``torch.func.functional_call`` with ``dict(model.named_parameters())``, ``state_dict()`` and
  ``state_dict(keep_vars=True)`` (forward, and training steps through it); parameter norms logged from
  ``named_parameters()`` (the storage's, documented; true after ``release_weights``);
- ``parametrize.register_parametrization``, ``parametrizations.weight_norm`` / ``spectral_norm``, the legacy
  ``weight_norm``, ``prune.l1_unstructured`` and ``del layer.weight`` after adoption: refused as they are put, the
  layer kept; after ``release_weights`` they act as on the plain model (state dict while on, weights once removed).

Found by this sweep and fixed:

- parameters saved by hand from ``named_parameters()`` keep their master scale through ``torch.save`` and
  ``torch.load(weights_only=True)``; ``functional_call`` honours it, and so did ``load_state_dict`` into an O2 model
  whose weights are masters, but not into a converted model without optimizer (the stored ``w * scale`` loaded as the
  weight);
- ``weight_norm`` and ``spectral_norm`` (parametrizations, and the legacy ``weight_norm``) put on an adopted weight and
  removed, as the forward's refusal says, left an inf or NaN weight; while an adopted weight was pruned or
  parametrized, ``state_dict()`` gave its scaled storage under ``weight_orig`` / ``parametrizations.weight.original``.
  Reparametrizing (or deleting) a weight FP8AdamW holds as a master is refused as it is put now.

Routes covered elsewhere are not repeated: a model's own or another O2 model's ``named_parameters()`` loaded with
``load_state_dict`` (test_layer_init_and_load.py), ``model.half()`` after adoption and the refusal of other casts
(test_master_adoption.py), the refusal message of ``vector_to_parameters`` (test_bad_input.py), the scaler's clipping
itself (test_clip_fp8_grads.py, test_scaler_clipping_args.py), copies trained on (test_routes_module_protocol.py,
test_layer_and_optimizer_edges.py, test_optim.py), ``reset_parameters`` of one adopted layer
(test_layer_and_optimizer_edges.py), a model materialized from meta after the optimizer (test_optim.py),
reparametrizations before the optimizer (test_optim_refusals.py, test_routes_module_protocol.py), ``add_param_group``,
optimizer state dicts into a fresh FP8AdamW or ``torch.optim.AdamW`` and ``release_weights`` then another optimizer
(test_optim.py, test_routes_optimizer.py, test_optim_shared_weights.py), writes to parameters whose masters are kept
apart (test_optim_outside_writes.py, test_optim_release.py), sharded DCP checkpoints (tests/distributed/).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.nn.utils import parametrize, prune
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.optim import master
from tests.numerics import assert_same

O2, O1 = "fp8-lm", "fp8-lm-o1"
MU = 2.0**8  # a gradient scale that is not 1, so that "times mu" and "in true units" differ


@pytest.fixture(autouse=True)
def _threads(one_thread):
    """Tiny tensors: one intra-op thread (tests/conftest.py)."""


# ------------------------------------------------------------------------------------------------------------ helpers
def _net(recipe: str = O2) -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)), recipe=recipe)


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _batches(n: int, seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 32, generator=gen) for _ in range(n)]


BATCHES = _batches(6)
X = torch.randn(8, 32, generator=torch.Generator().manual_seed(99))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(model[0].bias.dtype)).float().pow(2).mean() * 50


def _run(model: nn.Module, opt: FP8AdamW, scaler: FP8GradScaler, batches: list[torch.Tensor]) -> None:
    for x in batches:
        scaler.scale_loss(_loss(model, x)).backward()
        opt.step()
        opt.zero_grad()


def _fresh(recipe: str = O2, **kwargs) -> tuple[nn.Module, FP8AdamW, FP8GradScaler]:
    model = _net(recipe)
    scaler = FP8GradScaler(model=model, init_scale=MU)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, recipe=recipe, **kwargs)
    return model, opt, scaler


def _trained(recipe: str = O2, **kwargs) -> tuple[nn.Module, FP8AdamW, FP8GradScaler]:
    """A model trained 3 steps: at O2 its FP8 weights' storage holds the scaled fp16 masters."""
    model, opt, scaler = _fresh(recipe, **kwargs)
    _run(model, opt, scaler, BATCHES[:3])
    if recipe == O2:
        assert model[0].weight.dtype == torch.float16 and master.master_scale(model[0].weight) is not None
    return model, opt, scaler


def _reference(model: nn.Module) -> nn.Module:
    """A converted model, no optimizer, holding ``model``'s true weights and FP8 state: its forward is ``model``'s."""
    ref = _net(O1)
    ref.load_state_dict(model.state_dict())
    load_fp8_state_dict(ref, fp8_state_dict(model))
    return ref


def _plain_of(model: nn.Module) -> nn.Module:
    plain = _plain()
    plain.load_state_dict(model.state_dict())
    return plain


def _weight(model: nn.Module, index: int = 0) -> torch.Tensor:
    """The true weight of layer ``index`` (``state_dict()``'s)."""
    return model.state_dict()[f"{index}.weight"]


def _assert_fp16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to the rounding of an fp16 master with a per-tensor power-of-two scale (11 significant bits)."""
    amax = float(expected.detach().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-10, atol=amax * 2**-12)


def _optimizer_state(opt: FP8AdamW) -> dict:
    return copy.deepcopy(opt.state_dict())


def _values(obj: object) -> object:
    """``obj`` (a state dict) with every tensor as float64 values: equal values whatever the dtype they are kept in."""
    if isinstance(obj, torch.Tensor):
        return obj.double()
    if isinstance(obj, dict):
        return {k: _values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_values(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------- vectors, norms, clipping
def test_parameters_to_vector_reads_the_scaled_storage_until_release_weights():
    """Documented (docs/guides/checkpoints.md): ``parameters_to_vector`` hands on the storage, ``w * scale`` at O2.
    After ``release_weights()`` it is the vector of the true weights, as the plain model's."""
    model, opt, _ = _trained()
    true = torch.nn.utils.parameters_to_vector(_plain_of(model).parameters())
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    rows = model[0].weight.numel()
    assert_same(vec[:rows], (_weight(model) * master.master_scale(model[0].weight)).flatten())
    assert not torch.equal(vec, true)
    opt.release_weights()
    assert_same(torch.nn.utils.parameters_to_vector(model.parameters()), true)


def test_vector_to_parameters_of_its_own_vector_keeps_the_forward_and_the_next_step_steps_nothing():
    """``vector_to_parameters(parameters_to_vector(params), params)`` (the round trip of SAM-like or second-order code)
    makes the FP8 weights fp32 views of the vector (the vector is fp32: the biases are): the values are the storage's,
    exactly, so the forward stays right; the next step refuses (RuntimeError, naming the route) and changes nothing."""
    model, opt, scaler = _trained()
    ref = _reference(model)
    weights, state, mu = model.state_dict(), _optimizer_state(opt), scaler.state_dict()
    params = list(model.parameters())
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(params), params)
    assert model[0].weight.dtype == torch.float32
    assert_same(model(X), ref(X))
    scaler.scale_loss(_loss(model, BATCHES[3])).backward()
    with pytest.raises(RuntimeError, match="vector_to_parameters"):
        opt.step()
    assert_same(model.state_dict(), weights)
    assert_same(_values(opt.state_dict()), _values(state))  # the fp16 master now exported from fp32 storage
    assert_same(scaler.state_dict(), mu)


def test_vector_to_parameters_after_release_weights_is_where_the_next_step_starts():
    """After ``release_weights()`` a vector written with ``vector_to_parameters`` is the weights, and the run goes on
    bit for bit as one that loaded the same values with ``load_state_dict`` (FP8 state put back in both)."""
    model, opt, scaler = _trained()
    opt.release_weights()
    fp8 = fp8_state_dict(model)
    vec = torch.nn.utils.parameters_to_vector(model.parameters()) * 0.5
    torch.nn.utils.vector_to_parameters(vec, model.parameters())
    load_fp8_state_dict(model, fp8)

    loaded, loaded_opt, loaded_scaler = _trained()
    loaded_opt.release_weights()
    loaded.load_state_dict({k: v * 0.5 for k, v in loaded.state_dict().items()})
    load_fp8_state_dict(loaded, fp8)
    assert_same(model.state_dict(), loaded.state_dict())
    _run(model, opt, scaler, BATCHES[3:])
    _run(loaded, loaded_opt, loaded_scaler, BATCHES[3:])
    assert_same(model.state_dict(), loaded.state_dict())


@pytest.mark.parametrize("how", ["norm", "value"])
def test_torch_clipping_of_fp16_gradients_carrying_mu_steps_as_the_scalers_clipping(how):
    """With ``fp8_grads=False`` the O2 gradients are in ``param.grad`` (fp16 for the FP8 weights, times mu):
    ``torch.nn.utils.clip_grad_norm_(params, mu * max_norm)`` and ``clip_grad_value_(params, mu * c)`` clip them as
    the scaler's ``clip_grad_norm_(params, max_norm)`` / ``clip_grad_value_(params, c)`` do (torch sums each fp16
    norm in fp16: fp16 rounding), and the steps agree."""
    runs = []
    for route in ("torch", "scaler"):
        model, opt, scaler = _trained(fp8_grads=False)
        scaler.scale_loss(_loss(model, BATCHES[3])).backward()
        assert model[0].weight.grad.dtype == torch.float16
        mu = scaler.loss_scale
        if how == "norm":
            if route == "torch":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05 * mu) / mu
            else:
                norm = scaler.clip_grad_norm_(model.parameters(), 0.05)
            assert float(norm) > 0.5  # the limit clips
            runs.append(norm)
        elif route == "torch":
            torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3 * mu)
        else:
            scaler.clip_grad_value_(model.parameters(), 2e-3)
        grads = [p.grad.float().clone() for p in model.parameters()]
        opt.step()
        assert scaler.skipped_steps == 0
        runs.append((grads, model.state_dict()))
    if how == "norm":
        torch.testing.assert_close(runs[0], runs[2], rtol=1e-3, atol=0)
        runs = [runs[1], runs[3]]
    for torch_grad, scaler_grad in zip(runs[0][0], runs[1][0], strict=True):
        _assert_fp16_close(torch_grad, scaler_grad)
    for key, value in runs[1][1].items():
        _assert_fp16_close(runs[0][1][key], value)


def test_torch_total_norm_leaves_out_the_gradients_fp8adamw_holds_as_documented():
    """Documented (docs/guides/pytorch.md, "Gradient clipping"): with ``fp8_grads=True`` the FP8 weights'
    ``param.grad`` is None, so ``torch.nn.utils.get_total_norm`` of the gradients leaves them out; the scaler's
    ``clip_grad_norm_`` counts them: the norm of the same gradients kept in ``param.grad`` (``fp8_grads=False``), to
    their E5M2 rounding."""
    held, _, held_scaler = _trained()
    kept, _, kept_scaler = _trained(fp8_grads=False)
    held_scaler.scale_loss(_loss(held, BATCHES[3])).backward()
    kept_scaler.scale_loss(_loss(kept, BATCHES[3])).backward()
    assert held[0].weight.grad is None and held[2].weight.grad is None
    torch_norm = torch.nn.utils.get_total_norm([p.grad for p in held.parameters() if p.grad is not None])
    scaler_norm = held_scaler.clip_grad_norm_(held.parameters(), float("inf"))
    all_grads = torch.nn.utils.get_total_norm([p.grad.float() for p in kept.parameters()]) / kept_scaler.loss_scale
    torch.testing.assert_close(scaler_norm, all_grads, rtol=0.05, atol=0)
    assert float(torch_norm / held_scaler.loss_scale) < 0.9 * float(all_grads)


# ------------------------------------------------------------------------------------- initialization, in-place writes
def test_reset_parameters_through_model_apply_after_adoption_initializes_as_nn_linear():
    """``model.apply(init)`` calling ``reset_parameters()`` on every ``nn.Linear`` (an ``FP8Linear`` is one) after
    FP8AdamW took the weights: the true weights are those of the plain model initialized from the same seed (to the
    fp16 master's rounding), the biases exactly, and training goes on from them."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    model, opt, scaler = _trained()
    plain = _plain()
    torch.manual_seed(5)
    model.apply(init)
    torch.manual_seed(5)
    plain.apply(init)
    assert model[0].weight.dtype == torch.float16
    for key, value in plain.state_dict().items():
        if key.endswith("bias"):
            assert_same(model.state_dict()[key], value)
        else:
            _assert_fp16_close(model.state_dict()[key], value)
    ref = _reference(model)
    assert_same(model(X), ref(X))
    _run(model, opt, scaler, BATCHES[3:4])
    assert scaler.skipped_steps == 0 and all(torch.isfinite(v).all() for v in model.state_dict().values())


def _storage_after(model: nn.Module, how: str) -> torch.Tensor:
    """What layer 0's weight storage holds after the write ``how`` (computed apart, in the storage's dtype)."""
    weight, other = model[0].weight.detach(), model[2].weight.detach()

    def init(fn) -> torch.Tensor:
        return fn(torch.empty(64, 32, dtype=weight.dtype), generator=torch.Generator().manual_seed(1))

    return {
        "fill_": lambda: torch.full((64, 32), 0.01, dtype=weight.dtype),
        "copy_": lambda: COPIED.to(weight.dtype),
        "normal_": lambda: init(lambda t, generator: torch.nn.init.normal_(t, 0.0, 0.05, generator=generator)),
        "xavier_uniform_": lambda: init(torch.nn.init.xavier_uniform_),
        "tie_by_copy": lambda: other.T.to(weight.dtype),  # the other layer's storage (its master scale at O2)
        "mul_4": lambda: weight * 4,
    }[how]()


COPIED = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 0.05


def _write(model: nn.Module, how: str) -> None:
    """Write layer 0's weight in place, under no_grad, as user code does (re-initialization, a reset, tying by hand)."""
    weight = model[0].weight
    with torch.no_grad():
        if how == "zeros_":
            torch.nn.init.zeros_(weight)
        elif how == "mul_half":
            weight.mul_(0.5)
        elif how == "mul_4":
            weight.mul_(4)
        elif how == "fill_":
            weight.fill_(0.01)
        elif how == "copy_":
            weight.copy_(COPIED)
        elif how == "normal_":
            torch.nn.init.normal_(weight, 0.0, 0.05, generator=torch.Generator().manual_seed(1))
        elif how == "xavier_uniform_":
            torch.nn.init.xavier_uniform_(weight, generator=torch.Generator().manual_seed(1))
        else:  # weight tying by hand: layer 0 takes layer 2's weight, transposed
            weight.copy_(model[2].weight.T)


@pytest.mark.parametrize("how", ["zeros_", "mul_half"])
def test_scale_invariant_writes_to_the_scaled_storage_give_the_true_result(how):
    """Zeroing and multiplying by 0.5 commute with the master's scale: at O2 they write the true result, exactly."""
    model, _, _ = _trained()
    expected = torch.zeros(64, 32) if how == "zeros_" else _weight(model) * 0.5
    _write(model, how)
    assert_same(_weight(model), expected)


@pytest.mark.parametrize("how", ["fill_", "copy_", "normal_", "xavier_uniform_", "tie_by_copy"])
def test_writes_of_values_into_the_scaled_storage_are_divided_by_the_scale_as_documented(how):
    """Documented (docs/concepts/optimizer.md, docs/guides/checkpoints.md): ``fill_``, ``copy_``, ``nn.init.*`` into an
    FP8 weight at O2 write the scaled storage, so the weight becomes the value divided by the master scale (write with
    ``load_state_dict``, or after ``release_weights()``: next test). Tying by hand copies the other layer's storage,
    scaled by that layer's scale."""
    model, _, _ = _trained()
    scale = master.master_scale(model[0].weight)
    storage = _storage_after(model, how)
    _write(model, how)
    assert_same(model[0].weight.detach(), storage)
    assert_same(_weight(model), storage.float() / scale)


@pytest.mark.parametrize("how", ["fill_", "copy_", "normal_", "xavier_uniform_", "tie_by_copy", "mul_4"])
def test_after_release_weights_in_place_writes_are_where_the_next_step_starts(how):
    """After ``release_weights()`` an in-place write through the parameter is the weight, and the run continues bit for
    bit as one that loaded the same values with ``load_state_dict`` (the FP8 state put back in both: a weight load
    makes the layer's input and gradient scaling start fresh)."""
    model, opt, scaler = _trained()
    opt.release_weights()
    fp8 = fp8_state_dict(model)
    value = _storage_after(model, how)
    _write(model, how)
    load_fp8_state_dict(model, fp8)
    assert_same(_weight(model), value)

    loaded, loaded_opt, loaded_scaler = _trained()
    loaded_opt.release_weights()
    loaded.load_state_dict({**loaded.state_dict(), "0.weight": value})
    load_fp8_state_dict(loaded, fp8)
    _run(model, opt, scaler, BATCHES[3:])
    _run(loaded, loaded_opt, loaded_scaler, BATCHES[3:])
    assert_same(model.state_dict(), loaded.state_dict())


def test_a_weight_replaced_by_a_new_parameter_mid_training_computes_with_it_and_trains_as_a_plain_parameter():
    """``layer.weight = nn.Parameter(...)`` mid-training (docs/concepts/gemms.md): the layer computes with the new
    parameter (its true values: no master scale on it), the optimizer given it with ``add_param_group`` trains it
    with fp32 states (not taken as an O2 master), and the old one is no longer stepped."""
    model, opt, scaler = _trained()
    old = model[0].weight
    new = nn.Parameter(_weight(model).clone())
    model[0].weight = new
    opt.add_param_group({"params": [new]})
    assert master.master_scale(new) is None and new.dtype == torch.float32
    ref = _reference(model)
    assert_same(model(X), ref(X))
    before = old.detach().clone()
    _run(model, opt, scaler, BATCHES[3:4])
    assert_same(old.detach(), before)
    assert opt.state[new]["exp_avg"].dtype == torch.float32 and new.dtype == torch.float32
    assert not torch.equal(new.detach(), ref[0].weight.detach())


# --------------------------------------------------------------------------------------------------- casts, devices
@pytest.mark.parametrize("route", ["cpu", "share_memory", "to_empty_then_load", "float_then_half", "to_fp16"])
def test_moves_and_casts_that_keep_the_fp16_masters_continue_as_uninterrupted(route):
    """After adoption: ``cpu()`` and ``share_memory()`` change nothing; ``to_empty(device="cpu")`` then
    ``load_state_dict`` of the weights saved before continues as ``load_state_dict`` alone; ``float()`` then ``half()``
    gives the fp16 masters back exactly (docs/guides/checkpoints.md) and continues as ``half()`` alone, as does
    ``to(torch.float16)``."""
    model, opt, scaler = _trained()
    twin, twin_opt, twin_scaler = _trained()
    weights = model.state_dict()
    if route == "cpu":
        model.cpu()
    elif route == "share_memory":
        model.share_memory()
    elif route == "to_empty_then_load":
        model.to_empty(device="cpu")
        model.load_state_dict(weights)
        twin.load_state_dict(weights)
    elif route == "to_fp16":
        model.to(torch.float16)
        twin.half()
    else:
        model.float()
        assert model[0].weight.dtype == torch.float32
        model.half()
        twin.half()
    assert model[0].weight.dtype == torch.float16
    _run(model, opt, scaler, BATCHES[3:])
    _run(twin, twin_opt, twin_scaler, BATCHES[3:])
    assert_same(model.state_dict(), twin.state_dict())
    fp8, twin_fp8 = fp8_state_dict(model), fp8_state_dict(twin)
    # to_empty() on a real device gives the scaling buffers (not in the state dict) uninitialized memory: the load
    # makes the input and grad_output roles start fresh, the weight roles keep what was there (statistics only: the
    # weight casts take their own amax). Unlike to_empty() from meta, which resets them (test_linear_meta_load.py).
    if route == "to_empty_then_load":
        fp8, twin_fp8 = ({k: v for k, v in d.items() if ".weight." not in k} for d in (fp8, twin_fp8))
    assert_same(fp8, twin_fp8)


@pytest.mark.parametrize("cast", ["float", "bfloat16", "to_bf16"])
def test_a_cast_the_step_refuses_keeps_a_right_forward_and_steps_nothing(cast):
    """``float()``, ``bfloat16()``, ``to(torch.bfloat16)`` after adoption: the storage holds ``w * scale`` in the new
    dtype, the forward unscales it (the reference model cast alike computes the same), and the next step refuses
    (RuntimeError naming the cast) with nothing stepped."""
    model, opt, scaler = _trained()
    ref = _reference(model)
    apply = {
        "float": nn.Module.float,
        "bfloat16": nn.Module.bfloat16,
        "to_bf16": lambda m: m.to(torch.bfloat16),
    }[cast]
    apply(model)
    apply(ref)
    x = X.to(ref[0].bias.dtype)
    assert_same(model(x), ref(x))
    assert_same(model.state_dict()["0.weight"], ref.state_dict()["0.weight"].float())
    weights, state = model.state_dict(), _optimizer_state(opt)
    scaler.scale_loss(_loss(model, BATCHES[3])).backward()
    with pytest.raises(RuntimeError, match=r"model\.float\(\), \.bfloat16\(\).*nothing was stepped"):
        opt.step()
    assert_same(model.state_dict(), weights)
    assert_same(opt.state_dict(), state)


def test_a_model_sent_to_meta_after_adoption_refuses_its_forward():
    """``model.to("meta")`` after adoption: the master scales stay where the optimizer keeps them, and the forward
    refuses, saying to create FP8AdamW after moving the model; the state dict keeps its keys and shapes."""
    model, _, _ = _trained()
    model.to("meta")
    with pytest.raises(RuntimeError, match="moved or materialized.*Create FP8AdamW after"):
        model(X.to("meta"))
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in _net().state_dict().items()}


# ---------------------------------------------------------------------------------------------------------- averages
def _ema_run(release: bool) -> tuple[AveragedModel, dict[str, torch.Tensor], list[bool]]:
    """Train 4 steps with an ``AveragedModel`` EMA (decay 0.5) updated after each, and the EMA of the true weights the
    documentation recommends (``state_dict()`` values), started alike at the first update. At O2 the average starts
    as FP8AdamW took the weights (their master scale then is the amax's own; the steps' one-pass scales may be a binade
    lower: it moves); with ``release``, after 3 steps and ``release_weights()``."""
    model, opt, scaler = _fresh()
    if release:
        _run(model, opt, scaler, BATCHES[:3])
        opt.release_weights()
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ema: dict[str, torch.Tensor] = {}
    first = master.master_scale(model[0].weight)
    first = None if first is None else first.clone()
    moved = []
    for x in _batches(4, seed=3):
        _run(model, opt, scaler, [x])
        avg.update_parameters(model)
        for key, value in model.state_dict().items():
            ema[key] = value.float().clone() if key not in ema else ema[key].lerp(value.float(), 0.5)
        scale = master.master_scale(model[0].weight)
        moved.append(scale is not None and not torch.equal(scale, first))
    return avg, ema, moved


def test_averaged_model_at_o2_averages_the_scaled_storage_as_documented():
    """Documented (docs/guides/checkpoints.md and ``FP8Linear.__deepcopy__``): at O2 ``AveragedModel`` averages the
    storage, ``w * scale`` with the scale moving from step to step, so where the scale moved the average is off by far
    more than fp16 rounding; keep an EMA of the ``state_dict()`` values instead (or train at O1)."""
    avg, ema, moved = _ema_run(release=False)
    assert any(moved)
    error = (avg.module.state_dict()["0.weight"] - ema["0.weight"]).abs().max() / ema["0.weight"].abs().max()
    assert float(error) > 0.05


def test_averaged_model_after_release_weights_is_the_ema_of_the_true_weights():
    avg, ema, _ = _ema_run(release=True)
    for key, value in ema.items():
        assert_same(avg.module.state_dict()[key], value)


# -------------------------------------------------------------------------------------- torch.distributed.checkpoint
OPTIONS = {
    "default": {},
    "full_state_dict": {"full_state_dict": True},
    "flatten": {"flatten_optimizer_state_dict": True},
    "cpu_offload": {"cpu_offload": True},
}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_dcp_state_dict_functions_in_one_process_resume_bit_for_bit(options):
    """``get_model_state_dict`` / ``get_optimizer_state_dict`` of a run after 3 steps, ``set_model_state_dict`` /
    ``set_optimizer_state_dict`` into a fresh model and optimizer (plus the FP8 state and mu): no process group is
    needed, the model state dict holds the true weights, and the resumed run ends bit for bit as the uninterrupted
    one."""
    opts = StateDictOptions(**OPTIONS[options])
    whole, whole_opt, whole_scaler = _fresh()
    _run(whole, whole_opt, whole_scaler, BATCHES)
    saved, saved_opt, saved_scaler = _trained()
    model_sd = get_model_state_dict(saved, options=opts)
    assert_same(model_sd, saved.state_dict())
    optim_sd = get_optimizer_state_dict(saved, saved_opt, options=opts)
    model, opt, scaler = _fresh()
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, opt, optim_sd, options=opts)
    load_fp8_state_dict(model, fp8_state_dict(saved))
    scaler.load_state_dict(saved_scaler.state_dict())
    _run(model, opt, scaler, BATCHES[3:])
    assert_same(model.state_dict(), whole.state_dict())
    assert_same(opt.state_dict(), whole_opt.state_dict())


def test_set_model_state_dict_of_a_partial_dict_loads_its_keys_and_keeps_the_others():
    """``set_model_state_dict(model, partial, options=StateDictOptions(strict=False))``: torch fills the keys the dict
    lacks from ``named_parameters()`` (the scaled storage, loaded back as the no-op it is since session 68's fix,
    test_layer_init_and_load.py); the keys given load as true weights."""
    model, _, _ = _trained()
    other, _, _ = _fresh()
    before = model.state_dict()
    new = other.state_dict()["2.weight"]
    set_model_state_dict(model, {"2.weight": new}, options=StateDictOptions(strict=False))
    assert_same(model.state_dict(), {**before, "2.weight": new})


def test_dcp_save_and_load_in_one_process_resume_bit_for_bit(tmp_path):
    """The documented sharded-checkpoint recipe (docs/guides/checkpoints.md) in one process without a process group:
    ``dcp.save`` to a directory, ``dcp.load`` into a fresh model's template, ``set_state_dict``: bit for bit."""
    whole, whole_opt, whole_scaler = _fresh()
    _run(whole, whole_opt, whole_scaler, BATCHES)
    saved, saved_opt, saved_scaler = _trained()
    model_sd, optim_sd = get_state_dict(saved, saved_opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(
            {"model": model_sd, "optim": optim_sd, "fp8": fp8_state_dict(saved), "scaler": saved_scaler},
            checkpoint_id=tmp_path,
        )
        model, opt, scaler = _fresh()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "fp8": fp8_state_dict(model), "scaler": scaler}
        dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_fp8_state_dict(model, state["fp8"])
    assert_same(model.state_dict(), saved.state_dict())
    _run(model, opt, scaler, BATCHES[3:])
    assert_same(model.state_dict(), whole.state_dict())


def test_dcp_load_in_place_into_state_dict_values_reaches_the_fp8_weights_only_through_load_state_dict(tmp_path):
    """Documented (docs/guides/checkpoints.md): the FP8 weights' ``state_dict()`` values are computed tensors, not
    views of the parameters, so ``dcp.load`` into them changes the biases (views) but not the FP8 weights; the
    ``load_state_dict`` that the DCP recipe ends with loads them."""
    saved, _, _ = _trained()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save({"model": saved.state_dict()}, checkpoint_id=tmp_path)
        model, _, _ = _fresh()  # untrained: other weights, its storage holding the masters
        before = _weight(model).clone()
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=tmp_path)
    assert_same(_weight(model), before)
    assert_same(model.state_dict()["0.bias"], saved.state_dict()["0.bias"])
    model.load_state_dict(state["model"])
    assert_same(model.state_dict(), saved.state_dict())


# ----------------------------------------------------------------------------------------------------- saved by hand
def _saved(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_saved_state_dict_loads_the_true_weights_into_plain_and_converted_models():
    model, _, _ = _trained()
    loaded = _saved(model.state_dict())
    for target in (_plain(), _net()):
        target.load_state_dict(loaded)
        assert_same(target.state_dict(), model.state_dict())


def test_parameters_saved_by_hand_from_named_parameters_load_as_the_true_weights_into_a_converted_model():
    """``torch.save({k: v for k, v in model.named_parameters()})``: the saved FP8 weights are the storage with its
    master scale attribute, which ``torch.load(weights_only=True)`` restores. ``functional_call`` with them computes
    with the true weights (the layer unscales them); ``load_state_dict`` into a converted model must load the true
    weights as well. (Into a plain ``nn.Linear`` the scaled values load as they are: torch copies ``.data``, nothing
    of this library runs there; read the weights with ``state_dict()``, docs/guides/checkpoints.md.)"""
    model, _, _ = _trained()
    ref = _reference(model)
    loaded = _saved({k: v for k, v in model.named_parameters()})
    assert master.master_scale(loaded["0.weight"]) is not None
    adopted, _, _ = _fresh()  # an O2 model whose own weights are masters: the file's are unscaled (exported) first
    adopted.load_state_dict(loaded)
    _assert_fp16_close(_weight(adopted), _weight(model))
    fresh = _net()
    load_fp8_state_dict(fresh, fp8_state_dict(model))
    assert_same(torch.func.functional_call(fresh, loaded, (X,)), ref(X))
    # Found by this sweep: a converted model whose weight holds no master (no FP8AdamW over it yet: an inference or
    # evaluation copy) loaded the stored w * scale (2**17 times the weight) as its weight, silently: the load hook
    # (master_layer.py) returned at once where the target weight holds no master, before the check that unscales an
    # incoming tensor carrying its own master scale (which torch.save and torch.load(weights_only=True) keep on a saved
    # Parameter).
    fresh.load_state_dict(loaded)
    _assert_fp16_close(_weight(fresh), _weight(model))


@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_a_copy_made_without_the_optimizer_infers_with_the_true_weights_and_a_new_fp8adamw_gives_them_back(how):
    """``copy.deepcopy(model)`` or ``torch.save(model)`` (whole-module pickling) without the optimizer: the copy keeps
    the scaled storage and its master scale, so its forward and state dict are the true weights'; an O1 optimizer
    over it is refused as it is built, and ``FP8AdamW(copy.parameters()).release_weights()`` (what the refusal says
    to do when the first optimizer is gone) gives the weights their own storage back, exactly."""
    model, _, _ = _trained()
    ref = _reference(model)
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert copied[0].weight.dtype == torch.float16
    assert_same(copied(X), ref(X))
    assert_same(copied.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="release_weights"):
        FP8AdamW(copied.parameters(), lr=1e-2, recipe=O1)
    FP8AdamW(copied.parameters(), lr=1e-2, recipe=O2).release_weights()
    assert_same(dict(copied.named_parameters()), {k: v for k, v in model.state_dict().items()})


# ----------------------------------------------------------------------------------------------------------- reads
@pytest.mark.parametrize("given", ["named_parameters", "state_dict", "state_dict_keep_vars"])
def test_functional_call_computes_with_the_true_weights(given):
    """``torch.func.functional_call(model, params, x)`` with the parameters themselves or the state dict's values
    (documented to work: docs/guides/checkpoints.md) gives the model's own forward, bit for bit."""
    model, _, _ = _trained()
    ref = _reference(model)
    params = {
        "named_parameters": lambda: dict(model.named_parameters()),
        "state_dict": model.state_dict,
        "state_dict_keep_vars": lambda: model.state_dict(keep_vars=True),
    }[given]()
    assert_same(torch.func.functional_call(model, params, (X,)), ref(X))


def test_a_training_step_through_functional_call_with_named_parameters_is_the_plain_step():
    """Forward through ``functional_call(model, dict(model.named_parameters()), x)``, then backward and step: the FP8
    gradients reach the optimizer as through ``model(x)``, bit for bit."""
    model, opt, scaler = _trained()
    twin, twin_opt, twin_scaler = _trained()
    for x in BATCHES[3:]:
        out = torch.func.functional_call(model, dict(model.named_parameters()), (x,))
        scaler.scale_loss(out.float().pow(2).mean() * 50).backward()
        opt.step()
        opt.zero_grad()
    _run(twin, twin_opt, twin_scaler, BATCHES[3:])
    assert_same(model.state_dict(), twin.state_dict())


def test_logged_parameter_norms_are_the_storages_at_o2_and_the_weights_after_release():
    """Documented (docs/guides/checkpoints.md): code that reads the parameters (a logged weight norm) sees the storage
    at O2 (in fp16 such a norm overflows to inf); ``state_dict()``'s values are the weights; after
    ``release_weights()`` the parameters are too."""
    model, opt, _ = _trained()
    true = {k: float(v.detach().norm()) for k, v in _plain_of(model).named_parameters()}
    logged = {k: float(p.detach().float().norm()) for k, p in model.named_parameters()}
    scale = float(master.master_scale(model[0].weight))
    assert logged["0.weight"] == pytest.approx(true["0.weight"] * scale, rel=1e-3)
    assert float(model[0].weight.detach().norm()) == float("inf")
    assert logged["0.bias"] == true["0.bias"]
    assert {k: float(v.norm()) for k, v in model.state_dict().items()} == true
    opt.release_weights()
    assert {k: float(p.detach().norm()) for k, p in model.named_parameters()} == true


# ------------------------------------------------------------------------------------------------ reparametrizations
class _Identity(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        return fn(*args, **kwargs)


REPARAMETRIZATIONS = {
    "parametrize": (
        lambda layer: parametrize.register_parametrization(layer, "weight", _Identity()),
        lambda layer: parametrize.remove_parametrizations(layer, "weight"),
    ),
    "weight_norm": (
        lambda layer: torch.nn.utils.parametrizations.weight_norm(layer),
        lambda layer: parametrize.remove_parametrizations(layer, "weight"),
    ),
    "spectral_norm": (
        lambda layer: torch.nn.utils.parametrizations.spectral_norm(layer),
        lambda layer: parametrize.remove_parametrizations(layer, "weight"),
    ),
    "legacy_weight_norm": (
        lambda layer: _quiet(torch.nn.utils.weight_norm, layer),
        lambda layer: torch.nn.utils.remove_weight_norm(layer),
    ),
    "prune": (
        lambda layer: prune.l1_unstructured(layer, "weight", amount=0.5),
        lambda layer: prune.remove(layer, "weight"),
    ),
}


@pytest.mark.parametrize("kind", list(REPARAMETRIZATIONS))
def test_reparametrizing_an_adopted_weight_is_refused_as_it_is_put_and_the_layer_kept(kind):
    """Reparametrizing an FP8 layer whose weight FP8AdamW (O2) holds as a scaled fp16 master is refused as it is put,
    naming ``release_weights()``: the layer keeps its weight (the same parameter, the optimizer's), its state dict and
    its outputs, and trains on as a twin that was never touched."""
    # Found by this sweep: torch computes these from the parameter's storage, the scaled fp16 master. Weight norm's g =
    # ||w * scale|| per row overflowed fp16 and spectral norm's power iteration gave NaN, so the weight put back by
    # their removal (which the forward's refusal asked for) was inf or NaN, silently; while any of them was on, the
    # state dict held the scaled storage under the reparametrization's key (w * 2**17), silently. They were refused only
    # at the next forward.
    model, opt, scaler = _trained()
    twin, twin_opt, twin_scaler = _trained()
    weight, state, out = model[0].weight, model.state_dict(), model(X)
    torch.manual_seed(3)
    with pytest.raises(ValueError, match=r"cannot be reparametrized .* Call optimizer.release_weights\(\) first"):
        REPARAMETRIZATIONS[kind][0](model[0])
    assert model[0].weight is weight and not parametrize.is_parametrized(model[0])
    assert set(dict(model[0].named_parameters())) == {"weight", "bias"} and not model[0]._forward_pre_hooks
    assert_same(model.state_dict(), state)
    assert_same(model(X), out)
    _run(model, opt, scaler, BATCHES[3:4])
    _run(twin, twin_opt, twin_scaler, BATCHES[3:4])
    assert_same(model.state_dict(), twin.state_dict())


def test_deleting_an_adopted_weight_is_refused_and_after_release_weights_taken():
    model, opt, _ = _trained()
    weight = model[0].weight
    with pytest.raises(ValueError, match="release_weights"):
        del model[0].weight
    assert model[0].weight is weight
    opt.release_weights()
    del model[0].weight
    assert "weight" not in model[0]._parameters


@pytest.mark.parametrize("kind", ["parametrize", "prune"])
def test_an_identity_parametrization_or_pruning_after_release_weights_acts_as_on_the_plain_model(kind):
    """After ``release_weights()`` the weight is the true one: the identity parametrization put on and removed gives it
    back exactly, pruning one layer by L1 leaves the weights the plain model pruned alike keeps, and while either is on
    the state dict holds what the plain model's holds (under the reparametrization's key)."""
    model, opt, _ = _trained()
    opt.release_weights()
    plain = _plain_of(model)
    put, remove = REPARAMETRIZATIONS[kind]
    weight = model[0].weight
    put(model[0])
    put(plain[0])
    saved, expected = model.state_dict(), plain.state_dict()
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        _assert_fp16_close(saved[key], value)
    remove(model[0])
    remove(plain[0])
    assert model[0].weight is weight
    for key, value in plain.state_dict().items():
        _assert_fp16_close(model.state_dict()[key], value)


def test_weight_norm_after_release_weights_gives_the_weight_back():
    """After ``release_weights()`` the weight is the true one, so weight norm put on and removed gives it back, an FP8
    weight again (docs/concepts/gemms.md)."""
    model, opt, _ = _trained()
    opt.release_weights()
    before = _weight(model).clone()
    put, remove = REPARAMETRIZATIONS["weight_norm"]
    put(model[0])
    remove(model[0])
    _assert_fp16_close(_weight(model), before)
    assert master.is_fp8_weight(model[0].weight)
