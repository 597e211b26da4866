"""Command-line argument types shared by the example scripts: a bad value is argparse's usage error naming the
flag, not a traceback from deep inside the run.

- ``int_at_least(minimum, maximum=None)``: sizes, step counts, seeds.
- ``float_at_least(minimum)``: learning rates, weight decays, gradient norms.
- ``fraction``: a share strictly between 0 and 1 (``--val-fraction``).
- ``text_path``: ``--data``, a text file or a directory of them.
- ``output_dir``: ``--out``, a directory to write into (created if missing).
- ``flags_given(parser, argv)``: the flags a command line gives, defaults left out.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

__all__ = ["flags_given", "float_at_least", "fraction", "int_at_least", "output_dir", "text_path"]


def int_at_least(minimum: int, maximum: int | None = None) -> Any:
    """An argparse ``type``: an integer >= ``minimum`` (and <= ``maximum``)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse says "invalid int value"
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def float_at_least(minimum: float) -> Any:
    """An argparse ``type``: a finite float >= ``minimum``."""

    def parse(text: str) -> float:
        value = float(text)  # a ValueError: argparse says "invalid float value"
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum:g}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def fraction(text: str) -> float:
    """An argparse ``type``: a number strictly between 0 and 1."""
    value = float(text)  # a ValueError: argparse says "invalid fraction value"
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number strictly between 0 and 1, got {text}")
    return value


def text_path(text: str) -> str:
    """An argparse ``type`` for ``--data``: a path that is a file or a directory (``load_corpus`` reads it).

    An empty value is refused: ``--data "$UNSET"`` would otherwise mean the current directory.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty (an unset shell variable?); give a text file or a directory of text files, or leave "
            "--data out for the Python standard library's source"
        )
    if not (Path(text).is_file() or Path(text).is_dir()):
        reason = "no such file or directory" if not Path(text).exists() else "neither a file nor a directory"
        raise argparse.ArgumentTypeError(f"{text!r}: {reason}; give a text file or a directory of text files")
    return text


def output_dir(text: str) -> Path:
    """An argparse ``type`` for ``--out``: a directory, or a path that is not there yet (the script creates it).

    An existing file is refused now: the scripts create the folder only after loading the data and building the
    model, where ``mkdir`` failed with a traceback. An empty value would write into the current directory.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty (an unset shell variable?); give a directory to write to")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory; give a directory to write to")
    return path


def flags_given(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> list[str]:
    """The flags (``--max-steps``) that ``argv`` gives, in the parser's order, a default value given explicitly too.

    argparse fills in a default only where the namespace has no value yet: a namespace whose every attribute is a
    marker comes back with the marker wherever the command line gave nothing.
    """
    unset = object()
    dests = vars(parser.parse_args(argv))
    given = vars(parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests, unset))))
    return ["--" + dest.replace("_", "-") for dest, value in given.items() if value is not unset]
