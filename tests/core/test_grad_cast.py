"""FP8AdamW's batched gradient casts (lightning_fp8/optim/grad_cast.py) against the casts in each hook
(``grad_cast_bucket_mb=0``), bit for bit: parameters, optimizer states, pending FP8 gradients, the gradients' scaling
states and the gradient scaler's counts; and when the queue flushes."""

import weakref

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8, ops

SCALER_MU = 2.0**14


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def casts(monkeypatch):
    """The sizes of the batched casts (``ops.grad_cast`` calls) made so far."""
    sizes, real = [], ops.grad_cast

    def counting(grads, *args, **kwargs):
        sizes.append(len(grads))
        return real(grads, *args, **kwargs)

    monkeypatch.setattr(ops, "grad_cast", counting)
    return sizes


def _model(layers=3, width=48, growth=16):
    torch.manual_seed(0)
    dims = [32] + [width + growth * i for i in range(layers - 1)] + [16]
    mods = []
    for d_in, d_out in zip(dims[:-1], dims[1:], strict=True):
        mods += [nn.Linear(d_in, d_out), nn.GELU()]
    return convert_to_fp8(nn.Sequential(*mods[:-1]))


def _pair(bucket_mb=64, scaler=False, layers=3, width=48, device="cpu"):
    """(model, optimizer) batched with ``bucket_mb`` and the same casting in each hook, from the same weights."""
    pairs = []
    for mb in (bucket_mb, 0):
        model = _model(layers, width).to(device)
        grad_scaler = FP8GradScaler(init_scale=SCALER_MU) if scaler else None
        pairs.append((model, FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=grad_scaler, grad_cast_bucket_mb=mb)))
    return pairs


def _backward(model, opt, x, y):
    loss = ((model(x) - y) ** 2).mean()
    (opt.grad_scaler.scale_loss(loss) if opt.grad_scaler is not None else loss).backward()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _weights(opt):
    return [p for g in opt.param_groups for p in g["params"] if p in opt._low_precision]  # in order


def _assert_same(a: FP8AdamW, b: FP8AdamW) -> None:
    """Two optimizers (and their models) hold the same bits: parameters, states, pending FP8 gradients, scaling states
    of the gradient casts, the scaler's counts."""
    params_a = [p for g in a.param_groups for p in g["params"]]
    params_b = [p for g in b.param_groups for p in g["params"]]
    for x, y in zip(params_a, params_b, strict=True):
        _same(x, y)
        state_a, state_b = a.state.get(x, {}), b.state.get(y, {})
        assert state_a.keys() == state_b.keys()
        for key, value in state_a.items():
            _same(value, state_b[key])
        entry_a, entry_b = a._pending.get(x), b._pending.get(y)
        assert (entry_a is None) == (entry_b is None)
        if entry_a is not None:
            for u, w in zip((entry_a.data, entry_a.scale_inv, entry_a.amax), (entry_b.data, entry_b.scale_inv,
                                                                               entry_b.amax), strict=True):  # fmt: skip
                _same(u, w)
            assert entry_a.amax is a._grad_cast_state(x)[2]  # the state's last amax, as the per-tensor cast keeps it
        assert (x in a._grad_cast_states) == (y in b._grad_cast_states)
        if x in a._grad_cast_states:
            for u, w in zip(a._grad_cast_state(x), b._grad_cast_state(y), strict=True):
                _same(u, w)
    if a.grad_scaler is not None:
        sa, sb = a.grad_scaler, b.grad_scaler
        for name in ("_found", "_n_saturated", "_no_headroom"):
            _same(getattr(sa, name), getattr(sb, name))
        assert (sa._numel, sa.history, sa.skipped_steps) == (sb._numel, sb.history, sb.skipped_steps)
    assert a.skipped_grad_amax.keys() == set() or [v.item() for v in a.skipped_grad_amax.values()] == [
        v.item() for v in b.skipped_grad_amax.values()
    ]


@pytest.mark.parametrize(
    ("kernels", "scaler"), [("reference", False), ("reference", True), ("triton", True)], ids=lambda v: str(v)
)
def test_batched_casts_match_casts_in_each_hook(monkeypatch, casts, kernels, scaler):
    # Steps of two micro-batches each (the second accumulates onto the pending FP8 gradients); the last step sees a
    # non-finite gradient (skipped with a scaler). Triton (everything under the interpreter: fewer steps): the batched
    # kernels against the per-tensor Triton casts.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    (model_a, opt_a), (model_b, opt_b) = _pair(scaler=scaler)
    n_weights = len(_weights(opt_a))
    steps = 2 if kernels == "triton" else 3
    for step in range(steps):
        for micro in range(2):
            x, y = torch.randn(8, 32), torch.randn(8, 16)
            if step == steps - 1 and micro == 1:
                x[0, 0] = float("inf")
            _backward(model_a, opt_a, x, y)
            _backward(model_b, opt_b, x, y)
            assert len(opt_a._grad_casts) == 0 and len(opt_a._pending) == n_weights
            _assert_same(opt_a, opt_b)
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
        _assert_same(opt_a, opt_b)
    assert casts == [n_weights] * 2 * steps  # one batched cast per backward (the unbatched optimizer makes none)
    if scaler:
        assert opt_a.grad_scaler.skipped_steps == 1


@pytest.mark.gpu
@pytest.mark.parametrize("scaler", [False, True])
def test_gpu_batched_casts_match_casts_in_each_hook(casts, scaler):
    # The compiled Triton kernels on a GPU: batched against the per-tensor casts, over steps of two micro-batches.
    (model_a, opt_a), (model_b, opt_b) = _pair(scaler=scaler, device="cuda")
    n_weights = len(_weights(opt_a))
    for step in range(3):
        for micro in range(2):
            x, y = torch.randn(64, 32, device="cuda"), torch.randn(64, 16, device="cuda")
            if step == 2 and micro == 1:
                x[0, 0] = float("inf")
            _backward(model_a, opt_a, x, y)
            _backward(model_b, opt_b, x, y)
            _assert_same(opt_a, opt_b)
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
        _assert_same(opt_a, opt_b)
    assert casts == [n_weights] * 6


def test_flush_when_the_bucket_fills(casts):
    # fp16 weight gradients of 2560, 10240, 6144, 3072 bytes in the backward's order (last layer first): a bucket of
    # 6 KB flushes after the second and the third gradient, the end of the backward casts the last one.
    (model_a, opt_a), (model_b, opt_b) = _pair(bucket_mb=6 * 1024 / 2**20, layers=4)
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    _backward(model_a, opt_a, x, y)
    _backward(model_b, opt_b, x, y)
    assert casts == [2, 1, 1] and len(opt_a._grad_casts) == 0
    _assert_same(opt_a, opt_b)


def test_bucket_bounds_the_live_gradients():
    # During an eager backward, the queued fp16 gradients are the only ones alive; a flush frees them. Counted by weak
    # references from a hook that runs after the optimizer's on each weight.
    def max_alive(bucket_mb):
        model = _model(layers=8, width=32, growth=0)  # fp16 weight gradients of 2 KB (the last one: 1 KB)
        opt = FP8AdamW(model.parameters(), grad_cast_bucket_mb=bucket_mb)
        refs, alive = [], []
        put = opt._grad_casts.put

        def tracking_put(o, p, grad):
            refs.append(weakref.ref(grad))
            put(o, p, grad)

        opt._grad_casts.put = tracking_put
        for p in _weights(opt):
            p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(r() is not None for r in refs)))
        _backward(model, opt, torch.randn(8, 32), torch.randn(8, 16))
        assert len(refs) == 8 and all(r() is None for r in refs)  # all cast and freed by the end
        return max(alive)

    assert max_alive(64) == 8
    assert max_alive(3 * 2048 / 2**20) == 3  # 1 KB + 2 KB + 2 KB queued; the next one fills the bucket


@pytest.mark.parametrize(
    "reader",
    ["step", "_nonfinite_grads", "_fp8_skip", "_grad_of", "state_dict", "load_state_dict", "fp8_state_stats",
     "release", "accumulate_fp8_grad", "queued_twice"],
)  # fmt: skip
def test_readers_flush_the_queue(casts, reader):
    # Gradients queued outside a backward (no end-of-backward flush) are cast before anything reads them. One holds
    # values at the E5M2 maximum, which the scaler counts.
    (model_a, opt_a), (model_b, opt_b) = _pair(scaler=True)
    for opt in (opt_a, opt_b):
        opt.grad_scaler.scale_loss(torch.zeros(()))  # the gradients put here carry mu, as a scaled backward's do
    weights_a, weights_b = _weights(opt_a), _weights(opt_b)
    grads = [torch.randn(p.shape, dtype=p.dtype) for p in weights_a]
    grads[1].view(-1)[:2] = torch.tensor([60000.0, -57344.0])
    for p, q, g in zip(weights_a, weights_b, grads, strict=True):
        opt_a._grad_casts.put(opt_a, p, g.clone())
        opt_b.accumulate_fp8_grad(q, g.clone())
    assert len(opt_a._grad_casts) == len(grads) and not opt_a._pending and not casts
    extra = torch.randn(weights_a[0].shape, dtype=weights_a[0].dtype)
    for opt, weights in ((opt_a, weights_a), (opt_b, weights_b)):
        if reader == "load_state_dict":
            opt.load_state_dict(opt.state_dict() if opt is opt_b else opt_b.state_dict())
        elif reader in ("release", "_grad_of"):
            getattr(opt, reader)(weights[0])
        elif reader == "accumulate_fp8_grad":
            opt.accumulate_fp8_grad(weights[0], extra.clone())
        elif reader == "queued_twice":  # a second gradient for a queued weight: the first is cast before
            opt._grad_casts.put(opt, weights[0], extra.clone())
            opt._grad_casts.flush(opt)
        else:
            getattr(opt, reader)()
    assert len(opt_a._grad_casts) == 0 and casts[0] == len(grads)
    _assert_same(opt_a, opt_b)
    if reader not in ("step", "_fp8_skip"):  # (the step's update resets the scaler's counts)
        assert opt_a.grad_scaler._n_saturated.item() == 2


def test_zero_grad_drops_the_queue():
    (_, opt), _ = _pair()
    p = _weights(opt)[0]
    opt._grad_casts.put(opt, p, torch.randn(p.shape, dtype=p.dtype))
    opt.zero_grad()
    assert len(opt._grad_casts) == 0 and opt._grad_casts.nbytes == 0 and not opt._pending
    opt.step()  # nothing to cast, nothing to step
    assert p not in opt._grad_cast_states and not opt.state[p]


def test_bucket_zero_casts_in_each_hook(casts):
    (model, opt), _ = _pair(bucket_mb=0)
    seen = []
    for p in _weights(opt):
        p.register_post_accumulate_grad_hook(lambda q: seen.append(q in opt._pending))
    _backward(model, opt, torch.randn(8, 32), torch.randn(8, 16))
    assert seen == [True] * len(seen) and len(seen) == 3 and not casts


def test_compiled_training_step_flushes_at_the_end_of_its_backward(casts):
    # torch.compile's backward hands all gradients over at its end; the hooks queue them, the engine's callback casts.
    pairs = _pair()
    compiled = [torch.compile(model, fullgraph=True, backend="aot_eager") for model, _ in pairs]
    for _ in range(3):
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        for model, (_, opt) in zip(compiled, pairs, strict=True):
            _backward(model, opt, x, y)
            assert len(opt._grad_casts) == 0 and len(opt._pending) == 3
        _assert_same(pairs[0][1], pairs[1][1])
        for _, opt in pairs:
            opt.step()
            opt.zero_grad()
        _assert_same(pairs[0][1], pairs[1][1])
    assert casts == [3, 3, 3]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "64", True, None])
def test_bad_bucket_size(value):
    with pytest.raises(ValueError, match=r"grad_cast_bucket_mb=.*number of megabytes >= 0"):
        FP8AdamW(_model().parameters(), grad_cast_bucket_mb=value)
