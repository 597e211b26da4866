import copy

import numpy as np
import pytest
import torch
from lightning_fp8.kernels.reference import cast_to_fp8_ref, column_sum_ref
from torch import nn

from lightning_fp8 import FP8MLP, FP8Linear, FP8Recipe, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.scaling import compute_scale
from tests.numerics import BACKWARD_E4M3_SQNR_DB, BACKWARD_SQNR_DB, FORWARD_SQNR_DB, sqnr


def _pair(in_f, out_f, bias=True, recipe=None, dtype=torch.float32):
    ref = nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    fp8 = FP8Linear(in_f, out_f, bias=bias, dtype=dtype, recipe=recipe)
    fp8.load_state_dict(ref.state_dict())
    return fp8, ref


def _run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y, x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-current"])
@pytest.mark.parametrize(("tokens", "in_f", "out_f"), [(37, 48, 80), (128, 64, 32), (5, 16, 112)])
def test_sqnr_against_fp32(recipe, tokens, in_f, out_f):
    fp8, ref = _pair(in_f, out_f, recipe=recipe)
    for _ in range(3):  # several steps: delayed scaling uses the history from step 2 on
        x, dy = torch.randn(tokens, in_f), torch.randn(tokens, out_f)
        got, want = _run(fp8, x, dy), _run(ref, x, dy)
        assert sqnr(got[0], want[0]) > FORWARD_SQNR_DB
        assert sqnr(got[1], want[1]) > BACKWARD_SQNR_DB
        assert sqnr(got[2], want[2]) > BACKWARD_SQNR_DB
        torch.testing.assert_close(got[3], want[3])  # bias grad is a plain sum in high precision
        fp8.zero_grad()
        ref.zero_grad()


def test_e4m3_gradients_are_more_precise_than_e5m2():
    x, dy = torch.randn(64, 32), torch.randn(64, 48)
    results = {}
    for name in ("fp8-lm", "fp8-lm-e4m3"):
        fp8, ref = _pair(32, 48, recipe=name)
        results[name] = sqnr(_run(fp8, x, dy)[1], _run(ref, x, dy)[1])
    assert results["fp8-lm-e4m3"] > BACKWARD_E4M3_SQNR_DB
    assert results["fp8-lm-e4m3"] > results["fp8-lm"] + 3


def test_forward_equals_dequantized_product():
    # Independent of the GEMM path: the output is exactly (x_fp8 * s_x^-1) @ (w_fp8 * s_w^-1)^T in fp32.
    fp8 = FP8Linear(32, 48, bias=False, recipe="fp8-lm-current")
    x = torch.randn(19, 32)
    sx = compute_scale(x.abs().amax(), torch.float8_e4m3fn)
    sw = compute_scale(fp8.weight.abs().amax(), torch.float8_e4m3fn)
    xq = cast_to_fp8_ref(x, sx, torch.float8_e4m3fn)[0].double() / sx.double()
    wq = cast_to_fp8_ref(fp8.weight, sw, torch.float8_e4m3fn)[0].double() / sw.double()
    torch.testing.assert_close(fp8(x).double(), xq @ wq.t(), rtol=1e-5, atol=1e-5)


def test_nd_inputs_and_no_bias():
    fp8, ref = _pair(48, 32, bias=False)
    x, dy = torch.randn(3, 5, 7, 48), torch.randn(3, 5, 7, 32)
    got, want = _run(fp8, x, dy), _run(ref, x, dy)
    assert got[0].shape == (3, 5, 7, 32) and got[1].shape == x.shape
    assert sqnr(got[0], want[0]) > FORWARD_SQNR_DB and sqnr(got[1], want[1]) > BACKWARD_SQNR_DB


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_activations(act_dtype):
    fp8, ref = _pair(64, 48)
    x, dy = torch.randn(33, 64), torch.randn(33, 48)
    got = _run(fp8, x.to(act_dtype), dy.to(act_dtype))
    want = _run(ref, x, dy)
    assert got[0].dtype == act_dtype and got[1].dtype == act_dtype
    assert fp8.weight.grad.dtype == torch.float32
    assert sqnr(got[0], want[0]) > FORWARD_SQNR_DB - 1  # plus one bf16/fp16 rounding of the output
    assert sqnr(got[1], want[1]) > BACKWARD_SQNR_DB


def test_autocast_output_dtype_and_fp32_weight_grad():
    fp8, ref = _pair(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
        y_ref = ref(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32
    assert sqnr(y, y_ref) > FORWARD_SQNR_DB - 3


@pytest.mark.parametrize("save_weight_transpose", [False, True])
def test_saves_fp8_copies_not_the_input(monkeypatch, save_weight_transpose):
    # Besides the parameters, the backward keeps only FP8 copies: the input's transpose, and the weight's only with
    # SAVE_WEIGHT_TRANSPOSE (otherwise the backward casts the weight again).
    from lightning_fp8 import matmul

    monkeypatch.setattr(matmul, "SAVE_WEIGHT_TRANSPOSE", save_weight_transpose)
    fp8 = FP8Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8(x)
    params = {p.data_ptr() for p in fp8.parameters()}
    activations = [t for t in saved if t.dim() == 2 and t.data_ptr() not in params]
    assert not any(t.data_ptr() == x.data_ptr() for t in saved)
    assert {t.dtype for t in activations} == {torch.float8_e4m3fn}
    shapes = sorted(tuple(t.shape) for t in activations)
    assert shapes == ([(64, 16), (64, 32)] if save_weight_transpose else [(64, 16)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("master_scaled", [False, True])
def test_recast_weight_in_backward_gives_the_saved_transpose_bit_for_bit(monkeypatch, master_scaled, device):
    """The backward's recast of the weight (the default) and the forward's saved transposed copy give identical
    gradients, including at O2 where the weight's storage holds the fp16 master times its power-of-two scale."""
    from lightning_fp8 import FP8AdamW, matmul
    from lightning_fp8.optim import master

    layer_dtype = master_scale = None

    def grads(save: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(matmul, "SAVE_WEIGHT_TRANSPOSE", save)
        torch.manual_seed(0)
        layer = FP8Linear(48, 80, device=device)
        if master_scaled:  # O2: FP8AdamW adopts the weight (fp16 master, scaled) and steps once
            opt = FP8AdamW(layer.parameters(), lr=1e-2, opt_level="O2", fp8_grads=False)
            layer(torch.randn(24, 48, device=device)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        x = (torch.randn(3, 37, 48, device=device) * 3).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = layer(x)
        y.float().backward(torch.randn(y.shape, device=device))
        nonlocal layer_dtype, master_scale
        layer_dtype = layer.weight.dtype
        master_scale = getattr(layer.weight, master.SCALE_ATTR, None)
        return [x.grad, layer.weight.grad, layer.bias.grad]

    recast, saved = grads(False), grads(True)
    assert layer_dtype == (torch.float16 if master_scaled else torch.float32)
    assert (master_scale is not None and master_scale.item() != 1.0) == master_scaled
    for a, b in zip(recast, saved, strict=True):
        assert torch.equal(a, b)


def test_no_input_grad_skips_dgrad_and_frozen_weight_skips_wgrad():
    fp8 = FP8Linear(32, 16)
    fp8(torch.randn(4, 32)).sum().backward()
    assert fp8.weight.grad is not None
    fp8.weight.requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    fp8(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("frozen_weight", [False, True])
def test_bias_grad_comes_from_the_grad_cast(monkeypatch, frozen_weight):
    # With FUSED_BIAS_GRAD the backward takes the bias gradient from the grad_output cast (in column_sum_ref's order),
    # with or without the transposed copy of dy (a frozen weight needs no wgrad); it is the fp32 column sum of dy.
    from lightning_fp8 import matmul

    monkeypatch.setattr(matmul, "FUSED_BIAS_GRAD", True)
    fp8 = FP8Linear(48, 32)
    fp8.weight.requires_grad_(not frozen_weight)
    x, dy = torch.randn(150, 48), torch.randn(150, 32)
    fp8(x).backward(dy)
    assert torch.equal(fp8.bias.grad, column_sum_ref(dy))
    torch.testing.assert_close(fp8.bias.grad, dy.double().sum(0).float())
    assert (fp8.weight.grad is None) == frozen_weight


def test_state_dict_keys_match_nn_linear_and_fp8_state_round_trips(tmp_path):
    fp8 = FP8Linear(32, 48)
    assert fp8.state_dict().keys() == nn.Linear(32, 48).state_dict().keys()
    for _ in range(3):
        fp8(torch.randn(10, 32)).sum().backward()
    path = tmp_path / "fp8.pt"
    torch.save({"model": fp8.state_dict(), "fp8": fp8_state_dict(fp8)}, path)
    ckpt = torch.load(path, weights_only=True)
    clone = FP8Linear(32, 48)
    clone.load_state_dict(ckpt["model"])
    load_fp8_state_dict(clone, ckpt["fp8"])
    x = torch.randn(7, 32)
    assert torch.equal(clone(x), fp8(x))
    assert clone.fp8_scaling["input"].initialized


def test_load_fp8_state_rejects_other_model():
    fp8 = FP8Linear(32, 48)
    with pytest.raises(KeyError, match="missing"):
        load_fp8_state_dict(fp8, {})
    other = FP8Linear(32, 48, recipe=FP8Recipe(amax_history_len=4))
    with pytest.raises(ValueError, match="amax_history_len"):
        load_fp8_state_dict(fp8, fp8_state_dict(other))


@pytest.mark.parametrize("fused_bias_grad", [False, True])
def test_torch_compile_matches_eager(monkeypatch, fused_bias_grad):
    from lightning_fp8 import matmul

    monkeypatch.setattr(matmul, "FUSED_BIAS_GRAD", fused_bias_grad)
    eager = FP8Linear(32, 48)
    compiled_src = FP8Linear(32, 48)
    compiled_src.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_src, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(24, 32)
        y1, y2 = eager(x), compiled(x)
        y1.square().sum().backward()
        y2.square().sum().backward()
        assert torch.equal(y1, y2)
        assert torch.equal(eager.weight.grad, compiled_src.weight.grad)
        assert torch.equal(eager.bias.grad, compiled_src.bias.grad)  # the fused column sum, through the custom op
        eager.zero_grad()
        compiled_src.zero_grad()
    assert torch.equal(eager.fp8_scaling["grad_output"].scale, compiled_src.fp8_scaling["grad_output"].scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inductor_compiled_bias_is_rounded_to_the_output_dtype_as_eagerly(dtype):
    """CPU (the emulated GEMM): with a bf16/fp16 output (autocast, or such an input into an fp32 layer) the fp32 bias is
    rounded to the output dtype before it is added (ops.scaled_mm). Inductor drops a round trip fp32 -> bf16 -> fp32;
    the compiled layer must still add the rounded bias: its output equals eager's bit for bit."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = FP8Linear(16, 32, recipe="fp8-lm-current")
    with torch.no_grad():
        eager.bias.add_(torch.randn(32) * 1e-3 + 1.0)  # not representable in bf16/fp16: rounding it shows
    compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
    x = torch.randn(8, 16)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=dtype):
            pairs = [(eager(x), compiled(x))]
        pairs.append((eager(x.to(dtype)), compiled(x.to(dtype))))
    for mode, (want, got) in zip(("autocast", "low-precision input"), pairs, strict=True):
        assert want.dtype == got.dtype == dtype, mode
        assert torch.equal(want, got), f"{mode}: {int((want != got).sum())} of {want.numel()} differ"


class _SharedResidual(nn.Module):
    # A layer used twice (its two gradients summed) and a residual add: ops that consume the layers' bf16/fp16 results.
    # (Every sum here has two terms: inductor adds three in fp32 and rounds once, as it does for any bf16 model.)
    def __init__(self, dtype):
        super().__init__()
        self.lin = FP8Linear(32, 32, dtype=dtype)
        self.mlp = FP8MLP(32, 64, dtype=dtype)

    def forward(self, x):
        return self.mlp(x + self.lin(torch.relu(self.lin(x))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inductor_compiled_results_consumed_in_the_graph_are_rounded_as_eagerly(dtype):
    """CPU (the emulated GEMM): the layers' bf16/fp16 outputs and gradients are fp32 results converted to that dtype.
    Inductor fused the conversion into what consumes them (a residual add, the sum of a shared layer's two gradients)
    and dropped its rounding: a quarter of the elements differed from eager. ops.narrowed rounds through the bits."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _SharedResidual(dtype)
    eager(torch.randn(8, 32, dtype=dtype)).float().square().sum().backward()  # the eager step before compiling
    eager.zero_grad()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    for magnitude in (1.0, 2.0**6, 1.0):
        x = (torch.randn(24, 32) * magnitude).to(dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), compiled(xb)
        assert torch.equal(ya, yb), f"{int((ya != yb).sum())} of {ya.numel()} outputs differ"
        ya.float().square().sum().backward()
        yb.float().square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name
        eager.zero_grad()
        model.zero_grad()


class _ReluMLP(nn.Module):
    # Two FP8 linear layers without bias (every activation and gradient cast is fused under torch.compile) around an
    # exact activation (ReLU: inductor's and eager's agree bit for bit).
    def __init__(self, device=None):
        super().__init__()
        self.fc1 = FP8Linear(32, 64, bias=False, device=device)
        self.fc2 = FP8Linear(64, 48, bias=False, device=device)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _compiled_matches_eager(eager, compiled_src, compiled, device, steps=4, autocast=None):
    """Steps of magnitudes 0.1 .. 10 (every delayed scale moves): outputs, gradients and every scaling buffer of the
    compiled module equal eager's bit for bit. ``autocast`` (default: on a GPU): fp32 inputs under bf16 autocast; on
    CPU the input gradient is then compared within bf16 rounding: the emulated dgrad GEMM computes in fp32, and fused
    with autograd's widening of the gradient to the input's fp32, inductor drops the bf16 round trip that eager makes
    (on a GPU the FP8 GEMM writes bf16). Returns the generated code of the first compiled step."""
    from torch._inductor.utils import run_and_get_code

    autocast = device == "cuda" if autocast is None else autocast

    def step(model, x):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
        y.float().square().sum().backward()
        return y

    code = None
    for i in range(steps):
        x = torch.randn(80, 32, device=device) * 10.0 ** (i % 3 - 1)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1 = step(eager, x1)
        if i == 0:
            y2, code = run_and_get_code(step, compiled, x2)
        else:
            y2 = step(compiled, x2)
        assert torch.equal(y1, y2), i
        if autocast and device == "cpu":
            torch.testing.assert_close(x2.grad, x1.grad, rtol=2**-8, atol=0)
        else:
            assert torch.equal(x1.grad, x2.grad), i
        for (name, p), q in zip(eager.named_parameters(), compiled_src.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (i, name)
        for name, buf in eager.named_buffers():
            assert torch.equal(buf, compiled_src.get_buffer(name)), (i, name)
        eager.zero_grad()
        compiled_src.zero_grad()
    return code


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_casts_under_inductor_match_eager(monkeypatch, autocast):
    """scaling.FUSED_CASTS: under inductor the delayed casts are tensor ops fused into the kernels around them, the
    scale they use an op the backward keeps (the partitioner recomputes casts from what it saves). Bit for bit eager's
    results while every scale moves; the input and gradient casts are not the opaque cast op (the weights' are).
    Under bf16 autocast the second layer's input is the first one's bf16 output, rounded to bf16 inside the fused
    kernel, where inductor would keep it in fp32 but for ops.widen_bf16."""
    from lightning_fp8 import scaling

    monkeypatch.setattr(scaling, "FUSED_CASTS", True)
    torch._dynamo.reset()
    eager = _ReluMLP()
    compiled_src = _ReluMLP()
    compiled_src.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_src, fullgraph=True)
    code = _compiled_matches_eager(eager, compiled_src, compiled, "cpu", autocast=autocast)
    forward, backward = code[0], "\n".join(code[1:])
    assert forward.count("lightning_fp8.quantize.default(") == 2  # the two weights
    assert "lightning_fp8.used_scale_ref.default(" in forward
    assert "lightning_fp8.quantize.default(" not in backward and "lightning_fp8.used_scale_ref.default(" in backward


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_cast_of_a_half_tensor_made_in_the_graph_reads_it_rounded(monkeypatch, dtype):
    """FUSED_CASTS: a delayed cast of an fp16 tensor produced in the same compiled graph read inductor's unrounded
    fp32 value (only bf16 went through its bits): some bytes differed from the eager cast of the same tensor."""
    from lightning_fp8 import ScalingState, scaling

    monkeypatch.setattr(scaling, "FUSED_CASTS", True)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(32, 48, generator=gen) * k).to(dtype) for k in (3, 5))

    def produce_and_cast(state, a, b):
        x = a * b + a
        return x, state.quantize(x)

    compiled = torch.compile(produce_and_cast)
    compiled_state, eager_state = (ScalingState(torch.float8_e4m3fn, 4, 0, "max", True) for _ in range(2))
    for step in range(3):
        x, (got, _, got_scale_inv) = compiled(compiled_state, a * (step + 1), b)
        want, _, want_scale_inv = eager_state.quantize(x)  # the tensor the graph returned, cast eagerly
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), step
        assert torch.equal(got_scale_inv, want_scale_inv), step


def test_compiled_input_recast_matches_eager(monkeypatch):
    """matmul.SAVE_INPUT_TRANSPOSE_COMPILED off: compiled, the backward casts each layer's input again with the
    forward's scale instead of keeping the forward's transposed FP8 copy; bit for bit eager's results while every
    scale moves (benchmarks/train_step.py variant o2ri measures what it saves)."""
    from lightning_fp8 import matmul

    monkeypatch.setattr(matmul, "SAVE_INPUT_TRANSPOSE_COMPILED", False)
    torch._dynamo.reset()
    eager = _ReluMLP()
    compiled_src = _ReluMLP()
    compiled_src.load_state_dict(eager.state_dict())
    _compiled_matches_eager(eager, compiled_src, torch.compile(compiled_src, fullgraph=True), "cpu")


@pytest.mark.gpu
def test_gpu_compiled_input_recast_matches_eager(monkeypatch):
    """test_compiled_input_recast_matches_eager with inductor's Triton and the cast kernels (the recast a triton_op)."""
    from lightning_fp8 import matmul

    monkeypatch.setattr(matmul, "SAVE_INPUT_TRANSPOSE_COMPILED", False)
    torch._dynamo.reset()
    eager = _ReluMLP("cuda")
    compiled_src = _ReluMLP("cuda")
    compiled_src.load_state_dict(eager.state_dict())
    _compiled_matches_eager(eager, compiled_src, torch.compile(compiled_src, fullgraph=True), "cuda")


@pytest.mark.gpu
def test_gpu_fused_casts_match_eager(monkeypatch):
    """scaling.FUSED_CASTS on a GPU (inductor's Triton): bit for bit eager's FP8 linear layers (Triton casts) while
    every scale moves, scaling states included (their update in the backward too, on torch 2.11 as well); the
    bookkeeping is kernels/record.py's launch in the forward and in the backward."""
    from lightning_fp8 import scaling

    monkeypatch.setattr(scaling, "FUSED_CASTS", True)
    torch._dynamo.reset()
    eager = _ReluMLP("cuda")
    compiled_src = _ReluMLP("cuda")
    compiled_src.load_state_dict(eager.state_dict())
    code = _compiled_matches_eager(eager, compiled_src, torch.compile(compiled_src, fullgraph=True), "cuda")
    forward, backward = code[0], "\n".join(code[1:])
    assert "_record_kernel" in forward and "_record_kernel" in backward
    assert "lightning_fp8.quantize" not in forward + backward


@pytest.mark.gpu
@pytest.mark.parametrize(("trace_triton_casts", "speculate"), [(True, "eager"), (False, "eager"), (True, True)])
def test_gpu_inductor_matches_eager_and_launches_the_casts_itself(monkeypatch, trace_triton_casts, speculate):
    """Inductor on a GPU: the compiled layer matches eager bit for bit (bias gradient: fp32 summation order) over
    steps, scaling states included; with TRACE_TRITON_CASTS the generated code launches the cast kernels itself and
    calls no opaque ``lightning_fp8::quantize`` op; the backward casts the weight again (SAVE_WEIGHT_TRANSPOSE off).
    With speculative current scaling in the traced casts too, the weight moves by a binade or more between steps, so
    that some of its one-pass casts guess the scale wrong and cast again."""
    from lightning_fp8.kernels import quantize
    from torch._inductor.utils import run_and_get_code

    from lightning_fp8 import scaling

    monkeypatch.setattr(quantize, "SPECULATIVE_CURRENT_SCALING", speculate)
    monkeypatch.setattr(scaling, "TRACE_TRITON_CASTS", trace_triton_casts)
    monkeypatch.setattr(scaling, "FUSED_CASTS", False)  # every cast one op (test_gpu_fused_casts_match_eager: True)
    torch._dynamo.reset()
    eager = FP8Linear(64, 96, device="cuda")
    compiled_src = FP8Linear(64, 96, device="cuda")
    compiled_src.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_src, fullgraph=True)

    def step(model, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().sum().backward()
        return y

    for i in range(4 if speculate is True else 3):
        if speculate is True and i:
            with torch.no_grad():  # the weight's scale moves: x8, x1/8 ... of the last cast's
                for layer in (eager, compiled_src):
                    layer.weight.mul_(8.0 if i % 2 else 0.125)
        x = torch.randn(80, 64, device="cuda") * 10.0**i
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1 = step(eager, x1)
        if i == 0:
            y2, code = run_and_get_code(step, compiled, x2)
            forward, backward = code[0], "\n".join(code[1:])
            assert ("lightning_fp8.quantize.default" in forward) != trace_triton_casts
            # With opaque casts the forward launches no Triton cast itself: in particular the weight's transposed copy
            # is not made there (the partitioner keeps the recast in the backward, saving the free parameter instead).
            assert ("_cast_transpose_kernel" in forward) == trace_triton_casts
            assert "_cast_transpose_kernel" in backward  # the weight's recast (a triton_op either way)
        else:
            y2 = step(compiled, x2)
        assert torch.equal(y1, y2)
        assert torch.equal(x1.grad, x2.grad)
        assert torch.equal(eager.weight.grad, compiled_src.weight.grad)
        torch.testing.assert_close(eager.bias.grad, compiled_src.bias.grad, rtol=1e-5, atol=1e-5)
        for role in ("input", "weight", "grad_output"):
            for name, buf in eager.fp8_scaling[role].named_buffers():
                assert torch.equal(buf, compiled_src.fp8_scaling[role].get_buffer(name)), (i, role, name)
        eager.zero_grad()
        compiled_src.zero_grad()


@pytest.mark.parametrize(
    ("x", "exc", "match"),
    [
        (torch.randint(0, 5, (4, 32)), TypeError, "dtype torch.int64.*cast the input"),
        (torch.randn(4, 32, dtype=torch.complex64), TypeError, "complex64"),
        (torch.randn(4, 32, dtype=torch.float64), TypeError, "float64"),
        (torch.randn(4, 31), ValueError, r"shape \(4, 31\).*last dimension must be 32"),
        (torch.tensor(1.0), ValueError, "shape"),
        (torch.randn(4, 32).to_sparse(), TypeError, "takes dense tensors, got a torch.sparse_coo tensor"),
        (torch.nested.nested_tensor([torch.randn(2, 32), torch.randn(3, 32)], layout=torch.jagged), TypeError,
         "takes dense tensors, got a nested tensor"),
    ],
)  # fmt: skip
def test_bad_inputs_have_clear_errors(x, exc, match):
    layer = FP8Linear(32, 16)
    before = {name: buf.clone() for name, buf in layer.fp8_scaling.named_buffers()}
    with pytest.raises(exc, match=match):
        layer(x)
    assert all(torch.equal(buf, before[name]) for name, buf in layer.fp8_scaling.named_buffers())


def test_feature_sizes_must_be_multiples_of_16():
    with pytest.raises(ValueError, match="in_features=20.*multiples of 16"):
        FP8Linear(20, 16)
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8Linear.from_linear(nn.Linear(16, 10))
    for size in ("16", 16.0, True):  # "16" % 16 was string formatting: "not all arguments converted"
        with pytest.raises(TypeError, match=r"in_features=.*must be an int"):
            FP8Linear(size, 16)
    assert FP8Linear(np.int64(16), 32).in_features == 16  # a NumPy integer is an int
    # Found by a sweep: -16 is a multiple of 16, and torch's "negative dimension" RuntimeError came from the weight.
    with pytest.raises(ValueError, match=r"FP8Linear\(out_features=-16\): a feature size must be >= 0"):
        FP8Linear(16, -16)
    # Found by a sweep: bias was taken for its truth value, so bias="False" (a config read as text) made a bias.
    for bias in ("False", None, 0):
        with pytest.raises(TypeError, match=r"FP8Linear\(bias=.*\): must be True or False"):
            FP8Linear(16, 16, bias=bias)
    # Found by a sweep: dtype="float32" was told "FP8 layers keep float32 ...; keep a float32 layer as nn.Linear".
    with pytest.raises(TypeError, match=r"FP8Linear\(dtype='float32'\): must be a torch.dtype .* got str"):
        FP8Linear(16, 16, dtype="float32")


def test_nonfinite_input_propagates_not_saturates():
    fp8 = FP8Linear(16, 16, recipe="fp8-lm-current")
    x = torch.randn(4, 16)
    x[1, 2] = float("inf")
    y = fp8(x)
    assert not torch.isfinite(y[1]).any() and torch.isfinite(y[[0, 2, 3]]).all()
    assert fp8.fp8_scaling["input"].nonfinite_count.item() == 1


def test_double_backward_raises_instead_of_dropping_the_second_order_term():
    """A gradient penalty differentiates the layer's backward, whose FP8 casts are not differentiable: it raises (it
    silently dropped the penalty's term through the layer). nn.Linear, the reference, computes it."""
    fp8 = FP8Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    y = fp8(x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    assert g.requires_grad  # as nn.Linear's: the penalty below depends on the weight through it
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (y.sum() + g.pow(2).sum()).backward()


def test_double_backward_raises_when_the_output_gradient_is_constant_too():
    """A loss linear in the layer's output gives its backward a constant output gradient, but dx still depends on
    the weight: nn.Linear's penalty reaches the weight through it; FP8Linear raised nothing and silently dropped that
    term (torch's once_differentiable only looked at the incoming gradient). A backward with create_graph=True whose
    result is never differentiated again gives the plain backward's gradients."""
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    (g,) = torch.autograd.grad(ref(x).sum(), x, create_graph=True)
    (10 * g.pow(2).sum()).backward()
    assert ref.weight.grad.abs().sum() > 0  # the reference's second-order term is there
    fp8 = FP8Linear(32, 16)
    (g_plain,) = torch.autograd.grad(fp8(x).sum(), x)
    (g,) = torch.autograd.grad(fp8(x).sum(), x, create_graph=True)
    assert torch.equal(g.detach(), g_plain)
    with pytest.raises(RuntimeError, match="differentiate twice an FP8 layer's backward"):
        (10 * g.pow(2).sum()).backward()


@pytest.mark.parametrize("how", ["is_grads_batched", "jacobian"])
def test_batched_backward_raises_a_clear_error_and_records_nothing(how):
    """torch's vmap of a backward (no torch.func transform in the forward) reached the casts and failed in a batching
    rule; it is refused by name, and the grad_output state is unchanged."""
    fp8 = FP8Linear(32, 16)
    x = torch.randn(4, 32, requires_grad=True)
    y = fp8(x)
    grad_state = fp8.fp8_scaling["grad_output"]
    before = {k: v.clone() for k, v in grad_state.named_buffers()}
    with pytest.raises(RuntimeError, match="does not support batched gradients"):
        if how == "is_grads_batched":
            torch.autograd.grad(y, x, torch.randn(3, 4, 16), is_grads_batched=True)
        else:  # its own forward records the input's statistics, as any forward
            torch.autograd.functional.jacobian(fp8, x[:1].detach(), vectorize=True)
    assert all(torch.equal(before[k], v) for k, v in grad_state.named_buffers())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", [(1, 32), (1, 1, 32), (32,), (0, 32)], ids=["one_row", "one_row_3d", "1d", "empty"])
def test_torch_compile_single_token_and_empty_inputs(shape, device):
    """One row (generation, a batch of one) or none (an MoE expert without tokens): the cast's transposed copy of one
    row is a copy, not a view (a custom op's outputs must not alias); bit for bit eager's results over two steps. On a
    GPU with inductor (the traced Triton casts; an empty cast is the opaque op with the reference)."""
    torch._dynamo.reset()
    eager = FP8Linear(32, 48, device=device)
    compiled_src = copy.deepcopy(eager)
    compiled = torch.compile(compiled_src, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for step in range(2):
        x = torch.randn(shape, device=device) * 10.0**step
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = eager(x1), compiled(x2)
        y1.square().sum().backward()
        y2.square().sum().backward()
        assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
        for p, q in zip(eager.parameters(), compiled_src.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    with torch.no_grad():
        x = torch.ones(shape, device=device)
        assert torch.equal(compiled(x), eager(x))


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev"])
def test_torch_func_transforms_raise_a_clear_error(transform):
    """torch.func transforms cannot run the FP8 layer (autograd.Functions updating scaling state in place): a
    RuntimeError that names the layer and what to do, instead of PyTorch's message about setup_context. Without a
    transform, torch.func.functional_call works as for any module."""
    layer = FP8Linear(16, 16)
    params = {k: v.detach().clone() for k, v in layer.named_parameters()}
    x = torch.randn(2, 16)
    run = {
        "grad": lambda: torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x,)).sum())(params),
        "vmap": lambda: torch.vmap(layer)(torch.randn(3, 2, 16)),
        "jacrev": lambda: torch.func.jacrev(layer)(x),
    }[transform]
    with pytest.raises(RuntimeError, match=r"FP8Linear does not support torch\.func transforms.*module_filter_fn"):
        run()
    y = torch.func.functional_call(layer, params, (x,))
    assert torch.equal(y, layer(x))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # nn.Linear's init of the empty weight
@pytest.mark.parametrize("shape", [(2, 3, 0), (0,), (6, 0)], ids=["3d", "1d", "2d"])
def test_zero_in_features_computes_the_bias_as_nn_linear(shape):
    """in_features=0 passes the multiple-of-16 check, and convert_to_fp8 converts such a layer: inputs that are not
    2-D failed in reshape(-1, 0), which cannot infer the token count. nn.Linear gives the bias (an empty sum is 0)."""
    fp8, ref = _pair(0, 32)
    with torch.no_grad():
        fp8.bias.normal_()  # nn.Linear's init makes it 0 without inputs (fan_in 0)
        ref.bias.copy_(fp8.bias)
    dy = torch.randn(*shape[:-1], 32)
    got, want = _run(fp8, torch.randn(shape), dy), _run(ref, torch.randn(shape), dy)
    assert got[0].shape == want[0].shape == (*shape[:-1], 32) and torch.equal(got[0], want[0])
    assert got[1].shape == shape and got[2].shape == (32, 0)
    torch.testing.assert_close(got[3], want[3])  # the bias gradient: dy summed over the tokens


@pytest.mark.parametrize("module", ["linear", "mlp", "mlp_fp8_hidden"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_forward_casts_nothing_for_a_backward(monkeypatch, module, mode):
    """Under no_grad or inference_mode no backward runs: the forward writes no transposed FP8 copy of its inputs (the
    wgrad operand), where it wrote one whenever the weight required a gradient. Its output and the statistics it
    records are bit for bit those of the same forward with gradients enabled."""
    from lightning_fp8.scaling import ScalingState

    torch.manual_seed(0)
    layer = FP8Linear(32, 48) if module == "linear" else FP8MLP(32, 64, fp8_hidden=module == "mlp_fp8_hidden")
    ref = copy.deepcopy(layer)
    transposed = []
    quantize = ScalingState.quantize

    def spy(self, x, transpose=False, *args, **kwargs):
        out = quantize(self, x, transpose, *args, **kwargs)
        transposed.append(out[1].numel() > 0)
        return out

    monkeypatch.setattr(ScalingState, "quantize", spy)
    for step in range(3):  # the first casts use their own amax, the later ones the delayed scales
        x = torch.randn(8, 32) * 4.0**step
        with mode():
            y = layer(x)
        assert transposed and not any(transposed), step
        transposed.clear()
        assert torch.equal(y, ref(x)) and any(transposed)  # with gradients enabled: the copy is made
        transposed.clear()
    for (name, buf), ref_buf in zip(layer.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(buf, ref_buf), name
