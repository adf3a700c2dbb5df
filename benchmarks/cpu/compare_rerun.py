"""rerun_vs_first: the offline flow run twice in a child process (`bench.py --child rerun`) with its own PREFECT_HOME."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.harness import BENCH, ROOT, Context, entry, log, skipped


def bench_rerun_vs_first(ctx: Context) -> dict:
    """The offline flow twice in one (child) process: seconds of the cached second run over the first."""
    key = "rerun_vs_first"
    runs = []
    for rep in range(ctx.rerun_reps):
        with tempfile.TemporaryDirectory(prefix="jaxtune-bench-rerun-") as tmp:
            result = Path(tmp) / "result.json"
            env = {
                **os.environ,
                "PREFECT_HOME": str(Path(tmp) / "prefect"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PYTHONPATH": str(ROOT),
            }
            env.pop("PREFECT_API_URL", None)
            log(
                f"rerun_vs_first: repetition {rep + 1}/{ctx.rerun_reps} (child process, train.max_steps={ctx.rerun_steps})"
            )
            child = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    BENCH,
                    "--child",
                    "rerun",
                    "--child-dir",
                    tmp,
                    "--rerun-steps",
                    str(ctx.rerun_steps),
                ],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if child.returncode != 0 or not result.exists():
                return {key: skipped(f"child failed (exit {child.returncode}): {child.stderr[-2000:]}")}
            runs.append(json.loads(result.read_text()))
    first = statistics.median(r["first_seconds"] for r in runs)
    second = statistics.median(r["second_seconds"] for r in runs)
    ratios = [r["second_seconds"] / r["first_seconds"] for r in runs]
    return {
        key: entry(
            statistics.median(ratios),
            second,
            first,
            "s",
            "second run (every stage cached)",
            "first run",
            "lower: rerun cheaper",
            runs=runs,
            train_max_steps=ctx.rerun_steps,
            note=f"offline default config with train.max_steps={ctx.rerun_steps} (of 1000) and a temporary store; "
            "Prefect's temporary server started by a trivial flow first, not counted; median over "
            f"{len(runs)} fresh child process(es)",
        )
    }


def child_rerun(directory: str, max_steps: int) -> None:
    """(child) Start Prefect's temporary server with a trivial flow, then run the offline flow twice."""
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from prefect import flow

    import jaxtune.runtime  # noqa: F401  heavy imports before timing: the first run is charged only its work
    from jaxtune.config import load_config
    from jaxtune.flows.finetune import finetune

    @flow(name="bench-warmup")
    def warmup() -> int:
        return 1

    start = time.perf_counter()
    warmup()
    server = time.perf_counter() - start
    config = load_config(None, [f"store.root={Path(directory) / 'store'}", f"train.max_steps={max_steps}"])
    timings, states = [], []
    for _ in range(2):
        start = time.perf_counter()
        result = finetune(config=config)
        timings.append(time.perf_counter() - start)
        states.append(result["stages"])
    (Path(directory) / "result.json").write_text(
        json.dumps(
            {
                "server_start_seconds": server,
                "first_seconds": timings[0],
                "second_seconds": timings[1],
                "states": states,
            }
        )
    )
