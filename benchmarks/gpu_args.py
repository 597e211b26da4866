"""Command lines of the GPU-only benchmark scripts: ``--help`` shows the script's docstring, and on a machine without
a CUDA GPU the script stops with a usage error (exit 2) instead of a traceback from its first CUDA call."""

from __future__ import annotations

import argparse

import torch


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """A usage error from ``parser`` unless a CUDA GPU is there."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")


def gpu_only_args(doc: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    """The (empty) arguments of a script that takes none, described by ``doc``; see the module docstring."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = parser.parse_args(argv)
    require_cuda(parser)
    return args
