"""A byte-level text corpus that every machine has offline, split into training and validation, and its windows.

Public names (the example scripts and the tests import them; keep them stable):

- ``load_corpus(path=None, max_bytes=None, val_fraction=0.05) -> Corpus``: bytes of a text corpus split
  into ``train`` and ``val`` uint8 tensors. Default: the source files of Python's standard library.
- ``check_batches(corpus, seq_len, batch_size)``: a ``ValueError`` unless each split holds one full batch.
- ``ByteWindows(data, seq_len)``: a plain ``torch.utils.data.Dataset`` of ``(x, y)`` windows, ``y`` shifted by one.
- ``add_data_arguments(parser)``, ``corpus_from_args(args, seq_len)``, ``make_loaders(corpus, seq_len, batch_size)``:
  the ``--data``/``--max-bytes``/``--val-fraction`` flags every training script takes, and what they build.

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

import torch
from cli import fraction, int_at_least, text_path
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "ByteWindows", "Corpus", "add_data_arguments", "check_batches", "corpus_from_args", "load_corpus", "make_loaders",
    "stdlib_dir",
]  # fmt: skip


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split for training: ``train``/``val`` are 1-D uint8 tensors; ``source`` says where from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: int

    def describe(self) -> str:
        return (
            f"data: {self.source} ({self.files} files, {self.train.numel() / 1e6:.1f} MB train, "
            f"{self.val.numel() / 1e6:.2f} MB validation)"
        )


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
        paths = [Path(dirpath, f) for f in sorted(filenames) if (f.endswith(".py") or not default)]
        files += [p for p in paths if p.is_file()]  # not a broken link (no file to open) or a pipe (a read that waits)
    return files


def _bytes_tensor(data: bytes) -> torch.Tensor:
    # torch.frombuffer refuses an empty buffer (an empty file): its split gets load_corpus's size error instead.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _joined_size(parts: list[bytes]) -> int:
    # The size of b"\n".join(parts).
    return sum(map(len, parts)) + max(len(parts) - 1, 0)


def load_corpus(
    path: str | os.PathLike | None = None, max_bytes: int | None = None, val_fraction: float = 0.05
) -> Corpus:
    """Read a text corpus as bytes and split it deterministically into train and validation.

    Args:
        path: a text file or a directory (every non-binary file below it, in sorted order). ``None``: the
            ``.py`` files of Python's standard library.
        max_bytes: an upper bound on the corpus: files are read in order, the last one only in part, until the
            two splits together (with the newline that joins two files) hold this many bytes (``None``: everything).
        val_fraction: share of files (whole files, chosen by a hash of their path, so the split does not
            change when ``max_bytes`` does) held out for validation. A single file is split at its end: its
            last ``val_fraction`` of bytes are the validation split (so are files whose hashed split leaves either
            side under 1024 bytes).

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
        separator = 1 if n_files else 0  # the b"\n" that joins this file to the previous one
        allowed = None if max_bytes is None else max_bytes - total - separator
        if allowed is not None and allowed <= 0:
            break
        with open(f, "rb") as fh:
            data = fh.read(-1 if allowed is None else allowed)  # never more than the bound leaves
        if b"\0" in data[:4096]:  # binary file
            continue
        rel = str(f.relative_to(root)) if f != root else f.name
        held_out = zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000
        (val if held_out else train).append(data)
        n_files += 1
        total += separator + len(data)
    if n_files == 1 or min(_joined_size(train), _joined_size(val)) < _MIN_SPLIT_BYTES:
        # One file, or an unlucky split (no file held out, or only a small one: which files hash into validation
        # depends on the directory, e.g. on the Python version's standard library): hold out the tail instead.
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


def add_data_arguments(parser: argparse.ArgumentParser, max_bytes: int | None = None) -> None:
    """``--data``, ``--max-bytes`` and ``--val-fraction``, the arguments of :func:`load_corpus`."""
    parser.add_argument(
        "--data", type=text_path, help="a text file or directory (default: Python's standard library source)"
    )
    parser.add_argument(
        "--max-bytes", type=int_at_least(1), default=max_bytes, help="read at most this many bytes of the corpus"
    )
    parser.add_argument(
        "--val-fraction",
        type=fraction,
        default=0.05,
        help="share held out for validation: whole files of a directory, the tail of a single file (default: 0.05)",
    )


def corpus_from_args(args: argparse.Namespace, seq_len: int) -> Corpus:
    """The corpus of ``--data``/``--max-bytes``/``--val-fraction``, checked to hold a batch of ``--batch-size`` in
    each split. Raises ``ValueError`` (say it as a usage error) when it does not."""
    corpus = load_corpus(args.data, max_bytes=args.max_bytes, val_fraction=args.val_fraction)
    check_batches(corpus, seq_len, args.batch_size)
    return corpus


def make_loaders(
    corpus: Corpus, seq_len: int, batch_size: int, generator: torch.Generator | None = None
) -> tuple[DataLoader, DataLoader]:
    """Shuffled training windows (drawn with ``generator``) and validation windows in order; both drop a last
    partial batch."""
    pin = torch.cuda.is_available()
    train = DataLoader(
        ByteWindows(corpus.train, seq_len),
        batch_size,
        shuffle=True,
        drop_last=True,
        pin_memory=pin,
        generator=generator,
    )
    val = DataLoader(ByteWindows(corpus.val, seq_len), batch_size, shuffle=False, drop_last=True, pin_memory=pin)
    return train, val
