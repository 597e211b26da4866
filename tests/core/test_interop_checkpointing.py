"""FP8 layers under selective activation checkpointing (torch.utils.checkpoint's ``context_fn`` with
``create_selective_checkpoint_contexts``): the policy's cache hands the recompute the outputs the forward's ops saved,
matched by op and call count, so the recompute must run the forward's ops in the forward's order. A forward whose input
cast used its own amax (the first step of delayed scaling, every step of current scaling) once had its recompute cast
with the kept scale instead (fewer ops): a policy saving ``aten.amax`` gave silently wrong gradients, one saving
``aten.mul`` or ``aten.abs`` crashed inside the cast. A policy saving an in-place op (``aten.copy_``, ``aten.add_``, or
every op) failed the backward with "Tensor cached during selective activation checkpoint has been mutated": the policy
saw the casts' bookkeeping, in-place writes of the scaling buffers that the next cast writes again."""

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, ScalingState, scaling


def _model(kind: str, recipe: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(FP8Linear(32, 64, recipe=recipe), nn.GELU(), FP8Linear(64, 32, recipe=recipe))
    return nn.Sequential(FP8MLP(32, 64, recipe=recipe), nn.LayerNorm(32), FP8Linear(32, 32, recipe=recipe))


def _saving(op):
    # op None: the policy saves every op.
    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is None or func == op else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


_OPS = {
    "amax": torch.ops.aten.amax.default,
    "mul": torch.ops.aten.mul.Tensor,
    "abs": torch.ops.aten.abs.default,
    "copy_": torch.ops.aten.copy_.default,
    "add_": torch.ops.aten.add_.Tensor,
    "every op": None,
    "clone": torch.ops.aten.clone.default,
}


@pytest.mark.parametrize("op", ["amax", "mul", "abs"])
@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-current"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_selective_checkpointing_of_own_amax_casts_equals_the_unchecked_run(kind, recipe, op):
    """From the first step (own-amax casts) on: gradients bit for bit those of the model without checkpointing."""
    _assert_same_as_unchecked(_model(kind, recipe), _OPS[op])


@pytest.mark.parametrize("op", ["copy_", "add_", "every op"])
@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-current"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_selective_checkpointing_saving_in_place_ops_equals_the_unchecked_run(kind, recipe, op):
    """The casts' bookkeeping (the scaling buffers' in-place updates) is out of the policy's sight: it saved them and
    then failed ("Tensor cached during selective activation checkpoint has been mutated")."""
    _assert_same_as_unchecked(_model(kind, recipe), _OPS[op])


@pytest.mark.parametrize("op", ["every op", "clone"])
@pytest.mark.parametrize("emit", [False, True])
@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-current"])
def test_selective_checkpointing_of_every_op_with_fp8adamw_steps_equals_the_unchecked_run(recipe, emit, op):
    # O2: the weights' casts read FP8AdamW's scaled masters (their unscale bookkeeping too), gradients held in FP8.
    # emit_fp8_weights: the forward records the step's FP8 copy into the weight's state and makes the copy's
    # transpose on first use (the recompute finds it made): both out of the policy's sight, or saving every op failed
    # ("mutated"), and saving aten.clone handed the recompute's ops outputs of others.
    _assert_fp8adamw_steps_same_as_unchecked(recipe, emit, _OPS[op])


@pytest.mark.parametrize("emit", [False, True])
def test_selective_checkpointing_of_every_op_leaves_the_triton_paths_host_tensors_alone(monkeypatch, emit):
    # The Triton paths (on a GPU; here under the interpreter) make their outputs, zeroed workspaces and launch tables
    # on the host side: a policy saving every op kept them from the forward and handed them to the recompute's kernels,
    # which wrote them again ("Tensor cached during selective activation checkpoint has been mutated" here, an illegal
    # memory access on a GPU).
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    _assert_fp8adamw_steps_same_as_unchecked("fp8-lm", emit, None)


def _assert_fp8adamw_steps_same_as_unchecked(recipe: str, emit: bool, op) -> None:
    model = _model("mlp", recipe)
    ref = copy.deepcopy(model)
    opts = [FP8AdamW(m.parameters(), lr=1e-2, recipe=recipe, emit_fp8_weights=emit) for m in (model, ref)]
    for step in range(3):
        x = torch.randn(24, 32)
        checkpoint(model, x, use_reentrant=False, context_fn=_saving(op)).square().mean().backward()
        ref(x).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), (step, name)
        for name, buf in model.named_buffers():
            assert torch.equal(buf, ref.get_buffer(name)), (step, name)


class _Arrived:
    """A CUDA event whose copy has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-current"])
def test_the_gpus_amax_read_is_out_of_the_policys_sight(monkeypatch, recipe):
    # On a GPU, note_cast copies the cast's amax to the host without waiting, and a later cast reads it once it
    # arrived: the recompute of the first checkpointed step read it (aten._local_scalar_dense) where the forward had
    # nothing to read, and the backward failed ("encountered during backward, but not found in storage"). Here that
    # GPU path of note_cast on the CPU: the read goes to _SEEN_AMAX, already arrived.
    def note_cast_as_on_a_gpu(self, numel, by_value=True):
        if not by_value:
            return original(self, numel, by_value)
        with _disable_current_modes():
            seen = torch.maximum(self._buffers["amax"], self._buffers["amax_history"].amax())
            scaling._SEEN_AMAX[self] = (seen.clone(), _Arrived())

    original = ScalingState.note_cast
    monkeypatch.setattr(ScalingState, "note_cast", note_cast_as_on_a_gpu)
    _assert_same_as_unchecked(_model("linear", recipe), None)


def test_a_make_fx_trace_still_records_the_casts_bookkeeping():
    # Hidden from selective checkpointing's mode, the bookkeeping must stay in a trace (make_fx's proxy mode here).
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    layer = FP8Linear(32, 32)
    x = torch.randn(16, 32)
    layer(x)
    traced = [str(node.target) for node in make_fx(layer)(x).graph.nodes if node.op == "call_function"]
    assert traced.count("aten.add_.Tensor") == 4  # nonfinite_count and casts, of the input and the weight casts


def _assert_same_as_unchecked(model: nn.Module, op) -> None:
    ref = copy.deepcopy(model)
    for step, magnitude in enumerate((1.0, 4.0, 0.25)):
        x = torch.randn(24, 32) * magnitude
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        checkpoint(model, xs[0], use_reentrant=False, context_fn=_saving(op)).square().mean().backward()
        ref(xs[1]).square().mean().backward()
        assert torch.equal(xs[0].grad, xs[1].grad), step
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (step, name)
        for name, buf in model.named_buffers():
            assert torch.equal(buf, ref.get_buffer(name)), (step, name)
        model.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("op", ["nothing", "amax", "every op"])
@pytest.mark.parametrize("order", ["summed", "layer_twice"])
def test_selective_checkpointing_with_several_forwards_of_a_layer_waiting_equals_the_unchecked_run(order, op):
    """Micro-batch losses summed into one backward, or a layer twice in one region: the recompute could not tell which
    forward it repeats and cast with its input's own amax, other ops than the forward's, so every policy (one saving
    nothing too) failed the backward ("aten.abs.default invocation index 15 encountered during backward but not found
    in storage"). A region's recompute repeats the region's forwards in order."""
    _assert_several_pending_same_as_unchecked(order, _OPS.get(op, op))  # "nothing": a policy that matches no op


def test_selective_checkpointing_with_a_layer_twice_on_the_triton_path(monkeypatch):
    # The Triton casts are out of the policy's sight (ops.out_of_modes_sight): the own-amax recompute did not fail
    # there, but its bytes differed from the forward's (weight gradients not the unchecked run's).
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    _assert_several_pending_same_as_unchecked("layer_twice", None)


def _assert_several_pending_same_as_unchecked(order: str, op) -> None:
    torch.manual_seed(0)
    layer = FP8Linear(32, 32)
    ref = copy.deepcopy(layer)

    def run(lin, x, ckpt):
        sac = functools.partial(checkpoint, use_reentrant=False, context_fn=_saving(op))
        wrap = sac if ckpt else (lambda f, v: f(v))
        if order == "layer_twice":
            wrap(lambda v: lin(torch.tanh(lin(v))), x).square().mean().backward()
        else:
            sum(wrap(lin, x_mb).square().mean() for x_mb in x.chunk(2)).backward()

    for step, magnitude in enumerate((1.0, 4.0, 0.25)):  # own-amax casts first, then delayed ones
        x = torch.randn(16, 32) * magnitude
        run(layer, x, True)
        run(ref, x, False)
        assert torch.equal(layer.weight.grad, ref.weight.grad), step
        assert torch.equal(layer.bias.grad, ref.bias.grad), step
        for name, buf in layer.named_buffers():
            assert torch.equal(buf, ref.get_buffer(name)), (step, name)
        layer.zero_grad()
        ref.zero_grad()
