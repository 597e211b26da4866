"""Lightning integration: ``Trainer(precision="fp8-lm")``, ``strategy="fsdp_fp8"`` and the FP8 callbacks.

``import lightning_fp8`` registers the strings (see :mod:`.registry`); the classes can also be used directly::

    trainer = L.Trainer(plugins=[FP8LMPrecision(recipe="fp8-lm")], callbacks=[FP8ScaleMonitor()])
"""

from lightning_fp8.integrations.lightning.callbacks import FP8ScaleMonitor
from lightning_fp8.integrations.lightning.health_callback import TrainingHealthMonitor
from lightning_fp8.integrations.lightning.precision import FP8LMPrecision
from lightning_fp8.integrations.lightning.strategy import FP8FSDPStrategy

__all__ = ["FP8FSDPStrategy", "FP8LMPrecision", "FP8ScaleMonitor", "TrainingHealthMonitor"]
