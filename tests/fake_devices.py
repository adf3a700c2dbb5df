"""Running a test module's script in a process of its own with fake CPU devices: JAX fixes its
device count when it starts, so a mesh of several devices needs a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_with_devices(module: str, devices: int, timeout: int = 600):
    """`python -m module` with `devices` fake CPU devices; the JSON its last line prints."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    done = subprocess.run(
        [sys.executable, "-m", module],
        cwd=Path(__file__).parents[1],
        env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
