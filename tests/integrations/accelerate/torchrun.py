"""Run a worker script of these tests on two CPU processes under torchrun (DDP over gloo), and return its log.

The environment is the test process's without lightning_fp8's and Accelerate's variables (no recipe or Accelerate
config leaks in from the developer's shell or home), plus ``ACCELERATE_USE_CPU``, one thread per process (a small CI
machine) and ``env``. A worker's failed assertion fails its process: the test fails with the end of the log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300


def run_two_processes(worker: Path, tmp_path: Path, *args: str, drop: tuple[str, ...] = (), **env: str) -> str:
    """``torchrun --standalone --nproc_per_node 2 worker *args``; ``drop``: more variable prefixes to leave out."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FP8_", "ACCELERATE_", *drop))}
    environ.update({"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path), **env})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker), *args]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    return log
