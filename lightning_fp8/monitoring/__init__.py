"""The parts of :class:`~lightning_fp8.health.HealthMonitor` (:mod:`lightning_fp8.health`), one concern each.

- :mod:`~lightning_fp8.monitoring.config`: :class:`HealthConfig`, the thresholds of the spike and plateau tests.
- :mod:`~lightning_fp8.monitoring.events`: the series a monitor keeps, the kinds of events and recovery actions,
  :class:`HealthEvent`, and the actions of ``FP8GradScaler``'s fallbacks.
- :mod:`~lightning_fp8.monitoring.state`: a monitor's saved state, checked entry by entry before it is loaded.
- :mod:`~lightning_fp8.monitoring.measures`: what a monitor is given to watch: the global norm of gradients or
  parameters, and memory use.
"""
