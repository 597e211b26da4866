"""FSDP2 with FP8 gradient reduce-scatter when a parameter of a unit gets no gradient (an unused submodule).

FSDP2 leaves such a parameter out of the reduce-scatter buffer (unless ``set_reduce_scatter_unused_params(True)``),
so the comm cannot tell where each gradient lies in it. The gradients that ``FP8CommState(fp8_params=...)`` leaves
out must still be reduced in their own dtype: equal to the fp32 mean over ranks bit for bit, as in the same model
without the unused submodule; the FP8Linear weights' within FP8 error. The reference is the unsharded model run on
each rank's data in the same process, its gradients averaged with a plain all-reduce.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.launch import cpu_mesh, part_results, run_parts, run_workers
from tests.distributed.tolerances import REDUCE_SCATTER_E5M2_SQNR_DB
from tests.numerics import sqnr

pytestmark = pytest.mark.slow

WORLD = 2
D_IN, HIDDEN, D_OUT, TOKENS = 48, 80, 32, 12  # not powers of two (FP8 GEMMs take multiples of 16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)
        self.unused = nn.Linear(D_OUT, D_OUT)  # e.g. a head used only in another phase of training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(torch.relu(self.fc1(x))))


def _case(rank: int, fp8_weights_only: bool, reduce_unused: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8Linear, convert_to_fp8
    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2

    torch.manual_seed(0)
    ref = convert_to_fp8(Net())
    torch.manual_seed(0)
    model = convert_to_fp8(Net())
    # Fresh data per rank, of different magnitudes: a block scale shared by small and large gradients would show.
    x = torch.randn(TOKENS, D_IN, generator=torch.Generator().manual_seed(rank)) * 10.0**rank
    ref(x).pow(2).mean().backward()
    fully_shard(model, mesh=cpu_mesh())  # one unit: FP8Linear weights, biases, the norm and the unused layer
    if reduce_unused:
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            return {"skip": f"torch {torch.__version__}'s FSDP2 has no set_reduce_scatter_unused_params"}
        model.set_reduce_scatter_unused_params(True)
    weights = [m.weight for m in model.modules() if isinstance(m, FP8Linear)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_fp8_fsdp2(model, FP8CommState(fp8_params=weights if fp8_weights_only else None))
        model(x).pow(2).mean().backward()
    grads = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        mean = None
        if q.grad is not None:
            mean = q.grad.clone()
            dist.all_reduce(mean)
            mean /= WORLD
        grads[name] = (p.grad.full_tensor() if p.grad is not None else None, mean, any(p is w for w in weights))
    return {"grads": grads, "warnings": [str(w.message) for w in caught if "FP8ReduceScatter" in str(w.message)]}


CASES = {
    "fp8_params=weights": (True, False),
    "fp8_params=weights, reduce_scatter_unused_params": (True, True),
    "fp8_params=None": (False, False),
}


def _worker(rank: int, world: int) -> dict:
    return run_parts({name: (lambda args=args: _case(rank, *args)) for name, args in CASES.items()})


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, WORLD, timeout=300)


def _check_used(results: list[dict], exact_others: bool) -> None:
    for rank, result in enumerate(results):
        for name, (grad, mean, is_fp8_weight) in result["grads"].items():
            if name.startswith("unused."):
                continue
            if exact_others and not is_fp8_weight:  # "reduced in their own dtype": the fp32 mean itself
                assert torch.equal(grad, mean), f"rank {rank}: {name} is not the fp32 mean ({sqnr(grad, mean):.1f} dB)"
            else:
                db = sqnr(grad, mean)
                assert db >= REDUCE_SCATTER_E5M2_SQNR_DB, f"rank {rank}: {name}: {db:.1f} dB"


def test_gradients_outside_fp8_params_stay_exact_next_to_an_unused_submodule(two_ranks):
    results = part_results(two_ranks, "fp8_params=weights")
    _check_used(results, exact_others=True)
    for result in results:  # as plain FSDP2: no gradient for what took no part
        assert result["grads"]["unused.weight"][0] is None and result["grads"]["unused.bias"][0] is None
    assert any("requires_grad_(False)" in w for w in results[0]["warnings"]), results[0]["warnings"]


def test_reduce_scatter_unused_params_keeps_the_fp8_reduce_scatter(two_ranks):
    results = part_results(two_ranks, "fp8_params=weights, reduce_scatter_unused_params")
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    _check_used(results, exact_others=True)
    for rank, result in enumerate(results):
        assert result["warnings"] == [], f"rank {rank}: {result['warnings']}"
        for name in ("unused.weight", "unused.bias"):  # FSDP sends zeros for them: they get zero gradients
            assert torch.equal(result["grads"][name][0], torch.zeros_like(result["grads"][name][0])), (rank, name)
        # The FP8Linear weights did go through FP8: within its error, but not the fp32 mean.
        grad, mean, _ = result["grads"]["fc1.weight"]
        assert not torch.equal(grad, mean), f"rank {rank}: fc1.weight was not reduced through FP8"


def test_every_gradient_in_fp8_next_to_an_unused_submodule_stays_within_fp8_error(two_ranks):
    results = part_results(two_ranks, "fp8_params=None")
    _check_used(results, exact_others=False)
    assert any("one scale per block" in w for w in results[0]["warnings"]), results[0]["warnings"]
