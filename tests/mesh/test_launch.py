"""`jaxtune launch`: the commands and environments it composes, its prefixed output, and how a
failing process ends the job. Nothing here imports JAX: the processes are small shell scripts."""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxtune.cli.main import main
from jaxtune.host import launch

pytestmark = pytest.mark.mesh

ARGS = ["run", "configs/x.yaml", "--set", "data.source=my data.jsonl", "--set", 'train.note=it\'s "quoted" $HOME']


def test_local_processes_get_the_job_variables_and_the_same_command():
    base = {"PATH": "/bin", "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2"}
    procs = launch.plan(3, ARGS, cpu_devices=4, base_env=base, python="/venv/bin/python")
    assert [p.index for p in procs] == [0, 1, 2]
    coordinator = procs[0].env["JAX_COORDINATOR_ADDRESS"]
    host, port = coordinator.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    for i, p in enumerate(procs):
        assert p.argv == ["/venv/bin/python", "-m", "jaxtune.cli", *ARGS]
        assert p.env["JAX_COORDINATOR_ADDRESS"] == coordinator
        assert (p.env["JAX_NUM_PROCESSES"], p.env["JAX_PROCESS_ID"]) == ("3", str(i))
        # The device count replaces the one there was; other XLA flags stay.
        assert p.env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4"
        assert p.env["JAX_PLATFORMS"] == "cpu" and p.env["PATH"] == "/bin" and p.env["PYTHONHASHSEED"] == "0"
        assert f"JAX_PROCESS_ID={i}" in p.shown and "jaxtune run configs/x.yaml" in p.shown


def test_without_cpu_devices_the_platform_is_left_alone():
    [p] = launch.plan(1, ["run"], coordinator="10.0.0.2:1234", base_env={"XLA_FLAGS": "--xla_dump_to=/d"})
    assert "JAX_PLATFORMS" not in p.env and p.env["XLA_FLAGS"] == "--xla_dump_to=/d"
    assert (p.env["JAX_COORDINATOR_ADDRESS"], p.env["JAX_NUM_PROCESSES"], p.env["JAX_PROCESS_ID"]) == (
        "10.0.0.2:1234",
        "1",
        "0",
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"count": 0}, "--processes"),
        ({"cpu_devices": 0}, "--cpu-devices"),
        ({"arguments": []}, "no jaxtune command"),
        ({"arguments": ["launch", "--processes", "2"]}, "itself"),
        ({"coordinator": "no-port"}, "HOST:PORT"),
    ],
)
def test_launch_arguments_that_describe_no_job_are_refused(kwargs, message):
    arguments = {"count": 2, "arguments": ["run"], **kwargs}
    with pytest.raises(launch.LaunchError, match=message):
        launch.plan(**arguments, base_env={})


def test_cli_checks_the_command_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--processes", "2", "--", "run", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert main(["launch", "--processes", "0", "--", "run"]) == 2
    assert "--processes must be 1 or more" in capsys.readouterr().err


def _script(code: str) -> list[str]:
    return ["/bin/sh", "-c", code]


def _run(scripts: list[str]) -> tuple[int, str, str, float]:
    procs = [launch.Process(i, _script(code), dict(os.environ), code) for i, code in enumerate(scripts)]
    out, err = io.BytesIO(), io.BytesIO()
    started = time.monotonic()
    status = launch.run(procs, out, err, poll_seconds=0.02)
    return status, out.getvalue().decode(), err.getvalue().decode(), time.monotonic() - started


def test_output_lines_are_prefixed_with_the_process_index():
    status, out, err, _ = _run(["echo a; echo b; echo oops >&2", "printf 'c\\nno newline'"])
    assert status == 0
    assert sorted(out.splitlines()) == ["[0] a", "[0] b", "[1] c", "[1] no newline"]
    assert err.splitlines() == ["[0] oops"]


def test_a_failing_process_stops_the_others_and_gives_its_status(tmp_path):
    marker = tmp_path / "survived"
    # Process 0 would outlive the test by far, and its child (as Prefect's server would) too.
    status, out, err, seconds = _run(
        [f"(sleep 60; touch {marker}) & sleep 60; touch {marker}", "echo bye; sleep 0.3; exit 3"]
    )
    assert status == 3 and seconds < 20  # process 0 ended on its SIGTERM, within launch's 30 s grace
    assert "[1] bye" in out
    assert "process 1 exited with status 3; stopping process 0" in err
    time.sleep(0.5)
    assert not marker.exists()


MEMBER = """
import sys, time
from pathlib import Path
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from prefect.states import Running
from jaxtune.host import launch

@flow(name="member")
def member():
    pass

with get_client(sync_client=True) as client:
    run = client.create_flow_run(member, state=Running())
launch.record_run(run.id, PREFECT_API_URL.value())
Path(sys.argv[1]).write_text(str(run.id))
time.sleep(60)  # as in a collective with a dead peer: ended by a signal, its run left Running
"""


@pytest.mark.usefixtures("prefect_server")
def test_a_process_stopped_because_another_failed_ends_its_flow_run_cancelled_saying_so(tmp_path):
    """Process 0 records its Running flow run as `jaxtune run` does, and dies of the SIGTERM that
    process 1's failure brings it, its run not ended: the gang ends it Cancelled, naming process 1."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    started = tmp_path / "run-id"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(Path(__file__).parents[2])}
    member = launch.Process(0, [sys.executable, "-c", MEMBER, str(started)], env, "member")
    failing = launch.Process(1, _script(f"while [ ! -s {started} ]; do sleep 0.05; done; exit 3"), env, "exit 3")
    status = launch.run([member, failing], io.BytesIO(), io.BytesIO(), poll_seconds=0.02)
    assert status == 3
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(started.read_text()).state
    assert (state.name, state.message) == ("Cancelled", "stopped: process 1 failed with status 3")


def test_a_process_killed_by_a_signal_exits_as_a_shell_reports_it():
    status, *_ = _run(["kill -9 $$", "sleep 30"])
    assert status == 128 + 9


def test_sigterm_to_the_launcher_is_passed_on_to_every_process(tmp_path):
    """As a spot VM's notice or `kill` would: each process gets SIGTERM and its grace to save, and
    the job exits 143; the launcher's handler is gone afterwards. The launcher runs in a child
    process, so a launcher that died of the signal fails this test, not the whole session."""
    import signal
    import subprocess

    scripts = [
        f"trap 'echo saved > {tmp_path}/{i}; exit 143' TERM; touch {tmp_path}/started-{i}; sleep 60 & wait"
        for i in (0, 1)
    ]
    code = (
        "import os, signal, sys; from jaxtune.host import launch; "
        f"scripts = {scripts!r}; "
        "status = launch.run([launch.Process(i, ['/bin/sh', '-c', c], dict(os.environ), c) "
        "for i, c in enumerate(scripts)]); "
        "print(status, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120  # a Python process and two shells starting, however busy the machine
    while not all((tmp_path / f"started-{i}").exists() for i in (0, 1)):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.02)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert (launcher.returncode, out.strip()) == (0, "143 True"), err[-2000:]
    assert time.monotonic() - started < 20  # the processes ended on their SIGTERM, within launch's 30 s grace
    assert [(tmp_path / str(i)).read_text() for i in (0, 1)] == ["saved\n", "saved\n"]


def test_sigterm_while_the_processes_are_being_started_still_stops_them_all(tmp_path):
    """The signal lands in the middle of starting: right after the last process is spawned, before
    its output relays are. Every process is still terminated, with its grace, and the job exits 143."""
    import subprocess

    scripts = [
        f"trap 'echo saved > {tmp_path}/{i}; exit 143' TERM; touch {tmp_path}/started-{i}; "
        f"while [ ! -e {tmp_path}/started-{1 - i} ]; do sleep 0.01; done; sleep 60 & wait"
        for i in (0, 1)
    ]
    code = (
        "import os, signal, subprocess; from jaxtune.host import launch; "
        "spawn = subprocess.Popen\n"
        "def popen(*args, **kwargs):\n"
        "    child = spawn(*args, **kwargs)\n"
        "    if args[0][-1].startswith('trap') and '/started-1;' in args[0][-1]: os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return child\n"
        "subprocess.Popen = popen\n"
        f"scripts = {scripts!r}\n"
        "print(launch.run([launch.Process(i, ['/bin/sh', '-c', c], dict(os.environ), c) "
        "for i, c in enumerate(scripts)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300
    )
    assert (done.returncode, done.stdout.strip()) == (0, "143"), done.stderr[-2000:]
    assert (tmp_path / "0").read_text() == "saved\n"  # the first had its grace
    # The last may be terminated before its shell sets its trap; what must not happen is that it runs on.
    time.sleep(0.5)
    assert not any(
        p.stdout.strip()
        for p in [subprocess.run(["pgrep", "-f", f"{tmp_path}/started-1"], capture_output=True, text=True)]
    )


def test_launch_imports_neither_jax_nor_prefect():
    code = "import sys, jaxtune.host.launch; print(sorted(m for m in ('jax', 'prefect', 'torch') if m in sys.modules))"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]", out.stderr


def test_run_relays_output_while_the_processes_run(tmp_path):
    """A line comes out when it is written, not when its process ends: the process writes its second
    line only once the test has seen the first."""
    go = tmp_path / "go"
    script = f"echo first; while [ ! -e {go} ]; do sleep 0.02; done; echo second"
    procs = [launch.Process(0, _script(script), dict(os.environ), "")]
    out = io.BytesIO()
    thread = threading.Thread(target=launch.run, args=(procs, out, io.BytesIO()), kwargs={"poll_seconds": 0.02})
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while b"[0] first" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"[0] first" in out.getvalue() and b"second" not in out.getvalue()
    finally:
        go.touch()
        thread.join(timeout=120)
    assert out.getvalue().splitlines() == [b"[0] first", b"[0] second"]
