"""`jaxtune run` fed a user's mistakes, in this process: each case checks the exit status, the
last line on stderr, and what the run left in the store."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.flows.toy import TOY


@pytest.fixture(scope="session", autouse=True)
def _runs_use_the_server(prefect_server):
    yield


@dataclass
class Outcome:
    status: int
    stdout: str
    stderr: str
    flow_started: bool

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


class Jaxtune:
    """Runs `jaxtune run` with the toy settings and a store of its own."""

    def __init__(self, store: Path, monkeypatch):
        self.store, self.monkeypatch = store, monkeypatch

    def run(self, *args: str, toy: bool = True) -> Outcome:
        from jaxtune.cli import main as cli
        from jaxtune.flows import finetune as flow_module

        started = []
        flow = flow_module.finetune

        def watched(*a, **k):
            started.append(True)
            return flow(*a, **k)

        self.monkeypatch.setattr(flow_module, "finetune", watched)
        settings = [f"--set={item}" for item in (TOY if toy else [])] + [f"--set=store.root={self.store}"]
        out, err = io.StringIO(), io.StringIO()
        _console_logs_to(err)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = cli.main(["run", *settings, *args])
        except SystemExit as exit_:  # argparse
            status = exit_.code
        finally:
            _console_logs_to(io.StringIO())  # Prefect's later lines (its server stopping) go nowhere
        return Outcome(status, out.getvalue(), err.getvalue(), bool(started))

    def folders(self) -> set[str]:
        """Every artifact folder, temp folder and scratch folder in the store."""
        if not self.store.exists():
            return set()
        found = {str(p.relative_to(self.store)) for p in self.store.glob("*/*") if p.is_dir()}
        return found | {str(p.relative_to(self.store)) for p in self.store.glob(".scratch/*/*")}

    def stats(self) -> dict:
        [path] = self.store.glob("tokenize/*/stats.json")
        return json.loads(path.read_text())


def _console_logs_to(stream) -> None:
    """Point Prefect's console handlers, created by the first run in whatever stream was sys.stderr then, at `stream`."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for handler in {h for logger in loggers for h in logger.handlers if isinstance(h, PrefectConsoleHandler)}:
        handler.stream = handler.console.file = stream


@pytest.fixture
def jaxtune(tmp_path, monkeypatch) -> Jaxtune:
    return Jaxtune(tmp_path / "store", monkeypatch)


@pytest.fixture(scope="session")
def trained_until_eval(tmp_path_factory) -> Path:
    """A store holding the toy run's stages up to baseline_eval (built once per session)."""
    from jaxtune.flows.finetune import finetune

    store = tmp_path_factory.mktemp("until-eval") / "store"
    finetune(overrides=[*TOY, f"store.root={store}"], until="baseline_eval")
    return store


@pytest.fixture
def jaxtune_after_eval(trained_until_eval, tmp_path, monkeypatch) -> Jaxtune:
    """`jaxtune` on a copy of the store up to baseline_eval."""
    store = tmp_path / "store"
    shutil.copytree(trained_until_eval, store, ignore=shutil.ignore_patterns(".locks"))
    return Jaxtune(store, monkeypatch)


def refused_before_the_flow(done: Outcome, status: int, message: str, *, prefix: bool = False) -> None:
    """`done` exited with `status` before the flow started, its last line `message` (or starting with it)."""
    assert (done.status, done.flow_started) == (status, False), done.stderr
    assert done.last_line.startswith(message) if prefix else done.last_line == message, done.last_line
    assert "Traceback" not in done.stderr


def dolly_rows(n: int, words: int = 3) -> list[dict]:
    """`n` distinct Dolly rows whose responses have about `words` words."""
    return [
        {
            "instruction": f"Question {i} about item {i % 7}?",
            "context": "",
            "response": " ".join(f"answer{i}" for _ in range(words)),
            "category": "open_qa",
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
