"""A stage that fails on the user's data: one readable last line on the console, exit 1, no
traceback there, nothing added to the store, and the whole traceback kept in Prefect's run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.prefect_runs import flow_runs_of_store

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "jaxtune.cli", "run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_bad_data_file_ends_in_one_line_naming_it_and_prefect_keeps_the_traceback(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "c", "response": "d"}\nnot json\n')
    store = tmp_path / "store"
    done = run_cli("--set", f"data.source={bad}", "--set", f"store.root={store}")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last
        == f"jaxtune: build_tokenizer: {bad} line 3: not valid JSON (Expecting value at column 1) (--debug shows the traceback)"
    )
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not list(store.glob("*/*/manifest.json")) and not list(store.glob("*/.tmp-*")), "the store is as it was"

    with get_client(sync_client=True) as client:
        [run] = flow_runs_of_store(client, store)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert run.state.is_failed() and any("Traceback" in log.message and "not valid JSON" in log.message for log in logs)

    debug = run_cli("--set", f"data.source={bad}", "--set", f"store.root={store}", "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr
