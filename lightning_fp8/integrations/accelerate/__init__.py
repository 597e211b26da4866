"""FP8-LM for Hugging Face Accelerate: a drop-in ``Accelerator`` and the ``lightning-fp8 launch`` command.

Users import it as ``from lightning_fp8.accelerate import Accelerator``. See docs/accelerate.md.
"""

from lightning_fp8.integrations.accelerate.accelerator import Accelerator
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE, ENV_TP_PLAN, FP8LaunchConfig

__all__ = ["ENV_EXCLUDE", "ENV_RECIPE", "ENV_TP_PLAN", "Accelerator", "FP8LaunchConfig"]
