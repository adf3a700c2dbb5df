"""`make tpu-check`: every stage of the offline pipeline, and a few LoRA steps of every model family, on
this machine's default device (a TPU chip where there is one), with the results checked.

    python -m benchmarks.tpu.tpu_check                      # both parts: results/tpu-check.{json,md}
    python -m benchmarks.tpu.tpu_check --parts families --families gemma3 --families llama
    python -m benchmarks.tpu.tpu_check --no-prefect --out /tmp/tpucheck   # the stages without Prefect, here too

From the repository's root, which `-m` puts first on the import path: jaxtune is then this checkout's
where it is not installed (a TPU machine's PYTHONPATH, or a system Python before .venv exists).

1. pipeline: the bundled offline default (what `jaxtune run` runs with no config), with its export also
   merged (and written as GGUF where the writer takes the offline model's family), in a fresh store.
   Where a TCP socket opens on 127.0.0.1, `jaxtune run` itself runs it; where none does (Prefect's
   temporary server cannot start: `[Errno 97] Address family not supported by protocol`), or with
   --no-prefect, each step of the flow's own list (`finetune.pipeline`) is called in the flow's order as
   the plain function its Prefect task wraps. Then every stage's artifact is verified as the store
   verifies it, and the eval loss must have fallen.
2. families: `tpu_check_families`.

The exit status is 1 when any part fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

from benchmarks.common import harness
from benchmarks.tpu import tpu_check_families as families
from jaxtune.config import OFFLINE
from jaxtune.flows import finetune

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("pipeline", "families")
RESULTS = ROOT / "benchmarks" / "results"
GGUF_TYPES = ("q8_0",)
NO_SOCKET = "Prefect server unavailable here (no TCP socket): stages called directly over the store, without Prefect"
FORCED = "--no-prefect: stages called directly over the store, without Prefect"
# What a stage calls of a Prefect run: its logger, and the artifacts the UI shows (progress bar, live curve).
ARTIFACT_CALLS = (
    "create_progress_artifact",
    "update_progress_artifact",
    "create_markdown_artifact",
    "create_table_artifact",
)
log = logging.getLogger("jaxtune.tpu_check")


def say(line: str) -> None:
    print(line, flush=True)


# --------------------------------------------------------------------------------------------
# How the pipeline runs here: through Prefect, or its stages' own functions
# --------------------------------------------------------------------------------------------


def tcp_problem() -> str | None:
    """Why no TCP connection can be made on 127.0.0.1 (None when one can): Prefect's temporary server needs one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=5):
                return None
    except OSError as error:
        return str(error)


def prefect_route(no_prefect: bool) -> tuple[bool, str]:
    """(whether `jaxtune run` runs the pipeline, what the output says about it)."""
    if no_prefect:
        return False, FORCED
    problem = tcp_problem()
    if problem is not None:
        return False, f"{NO_SOCKET} [{problem}]"
    return True, "TCP on 127.0.0.1 works: `jaxtune run` runs the pipeline through Prefect's temporary server"


def stage_names(config) -> list[str]:
    """The stages the flow runs for `config`, in its order: from the flow's own list."""
    return [step.stage for step in finetune.pipeline(config)]


@contextlib.contextmanager
def without_prefect(modules):
    """Inside this block only, what the stage modules `modules` call of a Prefect run goes elsewhere: its
    run logger to a plain `logging` logger, its UI artifacts nowhere (outside a run they need Prefect's API)."""
    patches = [mock.patch(f"prefect.artifacts.{name}", lambda *args, **kwargs: None) for name in ARTIFACT_CALLS]
    for module in modules:
        if hasattr(module, "get_run_logger"):
            patches.append(mock.patch.object(module, "get_run_logger", lambda *args, **kwargs: log))
        patches += [
            mock.patch.object(module, name, lambda *args, **kwargs: None)
            for name in ARTIFACT_CALLS
            if hasattr(module, name)
        ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def run_directly(config) -> dict[str, float]:
    """Each step of the flow's list, in its order, called as the flow calls it (its task's function, over
    the store, under the lock a flow run takes) but with no Prefect run; {stage: seconds}."""
    from jaxtune.tasks import export
    from jaxtune.tasks.stage import built_outside_flow

    steps = finetune.pipeline(config)
    root = Path(config.store.root).resolve()
    if config.store.compile_cache:  # as the flow does
        from jaxtune.runtime.devices import compile_cache

        compile_cache.enable(compile_cache.folder_of(root))
    done, seconds = {}, {}
    with without_prefect({importlib.import_module(step.module) for step in steps}):
        for step in steps:
            inputs = {name: done[v] if isinstance(v, str) else v for name, v in step.inputs.items()}
            if step.stage == "train" and config.export.gguf:
                export.check_gguf_export(inputs["model"], config.model)  # as the flow does, before training
            start = time.perf_counter()
            done[step.stage] = built_outside_flow(
                root,
                step.stage,
                step.module,
                step.section,
                inputs,
                lambda: step.task.fn(step.section, inputs, str(root), **step.options),
            )
            seconds[step.stage] = round(time.perf_counter() - start, 2)
            say(f"stage {step.stage}: {seconds[step.stage]:.1f} s")
    return seconds


def run_through_prefect(overrides: list[str], home: Path) -> tuple[int, list[str], float]:
    """`jaxtune run` with `overrides`, in a process of its own, its Prefect home in `home`; (exit status,
    its output's lines, when it started). Its output goes on to this process's stderr as it comes."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT)))),
    }
    command = [sys.executable, "-m", "jaxtune.cli", "run", *(part for o in overrides for part in ("--set", o))]
    started, lines = time.time(), []
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as run:
        for line in run.stdout:
            sys.stderr.write(line)
            lines.append(line.rstrip("\n"))
    return run.returncode, lines, started


def seconds_from_artifacts(store, keys: dict[str, str], started: float) -> dict[str, float]:
    """Each stage's seconds in a run through Prefect: from the time the previous stage's artifact (or the
    run) was complete to the time its own was (its manifest's modification time)."""
    seconds, last = {}, started
    for stage, key in keys.items():
        done = (store.folder(stage, key) / "manifest.json").stat().st_mtime
        seconds[stage], last = round(done - last, 2), done
    return seconds


# --------------------------------------------------------------------------------------------
# Part 1: the pipeline
# --------------------------------------------------------------------------------------------


def gguf_refusal(tiny) -> str | None:
    """Why the GGUF writer refuses the offline model of `tiny`
    (model.tiny), from its config alone; None if it takes it."""
    from jaxtune.errors import ModelError
    from jaxtune.gguf.writer import check_supported
    from jaxtune.offline.architectures import tiny_config

    try:
        check_supported(tiny_config(tiny.architecture, tiny, tiny.vocab_size, 0, 1, 2))
    except ModelError as error:
        return str(error)
    return None


def check_overrides(store: Path, max_steps: int | None, recipe: str = OFFLINE) -> tuple[list[str], str | None]:
    """The recipe's overrides for the check (a merged export; for the offline default, GGUF too where its
    family allows it), and why GGUF is left out (None when it is written)."""
    overrides = [f"store.root={store}", "export.merge=true", *([f"train.max_steps={max_steps}"] if max_steps else [])]
    if recipe != OFFLINE:
        return overrides, None
    refusal = gguf_refusal(finetune.load_recipe(OFFLINE, overrides).model.tiny)
    if refusal is None:
        overrides.append(f"export.gguf=[{', '.join(GGUF_TYPES)}]")
    return overrides, refusal


def run_pipeline(store: Path, max_steps: int | None, use_prefect: bool, route: str, recipe: str = OFFLINE) -> dict:
    overrides, gguf_refused = check_overrides(store, max_steps, recipe)
    config = finetune.load_recipe(recipe, overrides)
    say(f"pipeline: {route}; stages {', '.join(stage_names(config))}; train.max_steps={config.train.max_steps}")
    result = {
        "recipe": recipe,
        "route": "prefect" if use_prefect else "direct",
        "note": route,
        "overrides": overrides,
        "max_steps": config.train.max_steps,
        "gguf": GGUF_TYPES if gguf_refused is None else [],
        "gguf_refused": gguf_refused,
    }
    started = time.perf_counter()
    if use_prefect:
        with tempfile.TemporaryDirectory(prefix="jaxtune-tpu-check-prefect-") as home:
            status, lines, since = run_through_prefect(overrides, Path(home))
        result["jaxtune_run"] = {"exit_status": status, "last_lines": lines[-12:]}
        if status != 0:
            return {**result, "pass": False, "error": f"jaxtune run exited {status}: {lines[-1] if lines else ''}"}
    else:
        seconds = run_directly(config)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result.update(verify_pipeline(config))
    if use_prefect:
        stored = [stage for stage in result["stages"] if stage["problem"] is None]
        times = seconds_from_artifacts(_store(config), {s["stage"]: s["key"] for s in stored}, since)
        # The first stage's time includes starting `jaxtune run` and its Prefect server.
        result["seconds_source"] = "artifact completion times"
    else:
        times, result["seconds_source"] = seconds, "timed around each stage's call"
    for stage in result["stages"]:
        stage["seconds"] = times.get(stage["stage"])
    return result


def _store(config):
    from jaxtune.artifacts import ArtifactStore

    return ArtifactStore(config.store.root)


def verify_pipeline(config) -> dict:
    """Every stage's artifact verified as the store verifies it (its manifest, each file's size and sha256),
    at the key the flow plans for it; and what the stages measured."""
    store, keys = _store(config), finetune.planned_keys(config)
    stages = [{"stage": stage, "key": key, "problem": store.problem(stage, key)} for stage, key in keys.items()]
    if any(stage["problem"] for stage in stages):
        return {
            "stages": stages,
            "pass": False,
            "error": "; ".join(f"{s['stage']}: {s['problem']}" for s in stages if s["problem"]),
        }
    read = lambda stage, name: store.ref(stage, keys[stage]).read_json(name)  # noqa: E731
    baseline, final = read("baseline_eval", "metrics.json")["loss"], read("final_eval", "metrics.json")["loss"]
    summary, exported = read("train", "summary.json"), read("export", "export.json")
    written = [f["type"] for f in exported.get("gguf", [])]
    figures = {
        "baseline_loss": baseline,
        "final_loss": final,
        "loss_fell": final < baseline,
        "train": {
            name: summary.get(name)
            for name in (
                "steps",
                "seconds",
                "compile_seconds",
                "tokens_per_second",
                "mfu",
                "fused_attention",
                "batch_shape",
                "final_loss",
            )
        },
        "exact_match": read("report", "report.json").get("exact_match"),
        "export": {"kind": exported["kind"], "merged": exported.get("merged") == "merged", "gguf": written},
    }
    figures["train"]["attention"] = train_attention(summary, model_head_dim(config))
    problems = [
        what
        for what, bad in (
            (f"eval loss did not fall ({baseline:.4f} -> {final:.4f})", not final < baseline),
            ("no merged model in the export", not figures["export"]["merged"]),
            (f"GGUF {list(config.export.gguf)} asked for, {written} written", written != list(config.export.gguf)),
            ("no tokens/s from training", not summary.get("tokens_per_second")),
        )
        if bad
    ]
    return {"stages": stages, **figures, "pass": not problems, **({"error": "; ".join(problems)} if problems else {})}


def model_head_dim(config) -> int:
    """The head size of the recipe's model: the offline default's from its tiny settings, else from the
    config.json of the model folder a GGUF checkpoint was imported into."""
    if config.model.name == OFFLINE:
        return config.model.tiny.head_dim
    keys = finetune.planned_keys(config)
    if "import_gguf" not in keys:
        raise ValueError(f"{config.model.name}: the check reads the head size of an imported GGUF or tiny model only")
    raw = json.loads((_store(config).folder("import_gguf", keys["import_gguf"]) / "config.json").read_text())
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def train_attention(summary: dict, head_dim: int) -> str:
    """The attention the train stage ran, from its summary: the platform's fused kernel where it takes the
    packed length, else XLA's (say why); transformers' eager attention where the model cannot fuse."""
    if not summary.get("fused_attention"):
        return "transformers eager (no fused attention for this model)"
    from jaxtune.config import MeshConfig
    from jaxtune.runtime.devices.mesh import make_placement

    return families.attention_core(make_placement(MeshConfig()).mesh, summary["batch_shape"][-1], head_dim)


# --------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    import jax

    def version(*names: str) -> str | None:
        for name in names:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return importlib.metadata.version(name)
        return None

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "libtpu": version("libtpu", "libtpu-nightly"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def guarded(part: str, run, *args) -> dict:
    """`run(*args)`, or a failed part naming the error (its traceback on stderr)."""
    try:
        return run(*args)
    except Exception as error:  # noqa: BLE001 - a part that breaks is a failed part; the others still run
        traceback.print_exc()
        return {"pass": False, "error": f"{part}: {type(error).__name__}: {error}".splitlines()[0]}


def exit_status(results: dict) -> int:
    return 0 if results["parts"] and all(part["pass"] for part in results["parts"].values()) else 1


def mark(ok: bool) -> str:
    return "pass" if ok else "**FAIL**"


def render_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"# TPU check, {results['date']}",
        "",
        f"{m['platform']} ({m['device_kind']}, {m['devices']} device(s)); jax {m['jax']}, jaxlib {m['jaxlib']}, "
        f"libtpu {m['libtpu']}, torch {m['torch']}, Python {m['python']}",
        "",
        f"`{results['command']}`: **{'pass' if exit_status(results) == 0 else 'FAIL'}**",
        "",
    ]
    pipeline = results["parts"].get("pipeline")
    if pipeline is not None:
        lines += [f"## Pipeline: {mark(pipeline['pass'])}", ""]
        if pipeline.get("note"):
            lines += [pipeline["note"], ""]
        if pipeline.get("error"):
            lines += [f"Error: {pipeline['error']}", ""]
        if pipeline.get("stages"):
            lines += ["| stage | seconds | artifact |", "|---|---|---|"]
            lines += [
                f"| {s['stage']} | {s.get('seconds')} | {'verified' if s['problem'] is None else s['problem']} |"
                for s in pipeline["stages"]
            ]
        if "train" in pipeline:
            t = pipeline["train"]
            lines += [
                "",
                f"eval loss {pipeline['baseline_loss']:.4f} -> {pipeline['final_loss']:.4f}; train: "
                f"{t['steps']} steps (train.max_steps={pipeline['max_steps']}), {t['tokens_per_second']} tokens/s, "
                f"compiling {t['compile_seconds']} s, batch {t['batch_shape']}, attention {t['attention']}; "
                f"exact match {pipeline['exact_match']}; export {pipeline['export']}"
                + (f"; GGUF left out: {pipeline['gguf_refused']}" if pipeline.get("gguf_refused") else ""),
            ]
        lines.append("")
    part = results["parts"].get("families")
    if part is not None:
        lines += [f"## Families: {mark(part['pass'])}", ""]
        if part.get("error"):
            lines += [f"Error: {part['error']}", ""]
        lines += [
            "| family | loss jax | loss torch | \\|diff\\| | bound | losses after steps | attention (step 0) | |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in part.get("rows", []):
            if "error" in row:
                lines.append(f"| {row['family']} | | | | | {row['error']} | | {mark(False)} |")
                continue
            lines.append(
                f"| {row['family']} | {row['loss_jax']:.6f} | {row['loss_torch']:.6f} | {row['diff']:.1e} | "
                f"{row['bound']:.0e} | {', '.join(f'{v:.4f}' for v in row['losses'])} | {row['attention']} | "
                f"{mark(row['pass'])} |"
            )
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tpu-check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "tpu-check.md").write_text(render_markdown(results))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="folder for tpu-check.json and tpu-check.md (default: %(default)s)"
    )
    parser.add_argument("--parts", action="append", choices=PARTS, help="a part to run (repeatable; default: both)")
    parser.add_argument(
        "--families",
        action="append",
        nargs="+",
        choices=families.ARCHITECTURES,
        metavar="NAME",
        help=f"families to check (default: all of {', '.join(families.ARCHITECTURES)})",
    )
    parser.add_argument(
        "--no-prefect", action="store_true", help="call the stages directly even where Prefect could run"
    )
    parser.add_argument("--max-steps", type=int, help="train.max_steps of the pipeline (default: the recipe's)")
    parser.add_argument(
        "--recipe",
        default=OFFLINE,
        help="the pipeline's recipe: a YAML file such as configs/gemma3-270m-offline-lora.yaml (default: the "
        "offline default)",
    )
    parser.add_argument("--store", type=Path, help="artifact store of the pipeline (default: a new temporary folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parts = args.parts or list(PARTS)
    results = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            ["python", "-m", "benchmarks.tpu.tpu_check", *(argv if argv is not None else sys.argv[1:])]
        ),
        "provenance": {"commit": harness.commit()},
        "parts": {},
    }
    # The store lives until the end: the pipeline keeps XLA's compile cache in it for the rest of the process.
    with tempfile.TemporaryDirectory(prefix="jaxtune-tpu-check-store-") as temporary:
        if "pipeline" in parts:
            use_prefect, route = prefect_route(args.no_prefect)
            store = (args.store or Path(temporary)).resolve()
            results["parts"]["pipeline"] = guarded(
                "pipeline", run_pipeline, store, args.max_steps, use_prefect, route, args.recipe
            )
        if "families" in parts:
            chosen = [name for group in args.families or [] for name in group]
            results["parts"]["families"] = guarded("families", families.run, chosen, say)
        results["machine"] = machine()  # after the pipeline: a `jaxtune run` process must find the chip free
    results["pass"] = exit_status(results) == 0
    write_results(args.out, results)
    say(render_markdown(results))
    say(f"written: {args.out / 'tpu-check.json'}, {args.out / 'tpu-check.md'}")
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
