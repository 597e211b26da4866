"""``from lightning_fp8.accelerate import Accelerator``: FP8-LM for a plain Accelerate script.

Re-exports :mod:`lightning_fp8.integrations.accelerate` (which imports Accelerate; the core does not).
"""

from lightning_fp8.integrations.accelerate import ENV_EXCLUDE, ENV_RECIPE, ENV_TP_PLAN, Accelerator, FP8LaunchConfig

__all__ = ["ENV_EXCLUDE", "ENV_RECIPE", "ENV_TP_PLAN", "Accelerator", "FP8LaunchConfig"]
