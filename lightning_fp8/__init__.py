"""lightning_fp8: FP8-LM mixed-precision training for PyTorch, Lightning and Accelerate.

The core (this package's top-level modules) imports only torch. When Lightning is installed,
``import lightning_fp8`` also imports it (``lightning`` and ``pytorch_lightning``, whichever are installed) to
register ``Trainer(precision="fp8-lm")`` and ``strategy="fsdp_fp8"``; without Lightning it imports only torch.
Accelerate is imported only when ``lightning_fp8.accelerate`` is used: the integrations' public names are
resolved lazily, and the core modules never import Lightning or Accelerate themselves.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from lightning_fp8.convert import convert_to_fp8, fp8_modules
from lightning_fp8.formats import E4M3, E5M2, fp8_max
from lightning_fp8.linear import FP8Linear
from lightning_fp8.mlp import FP8MLP
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.scale_rule import compute_scale
from lightning_fp8.scaling import ScalingState
from lightning_fp8.state import fp8_state_dict, load_fp8_state_dict

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    "FP8AdamW": "lightning_fp8.optim",
    "FP8GradScaler": "lightning_fp8.grad_scaler",
    "fp8_stats": "lightning_fp8.stats",
    "HealthMonitor": "lightning_fp8.health",
    "HealthConfig": "lightning_fp8.health",
    "FP8LMPrecision": "lightning_fp8.integrations.lightning",
    "FP8FSDPStrategy": "lightning_fp8.integrations.lightning",
}
_LAZY_MODULES = ("distributed", "callbacks", "accelerate", "kernels", "stats", "health", "optim")

__all__ = [
    "E4M3",
    "E5M2",
    "FP8Linear",
    "FP8MLP",
    "FP8Recipe",
    "ScalingState",
    "compute_scale",
    "convert_to_fp8",
    "fp8_max",
    "fp8_modules",
    "fp8_state_dict",
    "load_fp8_state_dict",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"lightning_fp8.{name}")
    raise AttributeError(f"module 'lightning_fp8' has no attribute {name!r}")


def _register_with_lightning() -> None:
    # The one registration with Lightning's internals (precision "fp8-lm", strategy "fsdp_fp8"); it lives
    # in integrations/lightning/registry.py, is idempotent, and is skipped when Lightning is absent.
    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ImportError:  # a broken or blocked install counts as absent
            return False

    if not (installed("lightning") or installed("pytorch_lightning")):
        return
    if not installed("lightning_fp8.integrations.lightning.registry"):
        return
    importlib.import_module("lightning_fp8.integrations.lightning.registry").register()


_register_with_lightning()
