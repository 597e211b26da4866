"""Run by test_routes_fsdp_on_cpu.py under torchrun with two CPU processes: FSDP asked for by an ``fsdp_plugin``
(``route=plugin``) or by the variables ``accelerate launch`` exports from a config file's ``distributed_type: FSDP``
(``route=env``, set by the test), where Accelerate sets up DDP on the CPU. Prints what ``prepare`` did."""

import sys
from pathlib import Path

import torch
from accelerate.utils import FullyShardedDataParallelPlugin

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
from gpt import GPT, GPTConfig  # noqa: E402

from lightning_fp8.accelerate import Accelerator  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402


def main(route: str) -> None:
    plugin = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)} if route == "plugin" else {}
    accelerator = Accelerator(fp8_lm_recipe="fp8-lm", **plugin)
    model = GPT(GPTConfig(depth=1, width=32, heads=2, seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except ValueError as error:
        converted = accelerator.fp8_report.get("converted_layers", 0)
        print(f"rank {accelerator.process_index}: refused ({converted} converted): {error}", flush=True)
        return
    print(f"rank {accelerator.process_index}: prepared {type(model).__name__}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
