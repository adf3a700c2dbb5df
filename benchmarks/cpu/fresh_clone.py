"""`make demo` or `make test` as a new user runs them, in a fresh clone, timed and kept as a result.

    .venv/bin/python -m benchmarks.cpu.fresh_clone demo          # results/demo.json
    .venv/bin/python -m benchmarks.cpu.fresh_clone test          # appended to results/suite.json's runs (about 25 min)
    .venv/bin/python -m benchmarks.cpu.fresh_clone demo --recipe configs/smollm2-135m-offline-grpo.yaml --name grpo-demo

Clones this checkout's HEAD into a temporary folder and runs the target there, the install included
(uv's cache as this machine has it), timing it from outside. `demo` then runs the same command again
(every stage `Cached`) and keeps the report's figures (`report.json`: losses before and after, exact
match, the train summary); with `--recipe`, the timed command is `jaxtune run RECIPE` after `make install`
and `python -m jaxtune.offline.checkpoints` (the GGUF files the offline real-model recipes name).
`test` keeps pytest's count and its slowest steps, appended to the runs results/suite.json holds (the newest
last), a failed run too (`green` false, the tests that failed under `failed`). The result names its commit,
command and machine (`harness.provenance`): the docs quote the demo's figures and the suite's runs by their
place in its history.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.harness import RESULTS, ROOT, provenance

SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ (?:failed|passed).*?) in (?P<seconds>[\d.]+)s", re.M)
FAILED = re.compile(r"^(?:FAILED|ERROR) (?P<test>\S+)", re.M)
SLOW = re.compile(r"^(?P<seconds>[\d.]+)s (?P<when>call|setup|teardown)\s+(?P<test>\S+)$", re.M)


def timed(command: list[str], folder: Path, env: dict, check: bool = True) -> tuple[float, str, int]:
    """Seconds, output (stdout and stderr) and exit status of `command` run in `folder`; with `check`, exits
    naming it where it fails."""
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - started
    if check and done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode} in {folder}:\n{done.stdout[-4000:]}")
    return seconds, done.stdout, done.returncode


def stage_states(output: str) -> dict[str, str]:
    """`jaxtune run`'s closing lines, `stage  state` each, as a dict."""
    found = re.findall(r"^(\w+)\s+(Completed|Cached|Failed|Crashed|Cancelled)\s*$", output, re.M)
    return dict(found)


def demo(clone: Path, env: dict, recipe: str | None) -> dict:
    if recipe:  # the checkpoints an offline recipe names are placed first (python -m jaxtune.offline.checkpoints)
        timed(["make", "install"], clone, env)
        timed([".venv/bin/python", "-m", "jaxtune.offline.checkpoints"], clone, env)
        command = [".venv/bin/jaxtune", "run", recipe]
    else:
        command = ["make", "demo"]
    first, output, _ = timed(command, clone, env)
    print(f"{' '.join(command)}: {first:.0f} s", file=sys.stderr)
    again, output_again, _ = timed(command, clone, env)
    print(f"again: {again:.0f} s", file=sys.stderr)
    # `jaxtune run` prints the report's folder after the stages' states
    folders = [Path(line) for line in output.splitlines() if line.startswith("/")]
    report = json.loads(next(f / "report.json" for f in reversed(folders) if (f / "report.json").is_file()).read_text())
    return {
        "command": " ".join(command),
        "recipe": recipe or "the offline default (jaxtune run with no config)",
        "first_run": {"seconds": round(first, 1), "states": stage_states(output)},
        "again": {"seconds": round(again, 1), "states": stage_states(output_again)},
        # the report's figures; not its examples, nor the paths into a store that is gone
        "report": {key: value for key, value in report.items() if key not in ("hardest", "export")},
    }


def suite(clone: Path, env: dict) -> dict:
    """A `make test` run's figures, green or not: a failed run is kept in the history too, with what failed."""
    seconds, output, status = timed(["make", "test"], clone, env, check=False)
    summary = SUMMARY.search(output)
    return {
        "command": "make test",
        "green": status == 0,
        "failed": [m["test"] for m in FAILED.finditer(output)],
        "seconds": round(seconds, 1),
        "minutes": round(seconds / 60, 2),
        "pytest": {"counts": summary["counts"], "seconds": float(summary["seconds"])} if summary else None,
        "slowest": [
            {"seconds": float(m["seconds"]), "when": m["when"], "test": m["test"]} for m in SLOW.finditer(output)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=("demo", "test"))
    parser.add_argument("--recipe", help="demo: a config file to run instead of the offline default")
    parser.add_argument("--name", help="the result's name under --out (default: demo, or suite)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder to write NAME.json in")
    args = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "JAX_PLATFORMS", "PYTHONPATH")}
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    made = provenance()  # this checkout's machine and command; the commit is the clone's
    load_before = os.getloadavg()  # (1, 5, 15 min): other work sharing the cores slows the run
    with tempfile.TemporaryDirectory(prefix="jaxtune-fresh-clone-") as temporary:
        clone = Path(temporary) / "jaxtune"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        head = ["git", "-C", str(clone), "rev-parse", "--short=12", "HEAD"]
        made["commit"] = subprocess.run(head, capture_output=True, text=True, check=True).stdout.strip()
        figures = demo(clone, env, args.recipe) if args.target == "demo" else suite(clone, env)
    result = {
        "date": date,
        "provenance": {**made, "command": f"{made['command']} (then in the clone: {figures['command']})"},
        "fresh_clone": True,
        **figures,
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
    }
    path = args.out / f"{args.name or ('demo' if args.target == 'demo' else 'suite')}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.target == "test":  # the suite's runs are kept, each after those before it
        result = with_runs_before(path, result)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(path)
    if result.get("runs") and not result["runs"][-1].get("green", True):
        print(f"make test failed in the clone: {', '.join(result['runs'][-1]['failed']) or 'see its output'}")
        return 1
    return 0


def with_runs_before(path: Path, run: dict) -> dict:
    """The history of fresh-clone suite runs in `path` with `run` appended: `{"runs": [oldest, ..., newest]}`,
    the file itself dated and attributed as its newest run. A file holding one run (as results/suite.json did
    before it kept a history) is that run's history."""
    found = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    runs = found["runs"] if "runs" in found else [found]
    return {"date": run["date"], "provenance": run["provenance"], "runs": [*runs, run]}


if __name__ == "__main__":
    sys.exit(main())
