"""A tiny GPT (nanoGPT's shape, toy size) and a learnable synthetic token task, for the Lightning tests.

Every linear layer has sizes that are multiples of 16, so all of them become FP8 layers; the task (each
sequence counts up by a fixed step modulo the vocabulary) is learnable in a few dozen steps, so a falling
loss is a real signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 24  # not a power of two: token counts per batch are not either
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)  # each (B, T, C)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class CountingTokens(Dataset):
    """Sequences ``start, start + step, start + 2 step, ...`` modulo the vocabulary: (input, next-token target)."""

    def __init__(self, n: int, cfg: GPTConfig, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, cfg.vocab_size, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        seq = (start + step * torch.arange(cfg.block_size + 1)) % cfg.vocab_size
        self.x, self.y = seq[:, :-1], seq[:, 1:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loader(n: int = 96, batch_size: int = 6, seed: int = 0, cfg: GPTConfig | None = None) -> DataLoader:
    return DataLoader(CountingTokens(n, cfg or GPTConfig(), seed), batch_size=batch_size, shuffle=False)


class GPTModule(L.LightningModule):
    """The tiny GPT with AdamW (two param groups: weights decayed, the rest not) and an optional LR warm-up.

    Records every training loss in ``self.losses`` (a Python list) for trajectory comparisons.
    """

    def __init__(
        self,
        cfg: GPTConfig | None = None,
        lr: float = 1e-2,
        optimizer: str = "adamw",
        scheduler: bool = False,
        manual: bool = False,
        clip: float | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        self.model = TinyGPT(self.cfg)
        self.lr, self.optimizer_name, self.use_scheduler = lr, optimizer, scheduler
        self.automatic_optimization = not manual
        self.manual_clip = clip
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.manual_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
        opt.step()
        return loss

    def param_groups(self) -> list[dict]:
        decay = [p for n, p in self.model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n]
        other = [
            p for n, p in self.model.named_parameters() if not (p.dim() == 2 and "wte" not in n and "wpe" not in n)
        ]
        return [{"params": decay, "weight_decay": 0.1, "name": "decay"}, {"params": other, "weight_decay": 0.0}]

    def configure_optimizers(self):
        groups = self.param_groups()
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), eps=1e-8)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        elif self.optimizer_name == "adam_wd":
            opt = torch.optim.Adam(self.model.parameters(), lr=self.lr, weight_decay=0.1)
        elif self.optimizer_name == "amsgrad":
            opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, amsgrad=True)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        elif self.optimizer_name == "fp8adamw":  # the user's own: the plugin keeps it
            from lightning_fp8 import FP8AdamW

            opt = FP8AdamW(groups, lr=self.lr, betas=(0.9, 0.95), eps=1e-8)
        else:
            raise ValueError(self.optimizer_name)
        if not self.use_scheduler:
            return opt
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
