"""The finetune flow as a job of two processes (`jaxtune launch --processes 2 --cpu-devices 4`),
through the train stage: process 0 alone writes the store and the Prefect artifacts, both train
on one mesh of all 8 devices (each process's 4 holding half of every batch), and the losses are
a one-process run's on the same 2 x 4 mesh.

One test, so that no two xdist workers start the job each (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxtune.artifacts import ArtifactStore
from tests.flows.shapes import TOY_MODEL
from tests.prefect_runs import flow_runs_of_store

pytestmark = pytest.mark.mesh

ROOT = Path(__file__).parents[2]
STAGES = ("build_tokenizer", "build_model", "tokenize", "baseline_eval", "train")
SETTINGS = [
    *TOY_MODEL,
    "data.max_train_rows=64",
    "data.max_eval_rows=16",
    "train.max_steps=3",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.eval_every=null",
    "train.checkpoint_every=2",  # one checkpoint, written by process 0 while the other waits
    "mesh.fsdp=4",  # data -1: 2, so the batch (and fsdp's parameter shards) spans both processes
]


def launch(store: Path, processes: int, devices: int, *extra: str) -> subprocess.CompletedProcess:
    """`jaxtune launch` of `jaxtune run --until train` with SETTINGS in `store`, on the session's Prefect server."""
    from prefect.settings import PREFECT_API_URL

    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": path}
    sets = [a for s in [*SETTINGS, f"store.root={store}"] for a in ("--set", s)]
    command = [
        sys.executable,
        "-m",
        "jaxtune.cli",
        "launch",
        "--processes",
        str(processes),
        "--cpu-devices",
        str(devices),
        "--",
        "run",
        "--until",
        "train",
        *sets,
        *extra,
    ]
    started = time.monotonic()
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(f"{processes} process(es) x {devices} devices: {time.monotonic() - started:.1f} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def losses(train_folder: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (train_folder / "log.jsonl").read_text().splitlines()) if "loss" in r]


def train_mesh(train_folder: Path) -> tuple[str, dict, list[int]]:
    """The train artifact's mesh line (summary.json), its memory plan (memory.json) and its batch shape."""
    summary = json.loads((train_folder / "summary.json").read_text())
    return summary["mesh"], json.loads((train_folder / "memory.json").read_text()), summary["batch_shape"]


def prefect_runs(store: Path) -> tuple[list, list, list]:
    """The flow runs of `store`'s job, their task runs and their Prefect artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = flow_runs_of_store(client, store)
        of_runs = FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs]))
        tasks = client.read_task_runs(flow_run_filter=of_runs, limit=200)
        artifacts = client.read_artifacts(flow_run_filter=of_runs, limit=200)
    return runs, tasks, artifacts


@pytest.mark.usefixtures("prefect_server")
def test_two_processes_train_as_one_and_process_0_alone_writes(tmp_path):
    store = tmp_path / "store"
    job = launch(store, 2, 4)

    # Both processes finish with the same artifact, each line prefixed with its process.
    last = {i: [line for line in job.stdout.splitlines() if line.startswith(f"[{i}] ")][-1] for i in (0, 1)}
    [train_folder] = (store / "train").iterdir()
    assert last == {0: f"[0] {train_folder}", 1: f"[1] {train_folder}"}

    # One verified artifact per stage, and nothing else: no temporary folder, no checkpoint left.
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".") and p.name != "xla-cache") == sorted(
        STAGES
    )
    for stage in STAGES:
        [folder] = (store / stage).iterdir()
        assert ArtifactStore(store).verify(stage, folder.name) and (folder / "result.json").is_file()
    assert not list((store / ".scratch").rglob("*.safetensors"))

    # Two flow runs, one per process; the tasks and the Prefect artifacts are process 0's run alone.
    runs, tasks, artifacts = prefect_runs(store)
    assert len(runs) == 2 and {r.state_name for r in runs} == {"Completed"}
    assert sorted(t.name.split(" · ")[0] for t in tasks) == sorted(STAGES)
    [writer] = {t.flow_run_id for t in tasks}
    assert artifacts and {a.flow_run_id for a in artifacts} == {writer}
    assert any(a.type == "progress" and float(a.data) == 100.0 for a in artifacts)

    # One mesh of both processes' devices: data=2 x fsdp=4 over 2 x 4, each device holding 1 of
    # the 8 rows of a micro-batch, so each process's devices hold half of it. Placed on
    # jax.local_devices() instead, each process would train every row on a mesh of its own 4
    # (data=1, fsdp=4, 2 rows a device), and the losses would be the same.
    mesh, plan, (_, rows, _) = train_mesh(train_folder)
    assert mesh == "data=2, fsdp=4, tensor=1 on 8 cpu devices across 2 processes"
    assert plan["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and plan["devices"] == 8
    assert rows == 8 and plan["shape"]["rows_per_device"] == 1
    plan_line = "memory plan per device on mesh data=2, fsdp=4, tensor=1 on 8 devices:"
    for i in (0, 1):  # process 1 writes nothing, but logs the plan of the mesh it trained on
        assert any(line.startswith(f"[{i}] ") and plan_line in line for line in job.stderr.splitlines()), i

    # The same steps on one process with all 8 devices, mesh data=2 x fsdp=4: the same losses.
    # Each device computes what it computes in the job; only the cross-process sums may add in
    # another order. Measured: equal to the log's 6 decimals at every step. The bound, 1e-6
    # relative (5.7e-6 here), holds the log's rounding (1e-6) and float32 sums in another order,
    # as for the meshes of one process (LOSS_RTOL and LOG_ROUNDING in tests/mesh/test_mesh.py).
    job_losses = losses(train_folder)
    assert len(job_losses) == 3
    launch(store, 1, 8, "--refresh", "train")
    assert losses(train_folder) == pytest.approx(job_losses, rel=1e-6, abs=1e-6)
    assert train_mesh(train_folder)[0] == "data=2, fsdp=4, tensor=1 on 8 cpu devices"
