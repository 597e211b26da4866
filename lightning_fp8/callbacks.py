"""``lightning_fp8.callbacks``: the Lightning callbacks that log FP8 scaling and training health.

Re-exported from :mod:`lightning_fp8.integrations.lightning` (importing this module imports Lightning)::

    trainer = L.Trainer(precision="fp8-lm", callbacks=[FP8ScaleMonitor(), TrainingHealthMonitor()])
"""

from lightning_fp8.integrations.lightning.callbacks import FP8ScaleMonitor
from lightning_fp8.integrations.lightning.health_callback import TrainingHealthMonitor

__all__ = ["FP8ScaleMonitor", "TrainingHealthMonitor"]
