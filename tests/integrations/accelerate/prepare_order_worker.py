"""Run by test_accelerator.py under torchrun with two CPU processes (DDP): an optimizer prepared in a later call than
the model it trains is refused with what to do (the model and its optimizer in one prepare call), nothing changed;
prepared together they train, gradients all-reduced in FP8 (the report names each of two models' hooks). With
argv[1] == "dynamo", under Accelerate's dynamo_backend (torch.compile around the DDP model, which hid the DDP
wrapper: no FP8 all-reduce, no refusal)."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]
from lightning_fp8.accelerate import Accelerator  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402
from tests.integrations.accelerate.test_load_state_atomic import Net, _batches  # noqa: E402


def main() -> None:
    kwargs = {"dynamo_backend": "aot_eager"} if sys.argv[1:] == ["dynamo"] else {}
    accelerator = Accelerator(fp8_lm_recipe="fp8-lm", **kwargs)
    torch.manual_seed(0)
    model = accelerator.prepare(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    try:
        accelerator.prepare(optimizer)
    except ValueError as error:
        assert "in the same call" in str(error) and "Nothing was changed" in str(error), error
    else:
        raise AssertionError("prepare(optimizer) after the DDP model was accepted")
    for name, p in model.named_parameters():  # the weights kept their storage and dtype
        assert p.dtype == weights[name][0] and torch.equal(p.detach(), weights[name][1]), name

    accelerator = Accelerator(fp8_lm_recipe="fp8-lm", **kwargs)
    torch.manual_seed(0)
    model = Net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert str(accelerator.fp8_report["ddp_comm_hook"]).startswith("fp8_allreduce_hook"), accelerator.fp8_report
    for x, y in _batches(accelerator.process_index, 3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)

    # Two DDP models (found by a sweep: the report's ddp_comm_hook described the last one only).
    accelerator = Accelerator(fp8_lm_recipe="fp8-lm", **kwargs)
    first, second = Net(), Net()
    params = [*first.parameters(), *second.parameters()]
    first, second, _ = accelerator.prepare(first, second, torch.optim.AdamW(params, lr=1e-2))
    lines = str(accelerator.fp8_report["ddp_comm_hook"]).split("; ")
    assert [line.split(": ")[0] for line in lines] == ["model0", "model1"], accelerator.fp8_report
    assert all(line.split(": ", 1)[1].startswith("fp8_allreduce_hook") for line in lines), accelerator.fp8_report
    print(f"rank {accelerator.process_index}: prepare order ok", flush=True)


if __name__ == "__main__":
    main()
    exit_worker()
