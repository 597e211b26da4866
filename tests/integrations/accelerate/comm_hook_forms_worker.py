"""Run by test_comm_hook_forms.py under torchrun with two CPU processes (DDP): DistributedDataParallelKwargs(comm_hook=)
in each form a script may write. Where Accelerate registers no hook (None, "no", a string such as "bf16" that is not a
DDPCommunicationHookType member) the gradients go in FP8, as without the handler; where it registers one (a member
such as FP16) that hook runs and the report names it. Found by a sweep: None, "no" and "bf16" turned the FP8
all-reduce off, and the report named a hook that DDP did not run (fp32 gradients)."""

import sys
import warnings
from pathlib import Path

from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]
from lightning_fp8.accelerate import Accelerator  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402
from tests.integrations.accelerate.test_load_state_atomic import Net  # noqa: E402

FORMS = {"left out": "fp8", "None": "fp8", "'no'": "fp8", "NO": "fp8", "'bf16'": "fp8", "FP16": "fp16_compress_hook"}
VALUES = {"None": None, "'no'": "no", "NO": DDPCommunicationHookType.NO, "'bf16'": "bf16",
          "FP16": DDPCommunicationHookType.FP16}  # fmt: skip


def main() -> None:
    for form, expected in FORMS.items():
        handlers = [DistributedDataParallelKwargs(comm_hook=VALUES[form])] if form in VALUES else []
        accelerator = Accelerator(fp8_lm_recipe="fp8-lm", kwargs_handlers=handlers)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = accelerator.prepare(Net())
        hooks = [getattr(hook, "__name__", repr(hook)) for hook, _ in model._comm_hooks]  # what DDP runs
        report = str(accelerator.fp8_report["ddp_comm_hook"])
        said = " ".join(str(w.message) for w in caught if "comm_hook" in str(w.message))
        if expected == "fp8":
            assert hooks == ["fp8_allreduce_hook"] and report.startswith("fp8_allreduce_hook"), (form, hooks, report)
            if form == "'bf16'" and accelerator.is_main_process:  # a value Accelerate ignored: said so
                assert "registered no hook" in said and "communicated in FP8" in said, (form, said)
            elif form != "'bf16'":
                assert not said, (form, said)
        else:
            assert hooks == [expected] and report == "fp16", (form, hooks, report)
            if accelerator.is_main_process:
                assert "not communicated in FP8" in said, (form, said)
    print(f"rank {accelerator.process_index}: comm hook forms ok", flush=True)
    exit_worker()


if __name__ == "__main__":
    main()
