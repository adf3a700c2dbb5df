"""`jaxtune launch --ray`: the finetune flow as a job of two processes on a real local Ray cluster of
two nodes (a head, and a second node joined with `ray start --address`), each process on its own
node with 4 fake CPU devices, placed, failed and restarted as one gang.

- spread over both nodes, the job trains to the losses of one process on all 8 devices;
- killing one node's jaxtune process mid-train restarts the whole gang, which resumes from the last
  checkpoint to the uninterrupted job's weights;
- a bad configuration fails once with its one line, and is not restarted;
- afterwards no jaxtune process is left, and once the cluster stops no Ray process either.

One module, one cluster: the Ray nodes are this machine's processes, started once for these tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from safetensors.numpy import load_file  # noqa: E402

from tests.flows.shapes import TOY_MODEL  # noqa: E402
from tests.flows.test_train_resume import newest_logged  # noqa: E402
from tests.mesh.test_multihost_flow import losses, prefect_runs  # noqa: E402

pytestmark = [pytest.mark.mesh, pytest.mark.ray]

ROOT = Path(__file__).parents[2]
SETTINGS = [
    *TOY_MODEL,
    "data.max_train_rows=64",
    "data.max_eval_rows=16",
    "train.max_steps=12",
    "train.batch_size=8",
    "train.warmup_steps=1",
    "train.eval_every=null",
    "train.checkpoint_every=4",
    "train.log_every=2",
    "mesh.fsdp=4",  # data -1: 2, so the batch spans both processes
]


def _jaxtune_processes() -> list[int]:
    """The pids of this machine's processes running `jaxtune.cli` as one process of a job."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"jaxtune.cli" in command and b"JAX_PROCESS_ID=" in environ:
            found.append(int(proc.name))
    return found


def _ray_processes() -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and ("raylet" in command or "gcs_server" in command or command.startswith("ray::")):
            found.append(f"{proc.name} {command[:120]}")
    return found


def started(command: list[str], env: dict[str, str]) -> None:
    """`ray start ...` run to its end; a failure shows what Ray printed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{' '.join(command[1:])}: status {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def cluster(prefect_server):
    """A Ray head and a second node on this machine, one CPU each, started as a user starts them; its
    address. Both nodes' workers get this session's Prefect server and the repository on their path."""
    from prefect.settings import PREFECT_API_URL

    from jaxtune.host.launch import free_port

    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    # Ray's sockets live under its temp folder, and a socket's path holds 107 bytes at most: pytest's
    # folders under xdist (/tmp/pytest-of-USER/pytest-N/popen-gwK/...) leave the second node's too few.
    folder = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONPATH": path,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    address = f"127.0.0.1:{free_port()}"
    common = ["--num-cpus=1", "--disable-usage-stats"]
    head = [ray, "start", "--head", f"--port={address.rsplit(':', 1)[1]}", "--node-ip-address=127.0.0.1"]
    head += ["--include-dashboard=false", f"--temp-dir={folder}", *common]
    try:
        started(head, env)
        started([ray, "start", f"--address={address}", "--node-ip-address=127.0.0.1", *common], env)
        yield address
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=600)
        shutil.rmtree(folder, ignore_errors=True)
    deadline = time.monotonic() + 120  # ray stop --force has SIGKILLed them: only their exits to wait for
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == [], "the Ray cluster's processes outlive ray stop"


def jaxtune(store: Path, launching: list[str], settings=SETTINGS) -> subprocess.Popen:
    """`jaxtune launch LAUNCHING -- run --until train` with `settings` in `store`, started."""
    sets = [a for s in [*settings, f"store.root={store}"] for a in ("--set", s)]
    command = [sys.executable, "-m", "jaxtune.cli", "launch", *launching, "--", "run", "--until", "train", *sets]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ray_launch(address: str, store: Path, restarts: int = 0, settings=SETTINGS) -> subprocess.Popen:
    """The job on the Ray cluster at `address`: 2 processes of 4 fake CPU devices each."""
    launching = ["--ray", address, "--processes", "2", "--cpu-devices", "4", "--restarts", str(restarts)]
    return jaxtune(store, launching, settings)


def finished(job: subprocess.Popen, timeout: float = 900) -> str:
    out = job.communicate(timeout=timeout)[0]
    print(out[-4000:])
    return out


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> Path:
    """The job on Ray, run through as prefect.yaml's ray-offline deployment (`jaxtune serve --only
    ray-offline`, then a run of it): its train artifact. Every line of both processes is in the
    deployment run's logs, marked with its index."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL

    store = tmp_path_factory.mktemp("uninterrupted")
    log = store.parent / "serve.log"  # not a pipe: nothing reads it while the job runs
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    served = subprocess.Popen(
        [sys.executable, "-m", "jaxtune.cli", "serve", "--only", "ray-offline"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        start_new_session=True,
    )
    try:
        started = time.monotonic()
        parameters = {"overrides": [*SETTINGS, f"store.root={store}"], "cpu_devices": 4, "restarts": 0}
        parameters |= {"address": cluster, "until": "train"}
        while True:  # until serve has registered the deployment
            try:
                run = run_deployment("ray-job/ray-offline", parameters=parameters, timeout=900)
                break
            except Exception as error:  # not yet there
                assert served.poll() is None and time.monotonic() - started < 600, (error, log.read_text()[-3000:])
                time.sleep(1)
        print(f"the Ray job as a deployment run: {time.monotonic() - started:.1f} s")
        # The run is Completed before its engine is done with it (it then joins its heartbeat thread,
        # up to a second, and reports the outcome to the runner). A runner stopped in between cancels
        # the run it still holds, forcing Cancelled ("Runner is shutting down.") over the Completed:
        # serve is stopped once the engine has logged its last line, after the runner took the outcome.
        of_run, logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), []
        deadline = time.monotonic() + 300
        while not any(line.message.startswith("Finished in state ") for line in logs):
            assert time.monotonic() < deadline, ([line.message for line in logs[-20:]], log.read_text()[-3000:])
            time.sleep(0.5)
            with get_client(sync_client=True) as client:
                while page := client.read_logs(of_run, limit=200, offset=len(logs), sort=LogSort.TIMESTAMP_ASC):
                    logs += page
    finally:
        os.killpg(served.pid, signal.SIGTERM)
        served.wait(timeout=300)
    assert run.state.is_completed(), run.state.message
    [train] = (store / "train").iterdir()
    logs = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(of_run, limit=200, offset=len(logs), sort=LogSort.TIMESTAMP_ASC):
            logs += page
    lines = [log.message for log in logs]
    assert {i: [line for line in lines if line.startswith(f"[{i}] ")][-1] for i in (0, 1)} == {
        0: f"[0] {train}",
        1: f"[1] {train}",
    }, lines[-20:]
    assert any(line.startswith("jaxtune launch: 2 processes on Ray, coordinator ") for line in lines)
    # Each process's own finetune flow run; the stages and artifacts are process 0's, as in any job.
    runs, tasks, artifacts = prefect_runs(store)  # the ray-job run names the store too
    assert sorted(r.name.split(" · ")[0] for r in runs) == ["offline", "offline", "ray"]
    assert {r.state_name for r in runs} == {"Completed"}, [(r.name, r.state_name, r.state.message) for r in runs]
    [writer] = {t.flow_run_id for t in tasks}
    assert artifacts and {a.flow_run_id for a in artifacts} == {writer}
    assert _jaxtune_processes() == []
    return train


def test_a_job_spread_over_two_ray_nodes_trains_as_one_process_on_all_devices(uninterrupted, tmp_path):
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["mesh"] == "data=2, fsdp=4, tensor=1 on 8 cpu devices across 2 processes"
    store = tmp_path / "one"
    job = jaxtune(store, ["--processes", "1", "--cpu-devices", "8"])
    out = finished(job)
    assert job.returncode == 0, out[-4000:]
    [one] = (store / "train").iterdir()
    assert json.loads((one / "summary.json").read_text())["mesh"] == "data=2, fsdp=4, tensor=1 on 8 cpu devices"
    # The bound of tests/mesh/test_multihost_flow.py: the log's rounding and float32 sums in another order.
    assert len(losses(uninterrupted)) == 12
    assert losses(uninterrupted) == pytest.approx(losses(one), rel=1e-6, abs=1e-6)


def test_a_killed_process_restarts_the_gang_which_resumes_to_the_uninterrupted_weights(
    cluster, uninterrupted, tmp_path
):
    store = tmp_path / "killed"
    job = ray_launch(cluster, store, restarts=1)
    deadline = time.monotonic() + 600
    while newest_logged(store) < 6:  # checkpointed at 4, logged 6: steps 5 and 6 are lost
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
        time.sleep(0.01)
    [second] = [
        pid for pid in _jaxtune_processes() if b"JAX_PROCESS_ID=1\0" in Path(f"/proc/{pid}/environ").read_bytes()
    ]
    os.kill(second, signal.SIGKILL)  # one node's process, as a preempted host's
    out = finished(job)
    assert job.returncode == 0, out[-4000:]
    # Process 1's death is seen first, or process 0's failure for want of its peer: either stops the gang.
    assert "jaxtune launch: process " in out and " exited with status " in out
    assert out.count("jaxtune launch: restarting the job (1 of 1 restarts)") == 1
    [train] = (store / "train").iterdir()
    summary = json.loads((train / "summary.json").read_text())
    assert summary["resumed_from"] in (4, 8) and len(summary["interruptions"]) == 1
    expected = load_file(str(uninterrupted / "params.safetensors"))
    got = load_file(str(train / "params.safetensors"))
    assert set(got) == set(expected)
    assert max(float(np.abs(got[k] - expected[k]).max()) for k in expected) <= 1e-6
    assert _jaxtune_processes() == []
    runs, _, _ = prefect_runs(store)
    print("the killed job's flow runs:", sorted((r.name, r.state_name, r.state.message) for r in runs))


def test_a_bad_configuration_fails_once_with_its_line_and_is_not_restarted(cluster, tmp_path):
    job = ray_launch(cluster, tmp_path / "bad", restarts=2, settings=[*SETTINGS, "train.no_such_key=1"])
    out = finished(job)
    assert job.returncode == 2, out[-3000:]
    assert "restarting" not in out
    assert "jaxtune launch: not restarted: status 2 is a failure that repeats" in out
    # Either process may read the setting first; the gang then stops the other, which may not have
    # printed its own line yet. The one that failed first said why, in one line.
    [first] = re.findall(r"^jaxtune launch: process (\d) exited with status 2", out, re.MULTILINE)
    said = [line for line in out.splitlines() if line.startswith(f"[{first}] ")]
    [line] = [line for line in said if line.startswith(f"[{first}] jaxtune: ")]
    assert "train.no_such_key" in line and not any("Traceback" in line for line in said), out[-3000:]
    assert _jaxtune_processes() == []


def test_a_tpu_slice_is_one_process_on_each_of_its_hosts_with_the_hosts_chips():
    from jaxtune.errors import LaunchError
    from jaxtune.host.ray_job import Gang, gang

    assert gang(None, ("v5e", "4x4")) == Gang(4, {"CPU": 1, "TPU": 4}, ("v5litepod", "4x4"))  # a v5e-16
    assert gang(2, ("v5p", "2x2x2")) == Gang(2, {"CPU": 1, "TPU": 4}, ("v5p", "2x2x2"))
    assert gang(2) == Gang(2, {"CPU": 1})
    with pytest.raises(LaunchError, match=r"--tpu v5e 4x4 has 4 hosts, one process each, not --processes 3"):
        gang(3, ("v5e", "4x4"))
    with pytest.raises(LaunchError, match=r"--tpu v9 4x4: Invalid accelerator_type"):
        gang(None, ("v9", "4x4"))


def test_ray_options_without_ray_are_refused_before_anything_starts(capsys):
    from jaxtune.cli.main import main

    assert main(["launch", "--processes", "2", "--restarts", "1", "--", "run"]) == 2
    assert "jaxtune launch: --restarts needs --ray" in capsys.readouterr().err
    assert main(["launch", "--", "run"]) == 2
    assert "--processes is needed" in capsys.readouterr().err
