"""The offline real-model recipes with a quantized frozen base, side by side with their float base, kept as a result.

    .venv/bin/python -m jaxtune.offline.checkpoints          # the GGUF files the recipes name, once
    .venv/bin/python -m benchmarks.cpu.quantized_quality     # results/quantized-quality.json (about an hour on 2 cores)

Each recipe runs as it is, then once per scheme with `--set model.base_quantization=SCHEME`, all in
one temporary store (the tokenized data is shared; every other stage depends on the base). Kept per
run: the eval loss before and after training, exact match before and after, and the train summary's
time; docs/qlora.md quotes them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common.harness import RESULTS, ROOT, provenance
from benchmarks.cpu.fresh_clone import stage_states, timed

RUNS = {
    "configs/smollm2-135m-offline-lora.yaml": ("none", "int8", "int4", "nf4", "gguf"),
    "configs/gemma3-270m-offline-lora.yaml": ("none", "int8", "int4", "nf4"),
}


def one_run(recipe: str, scheme: str, store: Path, env: dict) -> dict:
    command = [str(ROOT / ".venv" / "bin" / "jaxtune"), "run", recipe, "--set", f"store.root={store}"]
    command += ["--set", f"model.base_quantization={scheme}"]
    seconds, output = timed(command, ROOT, env)
    folders = [Path(line) for line in output.splitlines() if line.startswith("/")]
    report = json.loads(next(f / "report.json" for f in reversed(folders) if (f / "report.json").is_file()).read_text())
    print(f"{recipe} {scheme}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return {
        "seconds": round(seconds, 1),
        "states": stage_states(output),
        "eval_loss": {"before": report["baseline"]["loss"], "after": report["final"]["loss"]},
        "exact_match": report["exact_match"],
        "train_seconds": report["train"]["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "quantized-quality.json")
    args = parser.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",)} | {"JAX_PLATFORMS": "cpu"}
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "provenance": provenance()}
    with tempfile.TemporaryDirectory(prefix="jaxtune-quantized-") as temporary:
        runs = {}
        for recipe, schemes in RUNS.items():
            name = Path(recipe).stem
            runs[name] = {scheme: one_run(recipe, scheme, Path(temporary) / name, env) for scheme in schemes}
    result["runs"] = runs
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
