"""Crash-safe training: SIGKILL the training process twice at different steps, stop it once with
SIGTERM, re-run the flow, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxtune.config import load_config
from tests.flows.shapes import TOY_MODEL
from tests.prefect_runs import flow_runs_of_store

pytestmark = [pytest.mark.training, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
SETTINGS = [
    *TOY_MODEL,
    "data.max_train_rows=256",
    "data.max_eval_rows=16",
    "data.max_length=64",
    "lora.dropout=0.1",
    "train.max_steps=60",
    "train.batch_size=4",
    "train.grad_accumulation=2",
    "train.checkpoint_every=5",
    "train.log_every=3",
    "train.warmup_steps=2",
]


def newest_checkpoint(store: Path) -> int:
    steps = [
        int(p.name.removeprefix("step-")) for p in store.glob(".scratch/train/*/step-*") if (p / "state.json").is_file()
    ]
    return max(steps, default=0)


def newest_logged(store: Path) -> int:
    """The last step the running (not yet published) train stage has logged."""
    steps = [0]
    for log in store.glob("train/.tmp-*/log.jsonl"):
        lines = log.read_text().splitlines()
        steps += [json.loads(line)["step"] for line in lines[-1:] if line.endswith("}")]
    return max(steps)


def run_and_kill(store: Path, after_step: int, sig: int = signal.SIGKILL) -> tuple[int, int]:
    """Start `jaxtune run --until train` in a new process; send it `sig` once it has logged `after_step`.

    Returns (the last step it logged, its newest checkpoint); a SIGTERM must end it as a stop."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    args = [a for s in [*SETTINGS, f"store.root={store}"] for a in ("--set", s)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxtune.cli", "run", *args, "--until", "train"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while newest_logged(store) < after_step:
        if proc.poll() is not None:
            pytest.fail(f"training ended before checkpoint {after_step}: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.005)
    proc.send_signal(sig)
    signalled = time.monotonic()
    err = proc.communicate()[1]
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # finishes its step, saves it, and says so on its last line, with the signal's own exit status
        print(f"SIGTERM to exit: {time.monotonic() - signalled:.1f} s")
        step = newest_checkpoint(store)
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"jaxtune: train: stopped by SIGTERM at step {step}; checkpoint saved "
            f"({next(store.glob(f'.scratch/train/*/step-{step:08d}'))}); run again to resume"
        )
    return newest_logged(store), newest_checkpoint(store)


def train_in_process(store: Path) -> Path:
    from jaxtune.flows.finetune import finetune

    return Path(finetune(config=load_config(None, [*SETTINGS, f"store.root={store}"]), until="train")["path"])


def test_training_killed_twice_resumes_to_the_uninterrupted_weights(tmp_path):
    reference = train_in_process(tmp_path / "uninterrupted")

    store = tmp_path / "killed"
    # Logged every 3 steps, checkpointed every 5: killed at 12 or later, and again at 36 or later,
    # so each kill loses the steps since the last checkpoint.
    killed, first = run_and_kill(store, after_step=12)
    killed_again, second = run_and_kill(store, after_step=36)
    assert 10 <= first < second < 60 and killed > first and killed_again > second
    assert not list(store.glob("train/*/manifest.json")), "a killed run leaves no train artifact"
    # Then a stop signal, as a spot VM's notice: the step it reached is saved, whether or not it
    # is a multiple of checkpoint_every, and the next run resumes at that step exactly.
    _, third = run_and_kill(store, after_step=46, sig=signal.SIGTERM)
    assert 46 <= third < 60
    # In Prefect it ends Crashed, as a run a termination signal ends always has (what the
    # deployments' restart automation starts again), with the same words.
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        stopped = max(flow_runs_of_store(client, store), key=lambda run: run.start_time)
    assert stopped.state.is_crashed() and stopped.state.message.startswith(
        f"train: stopped by SIGTERM at step {third}; "
    )

    resumed = train_in_process(store)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"] == third
    interruptions = summary["interruptions"]  # what the report counts
    assert [(i["stopped_by"], i["resumed_from"]) for i in interruptions] == [
        ("killed", first),
        ("killed", second),
        ("SIGTERM", third),
    ]
    assert interruptions[0]["reached"] >= killed and interruptions[1]["reached"] >= killed_again
    assert [i["lost_steps"] for i in interruptions] == [i["reached"] - i["resumed_from"] for i in interruptions]
    assert interruptions[2]["lost_steps"] == 0
    log = [json.loads(line) for line in (resumed / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 61))
    expected, got = load_file(str(reference / "params.safetensors")), load_file(str(resumed / "params.safetensors"))
    assert set(got) == set(expected)
    worst = max(float(np.abs(got[k] - expected[k]).max()) for k in expected)
    print(
        f"killed after step {killed} (checkpoint {first}) and {killed_again} (checkpoint {second}), "
        f"resumed from {summary['resumed_from']}: max abs weight diff {worst:.1e}"
    )
    for name in expected:  # bit-identical: same data position, same dropout keys, same compiled step
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not list(store.glob(".scratch/train/*/step-*")), "checkpoints are removed once the artifact is complete"
