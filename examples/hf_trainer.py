"""A Hugging Face model trained by ``transformers.Trainer`` with FP8-LM layers and FP8AdamW.

The Trainer knows nothing of FP8: its checkpoints hold the weights (``model.safetensors``, the unscaled values) and
``FP8AdamW``'s state (``optimizer.pt``), but not the FP8 scaling state (scales and amax histories, in non-persistent
buffers), and it does not scale the loss by mu. So:

- ``FP8StateCallback`` saves the scaling state beside each checkpoint and loads it when training resumes from one:
  the resumed run then continues the uninterrupted one exactly (without it, the casts restart from fresh scales).
- ``FP8AdamW(..., fp8_grads=False)``: the Trainer's gradient clipping (``max_grad_norm``) reads ``param.grad``.
- The recipe is O1 (``"fp8-lm-o1"``: fp32 master weights and gradients): at O2 the FP8 weights' gradients are fp16,
  and without mu (the Trainer never calls ``FP8GradScaler.scale_loss``) those below 2**-24 are lost.

    python examples/hf_trainer.py --steps 40 --out runs/hf_trainer
    python examples/hf_trainer.py --steps 80 --out runs/hf_trainer --resume runs/hf_trainer/checkpoint-40

A tiny Llama built from its config (no download), trained on this file's bytes; put your own model and dataset in.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from cli import int_at_least, output_dir
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from lightning_fp8 import FP8AdamW, convert_to_fp8, fp8_state_dict, load_fp8_state_dict

RECIPE = "fp8-lm-o1"


def state_file(process_index: int) -> str:
    """Each process's own file (its activations' scales and histories are its own, as its RNG state is)."""
    return f"lightning_fp8_state_rank{process_index}.pt"


class FP8StateCallback(TrainerCallback):
    """Saves ``fp8_state_dict(model)`` into each checkpoint folder the Trainer writes (a file per process), and loads
    it from ``resume_from`` (the checkpoint folder given to ``trainer.train(resume_from_checkpoint=...)``: a path)
    when training begins. Written for ``args.output_dir`` (not a hyperparameter search's trial folders)."""

    def __init__(self, model: torch.nn.Module, resume_from: str | os.PathLike | None = None) -> None:
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(f"FP8StateCallback(resume_from=...) takes a checkpoint folder, got {resume_from!r}")
        self.model = model
        self.resume_from = resume_from

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)  # the main process may not have made it yet
        path = folder / state_file(args.process_index)
        partial = path.with_name(path.name + ".partial")
        torch.save(fp8_state_dict(self.model), partial)
        os.replace(partial, path)  # whole or absent, never half-written

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume_from is None:
            return
        path = Path(self.resume_from) / state_file(args.process_index)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was saved without FP8StateCallback (or by fewer processes). "
                "Resume without resume_from to start the FP8 scales fresh"
            )
        load_fp8_state_dict(self.model, torch.load(path, weights_only=True))


class ByteBlocks(torch.utils.data.Dataset):
    """Fixed windows of a text's bytes, as language-model examples."""

    def __init__(self, text: bytes, seq_len: int) -> None:
        data = torch.tensor(list(text), dtype=torch.long)
        self.blocks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build(seed: int = 0) -> tuple[torch.nn.Module, FP8AdamW]:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = convert_to_fp8(LlamaForCausalLM(config), recipe=RECIPE)
    return model, FP8AdamW(model.parameters(), lr=3e-3, recipe=RECIPE, fp8_grads=False)


def train(steps: int, out: str, resume: str | None = None, save_steps: int = 20) -> torch.nn.Module:
    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    args = TrainingArguments(
        output_dir=out, max_steps=steps, save_steps=save_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_grad_norm=1.0, logging_steps=max(1, steps // 4), use_cpu=not
        torch.cuda.is_available(), report_to=[], seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ByteBlocks(Path(__file__).read_bytes(), seq_len=32),
        optimizers=(optimizer, scheduler),
        callbacks=[FP8StateCallback(model, resume_from=resume)],
    )
    trainer.train(resume_from_checkpoint=resume)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # counts, checked here: transformers reads max_steps <= 0 as "train num_train_epochs epochs", so --steps 0 or -1
    # trained for 3 epochs without a word
    parser.add_argument("--steps", type=int_at_least(1), default=40, help="optimizer steps in all (also when resuming)")
    parser.add_argument("--save-steps", type=int_at_least(1), default=20)
    parser.add_argument("--out", type=output_dir, default="runs/hf_trainer")
    parser.add_argument("--resume", help="a checkpoint folder of an earlier run")
    args = parser.parse_args(argv)
    if args.resume is not None:  # checked before the Trainer creates --out and builds the model
        folder = Path(args.resume)
        if not folder.is_dir():
            parser.error(f"--resume {args.resume!r}: no such directory; give a checkpoint folder of an earlier run")
        if not list(folder.glob("lightning_fp8_state_rank*.pt")):
            parser.error(
                f"--resume {args.resume!r} holds no {state_file(0)}: it is not a checkpoint folder this script wrote "
                "(FP8StateCallback saves one into each); give one, e.g. --out/checkpoint-<step>"
            )
        # transformers checks max_steps only after a step: resumed at --steps already, it trained one step more
        trainer_state = folder / "trainer_state.json"
        done = json.loads(trainer_state.read_text()).get("global_step", 0) if trainer_state.is_file() else 0
        if done >= args.steps:
            parser.error(
                f"--resume {args.resume!r} is at step {done} already: give a --steps above it (the run's steps in all)"
            )
    train(args.steps, str(args.out), args.resume, args.save_steps)


if __name__ == "__main__":
    main()
