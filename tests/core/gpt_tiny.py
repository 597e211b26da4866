"""A tiny GPT (nanoGPT's shape: token + position embeddings, pre-norm attention and MLP blocks, a linear head)
for optimizer tests. Feature sizes are multiples of 16 so ``convert_to_fp8`` converts every block linear."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (batch, tokens, channels)
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, block_size: int = 16, n_embd: int = 32, n_head: int = 2, n_layer: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * n_layer) if "fc_out" in name or "proj" in name else 1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps: int, batch: int = 8, block_size: int = 16, vocab: int = 64, seed: int = 0):
    """A learnable synthetic language: each token is a fixed function of the previous two, plus 10% noise."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, vocab), generator=gen)
    for _ in range(steps):
        seq = torch.empty(batch, block_size + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, vocab, (batch, 2), generator=gen)
        for i in range(2, block_size + 1):
            nxt = table[seq[:, i - 2], seq[:, i - 1]]
            noise = torch.rand(batch, generator=gen) < 0.1
            seq[:, i] = torch.where(noise, torch.randint(0, vocab, (batch,), generator=gen), nxt)
        yield seq[:, :-1], seq[:, 1:]


def train(model: nn.Module, opt: torch.optim.Optimizer, data, scaler=None) -> torch.Tensor:
    """One optimizer step per ``(x, y)`` of ``data`` (the loss scaled by ``scaler`` when given); the losses."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = model(x, y)
        (scaler.scale_loss(loss) if scaler is not None else loss).backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)
