"""What a process other than 0 of a multi-process job does with a stage, without JAX or Prefect:
the job is faked by setting `jaxtune.host.processes`' state (the real one: test_multihost_flow.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaxtune.artifacts import ArtifactStore
from jaxtune.config import MeshConfig
from jaxtune.host import processes
from jaxtune.tasks.stage import build_artifact

pytestmark = pytest.mark.mesh

MODULE = "jaxtune.tasks.evaluate"  # a task module: its code is in the key
SECTION = {"setting": 1}


def write(folder: Path) -> None:
    (folder / "out.txt").write_text("built")


@pytest.fixture
def job(monkeypatch):
    """This process as process `index` of a job of 2; records its barriers, agrees with `decision`."""

    @dataclass
    class Job:
        barriers: list
        decision: bool = False

        def be(self, index: int) -> None:
            monkeypatch.setattr(processes, "index", index)

    state = Job(barriers=[])
    monkeypatch.setattr(processes, "count", 2)
    monkeypatch.setattr(processes, "_barrier", state.barriers.append)
    monkeypatch.setattr(processes, "_agree", lambda value: state.decision)
    return state


def test_another_process_builds_outside_the_store_and_publishes_nothing(tmp_path, job):
    job.be(1)
    seen = []
    ref = build_artifact(
        tmp_path / "store", "baseline_eval", MODULE, SECTION, {}, lambda folder: seen.append(folder) or write(folder)
    )
    assert len(seen) == 1 and not seen[0].is_relative_to(tmp_path) and not seen[0].exists()  # built, then deleted
    assert not (tmp_path / "store" / "baseline_eval").exists()
    assert ref.path == str(
        ArtifactStore(tmp_path / "store").folder("baseline_eval", ref.key)
    )  # where process 0 publishes


def test_process_0_of_a_job_builds_when_called_even_if_the_artifact_is_there(tmp_path, job):
    store = ArtifactStore(tmp_path)
    first = build_artifact(tmp_path, "train", MODULE, SECTION, {}, write)  # one process: builds once
    job.be(0)
    built = []
    again = build_artifact(tmp_path, "train", MODULE, SECTION, {}, lambda folder: built.append(1) or write(folder))
    assert built == [1], "the other processes build too: process 0 must not skip their collectives"
    assert again == first and store.verify("train", first.key)


def test_one_process_still_skips_a_verified_artifact(tmp_path):
    assert processes.count == 1 and processes.writes()
    build_artifact(tmp_path, "train", MODULE, SECTION, {}, write)
    build_artifact(tmp_path, "train", MODULE, SECTION, {}, lambda folder: pytest.fail("rebuilt"))


class FakeTask:
    """Stands in for a Prefect task: a process other than 0 only ever calls `.fn`."""

    def __init__(self):
        self.calls = []

        def fn(section, inputs, store_root, **options):
            self.calls.append((section, store_root, options))
            return build_artifact(store_root, "stage_x", MODULE, section, inputs, write)

        fn.__module__ = MODULE
        self.fn = fn


@pytest.mark.parametrize("on_mesh", [True, False])
@pytest.mark.parametrize("cached", [True, False])
def test_another_process_follows_process_0_and_reads_its_artifact(tmp_path, job, on_mesh, cached):
    from jaxtune.config import load_config
    from jaxtune.flows.finetune import StageRunner, Step

    published = build_artifact(tmp_path, "stage_x", MODULE, SECTION, {}, write)  # what process 0 writes
    job.be(1)
    job.decision = cached
    task = FakeTask()
    mesh = MeshConfig()
    step = Step("stage_x", task, SECTION, {}, {"mesh": mesh} if on_mesh else {"num_proc": 4})
    runner = StageRunner(tmp_path, set(), load_config(None, [f"store.root={tmp_path}"]))
    ref = runner(step, {})
    assert ref == published
    # A mesh stage that is not cached runs here too (its collectives need every process), as the task's function.
    assert task.calls == ([(SECTION, str(tmp_path), {"mesh": mesh})] if on_mesh and not cached else [])
    assert job.barriers == [f"stage_x/{published.key}"]
    assert runner.states == {"stage_x": "Cached" if cached else "Completed"}
    assert sorted(p.name for p in (tmp_path / "stage_x").iterdir()) == [published.key], "the store is process 0's"


def test_a_one_process_run_joins_nothing_and_imports_no_jax():
    code = (
        "import os, sys\n"
        "for v in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'): os.environ.pop(v, None)\n"
        "from jaxtune.host import processes\nfrom jaxtune.config import MeshConfig\n"
        "print(processes.join(MeshConfig()), processes.join(MeshConfig(num_processes=1, process_id=0)), 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.stdout.split() == ["False", "False", "False"], out.stderr
