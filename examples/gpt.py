"""A small GPT (nanoGPT-style) and a byte-level text corpus that every machine has offline.

Public names (other examples import them; keep them stable):

- ``GPTConfig``: frozen config (``vocab_size``, ``seq_len``, ``depth``, ``width``, ``heads``, ...);
  ``GPTConfig.preset(name)`` for ``"toy"``, ``"small"``, ``"gpt125m"``.
- ``GPT``: the model; ``model(idx, targets=None) -> (logits, loss)``.
- ``fp8_module_filter``: ``fn(module, fqn) -> bool`` for ``convert_to_fp8`` / ``FP8LMPrecision``
  (and torchao's ``convert_to_float8_training``): keeps the output head in high precision.
- ``load_corpus(path=None, max_bytes=None, val_fraction=0.05) -> Corpus``: bytes of a text corpus split
  into ``train`` and ``val`` uint8 tensors. Default: the source files of Python's standard library.
- ``ByteWindows(data, seq_len)``: a plain ``torch.utils.data.Dataset`` of ``(x, y)`` windows, ``y`` shifted by one.

Byte-level modelling (vocabulary of 256) needs no tokenizer and no download; the stdlib's ~30 MB of
Python source is plenty for models up to ~100M parameters and a few thousand steps.
"""

from __future__ import annotations

import argparse
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

__all__ = [
    "GPT", "ByteWindows", "Corpus", "GPTConfig", "check_batches", "float_at_least", "fp8_module_filter", "int_at_least",
    "load_corpus", "stdlib_dir", "text_path",
]  # fmt: skip

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


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split for training: ``train``/``val`` are 1-D uint8 tensors; ``source`` says where from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: int


def stdlib_dir() -> Path:
    """The directory holding the Python standard library's source (present on every CPython install)."""
    return Path(os.path.dirname(os.__file__))


# The fewest bytes load_corpus accepts in either split: a few windows of the toy preset (seq_len 128).
_MIN_SPLIT_BYTES = 1024


def _text_files(root: Path, default: bool) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(
            f"load_corpus(path={str(root)!r}): the path is neither a file nor a directory (does it exist?); give a "
            "text file, a directory of text files, or path=None for the Python standard library's source"
        )
    skip = {"site-packages", "dist-packages", "__pycache__"}  # installed third-party code differs per machine
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        files += [Path(dirpath, f) for f in sorted(filenames) if (f.endswith(".py") or not default)]
    return files


def _bytes_tensor(data: bytes) -> torch.Tensor:
    # torch.frombuffer refuses an empty buffer (an empty file): its split gets load_corpus's size error instead.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_corpus(
    path: str | os.PathLike | None = None, max_bytes: int | None = None, val_fraction: float = 0.05
) -> Corpus:
    """Read a text corpus as bytes and split it deterministically into train and validation.

    Args:
        path: a text file or a directory (every non-binary file below it, in sorted order). ``None``: the
            ``.py`` files of Python's standard library.
        max_bytes: stop reading once this many bytes are collected (``None``: everything).
        val_fraction: share of files (whole files, chosen by a hash of their path, so the split does not
            change when ``max_bytes`` does) held out for validation. A single file is split at its end: its
            last ``val_fraction`` of bytes are the validation split.

    Raises:
        FileNotFoundError: if ``path`` is neither a file nor a directory.
        ValueError: if no text file is found there, or if either split ends up with fewer than 1024 bytes: with a single
            file, one under about ``1024 / min(val_fraction, 1 - val_fraction)`` bytes (20.5 KB at the default
            0.05); give more text, or a ``val_fraction`` nearer 0.5.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"load_corpus(val_fraction={val_fraction!r}) must be in (0, 1)")
    root = stdlib_dir() if path is None else Path(path)
    files = _text_files(root, default=path is None)
    train, val, n_files, total = [], [], 0, 0
    for f in files:
        data = f.read_bytes()
        if b"\0" in data[:4096]:  # binary file
            continue
        rel = str(f.relative_to(root)) if f != root else f.name
        held_out = zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000
        (val if held_out else train).append(data)
        n_files += 1
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if n_files == 1 or not val:  # one file (or an unlucky split): hold out its tail instead
        joined = b"\n".join(train + val)
        cut = int(len(joined) * (1 - val_fraction))
        train, val = [joined[:cut]], [joined[cut:]]
    if not n_files:
        raise ValueError(f"load_corpus({str(root)!r}) found no text file there (binary files are skipped): give a "
                         "text file or a directory holding some")  # fmt: skip
    as_tensor = lambda parts: _bytes_tensor(b"\n".join(parts))
    corpus = Corpus(as_tensor(train), as_tensor(val), str(root), n_files)
    n_train, n_val = corpus.train.numel(), corpus.val.numel()
    if min(n_train, n_val) < _MIN_SPLIT_BYTES:
        short = [name for name, n in (("training", n_train), ("validation", n_val)) if n < _MIN_SPLIT_BYTES]
        needed = math.ceil(_MIN_SPLIT_BYTES / min(val_fraction, 1 - val_fraction))
        todo = f"give more text (about {needed} bytes at this val_fraction"
        todo += ")" if max_bytes is None else ", and a max_bytes at least that large)"
        if short == ["validation"]:
            todo += " or raise val_fraction"
        elif short == ["training"]:
            todo += " or lower val_fraction"
        raise ValueError(
            f"load_corpus({str(root)!r}, max_bytes={max_bytes}, val_fraction={val_fraction}) split {n_files} "
            f"file(s) into {n_train} training and {n_val} validation bytes, but each split needs at least "
            f"{_MIN_SPLIT_BYTES} (too few: {' and '.join(short)}); {todo}"
        )
    return corpus


def check_batches(
    corpus: Corpus, seq_len: int, batch_size: int, splits: tuple[str, ...] = ("training", "validation")
) -> None:
    """Raise ``ValueError`` unless each of ``splits`` holds a full batch of ``seq_len`` windows (the loaders drop a
    last partial batch: a split without one would train or validate on nothing)."""
    for name in splits:
        data = {"training": corpus.train, "validation": corpus.val}[name]
        windows = (data.numel() - 1) // seq_len
        if windows < batch_size:
            raise ValueError(
                f"the {name} split of {corpus.source} ({data.numel()} bytes) holds {windows} windows of --seq-len "
                f"{seq_len}, fewer than one batch of --batch-size {batch_size}: give more text, or a smaller "
                "--batch-size or --seq-len"
            )


def int_at_least(minimum: int, maximum: int | None = None) -> Any:
    """An argparse ``type``: an integer >= ``minimum`` (and <= ``maximum``); anything else is a usage error, not a
    traceback later."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid int value"
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def float_at_least(minimum: float) -> Any:
    """An argparse ``type``: a finite float >= ``minimum`` (a learning rate, a weight decay, a gradient norm)."""

    def parse(text: str) -> float:
        value = float(text)  # a ValueError: argparse says "invalid float value"
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum:g}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def text_path(text: str) -> str:
    """An argparse ``type`` for ``--data``: a path that is a file or a directory (``load_corpus`` reads it)."""
    if not (Path(text).is_file() or Path(text).is_dir()):
        reason = "no such file or directory" if not Path(text).exists() else "neither a file nor a directory"
        raise argparse.ArgumentTypeError(f"{text!r}: {reason}; give a text file or a directory of text files")
    return text


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte tensor: item ``i`` is ``(x, y)``, ``y`` is ``x`` shifted by one byte.

    Both are int64 of length ``seq_len``. Shuffle the DataLoader for training.

    Raises:
        ValueError: if ``seq_len`` is not an int >= 1, or ``data`` is not 1-D and longer than ``seq_len``.
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if isinstance(seq_len, bool) or not hasattr(seq_len, "__index__") or seq_len < 1:
            raise ValueError(f"ByteWindows(seq_len={seq_len!r}) must be an int >= 1 (the window length in bytes)")
        seq_len = int(seq_len)
        if data.dim() != 1 or data.numel() <= seq_len:
            raise ValueError(f"ByteWindows needs a 1-D tensor longer than seq_len={seq_len}, got {tuple(data.shape)}")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]
