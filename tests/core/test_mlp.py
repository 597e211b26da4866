"""FP8MLP (lightning_fp8/mlp.py): the GELU fused into the FP8 casts around it, against the same FP8Linear layers called
one after another with torch's GELU between them (``proj(F.gelu(fc(x)))``: separate casts, autograd's GELU backward),
and against a high-precision MLP."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8MLP, FP8Linear, FP8Recipe, ScalingState
from tests.core.test_linear_wrapping import LoRALinear
from tests.numerics import BACKWARD_SQNR_DB, FORWARD_SQNR_DB, sqnr

# fp32 activations: both paths cast the same fp32 GELU values (torch's and the casts' erf agree to an ulp or so, which
# at most moves a value to its neighbouring FP8 code now and then): the results agree far beyond FP8's ~30 dB.
SAME_CASTS_SQNR_DB = 60.0


def unfused(mlp: FP8MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.proj(F.gelu(mlp.fc(x)))


def run(fn, mlp, x, steps=3):
    """``steps`` forward/backward passes (scaling histories move between them); the last output and the gradients."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    for _ in range(steps):
        for p in mlp.parameters():
            p.grad = None
        if x.grad is not None:
            x.grad = None
        y = fn(mlp, x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y, x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def states(mlp):
    return {(layer, role): s for layer in ("fc", "proj") for role, s in getattr(mlp, layer).fp8_scaling.items()}


def assert_like_unfused(mlp, ref, result, result_ref, casts=3):
    """``result`` (output, input gradient, parameter gradients) of ``mlp`` against ``result_ref`` of its unfused copy
    ``ref`` (the same casts: SAME_CASTS_SQNR_DB), and each scaling state's cast count and scale against the copy's;
    the pairs of states ``(state, the copy's)`` for more checks."""
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = result, result_ref
    assert sqnr(y, y_ref) > SAME_CASTS_SQNR_DB
    assert sqnr(dx, dx_ref) > SAME_CASTS_SQNR_DB
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert sqnr(g, grads_ref[name]) > SAME_CASTS_SQNR_DB, name
    ref_states, pairs = states(ref), []
    for key, s in states(mlp).items():
        r = ref_states[key]
        assert int(s.casts) == int(r.casts) == casts, key
        assert torch.equal(s.scale, r.scale), key
        pairs.append((s, r))
    return pairs


@pytest.mark.parametrize("recipe", ["fp8-lm", "current"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_equals_unfused_layers(recipe, bias):
    mlp = FP8MLP(32, 128, bias=bias, recipe=FP8Recipe(scaling="current") if recipe == "current" else None)
    ref = copy.deepcopy(mlp)
    x = torch.randn(3, 20, 32, requires_grad=True) * 2
    result = run(lambda m, v: m(v), mlp, x)
    assert result[0].shape == (3, 20, 32) and result[0].dtype == torch.float32
    # The scaling states saw the same tensors: proj's input is the GELU's output, fc's output gradient the GELU's
    # input gradient.
    for s, r in assert_like_unfused(mlp, ref, result, run(unfused, ref, x)):
        torch.testing.assert_close(s.amax_history, r.amax_history, rtol=1e-5, atol=0)


def test_autocast_bf16_against_high_precision():
    """Under bf16 autocast the unfused GELU rounds its output to bf16 before the FP8 cast; the fused one casts the fp32
    GELU. Both are FP8-accurate against an fp32 MLP, and the fused one no worse."""
    mlp = FP8MLP(64, 256)
    ref = copy.deepcopy(mlp)
    hp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    hp.load_state_dict({"0.weight": mlp.fc.weight, "0.bias": mlp.fc.bias, "2.weight": mlp.proj.weight,
                        "2.bias": mlp.proj.bias})  # fmt: skip
    x = torch.randn(4, 16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, grads = run(lambda m, v: m(v), mlp, x, steps=1)
        y_unfused, dx_unfused, _ = run(unfused, ref, x, steps=1)
    y_hp, dx_hp, _ = run(lambda m, v: m(v), hp, x, steps=1)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert sqnr(y, y_hp) > FORWARD_SQNR_DB - 2  # and a bf16 output rounding
    assert sqnr(dx, dx_hp) > BACKWARD_SQNR_DB
    assert sqnr(y, y_hp) >= sqnr(y_unfused, y_hp) - 1.0
    assert sqnr(dx, dx_hp) >= sqnr(dx_unfused, dx_hp) - 1.0
    assert all(g.dtype == torch.float32 for g in grads.values())


@pytest.mark.parametrize("frozen", ["fc", "proj", "input"])
def test_partial_gradients(frozen):
    """Frozen layers get no gradient and cost no wgrad; the other gradients are the unfused layers'."""
    mlp = FP8MLP(32, 64, out_features=48)
    ref = copy.deepcopy(mlp)
    for m in (mlp, ref):
        if frozen != "input":
            getattr(m, frozen).requires_grad_(False)
    x = torch.randn(40, 32, requires_grad=frozen != "input")
    y, dx, grads = run(lambda m, v: m(v), mlp, x)
    y_ref, dx_ref, grads_ref = run(unfused, ref, x)
    assert y.shape == (40, 48)
    assert sqnr(y, y_ref) > SAME_CASTS_SQNR_DB
    assert (dx is None) == (frozen == "input") and (dx is None or sqnr(dx, dx_ref) > SAME_CASTS_SQNR_DB)
    for name, g in grads.items():
        assert (g is None) == (grads_ref[name] is None) == name.startswith(frozen), name
        assert g is None or sqnr(g, grads_ref[name]) > SAME_CASTS_SQNR_DB, name


def test_everything_frozen_is_a_forward():
    mlp = FP8MLP(32, 64).requires_grad_(False)
    ref = copy.deepcopy(mlp)
    x = torch.randn(8, 32)
    with torch.no_grad():
        y, y_ref = mlp(x), unfused(ref, x)
    assert y.shape == (8, 32) and not y.requires_grad
    assert sqnr(y, y_ref) > SAME_CASTS_SQNR_DB


def test_from_modules_shares_parameters_and_keys():
    fc, proj = nn.Linear(32, 128), nn.Linear(128, 32)
    mlp = FP8MLP.from_modules(fc, proj, recipe="fp8-lm-current")
    assert mlp.fc.weight is fc.weight and mlp.proj.bias is proj.bias
    assert mlp.fc.recipe.scaling == "current"
    assert list(mlp.state_dict()) == ["fc.weight", "fc.bias", "proj.weight", "proj.bias"]
    fp8_fc = FP8Linear(32, 128)
    assert FP8MLP.from_modules(fp8_fc, proj).fc is fp8_fc  # an FP8Linear is taken as it is
    with pytest.raises(ValueError, match="fc gives 128 features but proj takes 64"):
        FP8MLP.from_modules(fc, nn.Linear(64, 32))
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        FP8MLP.from_modules(fc, nn.Conv1d(128, 32, 1))
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8MLP.from_modules(nn.Linear(32, 120), nn.Linear(120, 32))
    # A bad recipe is refused where nothing would be wrapped with it, too (it was ignored there).
    with pytest.raises(ValueError, match="fp8-lmm"):
        FP8MLP.from_modules(FP8Linear(32, 128), FP8Linear(128, 32), recipe="fp8-lmm")
    with pytest.raises(TypeError, match=r"FP8MLP\.from_modules\(recipe=\.\.\.\) must be an FP8Recipe"):
        FP8MLP.from_modules(FP8Linear(32, 128), FP8Linear(128, 32), recipe={"scaling": "current"})


def test_hooks_run_unfused():
    """A forward hook on a layer (FSDP2's fully_shard of one layer registers some) makes the module call the layers
    one after another, so that the hook runs."""
    mlp = FP8MLP(32, 64)
    ref = copy.deepcopy(mlp)
    seen = []
    mlp.fc.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    x = torch.randn(10, 32)
    y, _, grads = run(lambda m, v: m(v), mlp, x)
    y_ref, _, grads_ref = run(unfused, ref, x)
    assert seen == [(10, 64)] * 3
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize(
    ("make_fc", "reason"),
    [
        (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(32, 64)), "computed from other parameters"),
        (lambda: LoRALinear(32, 64), "subclasses of nn.Linear"),
    ],
    ids=["weight_norm", "lora"],
)
def test_from_modules_refuses_layers_whose_additions_it_would_drop(make_fc, reason):
    """A reparametrized fc lost its real parameters (they got no gradient, a second backward failed); a LoRA fc its
    adapters and forward."""
    fc = make_fc()
    with pytest.raises(ValueError, match=rf"FP8MLP.from_modules \(fc\): {type(fc).__name__}.*{reason}"):
        FP8MLP.from_modules(fc, nn.Linear(64, 32))


def test_from_modules_carries_the_layers_hooks_over():
    torch.manual_seed(0)
    fc, proj = nn.Linear(32, 64), nn.Linear(64, 32)
    ref = FP8MLP.from_modules(copy.deepcopy(fc), copy.deepcopy(proj))  # fused
    seen = []
    proj.register_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    mlp = FP8MLP.from_modules(fc, proj)
    x = torch.randn(8, 32)
    y = mlp(x)
    assert seen == ["FP8Linear"]  # the module calls the layers one after another, so that the hook runs
    assert sqnr(y, ref(x)) > SAME_CASTS_SQNR_DB


def test_float64_proj_is_refused():
    """Only fc's weight was checked: a float64 proj ran through the fused path (FP8Linear alone refuses it)."""
    with pytest.raises(TypeError, match=r"from_modules \(proj\): .* has a torch.float64 weight"):  # up front now
        FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 32).double())
    mlp = FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 32))
    mlp.proj.double()  # after construction: the forward refuses it
    with pytest.raises(TypeError, match="proj's weight has dtype torch.float64: use float32, bfloat16 or float16"):
        mlp(torch.randn(8, 32))


def test_parametrized_after_construction_is_refused():
    """The fused path reads the weights without calling the layers: it refuses a reparametrized one as they do."""
    mlp = FP8MLP(32, 64)
    nn.utils.parametrizations.weight_norm(mlp.proj)
    with pytest.raises(RuntimeError, match=r"FP8Linear\(in_features=64, out_features=32\) was reparametrized"):
        mlp(torch.randn(8, 32))


def test_bad_input_is_named():
    mlp = FP8MLP(32, 64)
    with pytest.raises(ValueError, match=r"FP8MLP\(in_features=32\).*last dimension must be 32"):
        mlp(torch.randn(4, 16))
    with pytest.raises(TypeError, match="FP8MLP received an input of dtype torch.int64"):
        mlp(torch.ones(4, 32, dtype=torch.int64))
    with pytest.raises(TypeError, match="FP8MLP takes dense tensors, got a torch.sparse_coo tensor"):
        mlp(torch.randn(4, 32).to_sparse())
    # Found by a sweep: the error named FP8Linear(out_features=100), not the hidden_features the user passed.
    with pytest.raises(ValueError, match=r"FP8MLP\(hidden_features=100\): .*multiples of 16"):
        FP8MLP(32, 100)
    with pytest.raises(ValueError, match=r"FP8MLP\(out_features=-16\): .*multiples of 16"):
        FP8MLP(32, 64, -16)


def test_proj_of_another_size_is_refused_before_any_cast():
    """A proj replaced by one that does not take fc's output size: a clear error, and no scaling state records a
    cast (the unfused path's FP8Linear check would name proj's input; the fused path must not reach its GEMM)."""
    mlp = FP8MLP(32, 64)
    mlp.proj = FP8Linear(48, 32)
    with pytest.raises(ValueError, match="fc gives 64 features but proj takes 48"):
        mlp(torch.randn(4, 32))
    for layer in (mlp.fc, mlp.proj):
        for state in layer.fp8_scaling.values():
            assert state.casts.item() == 0 and not state.amax_history.any()


def test_quantize_activation_arguments_are_checked():
    s = ScalingState(torch.float8_e5m2, 4, 0, "max", delayed=True)
    g = torch.randn(8, 16)
    with pytest.raises(ValueError, match="choose one of"):
        s.quantize(g, activation="relu")
    with pytest.raises(ValueError, match="needs a 2-D tensor"):
        s.quantize(g.reshape(2, 4, 16), activation="gelu")
    with pytest.raises(ValueError, match="needs activation_input"):
        s.quantize(g, activation="gelu_backward")
    with pytest.raises(ValueError, match="needs activation_input"):
        s.quantize(g, activation="gelu_backward", activation_input=torch.randn(16, 8))
    with pytest.raises(TypeError, match="activation_input must be"):
        s.quantize(g, activation="gelu_backward", activation_input=torch.ones(8, 16, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"ScalingState.quantize\(activation='gelu_backward'\).*pass it as float32"):
        s.quantize(g, activation="gelu_backward", activation_input=torch.ones(8, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="takes no activation_input"):
        s.quantize(g, activation="gelu", activation_input=g)
    assert int(s.casts) == 0  # nothing was recorded by the refused calls


def test_non_finite_is_counted_as_the_unfused_cast_counts_it():
    mlp = FP8MLP(32, 64)
    ref = copy.deepcopy(mlp)
    x = torch.randn(8, 32)
    x[3, 5] = float("inf")
    y, y_ref = mlp(x), unfused(ref, x)
    assert torch.equal(y.isnan(), y_ref.isnan()) and y.isnan().any()
    for key, s in states(mlp).items():
        assert int(s.nonfinite_count) == int(states(ref)[key].nonfinite_count), key


def test_compiled_equals_eager():
    mlp = FP8MLP(32, 64)
    ref = copy.deepcopy(mlp)
    x = torch.randn(2, 24, 32, requires_grad=True)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    y, dx, grads = run(lambda m, v: compiled(v), mlp, x)
    y_ref, dx_ref, grads_ref = run(lambda m, v: m(v), ref, x)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


class _Stack(nn.Module):
    """Embedding, two pre-norm residual MLP blocks, head: enough to train."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.norms = nn.ModuleList(nn.LayerNorm(32) for _ in range(2))
        self.mlps = nn.ModuleList(FP8MLP(32, 128) for _ in range(2))
        self.head = nn.Linear(32, 64)
        self.fused = fused

    def forward(self, idx):
        x = self.emb(idx)
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + (mlp(norm(x)) if self.fused else unfused(mlp, norm(x)))
        return self.head(x)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_training_tracks_the_unfused_layers(opt_level):
    """30 steps of FP8AdamW (O2: fp16 masters scaled in the weights' storage) learn a fixed mapping, fused and unfused
    from the same start: the same losses to within FP8's noise, and both learn."""
    from lightning_fp8 import FP8AdamW

    torch.manual_seed(0)
    fused = _Stack(fused=True)
    plain = copy.deepcopy(fused)
    plain.fused = False
    idx = torch.randint(0, 64, (8, 16))
    target = (idx * 7 + 3) % 64
    losses = {}
    for name, model in (("fused", fused), ("plain", plain)):
        opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level)
        losses[name] = []
        for _ in range(30):
            loss = F.cross_entropy(model(idx).flatten(0, 1), target.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    a, b = torch.tensor(losses["fused"]), torch.tensor(losses["plain"])
    assert a[-1] < 0.5 * a[0] and b[-1] < 0.5 * b[0]
    assert (a - b).abs().max() < 0.02 * a[0], (a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_fused_against_unfused_and_high_precision(compiled):
    """On a GPU (real FP8 GEMMs, the Triton casts; compiled: inductor and the traced triton_ops): bf16 autocast, both
    paths FP8-accurate against the bf16 MLP, and within FP8 noise of each other."""
    torch.manual_seed(0)
    mlp = FP8MLP(1024, 4096, device="cuda")
    ref = copy.deepcopy(mlp)
    hp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    hp.load_state_dict({"0.weight": mlp.fc.weight, "0.bias": mlp.fc.bias, "2.weight": mlp.proj.weight,
                        "2.bias": mlp.proj.bias})  # fmt: skip
    fused = torch.compile(mlp) if compiled else mlp
    x = torch.randn(4, 512, 1024, device="cuda", requires_grad=True)
    weights = torch.linspace(-1, 1, 1024, device="cuda")
    outs = []
    for fn, module in ((lambda m, v: fused(v), mlp), (unfused, ref), (lambda m, v: m(v), hp)):
        xi = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                module.zero_grad()
                xi.grad = None
                y = fn(module, xi)
                (y.float() * weights).sum().backward()
        outs.append((y, xi.grad, module[0].weight.grad if isinstance(module, nn.Sequential) else module.fc.weight.grad))
    (y, dx, dw1), (y_u, dx_u, dw1_u), (y_hp, dx_hp, dw1_hp) = outs
    assert sqnr(y, y_hp) > FORWARD_SQNR_DB - 2 and sqnr(y_u, y_hp) > FORWARD_SQNR_DB - 2
    assert sqnr(dx, dx_hp) > BACKWARD_SQNR_DB and sqnr(dw1, dw1_hp) > BACKWARD_SQNR_DB
    assert sqnr(y, y_hp) >= sqnr(y_u, y_hp) - 1.0 and sqnr(dx, dx_hp) >= sqnr(dx_u, dx_hp) - 1.0


def test_double_backward_raises_instead_of_dropping_the_second_order_term():
    """A gradient penalty through the fused MLP raises (it silently dropped the penalty's term through the MLP)."""
    mlp = FP8MLP(32, 64)
    x = torch.randn(8, 32, requires_grad=True)
    y = mlp(x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (y.sum() + g.pow(2).sum()).backward()


@pytest.mark.parametrize("shape", [(1, 1, 32), (32,), (0, 32)], ids=["one_row", "1d", "empty"])
def test_compiled_single_token_and_empty_inputs(shape):
    """One row or none through the compiled fused MLP (its casts' transposed copies of one row are copies, not views):
    bit for bit eager's results."""
    torch._dynamo.reset()
    mlp = FP8MLP(32, 64)
    ref = copy.deepcopy(mlp)
    x = torch.randn(shape, requires_grad=True)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    y, dx, grads = run(lambda m, v: compiled(v), mlp, x, steps=2)
    y_ref, dx_ref, grads_ref = run(lambda m, v: m(v), ref, x, steps=2)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


def _hidden_pair(**kwargs):
    mlp = FP8MLP(**kwargs)
    ref = copy.deepcopy(mlp)
    mlp.fp8_hidden = True
    return mlp, ref


def test_fp8_hidden_is_exact_where_the_hidden_values_are_fp8_values():
    """fp8_hidden keeps the GELU's input in FP8 and recomputes gelu(h)'s transposed copy from it. With fc the identity
    and inputs on the E4M3 grid (magnitudes 0.5-7.5), h is x exactly and its FP8 copy loses nothing: every output and
    gradient is the default path's, bit for bit (a wrong scale in the recomputed copy or in gelu' would show here)."""
    gen = torch.Generator().manual_seed(0)
    mlp, ref = _hidden_pair(in_features=16, hidden_features=16, out_features=32)
    with torch.no_grad():
        for m in (mlp, ref):
            m.fc.weight.copy_(torch.eye(16))
            m.fc.bias.zero_()
    mantissa = torch.randint(0, 8, (64, 16), generator=gen)
    exponent = torch.randint(-1, 3, (64, 16), generator=gen)
    sign = torch.randint(0, 2, (64, 16), generator=gen) * 2 - 1
    x = (sign * (1 + mantissa / 8) * 2.0**exponent).float().requires_grad_()
    y, dx, grads = run(lambda m, v: m(v), mlp, x)
    y_ref, dx_ref, grads_ref = run(lambda m, v: m(v), ref, x)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


def test_fp8_hidden_is_fp8_accurate():
    """Random inputs under bf16 autocast: the forward is the default path's bit for bit; the gradients are FP8-accurate
    against the bf16 MLP, and within FP8 noise of the default path's."""
    torch.manual_seed(1)
    mlp, ref = _hidden_pair(in_features=64, hidden_features=256)
    hp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    hp.load_state_dict({"0.weight": mlp.fc.weight, "0.bias": mlp.fc.bias, "2.weight": mlp.proj.weight,
                        "2.bias": mlp.proj.bias})  # fmt: skip
    x = torch.randn(4, 32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, grads = run(lambda m, v: m(v), mlp, x)
        y_ref, dx_ref, grads_ref = run(lambda m, v: m(v), ref, x)
        y_hp, dx_hp, grads_hp = run(lambda m, v: m(v), hp, x)
    assert torch.equal(y, y_ref)
    assert sqnr(dx, dx_hp) > BACKWARD_SQNR_DB and sqnr(dx, dx_ref) > BACKWARD_SQNR_DB
    for name, hp_name in (("fc.weight", "0.weight"), ("fc.bias", "0.bias"), ("proj.weight", "2.weight")):
        assert sqnr(grads[name], grads_hp[hp_name]) > BACKWARD_SQNR_DB, name
        assert sqnr(grads[name], grads_ref[name]) > BACKWARD_SQNR_DB, name
    assert torch.equal(grads["proj.bias"], grads_ref["proj.bias"])  # from dy alone


def _saved_bytes(mlp, x):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x).float().sum().backward()
    return sum(saved)


def test_fp8_hidden_keeps_one_byte_per_hidden_element():
    """What the backward keeps: with fp8_hidden, one byte per element of h (tokens x hidden) in place of h in bf16 and
    gelu(h)'s transposed FP8 copy: two bytes per element fewer, the rest unchanged."""
    mlp, ref = _hidden_pair(in_features=32, hidden_features=128)
    x = torch.randn(48, 32, requires_grad=True)
    assert _saved_bytes(ref, x) - _saved_bytes(mlp, x) == 48 * 128 * 2


@pytest.mark.parametrize("frozen", ["fc", "proj", "input", "fc_and_input"])
def test_fp8_hidden_partial_gradients(frozen):
    """Frozen parts get no gradient; the others are within FP8 noise of the default path's (proj alone trainable: the
    default path's gelu(h) copy is kept, h is not)."""
    mlp, ref = _hidden_pair(in_features=32, hidden_features=64, out_features=48)
    for m in (mlp, ref):
        for part in ("fc", "proj"):
            if part in frozen:
                getattr(m, part).requires_grad_(False)
    x = torch.randn(40, 32, requires_grad="input" not in frozen)
    y, dx, grads = run(lambda m, v: m(v), mlp, x)
    y_ref, dx_ref, grads_ref = run(lambda m, v: m(v), ref, x)
    assert torch.equal(y, y_ref)
    assert (dx is None) == (dx_ref is None) and (dx is None or sqnr(dx, dx_ref) > BACKWARD_SQNR_DB)
    for name, g in grads.items():
        assert (g is None) == (grads_ref[name] is None), name
        assert g is None or sqnr(g, grads_ref[name]) > BACKWARD_SQNR_DB, name


def test_fp8_hidden_compiled_and_checkpointed_equal_eager():
    """torch.compile (the traced casts and the recomputed copy) and activation checkpointing (the recompute repeats
    the forward's scales) give eager's fp8_hidden results bit for bit."""
    from torch.utils.checkpoint import checkpoint

    mlp = FP8MLP(32, 64, fp8_hidden=True)
    compiled_copy, checkpointed = copy.deepcopy(mlp), copy.deepcopy(mlp)
    x = torch.randn(2, 24, 32, requires_grad=True)
    compiled = torch.compile(compiled_copy, backend="aot_eager", fullgraph=True)
    runs = [
        run(lambda m, v: m(v), mlp, x),
        run(lambda m, v: compiled(v), compiled_copy, x),
        run(lambda m, v: checkpoint(m, v, use_reentrant=False), checkpointed, x),
    ]
    (y, dx, grads), *others = runs
    for y_o, dx_o, grads_o in others:
        assert torch.equal(y, y_o) and torch.equal(dx, dx_o)
        for name, g in grads.items():
            assert torch.equal(g, grads_o[name]), name


@pytest.mark.parametrize("shift", [-3.0, -6.0, -12.0])
def test_fp8_hidden_strongly_negative_gelu_inputs_keep_fp8_accurate_gradients(shift):
    """Every GELU input strongly negative (a shifted fc bias): the GELU output's amax is tiny, and the kept h's scale
    alone (that output's, / 16) saturated h at -16 x that amax, where gelu' is far from the true gelu'(h) ~ 0: the
    gradients were as large as an unshifted MLP's where they should be about 0, silently. Capped, the kept h holds
    values down to -14: the gradients' error is FP8 noise of their own size (plus 1e-3 of the unshifted MLP's)."""
    torch.manual_seed(0)
    mlp = FP8MLP(64, 256, fp8_hidden=True)
    x = torch.randn(128, 64, requires_grad=True)

    def high_precision():
        hp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        hp.load_state_dict({"0.weight": mlp.fc.weight, "0.bias": mlp.fc.bias, "2.weight": mlp.proj.weight,
                            "2.bias": mlp.proj.bias})  # fmt: skip
        _, dx_hp, grads_hp = run(lambda m, v: m(v), hp, x, steps=1)
        return dx_hp, grads_hp

    dx_usual, grads_usual = high_precision()  # the gradients' usual size
    with torch.no_grad():
        mlp.fc.bias.add_(shift)
    dx_hp, grads_hp = high_precision()
    _, dx, grads = run(lambda m, v: m(v), mlp, x)

    def close(got, ref, usual):
        return (got - ref).norm() < 0.2 * ref.norm() + 1e-3 * usual.norm()

    assert close(dx, dx_hp, dx_usual)
    for name, hp_name in (("fc.weight", "0.weight"), ("fc.bias", "0.bias"), ("proj.weight", "2.weight")):
        assert close(grads[name], grads_hp[hp_name], grads_usual[hp_name]), name


def test_backward_hooks_on_the_layers_run():
    """Backward hooks on fc or proj ran only on the unfused path (taken for forward hooks): in the fused path they
    never fired, silently. They now send the module unfused too, with the same results."""
    for fp8_hidden in (False, True):
        mlp = FP8MLP(32, 64, fp8_hidden=fp8_hidden)
        ref = copy.deepcopy(mlp)
        fired = []
        mlp.fc.register_full_backward_hook(lambda m, gi, go, fired=fired: fired.append("fc"))
        mlp.proj.register_full_backward_pre_hook(lambda m, go, fired=fired: fired.append("proj"))
        x = torch.randn(10, 32, requires_grad=True)
        y, dx, _ = run(lambda m, v: m(v), mlp, x)
        y_ref, dx_ref, _ = run(unfused, ref, x)
        assert fired.count("fc") == fired.count("proj") == 3  # once per backward of run's three
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


def test_fp8_hidden_keeps_nothing_more_when_only_proj_trains():
    """fc and the input frozen: the backward needs gelu(h)'s FP8 copy alone (one byte per element), so fp8_hidden
    keeps that copy as the default path does (keeping h instead would cost a recompute pass for nothing)."""
    mlp, ref = _hidden_pair(in_features=32, hidden_features=128)
    for m in (mlp, ref):
        m.fc.requires_grad_(False)
    x = torch.randn(48, 32)
    assert _saved_bytes(mlp, x) == _saved_bytes(ref, x)
    _, _, grads = run(lambda m, v: m(v), mlp, x)
    _, _, grads_ref = run(lambda m, v: m(v), ref, x)
    assert torch.equal(grads["proj.weight"], grads_ref["proj.weight"])


def test_fp8_hidden_is_checked_and_shown():
    with pytest.raises(TypeError, match="fp8_hidden"):
        FP8MLP(32, 64, fp8_hidden="yes")
    mlp = FP8MLP(32, 64)
    with pytest.raises(TypeError, match="fp8_hidden"):
        mlp.fp8_hidden = "False"  # truthy: would have turned it on
    assert mlp.fp8_hidden is False
    mlp = FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 32), fp8_hidden=True)
    assert mlp.fp8_hidden and "fp8_hidden=True" in repr(mlp)
    assert "fp8_hidden" not in repr(FP8MLP(32, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_fp8_hidden_against_default_and_high_precision(compiled):
    """On a GPU (real FP8 GEMMs, the Triton casts with the kept input and the recomputed copy; compiled: the traced
    triton_ops), bf16 autocast: the forward is the default path's bit for bit, the gradients FP8-accurate against
    the bf16 MLP and within FP8 noise of the default path's."""
    torch.manual_seed(0)
    mlp = FP8MLP(1024, 4096, device="cuda", fp8_hidden=True)
    ref = copy.deepcopy(mlp)
    ref.fp8_hidden = False
    hp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    hp.load_state_dict({"0.weight": mlp.fc.weight, "0.bias": mlp.fc.bias, "2.weight": mlp.proj.weight,
                        "2.bias": mlp.proj.bias})  # fmt: skip
    hidden, default = (torch.compile(m) if compiled else m for m in (mlp, ref))
    x = torch.randn(4, 512, 1024, device="cuda")
    weights = torch.linspace(-1, 1, 1024, device="cuda")
    outs = []
    for module, fn in ((mlp, hidden), (ref, default), (hp, hp)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                module.zero_grad()
                xi.grad = None
                y = fn(xi)
                (y.float() * weights).sum().backward()
        params = dict(module.named_parameters())
        outs.append((y, xi.grad, *(params[k] for k in (("fc.weight", "proj.weight") if module is not hp
                                                       else ("0.weight", "2.weight")))))  # fmt: skip
    (y, dx, w1, w2), (y_d, dx_d, w1_d, w2_d), (y_hp, dx_hp, w1_hp, w2_hp) = outs
    assert torch.equal(y, y_d)
    for got, default_grad, hp_grad in ((dx, dx_d, dx_hp), (w1.grad, w1_d.grad, w1_hp.grad), (w2.grad, w2_d.grad,
                                                                                              w2_hp.grad)):  # fmt: skip
        assert sqnr(got, hp_grad) > BACKWARD_SQNR_DB and sqnr(got, default_grad) > BACKWARD_SQNR_DB
        assert sqnr(got, hp_grad) >= sqnr(default_grad, hp_grad) - 1.0


def test_torch_func_transform_raises_a_clear_error():
    """FP8MLP under torch.func.vmap: a RuntimeError naming the module and the way out, not PyTorch's internal one."""
    mlp = FP8MLP(16, 32)
    with pytest.raises(RuntimeError, match=r"FP8MLP does not support torch\.func transforms"):
        torch.vmap(mlp)(torch.randn(3, 2, 16))


@pytest.mark.parametrize("plain", ["fc", "proj", "both"])
def test_a_layer_put_back_to_nn_linear_runs_unfused(plain):
    """An FP8MLP whose fc or proj was replaced by a plain nn.Linear (to keep it in high precision) failed on the fused
    path's FP8Linear-only calls; it runs the layers one after another, as with a hook on a layer."""
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64)
    for name in ("fc", "proj") if plain == "both" else (plain,):
        fp8 = getattr(mlp, name)
        setattr(mlp, name, nn.Linear(fp8.in_features, fp8.out_features))
    ref = copy.deepcopy(mlp)
    x = torch.randn(2, 5, 32, requires_grad=True)
    y, dx, grads = run(lambda m, v: m(v), mlp, x)
    y_ref, dx_ref, grads_ref = run(unfused, ref, x)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)


@pytest.mark.parametrize("fp8_hidden", [False, True])
def test_one_layer_as_fc_and_proj_runs_unfused_and_checkpoints_exactly(fp8_hidden, monkeypatch):
    """Found by a sweep: FP8MLP.from_modules(f, f) fused both input casts into one scaling state; a non-reentrant
    checkpoint's recompute replayed x's cast with gelu(h)'s scale (saturating): fc's weight gradient 20% off, no
    warning. The shared layer runs unfused: exactly f(gelu(f(x))), and checkpointed as without checkpointing (the
    region's recompute repeats the layer's two forwards in order; it once cast with their own amax, with a warning)."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())  # warnings are once per process
    torch.manual_seed(0)
    linear = nn.Linear(32, 32)
    with torch.no_grad():
        linear.weight.mul_(0.05)
        linear.bias.fill_(3.0)  # x's and gelu(h)'s scales differ
    f = FP8Linear.from_linear(linear)
    mlp = FP8MLP.from_modules(f, f, fp8_hidden=fp8_hidden)
    ref = copy.deepcopy(mlp)
    x = torch.randn(8, 32) * 50
    y, dx, grads = run(lambda m, v: m(v), mlp, x.clone().requires_grad_())
    y_ref, dx_ref, grads_ref = run(unfused, ref, x.clone().requires_grad_())
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)

    checkpointed = copy.deepcopy(ref)
    plain = copy.deepcopy(ref)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.linspace(-1, 1, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the layer is called twice in the checkpointed region: no ambiguity warning
        (torch.utils.checkpoint.checkpoint(checkpointed, xa, use_reentrant=False) * weights).sum().backward()
    (plain(xb) * weights).sum().backward()
    assert torch.equal(checkpointed.fc.weight.grad, plain.fc.weight.grad)
    assert torch.equal(xa.grad, xb.grad)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # nn.Linear's init of the empty weight
@pytest.mark.parametrize("fp8_hidden", [False, True])
def test_zero_in_features_with_a_token_dimension(fp8_hidden):
    """in_features=0 (proj(gelu(b1)) for every token): inputs that are not 2-D failed in reshape(-1, 0)."""
    torch.manual_seed(0)
    mlp = FP8MLP(0, 64, 32, fp8_hidden=fp8_hidden)
    with torch.no_grad():
        mlp.fc.bias.normal_()  # nn.Linear's init makes it 0 without inputs (fan_in 0)
    ref = copy.deepcopy(mlp)
    x = torch.randn(2, 3, 0, requires_grad=True)
    y, dx, grads = run(lambda m, v: m(v), mlp, x)
    y_ref, dx_ref, grads_ref = run(unfused, ref, x)
    assert y.shape == (2, 3, 32) and dx.shape == x.shape and grads["fc.weight"].shape == (64, 0)
    assert sqnr(y, y_ref) > SAME_CASTS_SQNR_DB
    # fp8_hidden: the backward sees the GELU's input rounded to FP8 (the class docstring), the unfused layers do not
    bound = BACKWARD_SQNR_DB if fp8_hidden else SAME_CASTS_SQNR_DB
    assert all(sqnr(grads[n], grads_ref[n]) > bound for n in ("fc.bias", "proj.weight", "proj.bias"))


def test_from_modules_wraps_a_layer_passed_as_both_once_and_keeps_each_layers_mode():
    # One nn.Linear as fc and proj became two FP8Linear wrappers of one weight, each with its own scaling state; and
    # proj's wrapper took fc's train/eval mode.
    torch.manual_seed(0)
    square = nn.Linear(32, 32)
    mlp = FP8MLP.from_modules(square, square)
    assert mlp.fc is mlp.proj and len(list(mlp.parameters())) == 2
    x = torch.randn(8, 32)
    ref = square(F.gelu(square(x)))
    assert sqnr(mlp(x), ref) > FORWARD_SQNR_DB - 6  # two FP8 GEMMs in a row
    fc, proj = nn.Linear(32, 64), nn.Linear(64, 32)
    fc.eval()
    mlp = FP8MLP.from_modules(fc, proj)
    assert (mlp.training, mlp.fc.training, mlp.proj.training) == (False, False, True)
