"""What a mutation audit of kernels/quantize.py found unpinned: the replay cache of the casts' launches.

``_replay_key`` must tell apart every two casts whose launches differ (``_replay_key``'s docstring: kernels, grids,
non-tensor arguments and Triton's specialization of the tensors: their shapes, dtypes and 16-byte alignment, the
caller's flags) and refuse a cast with a misaligned tensor (its replay would reuse a kernel specialized for aligned
pointers); the cache of replays stays bounded by MAX_REPLAYS. The key is computed on a GPU only: here the CUDA
tensors are stand-ins that carry what the key reads (address, shape, dtype, device), with the fast launch path on.
"""

import pytest
import torch

pytest.importorskip("triton")

from lightning_fp8.kernels import cast, launch, quantize  # noqa: E402


class FakeCuda:
    """What _replay_key reads of a CUDA tensor."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, shape, dtype=torch.bfloat16, address=1 << 20):
        self.shape, self.dtype, self.address = torch.Size(shape), dtype, address

    def data_ptr(self):
        return self.address


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(quantize, "REPLAY", True)
    monkeypatch.setattr(cast, "_interpreted", lambda kernel: False)
    monkeypatch.setattr(launch, "_current_device_stream", lambda: (0, 7))
    monkeypatch.setattr(launch, "_knobs_key", lambda: ())


def _state():
    # amax_history, scale, last_amax, saturation, nonfinite_count, casts
    scalars = [FakeCuda((), torch.float32, (1 << 22) + 64 * i) for i in range(5)]
    return [FakeCuda((4,), torch.float32, 1 << 21), *scalars]


def _key(x, transpose=True, current=True, fp8_dtype=torch.float8_e4m3fn, margin=0, state=None, **kw):
    tensors = (x, *(state or _state()), None, None, None)
    return quantize._replay_key(tensors, transpose, current, fp8_dtype, margin, True, False, False, **kw)


def test_casts_with_different_launches_get_different_keys(on_gpu):
    base = _key(FakeCuda((64, 48)))
    assert base is not None and base == _key(FakeCuda((64, 48), address=1 << 24))  # another aligned address: same
    others = {
        "shape": _key(FakeCuda((48, 64))),
        "rows": _key(FakeCuda((65, 48))),
        "dtype": _key(FakeCuda((64, 48), torch.float16)),
        "fp8 dtype": _key(FakeCuda((64, 48)), fp8_dtype=torch.float8_e5m2),
        "margin": _key(FakeCuda((64, 48)), margin=1),
        "transpose": _key(FakeCuda((64, 48)), transpose=False),
        "current": _key(FakeCuda((64, 48)), current=False),
        "column sum": _key(FakeCuda((64, 48)), column_sum=True),
        "activation": _key(FakeCuda((64, 48)), activation="gelu"),
        "history length": _key(FakeCuda((64, 48)), state=[FakeCuda((8,), torch.float32)] + _state()[1:]),
    }
    for name, key in others.items():
        assert key is not None and key != base, name


@pytest.mark.parametrize("which", ["x", "state"])
def test_a_misaligned_tensor_is_not_replayed(on_gpu, which):
    x, state = FakeCuda((64, 48)), _state()
    if which == "x":
        x.address += 2  # a bf16 view one element into its storage
    else:
        state[1].address += 4
    assert _key(x, state=state) is None


def test_the_replay_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(quantize, "MAX_REPLAYS", 8)
    monkeypatch.setattr(quantize, "_REPLAYS", {})
    for i in range(30):
        quantize._remember(("key", i), [], (), ())
        assert len(quantize._REPLAYS) <= 8
    assert ("key", 29) in quantize._REPLAYS
