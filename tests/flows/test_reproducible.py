"""Two fresh processes given one config write the same bytes: weights, generations and metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.toy import TOY

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
TIMINGS = (
    "seconds",
    "compile_seconds",
    "tokens_per_second",
    "mfu",
)  # wall-clock figures, the only ones allowed to differ


def run_in_fresh_process(store: Path) -> Path:
    """`jaxtune run` with the toy settings in a new interpreter; returns the report folder."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    env.pop(
        "JAXTUNE_COMPILE_CACHE", None
    )  # each process compiles for itself: a shared cache would hide a differing program
    args = [a for s in [*TOY, f"store.root={store}"] for a in ("--set", s)]
    out = subprocess.run(
        [sys.executable, "-m", "jaxtune.cli", "run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


def metrics(report_folder: Path) -> dict:
    report = json.loads((report_folder / "report.json").read_text())
    report["train"] = {k: v for k, v in report["train"].items() if k not in TIMINGS}
    del report["export"]["path"]  # inside each process's own store
    return report


def test_two_fresh_processes_write_identical_artifacts(tmp_path):
    first, second = run_in_fresh_process(tmp_path / "a"), run_in_fresh_process(tmp_path / "b")
    assert first.name == second.name, "same config, same code: same keys"
    assert metrics(first) == metrics(second)
    for stage, name in [
        ("train", "params.safetensors"),
        ("train", "optimizer.safetensors"),
        ("generate", "generations.jsonl"),
        ("final_eval", "metrics.json"),
        ("export", "adapter/adapter_model.safetensors"),
        ("tokenize", "train.arrow"),
    ]:
        [a] = (tmp_path / "a" / stage).glob(f"*/{name}")
        [b] = (tmp_path / "b" / stage).glob(f"*/{name}")
        assert a.read_bytes() == b.read_bytes(), f"{stage}/{name} differs"
