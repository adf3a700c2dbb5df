"""Shared fixtures: tiny random models built from configs (nothing is downloaded)."""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

# Before Prefect loads: no telemetry, and its home (database, logs) in a throwaway folder, removed
# when this process ends (the processes a test starts inherit it and end before).
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="jaxtune-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Prefect's temporary servers (a `jaxtune run` a test starts without a server, Prefect's test harness)
# are given 10 minutes to answer, in this process and every process it starts: jaxtune's own 120 s
# (`jaxtune.cli.main._local_servers`, which a setting here overrides) was too few for a new database's
# migration on 2 cores kept busy by other work (load 12). tests/safety/test_localhost.py checks the 120.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
# XLA:CPU built for compile time, in this process and every process it starts: the suite compiles
# about 900 distinct programs for models that run in milliseconds: JAX's compile events add up to
# about 40% of its 1,950 s of CPU.
# - Without LLVM's optimisation passes (level 0), the toy programs compile in about half the time
#   (the toy flows run 10-35% faster in all; the 135M-parameter checkpoints' tests 5% slower).
# - With XLA:CPU's older elemental emitters in place of its MLIR fusion emitters, the toy LoRA train
#   step compiles in 0.8 s of CPU instead of 2.1 s. Bigger programs lose: the 1B-shaped memory plan
#   compiles in 32.5 s instead of 24.0, and the real checkpoints' tests take about 25% longer.
#   Over the whole suite (`-n 2`, two runs one after the other) JAX's compile events summed 811 s
#   without the flag and 636 s with it, the tests 2,006 and 1,867 s, and the run 1,955 and 1,804 s
#   of CPU; 878 passed both times.
# The HLO is the same; the arithmetic differs in float32's last digit: five toy LoRA steps give
# losses 1.4e-7 apart relatively between these flags and XLA's defaults, far inside every tolerance.
# Only tests run so; jaxtune itself, `make demo` and `make bench` keep XLA's defaults.
# jaxlib 0.11 removed the elemental emitters and their flag, and XLA aborts on a flag it does not
# know: the flag is given to jaxlib 0.10 alone.
ELEMENTAL_EMITTERS = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
CPU_TEST_FLAGS = "--xla_backend_optimization_level=0" + " --xla_cpu_use_fusion_emitters=false" * ELEMENTAL_EMITTERS
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_TEST_FLAGS}".strip()
# PyTorch's intra-op work on one thread, in this process and every process it starts: `make test`
# runs one worker per core, so a second OpenMP thread only contends with the other worker, and
# waits by spinning. tests/parity, test_chat and test_doctor under `-n 2`, alternating runs: 332
# and 345 s of CPU (186 and 193 s of wall time) on one thread, 352 and 355 s (195 and 199 s) on two.
# XLA's own threads are not affected.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every compiled program into the shared compile cache, however fast it compiled: at level 0 most
# of the toy model's compile in under jaxtune's half-second threshold, and the suite builds each
# of them in many stores (a toy flow in a fresh store: 9.1 s with the threshold, 7.2 s without).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The CPU alone, in this process and every process it starts: with libtpu installed (the tpu-plan
# extra the target tests use) JAX would first look for a TPU and print libtpu's warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The plans of the steps the suite compiles for a target's compile-only TPU or GPU devices (recipe fits,
# doctor --target) are read from the committed tests/targets/plans.json (`compile_cache`): each of those
# compiles takes minutes on 2 cores, and its outcome is a function of its key alone (the lowered program,
# the devices, the compiler's version and flags). The suite reads a copy of that file in a folder of its
# own, removed when the session ends, and a step whose key misses is compiled for real and its plan kept
# in the copy alone: the suite never writes the checkout. A key misses where the program, a recipe, the
# compiler or its flags differ from the recording run's (XLA_FLAGS above holds this module's flags once
# per import of it: twice in a process, as conftest and as tests.conftest, and once more in the xdist
# controller, so record under -n as `make test` runs). To record plans into the committed file, name it:
# `JAXTUNE_PLANS_FILE=tests/targets/plans.json PYTHONHASHSEED=0 pytest -m target -n 2` (commit the file
# with the change; delete it first to drop the records nothing reads any more). `make test` runs with
# PYTHONHASHSEED=0: Gemma 3's programs trace in the order of a set of strings.
COMMITTED_PLANS = os.path.join(os.path.dirname(__file__), "targets", "plans.json")
if "JAXTUNE_PLANS_FILE" not in os.environ:  # this module runs twice in a process (as conftest, tests.conftest)
    _plans_folder = tempfile.mkdtemp(prefix="jaxtune-plans-")  # xdist's workers inherit it
    atexit.register(shutil.rmtree, _plans_folder, ignore_errors=True)
    shutil.copyfile(COMMITTED_PLANS, os.path.join(_plans_folder, "plans.json"))
    os.environ["JAXTUNE_PLANS_FILE"] = os.path.join(_plans_folder, "plans.json")
# No executables kept whole, nor plans recalled, across the suite's tests: a test that fakes a plan or a
# refusal must not find another test's. tests/training/test_kept_executables.py turns them on in a
# folder of its own.
os.environ["JAXTUNE_KEEP_EXECUTABLES"] = "0"

# Prefect configures logging when it is first imported, closing the handlers there are. Imported
# after JAX, that closes absl's handler and with it the stream absl took as stderr, which under
# pytest is the capture's file: every later test then fails in pytest's capture.
import prefect.main  # noqa: E402, F401
import pytest  # noqa: E402

PAD, EOS, BOS = 0, 1, 2
VOCAB = 256


def tiny_model(
    family: str = "gemma3",
    layers: int = 2,
    sliding_window: int = 16,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
):
    """A random fp32 model of `family` (see jaxtune.offline.architectures), eager attention, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxtune.config import TinyModelConfig
    from jaxtune.offline.architectures import tiny_config

    shape = TinyModelConfig(
        architecture=family,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        vocab_size=VOCAB,
    )
    torch.manual_seed(seed)
    config = tiny_config(family, shape, VOCAB, PAD, BOS, EOS)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory, worker_id):
    """One XLA compilation cache for the whole session, every xdist worker and every process the
    tests start: the toy model's programs compile once instead of once per test store.
    test_reproducible opts out, to compile in each fresh process."""
    from jaxtune.runtime.devices.compile_cache import SHARED_FOLDER_VARIABLE

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if worker_id != "master" else base) / "xla-cache"
    os.environ[SHARED_FOLDER_VARIABLE] = str(folder)
    yield folder
    os.environ.pop(SHARED_FOLDER_VARIABLE, None)


@pytest.fixture(scope="session")
def real_store(tmp_path_factory, worker_id) -> Path:
    """One artifact store for the real checkpoints' imports and runs, shared by every test module
    and xdist worker of the session: keys hash content (a GGUF file's bytes, a config section, the
    code), so a module finds what another built, and the stage locks make a second builder wait."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if worker_id != "master" else base) / "real-store"


SHARED_SERVER = "jaxtune_prefect_url_file"  # the xdist worker input naming the file that holds its URL
SESSION_SERVER = pytest.StashKey()


def pytest_configure(config):
    """Under xdist, the controller starts the session's one Prefect server while the workers start
    and collect (each would otherwise start its own, about 7 s of CPU on a quiet machine and 20 s
    under the suite's load, before its first flow could run); it stops it once they are done."""
    if (
        getattr(config, "workerinput", None) is None
        and getattr(config.option, "numprocesses", None)
        and getattr(config.option, "dist", "no") != "no"
    ):
        from tests.session_server import SessionServer

        config.stash[SESSION_SERVER] = SessionServer.start_in_background()


def pytest_unconfigure(config):
    server = config.stash.get(SESSION_SERVER, None)
    if server is not None:
        server.stop()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    server = node.config.stash.get(SESSION_SERVER, None)
    if server is not None:
        node.workerinput[SHARED_SERVER] = str(server.url_file)


@pytest.fixture(scope="session")
def prefect_server(request):
    """The Prefect server every test that runs a flow records in: under xdist the session's one
    server (see `pytest_configure`), shared by the workers; run without xdist, a temporary one of
    this process's own.

    Flow runs in this process send Prefect no heartbeats: the liveness signal (every 180 s) that
    no test reads, whose thread each run otherwise waits on as it ends, for up to a second (a
    cached toy run: 1.06 s with it, 0.68 s without). Runs in processes the tests start keep them."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    from tests.session_server import drain_to_server, wait_for_server

    url_file = getattr(request.config, "workerinput", {}).get(SHARED_SERVER)
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        if url_file is None:
            with prefect_test_harness(server_startup_timeout=600):
                yield
            return
        shared = wait_for_server(Path(url_file))  # its database named as the harness names its own
        with temporary_settings(
            {PREFECT_API_URL: shared["api"], PREFECT_SERVER_DATABASE_CONNECTION_URL: shared["database"]}
        ):
            yield
            drain_to_server()


# Whole flows, checkpoints, child processes; in the order their modules should start: a real
# checkpoint's module takes 1-2 minutes of a worker, a deployment module over 1.5, a mesh one 1.
LONG_MARKERS = ("real", "deployment", "mesh", "slow", "target", "parity")


def pytest_collection_modifyitems(items):
    """The modules with long tests first, the longest kinds first (`LONG_MARKERS`), each module's
    tests kept together and in order. Under `make test` (`-n auto --dist loadscope
    --no-loadscope-reorder`) each module (or class) goes whole to one worker in this order, so the
    long ones start early and the many short ones fill in at the end, instead of one worker running
    a minute-long module while the other has nothing left. (Without --no-loadscope-reorder, xdist
    orders modules by their number of tests, which puts a checkpoint's eight long tests last.)"""
    rank: dict[str, int] = {}
    for item in items:
        kinds = [i for i, marker in enumerate(LONG_MARKERS) if item.get_closest_marker(marker)]
        rank[item.module.__name__] = min([rank.get(item.module.__name__, len(LONG_MARKERS)), *kinds])
    position = {name: i for i, name in enumerate(rank)}
    items.sort(key=lambda item: (rank[item.module.__name__], position[item.module.__name__]))
