"""Command-line pieces the benchmark scripts share.

- ``require_cuda`` / ``gpu_only_args``: on a machine without a CUDA GPU a GPU-only script stops with a usage error
  (exit 2) instead of a traceback from its first CUDA call; ``--help`` shows the script's docstring.
- ``count`` / ``at_least_0`` / ``float_count``: argparse types of sizes, step counts and repeats (the examples'
  ``int_at_least``), so that ``--iters 0`` or ``--layers -1`` is a usage error naming the flag, not an empty
  median or a traceback after a model was built.
- ``fill_defaults``: the flags that ``--toy`` changes take their toy value only where not given.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from cli import int_at_least  # noqa: E402

count, at_least_0 = int_at_least(1), int_at_least(0)


def float_count(text: str) -> float:
    """An argparse ``type``: a whole number >= 1 written as a float (``--numel 1e9``)."""
    value = float(text)  # a ValueError: argparse says "invalid float_count value"
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (e.g. 1e9), got {text}")
    return value


def fill_defaults(args: argparse.Namespace, defaults: dict, toy_defaults: dict) -> argparse.Namespace:
    """Set each flag of ``defaults`` left at ``None`` (not given) to its ``--toy`` or full-size default: a flag
    given wins over ``--toy``. The flags' argparse defaults must be ``None``."""
    for key, value in (toy_defaults if args.toy else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


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
