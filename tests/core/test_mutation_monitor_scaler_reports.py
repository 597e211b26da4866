"""What reaches FP8GradScaler's decisions, as lightning_fp8/grad_scaling/reports.py documents it, where a mutation audit
found it unpinned: a sparse gradient's headroom is that of its values with duplicates summed ("as the dense gradient
holds them": the same run with a dense embedding is the reference), and record_nonfinite's flag counts only where it
is > 0 (its docstring), so a flag of 0 or below never cancels another report."""

import torch
from torch import nn

from lightning_fp8 import FP8GradScaler


def _mu_after_one_step(sparse: bool) -> tuple[float, int]:
    # Row 0 is looked up twice: each lookup's gradient is 2 * mu = 2**126, their sum 2**127, which with the headroom
    # of 2 passes fp32's maximum (~2**128 > 3.4e38): no headroom, so mu must not double (growth_interval=1).
    emb = nn.Embedding(4, 3, sparse=sparse)
    opt = torch.optim.SGD(emb.parameters(), lr=0.0)
    scaler = FP8GradScaler(init_scale=2.0**125, max_scale=2.0**127, growth_interval=1, headroom=2.0)
    scaler.scale_loss((emb(torch.tensor([0, 0, 1])) * 2.0).sum()).backward()
    if sparse:
        assert not emb.weight.grad.is_coalesced()  # the duplicates are stored apart
    assert scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), scaler.skipped_steps


def test_a_sparse_gradients_headroom_is_that_of_its_summed_duplicates_as_the_dense_one():
    dense = _mu_after_one_step(sparse=False)
    assert dense == (2.0**125, 0)  # the dense gradient's 2**127 has no headroom: mu stays
    assert _mu_after_one_step(sparse=True) == dense


def _skipped(flags: list[float]) -> bool:
    scaler = FP8GradScaler(init_scale=2.0**10)
    for flag in flags:
        scaler.record_nonfinite(torch.tensor(flag))
    scaler.update()
    return scaler.get_scale() == 2.0**9 and scaler.skipped_steps == 1


def test_a_nonfinite_flag_counts_only_where_it_is_positive():
    assert _skipped([1.0]) and _skipped([3.0]) and _skipped([0.0, 1.0])
    assert not _skipped([0.0]) and not _skipped([-1.0])
    assert _skipped([-1.0, 1.0])  # a flag that says "none seen" does not cancel one that saw a non-finite value
    assert _skipped([1.0, -2.0, 0.5])
