"""`jaxtune launch`: one jaxtune command as a job of N processes on this host (JAX multi-process).

    jaxtune launch --processes 2 --cpu-devices 4 -- run --set mesh.fsdp=4

Every process runs the same jaxtune command with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set, which `jaxtune.host.processes.settings` reads (so the flow joins the job through
`jax.distributed.initialize`). They are child processes of this one; each output line comes out
prefixed `[i] ` (stdout on stdout, stderr on stderr). When a process exits with a non-zero status,
the others are terminated and `launch` exits with that status.

A job of several hosts runs on Ray (`--ray`): `jaxtune.host.ray_job` reserves the hosts, starts each
process through a Ray actor and restarts the job after a failure. The gang loop that watches and
stops the processes (`watch`, `stop`) is this module's, for both.

Each process records its finetune flow run in a file the gang names (RUN_FILE): a process stopped
because another failed may be killed in a collective before its flow run ends, and the gang then
ends that run Cancelled, saying which process failed (`stop`).

Composing the processes' commands (`plan`) imports neither JAX nor Prefect.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from jaxtune.errors import LaunchError

COORDINATOR, NUM_PROCESSES, PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Between asking the other processes to stop and killing them: a process stopped by SIGTERM in
# training first writes a checkpoint of its step (as on a spot VM's notice, which gives 30 s).
GRACE_SECONDS = 30.0
# The file where a process of the job records its flow run (`record_run`), for `stop` to end it.
RUN_FILE = "JAXTUNE_RUN_FILE"


@dataclass(frozen=True)
class Process:
    """One process of the job: the argv run here, and the environment it runs with."""

    index: int
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    shown: str  # the command as a person would type it, for messages


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (the coordinator binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def job_env(
    index: int, count: int, coordinator: str | None, cpu_devices: int | None, base: Mapping[str, str] = {}
) -> dict[str, str]:  # noqa: B006 (never mutated)
    """The variables that make process `index` of `count` join the job (only these, not `base`,
    which is read for XLA_FLAGS to extend)."""
    env = {NUM_PROCESSES: str(count), PROCESS_ID: str(index)}
    if coordinator is not None:
        env = {COORDINATOR: coordinator, **env}
    if cpu_devices is not None:
        kept = [flag for flag in shlex.split(base.get("XLA_FLAGS", "")) if not flag.startswith(DEVICE_COUNT_FLAG)]
        env["XLA_FLAGS"] = " ".join([*kept, f"{DEVICE_COUNT_FLAG}={cpu_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def plan(
    count: int,
    arguments: Sequence[str],
    coordinator: str | None = None,
    cpu_devices: int | None = None,
    base_env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> list[Process]:
    """The `count` processes that run `jaxtune <arguments>` as one job on this host; the coordinator
    defaults to 127.0.0.1 on a free port."""
    base_env = dict(os.environ if base_env is None else base_env)
    if count < 1:
        raise LaunchError(f"--processes must be 1 or more, not {count}")
    if cpu_devices is not None and cpu_devices < 1:
        raise LaunchError(f"--cpu-devices must be 1 or more, not {cpu_devices}")
    if not arguments:
        raise LaunchError("no jaxtune command to launch: give one after --, e.g. jaxtune launch --processes 2 -- run")
    if arguments[0] == "launch":
        raise LaunchError("jaxtune launch cannot launch itself")
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    if not _host_port(coordinator):
        raise LaunchError(f"--coordinator must be HOST:PORT, not {coordinator!r}")
    processes = []
    for index in range(count):
        variables = job_env(index, count, coordinator, cpu_devices, base_env)
        # PYTHONHASHSEED=0 as `jaxtune` itself sets it (see jaxtune.cli.main.entry), without its re-exec.
        env = {**base_env, **variables, "PYTHONHASHSEED": "0"}
        argv = [python, "-m", "jaxtune.cli", *arguments]
        shown = (
            " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items()) + " " + shlex.join(["jaxtune", *arguments])
        )
        processes.append(Process(index=index, argv=argv, env=env, shown=shown))
    return processes


def _host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Prefixer(threading.Thread):
    """Copies a child's stream to `out` line by line, each line prefixed."""

    def __init__(self, source: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock):
        super().__init__(daemon=True)
        self.source, self.out, self.prefix, self.lock = source, out, prefix, lock

    def run(self) -> None:
        for line in iter(self.source.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.lock:
                self.out.write(self.prefix + line)
                self.out.flush()
        self.source.close()


class Member(Protocol):
    """One process of a job as the gang loop (`watch`, `stop`) sees it: started here (`Local`) or by a
    Ray actor on another node (`ray_job`)."""

    index: int

    def poll(self) -> int | None:
        """Its exit status as a shell reports it (128 + N for signal N), or None while it runs."""

    def terminate(self) -> None:
        """SIGTERM to it and what it started, without waiting."""

    def kill(self) -> None:
        """SIGKILL to it and what it started, even where it exited (its children may not have), and wait."""

    def flow_run(self) -> dict | None:
        """The flow run it recorded (`record_run`), or None."""


@dataclass
class Local:
    """A process of the job started here, in a session of its own: ending it ends what it started
    (Prefect's temporary server, a compiler)."""

    index: int
    child: subprocess.Popen
    run_file: str | None = None

    def poll(self) -> int | None:
        code = self.child.poll()
        return None if code is None else exit_status(code)

    def terminate(self) -> None:
        _signal_group(self.child, signal.SIGTERM)

    def kill(self) -> None:
        _signal_group(self.child, signal.SIGKILL)
        self.child.wait()

    def flow_run(self) -> dict | None:
        try:
            return json.loads(Path(self.run_file).read_text()) if self.run_file else None
        except (OSError, ValueError):  # none recorded, or cut short by a kill
            return None


def record_run(run_id: str, api: str | None) -> None:
    """In a process of a job: record its flow run `run_id` on the Prefect server at `api` in the file
    the gang named, once (a subflow's run is not the process's). A run on a temporary server (no
    `api`) ends with its process, and is not recorded."""
    path = os.environ.get(RUN_FILE)
    if path and api and not os.path.exists(path):
        Path(path).write_text(json.dumps({"id": str(run_id), "api": api}))


def watch(
    members: Sequence[Member], say: Callable[[str], None], poll_seconds: float, terminated: Sequence[int] = ()
) -> int:
    """Wait for the gang: 0 when every member exits 0, else the first non-zero status, said with the
    members still running (which `stop` then ends); 128 + SIGTERM once `terminated` holds a signal."""
    done: set[int] = set()
    while True:
        if terminated:
            return 128 + signal.SIGTERM
        for member in members:
            if member.index in done:
                continue
            status = member.poll()
            if status == 0:
                done.add(member.index)
            elif status is not None:
                others = [str(m.index) for m in members if m is not member and m.index not in done and m.poll() is None]
                stopping = f"; stopping process{'es' * (len(others) > 1)} {', '.join(others)}" if others else ""
                say(f"jaxtune launch: process {member.index} exited with status {status}{stopping}")
                return status
        if len(done) == len(members):
            return 0
        time.sleep(poll_seconds)


def stop(members: Sequence[Member], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every running member, then SIGKILL every one (what a member started outlives it when
    it is killed, by us or by JAX's fatal-error handler) once all exited or `grace` s passed. The
    flow runs of the members stopped that did not end them (killed in a collective with a failed
    peer) end Cancelled, with why."""
    failed = next(((m.index, status) for m in members if (status := m.poll()) not in (None, 0)), None)
    alive = [m for m in members if m.poll() is None]
    for member in alive:
        member.terminate()
    deadline = time.monotonic() + grace
    while any(m.poll() is None for m in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    runs = [run for m in alive if (run := m.flow_run())]  # before the kill, which ends a Ray member's actor
    for member in members:
        member.kill()
    why = f"process {failed[0]} failed with status {failed[1]}" if failed else "the job was stopped"
    cancel_runs(runs, f"stopped: {why}")


def cancel_runs(runs: Sequence[dict], message: str) -> None:
    """Set each of `runs` (as `record_run` wrote them) that is not in a final state Cancelled, with `message`."""
    if not runs:
        return
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelled

    for run in runs:
        try:
            with temporary_settings({PREFECT_API_URL: run["api"]}), get_client(sync_client=True) as client:
                state = client.read_flow_run(run["id"]).state
                if state is None or not state.is_final():
                    client.set_flow_run_state(run["id"], Cancelled(message=message), force=True)
        except (httpx.HTTPError, ObjectNotFound):  # the server is gone, or lost the run: nothing to end
            pass


def run(
    processes: Sequence[Process],
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    poll_seconds: float = 0.1,
) -> int:
    """Start every process, relay their output prefixed `[i] `, and return the job's status: 0 when
    all exit 0, else the first non-zero status (the others are terminated then)."""
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    lock = threading.Lock()
    members: list[Local] = []
    relays: list[_Prefixer] = []
    records = tempfile.TemporaryDirectory(prefix="jaxtune-launch-")  # each process's RUN_FILE

    def say(line: str) -> None:
        with lock:
            stderr.write(f"{line}\n".encode())
            stderr.flush()

    # SIGTERM to the launcher (`kill`, a scheduler, a spot VM's notice) is passed on as Ctrl-C is:
    # the processes get it and their grace, rather than being left running without it.
    # The handler only notes the signal, and the gang loop acts on it: an exception raised from a
    # handler could land anywhere, between starting a child and starting its relays. (A list, not an
    # Event: setting an Event from a handler can deadlock on the lock the interrupted code holds.)
    terminated: list[int] = []
    previous = _take(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    try:
        for process in processes:
            run_file = os.path.join(records.name, f"{process.index}.json")
            child = subprocess.Popen(
                process.argv,
                env={**process.env, RUN_FILE: run_file},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C here is handled here, once
            )
            members.append(Local(process.index, child, run_file))
            prefix = f"[{process.index}] ".encode()
            relays += [_Prefixer(child.stdout, stdout, prefix, lock), _Prefixer(child.stderr, stderr, prefix, lock)]
            relays[-2].start()
            relays[-1].start()
        status = watch(members, say, poll_seconds, terminated)
    except KeyboardInterrupt:
        status = 130
    except BaseException:
        stop(members)
        records.cleanup()
        raise
    finally:
        _take(signal.SIGTERM, previous)  # a second SIGTERM ends the launcher; the processes have theirs
    stop(members)
    records.cleanup()
    for relay in relays:
        if relay.ident is not None:  # a Ctrl-C can land between creating a relay and starting it
            relay.join(timeout=5)
    return status


def _take(signum: int, handler):
    """Install `handler` for `signum` where Python can (the main thread); the one there before."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signum, handler)


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(count: int, arguments: Sequence[str], coordinator: str | None, cpu_devices: int | None) -> int:
    """`jaxtune launch`: the job's exit status, or 2 for launch arguments that describe none."""
    try:
        processes = plan(count, arguments, coordinator, cpu_devices)
    except LaunchError as error:
        print(f"jaxtune launch: {error}", file=sys.stderr)
        return 2
    for process in processes:
        print(f"jaxtune launch: [{process.index}] {process.shown}", file=sys.stderr)
    sys.stderr.flush()
    return run(processes)
