"""lightning_fp8: FP8-LM mixed-precision training for PyTorch, Lightning and Accelerate.

The core (this package) imports only torch. ``import lightning_fp8`` also registers
``Trainer(precision="fp8-lm")`` and ``strategy="fsdp_fp8"`` when Lightning is installed.
"""

from lightning_fp8.convert import convert_to_fp8, fp8_modules
from lightning_fp8.formats import E4M3, E5M2, fp8_max
from lightning_fp8.linear import FP8Linear
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.scaling import ScalingState, compute_scale
from lightning_fp8.state import fp8_state_dict, load_fp8_state_dict

__version__ = "0.1.0"

__all__ = [
    "E4M3",
    "E5M2",
    "FP8Linear",
    "FP8Recipe",
    "ScalingState",
    "compute_scale",
    "convert_to_fp8",
    "fp8_max",
    "fp8_modules",
    "fp8_state_dict",
    "load_fp8_state_dict",
]
