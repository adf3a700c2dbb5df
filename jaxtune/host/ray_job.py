"""`jaxtune launch --ray`: one jaxtune command as a job of N processes on a Ray cluster, placed,
failed and restarted as one gang.

    jaxtune launch --ray auto --processes 2 --cpu-devices 4 -- run --set mesh.fsdp=4
    jaxtune launch --ray auto --tpu v5e 4x4 -- run configs/my-recipe.yaml    # a v5e-16: 4 hosts, 4 processes

The processes are reserved together as a placement group, one bundle a process, on distinct
nodes (STRICT_SPREAD); on a Cloud TPU slice, Ray's own slice reservation (`ray.util.tpu.
SlicePlacementGroup`: the slice's head resource, then one bundle per host with its chips), so each
host of the slice runs one process. In each bundle an actor starts `python -m jaxtune.cli COMMAND`
as a child process, with the job's variables (`launch.job_env`: JAX_COORDINATOR_ADDRESS on
process 0's node, JAX_NUM_PROCESSES, JAX_PROCESS_ID, and on a CPU its own fake devices): the same
command `jaxtune launch` runs locally, so the flow joins the job through `jax.distributed` and
process 0 writes the store as in any job.

Why actors over a placement group rather than Ray Train's `JaxTrainer`: a jaxtune process is a
whole `jaxtune run` (its Prefect flow run, its stages, its exit status), not a training function;
run as a child, a crash of XLA or of the process ends that child and not the Ray worker watching
it, its exit status says whether running again can help, and the command, its environment and its
output are what `jaxtune launch` gives locally. `JaxTrainer` would run the flow inside Ray Train's
worker processes, initialise JAX there itself, and retry every failure alike.

A failure is the gang's: when any process exits non-zero or its actor is lost (a node preempted or
gone), the others are stopped (SIGTERM, then SIGKILL after `GRACE_SECONDS`: without their peer they
can finish no step), the actors and the placement group are removed, and the whole
job starts again, up to `restarts` times, where the train stage resumes from its last checkpoint.
Watching and stopping the gang is `launch.watch` and `launch.stop`, as for a job on one host: here
each member is a `_Remote`, asked over Ray, there a local child.
A process that exits with status 2 (a configuration error, or a step that fits no device: the same
command fails the same way) is not restarted. Nothing is left running: every child is ended with its
actor.

Every process's output comes back line by line, `[i] ` before each (`sink`: by default this process's
stdout), while the job runs. Ray itself is imported only here, when a job starts (the `ray` extra).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxtune.errors import LaunchError
from jaxtune.host import launch

# After one process failed, the others can finish no step (each waits on its peer in a collective),
# and so save no checkpoint: they get a short grace to end their flow runs, then are killed.
GRACE_SECONDS = 10.0
NOT_RETRIED = 2  # `jaxtune run`'s status for a failure that repeats: the config, or a step that fits no device
READY_SECONDS = 300.0  # how long the cluster may take to find room for the whole gang


RAY_TPU_NAMES = {"v5e": "v5litepod"}  # Ray's name of a TPU version, where it is not the one Cloud TPU users say


@dataclass(frozen=True)
class Gang:
    """Where the job's processes go: `count` of them, each on its own node with `bundle`'s resources,
    or one on each host of a TPU slice (`tpu`: accelerator version and topology, e.g. ("v5e", "4x4"))."""

    count: int
    bundle: dict
    tpu: tuple[str, str] | None = None


def gang(count: int | None, tpu: tuple[str, str] | None = None, cpus: float = 1) -> Gang:
    """The gang for `count` processes of `cpus` CPUs each, or for a TPU slice (its hosts' count)."""
    if tpu is None:
        if count is None or count < 1:
            raise LaunchError(f"--processes must be 1 or more, not {count}")
        return Gang(count, {"CPU": cpus})
    from ray.util.tpu import get_tpu_worker_resources

    version, topology = RAY_TPU_NAMES.get(tpu[0].lower(), tpu[0].lower()), tpu[1]
    try:
        hosts, bundle = get_tpu_worker_resources(topology, version)
    except (ValueError, KeyError) as error:
        raise LaunchError(f"--tpu {' '.join(tpu)}: {error}") from None
    if count is not None and count != hosts:
        raise LaunchError(f"--tpu {' '.join(tpu)} has {hosts} hosts, one process each, not --processes {count}")
    return Gang(hosts, bundle, (version, topology))


class JobProcess:
    """A Ray actor's side of one process of the job: starts `python -m jaxtune.cli` as its child and
    keeps its output lines until the driver reads them."""

    def __init__(self) -> None:
        self.child: launch.Local | None = None
        self.relay: threading.Thread | None = None
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.records = tempfile.mkdtemp(prefix="jaxtune-process-")  # the child's RUN_FILE

    def address(self) -> str:
        """HOST:PORT for the job's coordinator on this node (process 0's)."""
        import ray

        here = ray.get_runtime_context().get_node_id()  # the address the cluster knows this node by
        host = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == here), None)
        host = host or ray.util.get_node_ip_address()
        return f"{host}:{launch.free_port(host)}"

    def start(self, arguments: Sequence[str], index: int, count: int, coordinator: str, cpu_devices: int | None):
        variables = launch.job_env(index, count, coordinator, cpu_devices, os.environ)
        run_file = os.path.join(self.records, "flow-run.json")
        env = {**os.environ, **variables, "PYTHONHASHSEED": "0", launch.RUN_FILE: run_file}
        child = subprocess.Popen(
            [sys.executable, "-m", "jaxtune.cli", *arguments],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # ending it ends what it started (Prefect's temporary server)
            preexec_fn=_dies_with_parent(),
            text=True,
        )
        self.child = launch.Local(index, child, run_file)
        self.relay = threading.Thread(target=self._relay, args=(child.stdout,), daemon=True)
        self.relay.start()
        return child.pid

    def _relay(self, stream) -> None:
        for line in stream:
            with self.lock:
                self.lines.append(line.rstrip("\n"))

    def read(self) -> tuple[list[str], int | None]:
        """The lines since the last read, and the child's exit status (None while it runs)."""
        if self.child is None:  # never started (the job stopped while starting): nothing to wait for
            return [], 0
        status = self.child.poll()
        if status is not None:
            self.relay.join(timeout=5)  # its last lines
        with self.lock:
            lines, self.lines = self.lines, []
        return lines, status

    def terminate(self) -> None:
        if self.child is not None:
            self.child.terminate()

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()
        shutil.rmtree(self.records, ignore_errors=True)

    def flow_run(self) -> dict | None:
        return self.child.flow_run() if self.child is not None else None


class _Remote:
    """A process of the job as the gang loop sees it (`launch.Member`): its actor, asked over Ray; its
    lines go to `sink` as each poll brings them. A lost actor is a process killed (status 137)."""

    def __init__(self, ray, index: int, actor, sink: Callable[[str], None]):
        self.ray, self.index, self.actor, self.sink = ray, index, actor, sink
        self.status: int | None = None

    def poll(self) -> int | None:
        if self.status is not None:
            return self.status
        try:
            lines, status = self.ray.get(self.actor.read.remote())
        except self.ray.exceptions.RayActorError as error:
            self.sink(f"jaxtune launch: process {self.index} was lost with its Ray actor ({_first_line(error)})")
            lines, status = [], 128 + signal.SIGKILL
        for line in lines:
            self.sink(f"[{self.index}] {line}")
        self.status = status
        return status

    def terminate(self) -> None:
        self.actor.terminate.remote()

    def kill(self) -> None:
        try:
            self.ray.get(self.actor.kill.remote(), timeout=60)
        except Exception:  # the actor is gone, and its child with it (_dies_with_parent)
            pass
        self.ray.kill(self.actor)

    def flow_run(self) -> dict | None:
        try:
            return self.ray.get(self.actor.flow_run.remote(), timeout=60)
        except Exception:  # the actor is gone: its record with it
            return None


def _dies_with_parent() -> Callable[[], None] | None:
    """For a child started from this (actor) process: Linux kills it when this process dies (an actor
    killed, a node's Ray stopped), so no jaxtune process outlives the Ray worker that watched it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _printer(line: str) -> None:
    print(line, flush=True)


def run(
    arguments: Sequence[str],
    gang: Gang,
    address: str | None = "auto",
    cpu_devices: int | None = None,
    restarts: int = 0,
    sink: Callable[[str], None] = _printer,
    grace: float = GRACE_SECONDS,
    poll_seconds: float = 0.2,
) -> int:
    """Run `jaxtune <arguments>` as `gang` on the Ray cluster at `address`, restarting the whole job up
    to `restarts` times after a failure worth retrying; the job's exit status (0 when every process
    exited 0, else the first failure's: 128 + 9 for a process whose actor or node was lost)."""
    import ray

    if not arguments or arguments[0] == "launch":
        raise LaunchError(
            "give the jaxtune command to run after --, e.g. jaxtune launch --ray auto --processes 2 -- run"
        )
    ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=False)
    try:
        for attempt in range(restarts + 1):
            status = _attempt(ray, list(arguments), gang, cpu_devices, sink, grace, poll_seconds)
            if status == 0 or status == NOT_RETRIED or attempt == restarts:
                if status == NOT_RETRIED:
                    sink(f"jaxtune launch: not restarted: status {NOT_RETRIED} is a failure that repeats")
                return status
            sink(f"jaxtune launch: restarting the job ({attempt + 1} of {restarts} restarts)")
        raise AssertionError("unreachable")
    finally:
        ray.shutdown()


def _attempt(ray, arguments, gang: Gang, cpu_devices, sink, grace: float, poll_seconds: float) -> int:
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if gang.tpu is not None:
        from ray.util.tpu import SlicePlacementGroup

        version, topology = gang.tpu
        reserved = SlicePlacementGroup(topology=topology, accelerator_version=version, strategy="STRICT_SPREAD")
        group, release = reserved.placement_group, reserved.shutdown
    else:
        group = placement_group([dict(gang.bundle)] * gang.count, strategy="STRICT_SPREAD")
        release = lambda: remove_placement_group(group)  # noqa: E731
    members: list[_Remote] = []
    try:
        try:
            ray.get(group.ready(), timeout=READY_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(
                f"the Ray cluster found no room for {gang.count} processes on {gang.count} distinct nodes, each with "
                f"{gang.bundle}, within {READY_SECONDS:.0f} s (ray status shows its nodes and what they have free)"
            ) from None
        actor = ray.remote(JobProcess)
        resources = {k: v for k, v in gang.bundle.items() if k != "CPU"}
        for index in range(gang.count):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            options = actor.options(
                num_cpus=gang.bundle.get("CPU", 0), resources=resources, scheduling_strategy=strategy
            )
            members.append(_Remote(ray, index, options.remote(), sink))
        coordinator = ray.get(members[0].actor.address.remote())
        ray.get([m.actor.start.remote(arguments, m.index, gang.count, coordinator, cpu_devices) for m in members])
        sink(f"jaxtune launch: {gang.count} processes on Ray, coordinator {coordinator}")
        return launch.watch(members, sink, poll_seconds)
    finally:
        launch.stop(members, grace)
        release()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
