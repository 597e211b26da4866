"""The first cast of each role of an FP8 layer has no amax history and uses its tensor's own amax (DESIGN.md,
docs/concepts/formats.md), whatever ran before it: forwards without a backward (an evaluation under no_grad, as
Lightning's sanity check runs; a forward whose graph is dropped), a second use of the layer in one graph, several
micro-batch forwards before one backward, and casts of empty or all-zero tensors (an MoE expert without tokens, the
output of a zero-initialized layer at step 0) or of non-finite ones, which carry no amax. The references: the FP8
step by definition (every operand cast with its own power-of-two scale, float64 math) and the high-precision
layers."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8MLP, FP8Linear, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.formats import E4M3, E5M2, fp8_max
from tests.numerics import BACKWARD_SQNR_DB, FORWARD_SQNR_DB, assert_same, pow2_scale, sqnr

# Output gradients far below E5M2's smallest subnormal (2**-16): a cast with the initial scale 1 flushes them all to
# zero, a cast with their own amax keeps them.
TINY = 1e-6


def assert_gemm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` (a GEMM of the layer, from the same FP8 operands as ``want``, float64) agrees to its accumulation: on
    the CPU the emulation's fp32 (another summation order: 1e-5 of the largest value), on a GPU the FP8 tensor cores'
    (their accumulator keeps fewer bits between promotions to fp32, and the forward's fast accumulation fewer still:
    1e-4 of the largest value seen on an H100; 1e-3 allowed). A cast flushed to zero is off by the whole value."""
    tol = (1e-3 if got.is_cuda else 1e-5) * want.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=tol)


def own_scale(t: torch.Tensor, fmt: torch.dtype) -> float:
    """The largest power of two ``2**k`` with ``max|t| * 2**k <= fp8_max`` (DESIGN.md's scale), found in float64."""
    return pow2_scale(t.abs().max().item(), fp8_max(fmt))


def fp8_round(t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``fmt`` with its own scale and back, in float64 (the scale is a power of two: exact in fp32)."""
    s = own_scale(t, fmt)
    return (t.float() * s).clamp(-fp8_max(fmt), fp8_max(fmt)).to(fmt).double() / s


def first_step_by_definition(x, w, dy):
    """``(y, dx, dw)`` of an FP8 linear layer without bias whose casts use their own amax (E4M3 x and w, E5M2 dy)."""
    xq, wq, dyq = fp8_round(x, E4M3), fp8_round(w, E4M3), fp8_round(dy, E5M2)
    return xq @ wq.T, dyq @ wq, dyq.T @ xq


def _before(layer: nn.Module, what: str, x: torch.Tensor) -> None:
    if what == "no_grad_eval":  # Lightning's sanity check: validation batches under no_grad before step 1
        layer.eval()
        with torch.no_grad():
            layer(x)
        layer.train()
    elif what == "graph_without_backward":  # an evaluation forgetting no_grad: the graph is built, then dropped
        layer(x.clone().requires_grad_())
    elif what == "empty_batch":  # an MoE expert that no token was routed to, forward and backward
        layer(x[:0].clone().requires_grad_()).sum().backward()
        layer.zero_grad()
    elif what in ("zero_batch", "nonfinite_batch"):
        # Fed by a zero-initialized layer (LoRA-B, adaLN-zero) at step 0: all-zero input and output gradient, amax 0;
        # or an overflow upstream: inf in both. Neither tells a scale: the history records 0.
        fill = 0.0 if what == "zero_batch" else float("inf")
        y = layer(torch.full_like(x, fill).requires_grad_())
        y.backward(torch.full_like(y, fill))
        layer.zero_grad()
    elif what == "fake_tensor_step":
        # A step traced under FakeTensorMode (memory estimation, make_fx): nothing reaches the real history, which
        # still says nothing. It marked the states initialized; the first real cast then scaled by 1 (62% saturated).
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            layer(x.clone().requires_grad_()).sum().backward()
        layer.zero_grad(set_to_none=True)  # the gradient is a fake tensor


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "before",
    [
        None,
        "no_grad_eval",
        "graph_without_backward",
        "empty_batch",
        "zero_batch",
        "nonfinite_batch",
        "fake_tensor_step",
    ],
)
def test_first_step_casts_with_own_amax_whatever_ran_before(before, device):
    """The step's forward and backward are the FP8 step by definition: the same input (so that an earlier cast of it
    leaves the input's delayed scale at its own), output gradients of 1e-6. On a GPU: the Triton casts, real FP8
    GEMMs."""
    torch.manual_seed(0)
    layer = FP8Linear(32, 48, bias=False, device=device)
    x, dy = torch.randn(40, 32, device=device) * 0.01, torch.randn(40, 48, device=device) * TINY
    if before is not None:
        _before(layer, before, x)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = first_step_by_definition(x.cpu(), layer.weight.detach().cpu(), dy.cpu())
    assert_gemm_close(y, y_ref)
    assert_gemm_close(xg.grad, dx_ref)
    assert_gemm_close(layer.weight.grad, dw_ref)
    no_information = before in ("empty_batch", "zero_batch", "nonfinite_batch")  # a cast that did not count
    if before != "fake_tensor_step":  # fake mode may run the one-element counter's += 1 for real (a constant)
        assert int(layer.fp8_scaling["grad_output"].casts) == 1 + no_information
    # settle(): on a GPU the first-cast rule's amax reads arrive without a sync (a later cast takes them)
    assert all(layer.fp8_scaling[role].settle() for role in ("input", "weight", "grad_output"))


def test_a_fake_tensor_step_launches_no_triton_kernel(monkeypatch):
    """The Triton casts (Triton's interpreter on a CPU) under FakeTensorMode: the eager casts launched their kernels
    on the fake tensors, whose addresses are no memory (on an H100: an illegal memory access that ended every later
    CUDA call of the process; here: a storage error). The traced casts take the reference's ops."""
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    test_first_step_casts_with_own_amax_whatever_ran_before("fake_tensor_step", "cpu")


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum() * TINY


def _model_for(layer: nn.Module, use: str) -> nn.Module:
    # The same layer twice in one module: one compiled graph holds both uses.
    return nn.Sequential(layer, layer) if use == "twice_in_one_graph" else layer


def _several_uses(module: nn.Module, x: torch.Tensor, use: str) -> None:
    if use == "twice_in_one_graph":
        _loss(module(x)).backward()
    elif use == "twice_in_two_graphs":  # compiled: two calls of the compiled layer, one backward
        _loss(module(module(x))).backward()
    elif use == "micro_batches_then_one_backward":
        sum(_loss(module(chunk)) for chunk in x.chunk(4)).backward()
    else:  # a forward whose graph is dropped (its backward never runs), then the step
        module(x.clone().requires_grad_())
        _loss(module(x)).backward()


USES = ["twice_in_one_graph", "twice_in_two_graphs", "micro_batches_then_one_backward", "graph_without_backward"]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("use", USES)
def test_layer_forwarded_several_times_before_its_first_backward(use, compiled):
    """Weight sharing and micro-batches summed into one backward: the gradients are FP8-accurate against nn.Linear.
    (With the first backward cast at scale 1 they were all zero, or most of them; compiled, where the first traced
    use marks the role before any backward ran, the later uses' casts got that scale until 2026-12-05.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = FP8Linear(32, 32, bias=False)
    ref = nn.Linear(32, 32, bias=False)
    ref.weight.data.copy_(layer.weight.data)
    x = torch.randn(64, 32)
    fp8 = _model_for(layer, use)
    fp8 = torch.compile(fp8, backend="aot_eager") if compiled else fp8
    _several_uses(fp8, x, use)
    _several_uses(_model_for(ref, use), x, use)
    assert sqnr(layer.weight.grad, ref.weight.grad) > BACKWARD_SQNR_DB


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("use", USES)
def test_compiled_steps_after_several_uses_before_the_first_backward(use, device):
    """Every step is FP8-accurate against nn.Linear, and the graphs traced in the first two steps serve every step
    after (no graph per call). On a GPU: inductor, the Triton casts, real FP8 GEMMs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = FP8Linear(32, 32, bias=False, device=device)
    ref = nn.Linear(32, 32, bias=False, device=device)
    ref.weight.data.copy_(layer.weight.data)
    counter = CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    compiled = torch.compile(_model_for(layer, use), backend=counter)
    graphs = []
    for step in range(4):
        x = torch.randn(64, 32, device=device)
        layer.zero_grad()
        ref.zero_grad()
        _several_uses(compiled, x, use)
        _several_uses(_model_for(ref, use), x, use)
        assert sqnr(layer.weight.grad, ref.weight.grad) > BACKWARD_SQNR_DB, step
        graphs.append(counter.frame_count)
    assert graphs[1] == graphs[-1] <= 4, graphs


def test_layers_compiled_one_by_one_share_their_graphs():
    """Ten layers compiled one by one (as per-block compiles do: one code object) share two graphs, the first step's
    and the steady one: the check of the first backward casts installs no guard on a layer's own state (a guard per
    layer reached dynamo's recompile limit of 8, and the layers after it ran eagerly)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [FP8Linear(32, 32, bias=False) for _ in range(10)]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = [torch.compile(layer, backend=counter) for layer in layers]
    for _ in range(3):
        x = torch.randn(64, 32, requires_grad=True)  # as every later layer's input
        for c in compiled:
            x = c(x)
        _loss(x).backward()
    assert counter.frame_count == 2


@pytest.mark.parametrize("before", ["micro_batches", "evaluation_with_grad"])
def test_many_forwards_before_the_first_backward_trace_few_graphs(before):
    """Ten micro-batches summed into one backward, or ten evaluation batches with gradients on (model.eval() without
    no_grad): a few graphs, not one per call (dynamo's recompile limit of 8 would leave the model eager)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear(32, 32, bias=False), nn.ReLU(), FP8Linear(32, 32, bias=False))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    if before == "evaluation_with_grad":
        model.eval()
        for _ in range(10):
            compiled(torch.randn(16, 32))
        model.train()
    for _ in range(3):
        sum(_loss(compiled(torch.randn(16, 32))) for _ in range(10)).backward()
    assert counter.frame_count <= 3


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_mlp_applied_twice_before_its_first_backward(compiled):
    """FP8MLP's two grad_output roles with the MLP applied twice in one graph: FP8-accurate against the fp32 MLP."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64, bias=False)
    hp = nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU(), nn.Linear(64, 32, bias=False))
    hp.load_state_dict({"0.weight": mlp.fc.weight, "2.weight": mlp.proj.weight})
    x = torch.randn(48, 32)
    fp8 = torch.compile(mlp, backend="aot_eager") if compiled else mlp
    for module in (fp8, hp):
        _loss(module(module(x))).backward()
    assert sqnr(mlp.fc.weight.grad, hp[0].weight.grad) > BACKWARD_SQNR_DB
    assert sqnr(mlp.proj.weight.grad, hp[2].weight.grad) > BACKWARD_SQNR_DB


@pytest.mark.parametrize("before", ["no_grad_eval", "empty_batch"])
def test_fp8_mlp_first_backward_after_earlier_forwards(before):
    """FP8MLP's two grad_output roles (fc's is the GELU's input gradient): FP8-accurate against the fp32 MLP."""
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64)
    hp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    hp.load_state_dict({"0.weight": mlp.fc.weight, "0.bias": mlp.fc.bias, "2.weight": mlp.proj.weight,
                        "2.bias": mlp.proj.bias})  # fmt: skip
    x = torch.randn(48, 32)
    _before(mlp, before, x)
    (mlp(x) * TINY).sum().backward()
    (hp(x) * TINY).sum().backward()
    assert sqnr(mlp.fc.weight.grad, hp[0].weight.grad) > BACKWARD_SQNR_DB
    assert sqnr(mlp.proj.weight.grad, hp[2].weight.grad) > BACKWARD_SQNR_DB


def test_empty_first_batch_leaves_the_next_forward_its_own_amax():
    """Forward only (inference of an MoE expert): the first non-empty input is cast with its own amax."""
    layer = FP8Linear(32, 16, bias=False)
    with torch.no_grad():
        assert layer(torch.randn(0, 32)).shape == (0, 16)
        x = torch.randn(20, 32) * 1e-3
        y = layer(x)
    y_ref = fp8_round(x, E4M3) @ fp8_round(layer.weight, E4M3).T
    assert_gemm_close(y, y_ref)
    assert sqnr(y, x @ layer.weight.T) > FORWARD_SQNR_DB


@pytest.mark.parametrize("first", ["zeros", "nan"])
def test_all_zero_first_input_leaves_the_next_delayed_cast_its_own_amax(first):
    """A zero-initialized layer (LoRA-B, adaLN-zero) feeding an FP8 layer at step 0: its all-zero first input, like an
    empty one, carries no amax; the next input, of ~1e-4 (all below E4M3's smallest subnormal at scale 1), is cast with
    its own amax: the output agrees with the float64 FP8 reference, and is not flushed to zero."""
    torch.manual_seed(0)
    layer = FP8Linear(16, 16, bias=False)  # the default recipe: delayed scaling
    with torch.no_grad():
        layer(torch.full((8, 16), 0.0 if first == "zeros" else float("nan")))
    state = layer.fp8_scaling["input"]
    assert not state.initialized and int(state.casts) == 1
    x = torch.randn(8, 16) * 1e-4
    with torch.no_grad():
        y = layer(x)
    assert state.initialized
    y_ref = fp8_round(x, E4M3) @ fp8_round(layer.weight, E4M3).T
    assert_gemm_close(y, y_ref)
    assert sqnr(y, x @ layer.weight.T) > FORWARD_SQNR_DB


def test_state_saved_after_empty_casts_only_loads_without_history():
    """A scaling state saved when its only casts were of empty tensors has no history: loaded, its next cast still
    uses its own amax (as the saved layer's would)."""
    saved = FP8Linear(32, 16, bias=False)
    saved(torch.randn(0, 32, requires_grad=True)).sum().backward()
    fp8 = fp8_state_dict(saved)
    assert int(fp8["fp8_scaling.input.casts"]) == 1
    loaded = FP8Linear(32, 16, bias=False)
    loaded.load_state_dict(saved.state_dict())
    load_fp8_state_dict(loaded, fp8)
    x, dy = torch.randn(20, 32) * 1e-3, torch.randn(20, 16) * TINY
    xg = x.clone().requires_grad_()
    loaded(xg).backward(dy)
    _, dx_ref, dw_ref = first_step_by_definition(x, loaded.weight.detach(), dy)
    assert_gemm_close(loaded.weight.grad, dw_ref)
    assert_gemm_close(xg.grad, dx_ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("eval_first", [False, True])
@pytest.mark.parametrize("module", ["linear", "mlp"])
def test_one_eager_step_then_compile_compiles_once(eval_first, module, device):
    """The benchmarks run one eager training step before torch.compile so that the model compiles once (the first-cast
    flags are dynamo guards): still so when an evaluation under no_grad came first. On a GPU the eager step's amax
    reads are still on their way when the trace starts (the test below emulates that on CPU)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = (FP8Linear(32, 48) if module == "linear" else FP8MLP(32, 64)).to(device)
    if eval_first:
        with torch.no_grad():
            model(torch.randn(8, 32, device=device))
    model(torch.randn(8, 32, device=device)).square().sum().backward()  # the eager step
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(3):
        compiled(torch.randn(24, 32, device=device)).square().sum().backward()
    assert counter.frame_count == 1


class _InFlightRead:
    """Stands in for the CUDA event after a first cast's amax copy to the host (ScalingState.note_cast on a GPU): the
    copy has not arrived until someone waits for it."""

    def __init__(self) -> None:
        self.arrived = False

    def synchronize(self) -> None:
        self.arrived = True

    def query(self) -> bool:
        return self.arrived


@pytest.mark.parametrize("module", ["linear", "mlp"])
def test_compile_after_an_eager_step_whose_amax_reads_are_on_their_way(module):
    """On a GPU the eager step's first-cast amaxes reach the host asynchronously: the first compiled call takes them
    at trace time (one graph, no break, compiled once) instead of tracing the event's query, which broke the graph
    at every layer of a compiled GPT and ran it partly eager. Emulated on CPU by handing each state's read back as
    in flight."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from lightning_fp8 import scaling

    torch._dynamo.reset()
    model = FP8Linear(32, 48) if module == "linear" else FP8MLP(32, 64)
    model(torch.randn(8, 32)).square().sum().backward()  # the eager step
    states = [m for m in model.modules() if isinstance(m, scaling.ScalingState) and m.delayed]
    reads = []
    for state in states:  # as on a GPU: the flags wait for reads on their way
        assert state.initialized
        state.initialized = False
        reads.append(_InFlightRead())
        scaling._SEEN_AMAX[state] = (state.amax_history.amax().clone(), reads[-1])
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(3):
        compiled(torch.randn(24, 32)).square().sum().backward()
    assert counter.frame_count == 1
    assert all(r.arrived for r in reads) and all(s.initialized for s in states)
    assert not any(s in scaling._SEEN_AMAX for s in states)


def test_loaded_flag_drops_a_first_cast_read_from_before_the_load():
    """A checkpoint's flag says what the next cast does: an amax read still on its way from a cast before the load
    (a GPU's asynchronous first-cast read) must not mark the loaded state initialized afterwards."""
    from lightning_fp8 import scaling

    torch.manual_seed(0)
    layer = FP8Linear(32, 16)
    state = layer.fp8_scaling["input"]
    checkpoint = fp8_state_dict(FP8Linear(32, 16))  # a fresh layer's: no role initialized
    read = _InFlightRead()
    scaling._SEEN_AMAX[state] = (torch.tensor(3.0), read)  # a cast of amax 3 before the load, its read on its way
    load_fp8_state_dict(layer, checkpoint)
    read.synchronize()  # it arrives after the load
    assert state.needs_current_scale() and not state.initialized
    assert state not in scaling._SEEN_AMAX


def test_compiled_mlp_with_a_frozen_fc_leaves_fcs_gradient_role_uninitialized_as_eagerly():
    # Only proj trains (fc frozen, the input needs no gradient): fc's output gradient is never cast, yet a traced
    # forward marked fc's grad_output role initialized, so fc's first gradient cast after unfreezing used the delayed
    # scale of an empty history.
    torch.manual_seed(0)
    eager = FP8MLP(32, 64)
    compiled_src = copy.deepcopy(eager)
    compiled = torch.compile(compiled_src, backend="aot_eager", fullgraph=True)
    for module in (eager, compiled_src):
        module.fc.requires_grad_(False)
    x = torch.randn(8, 32)
    for model in (eager, compiled):
        model(x).sum().backward()
    assert not eager.fc.fp8_scaling["grad_output"].initialized
    assert not compiled_src.fc.fp8_scaling["grad_output"].initialized
    assert compiled_src.proj.fp8_scaling["grad_output"].initialized == eager.proj.fp8_scaling["grad_output"].initialized


def test_stacked_layers_compile_with_dynamic_shapes_as_eager():
    # The backward's weight recast of the second of two FP8Linears failed in dynamo with dynamic shapes (a dict lookup
    # of the format maximum in the traced reference cast): "lift_tracked_freevar_to_input should not be called on root".
    torch.manual_seed(0)
    eager = nn.Sequential(FP8Linear(32, 64), FP8Linear(64, 32), FP8MLP(32, 64))
    compiled_src = copy.deepcopy(eager)
    compiled = torch.compile(compiled_src, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (5, 7):
        x = torch.randn(3, rows, 32)
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_eager, y_compiled = eager(x_eager), compiled(x_compiled)
        y_eager.sum().backward()
        y_compiled.sum().backward()
        assert torch.equal(y_eager, y_compiled) and torch.equal(x_eager.grad, x_compiled.grad)
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled_src.named_parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    assert_same(fp8_state_dict(eager), fp8_state_dict(compiled_src))


def _two_layers(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(FP8Linear(32, 32, bias=False), nn.ReLU(), FP8Linear(32, 32, bias=False))
    ref = nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False))
    ref.load_state_dict(model.state_dict())
    return model, ref


def _compare_step(model: nn.Module, run: nn.Module, ref: nn.Module, x: torch.Tensor, micro_batches: int = 1) -> None:
    for module in (model, ref):
        module.zero_grad()
    for module in (run, ref):
        sum(_loss(module(chunk)) for chunk in x.chunk(micro_batches)).backward()
    # The first layer's gradient comes through the second's FP8 dgrad too: two E5M2 roundings (16-18 dB seen; a
    # flushed cast gave 0-8 dB).
    assert sqnr(model[2].weight.grad, ref[2].weight.grad) > BACKWARD_SQNR_DB
    assert sqnr(model[0].weight.grad, ref[0].weight.grad) > 12.0


@pytest.mark.parametrize("after", ["new_weights", "compiled_forward_without_backward", "checkpoint_of_that"])
@pytest.mark.parametrize("compiled", [False, True])
def test_first_backward_after_a_mark_that_no_backward_followed(after, compiled):
    """Roles a traced forward marked with no backward cast since: new weights loaded into a compiled model that trained
    (its steady graphs must not be reused: micro-batches summed into one backward), a compiled forward whose graph was
    dropped followed by eager or compiled steps, and a checkpoint of the FP8 state saved then: every later step is
    FP8-accurate against nn.Linear (they flushed the gradients with the delayed scale of an empty history)."""
    torch._dynamo.reset()
    model, ref = _two_layers()
    if after == "new_weights":
        warm = torch.compile(model, backend="aot_eager")
        for _ in range(3):
            _loss(warm(torch.randn(16, 32))).backward()
        new = {k: torch.randn_like(v) * 0.2 for k, v in model.state_dict().items()}
        model.load_state_dict(new)  # the layers' input and grad_output states start afresh
        ref.load_state_dict(new)
        run = warm if compiled else model
    else:
        torch.compile(model, backend="aot_eager")(torch.randn(16, 32))  # gradients on, the graph dropped
        if after == "checkpoint_of_that":
            saved = fp8_state_dict(model)
            model, ref = _two_layers()
            load_fp8_state_dict(model, saved)
        run = torch.compile(model, backend="aot_eager") if compiled else model
    for _ in range(2):
        _compare_step(model, run, ref, torch.randn(64, 32), micro_batches=4 if after == "new_weights" else 1)


def test_compiled_step_after_an_all_zero_first_gradient():
    """A zero-initialized last layer: the first step's gradient into the first layer is all zero, which initializes
    nothing (eagerly too); the second compiled step casts it with its own amax."""
    torch._dynamo.reset()
    model, ref = _two_layers()
    with torch.no_grad():
        model[2].weight.zero_()
        ref[2].weight.zero_()
    run = torch.compile(model, backend="aot_eager")
    for module in (run, ref):
        _loss(module(torch.randn(16, 32))).backward()
    with torch.no_grad():
        w = torch.randn(32, 32) * 0.1
        model[2].weight.copy_(w)
        ref[2].weight.copy_(w)
    _compare_step(model, run, ref, torch.randn(16, 32))
