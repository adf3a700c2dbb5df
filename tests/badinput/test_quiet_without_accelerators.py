"""`jaxtune` in a process of its own, with JAX's TPU and CUDA plugins installed (the tpu-plan and
gpu-plan extras, which `make test` installs) on a machine with neither device and no
JAX_PLATFORMS set: a bad data file gives jaxtune's line, and no plugin's traceback or warning."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxtune.host import accelerators
from tests.badinput.conftest import dolly_rows, write_jsonl

pytestmark = [
    pytest.mark.badinput,
    pytest.mark.skipif(accelerators.present(), reason="this machine has an accelerator"),
]

# What the plugins print when they start without their device: cuDNN's traceback, libtpu's warnings.
NOISE = ("Traceback", "cuDNN", "jax_plugins", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "libtpu")


def test_a_bad_data_file_gives_jaxtunes_line_and_no_plugin_noise(tmp_path):
    from prefect.settings import PREFECT_API_URL

    assert importlib.util.find_spec("libtpu") and importlib.util.find_spec("jax_plugins.xla_cuda13")
    bad = write_jsonl(tmp_path / "bad_line3.jsonl", dolly_rows(2))
    bad.write_text(bad.read_text() + "not json\n")
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value() or ""  # the session's server, or one of its own
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxtune.cli",
            "run",
            f"--set=data.source={bad}",
            f"--set=store.root={tmp_path / 'store'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"jaxtune: build_tokenizer: {bad} line 3: not valid JSON (Expecting value at column 1) (--debug shows the traceback)"
    )
    assert [word for word in NOISE if word in done.stderr] == [], done.stderr
