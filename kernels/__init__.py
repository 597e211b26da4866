"""Kernels of lightning_fp8, installed as ``lightning_fp8.kernels``.

Each Triton kernel module (``cast``, ``adamw``, ...) has a pure-PyTorch reference of the same signature in
:mod:`lightning_fp8.kernels.reference`. Nothing here chooses between them: the core does that at one
dispatch point, :mod:`lightning_fp8.ops`. Triton modules are imported lazily, so this package imports
without Triton.

Nothing installs a top-level package named ``kernels``; but in a checkout's root (the current directory on
``sys.path``: ``python -m pytest``, a notebook) ``import kernels`` finds this folder first, before an installed
distribution of that name (Hugging Face's ``kernels``, which transformers imports). Imported that way, the folder
steps aside for the installed package when there is one.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _step_aside() -> None:
    """Put the installed ``kernels`` package in ``sys.modules`` in place of this folder, which the import system then
    returns (it reads the module back from ``sys.modules`` after running this file)."""
    # Every sys.path entry holding a lightning_fp8 checkout (this one by any spelling, through a link, or another
    # copy), whose kernels/ would step aside in turn: found again, they would recurse.
    path = [entry for entry in sys.path if not _is_checkout(entry or os.curdir)]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:  # none installed (or only a namespace portion): stay
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)  # if it raises, the import system drops sys.modules["kernels"]: not half-set


def _is_checkout(entry: str) -> bool:
    return os.path.isfile(os.path.join(entry, "kernels", "reference_adamw.py")) and os.path.isdir(
        os.path.join(entry, "lightning_fp8")
    )


if __name__ == "kernels":
    _step_aside()
