"""A stop signal that reaches one process of a job stops every process at the same step, agreed
through JAX's coordination service (`jaxtune.host.processes.any_of`): a process that stopped alone
would leave the others waiting in the step's collectives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtune.host.launch import free_port

pytestmark = pytest.mark.mesh

ROOT = Path(__file__).parents[2]


def test_sigterm_to_one_process_stops_both_at_its_step():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.mesh.stop_job", str(index), str(port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in (0, 1)
    ]
    outs = [job.communicate(timeout=300) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err[-3000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == [
        "process 0 stopped at step 5 by another process's signal",
        "process 1 stopped at step 5 by SIGTERM",
    ]
