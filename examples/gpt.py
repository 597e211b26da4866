"""A small GPT (nanoGPT-style), trained on bytes (the data is in corpus.py).

Public names (other examples import them; keep them stable):

- ``GPTConfig``: frozen config (``vocab_size``, ``seq_len``, ``depth``, ``width``, ``heads``, ...);
  ``GPTConfig.preset(name)`` for ``"toy"``, ``"small"``, ``"gpt125m"``.
- ``GPT``: the model; ``model(idx, targets=None) -> (logits, loss)``.
- ``fp8_module_filter``: ``fn(module, fqn) -> bool`` for ``convert_to_fp8`` / ``FP8LMPrecision``
  (and torchao's ``convert_to_float8_training``): keeps the output head in high precision.
- ``evaluate(model, batches, max_batches=None)``: the mean loss over (a few) validation batches.
- ``adamw_with_schedule(model, ...)``: the examples' AdamW (decay on matrices only) and its warm-up + cosine
  schedule.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "adamw_with_schedule", "evaluate", "fp8_module_filter"]

_PRESETS: dict[str, dict[str, int]] = {
    # Runs in a couple of minutes on a laptop CPU (FP8 emulated).
    "toy": {"seq_len": 128, "depth": 2, "width": 128, "heads": 4},
    # Minutes on one GPU.
    "small": {"seq_len": 512, "depth": 8, "width": 512, "heads": 8},
    # ~128M parameters: GPT-2 small's width and heads, 18 layers because a byte vocabulary has almost no
    # embedding parameters (GPT-2's 50257-token embedding is 39M of its 124M).
    "gpt125m": {"seq_len": 1024, "depth": 18, "width": 768, "heads": 12},
}


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        vocab_size: number of token ids; 256 for bytes.
        seq_len: context length (positions).
        depth: number of transformer blocks.
        width: embedding width; a multiple of ``heads`` (and of 16 for the linear layers to run in FP8).
        heads: attention heads.
        dropout: dropout probability (0 for short runs).
        bias: biases in linear layers and LayerNorms.
        tie_weights: share the token embedding with the output head (as GPT-2 does).
    """

    vocab_size: int = 256
    seq_len: int = 128
    depth: int = 2
    width: int = 128
    heads: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "depth", "width", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig({name}={value!r}) must be a positive int")
        if self.width % self.heads:
            raise ValueError(f"GPTConfig(width={self.width}, heads={self.heads}): width must be a multiple of heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig(dropout={self.dropout!r}) must be in [0, 1)")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named shape (``"toy"``, ``"small"``, ``"gpt125m"``) with optional field overrides."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}: choose one of {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads). The heads are the outer part of qkv's output features (each
        # head's q, k, v side by side, as in Megatron), so a tensor-parallel shard of qkv holds whole heads: the
        # number of heads here is the local one, from the width of qkv's output.
        q, k, v = self.qkv(x).view(B, T, -1, 3, C // self.heads).permute(3, 0, 2, 1, 4)
        # Attention itself stays in high precision: only the linear layers run in FP8 (as in FP8-LM).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # pre-norm residual blocks, as GPT-2
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, ``depth`` blocks, LayerNorm, output head.

    ``forward(idx, targets=None)`` takes ``idx`` of shape ``(B, T)`` (``T <= seq_len``) and returns
    ``(logits (B, T, vocab), loss)``; ``loss`` is the mean cross-entropy when ``targets`` is given, else None.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln_f = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * depth) so the residual stream's variance
        # does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"GPT got a sequence of length {T} but seq_len is {self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, width)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """Which linear layers run in FP8: all but the output head.

    The head's logits feed a softmax over the vocabulary, whose error FP8-LM (and torchao, and Transformer
    Engine's recipes) keep out of FP8; with a tied head its weight is also the embedding table.
    """
    return fqn.rpartition(".")[2] != "lm_head"


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], max_batches: int | None = None
) -> torch.Tensor:
    """Mean loss of ``model`` over the first ``max_batches`` ``(x, y)`` of ``batches`` (all of them: None), in eval
    mode.

    Returns a 0-dim fp32 tensor on the model's device (no host sync: a distributed caller can average it over
    ranks first). The model's train/eval mode is restored; run it under the autocast the training step uses.
    """
    was_training = model.training
    model.eval()
    losses = [model(x, y)[1].float() for x, y in itertools.islice(batches, max_batches)]
    model.train(was_training)
    if not losses:
        raise ValueError(f"evaluate(max_batches={max_batches}) got no batch: the validation data holds none")
    return torch.stack(losses).mean()


def adamw_with_schedule(
    model: nn.Module, *, lr: float, weight_decay: float, warmup_steps: int, max_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """A plain AdamW over ``model`` and its per-step schedule: linear warm-up, then cosine decay to 10% of ``lr``.

    Matrices (linear weights, embeddings) decay, as in GPT-2; biases and LayerNorm gains never do. With FP8-LM
    (``precision="fp8-lm"``, the Accelerate launch flag) it becomes ``FP8AdamW`` with the same hyper-parameters.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
