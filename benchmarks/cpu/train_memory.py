"""The train stage's memory against the size of its data: the same few LoRA steps of the offline
tiny model on token tables of 10k and 1M rows, each run in a fresh process, reporting peak RSS.

    .venv/bin/python -m benchmarks.cpu.train_memory
    .venv/bin/python -m benchmarks.cpu.train_memory --rows 10000 --rows 1000000 --steps 20

The tables are written directly in the tokenize stage's Arrow schema (random token ids, lengths
24 to 255, the first third of each row a prompt masked from the loss): what the stage reads, at
any size, without tokenizing a million rows first. The child does what `jaxtune.tasks.train`
does (memory-mapped `TokenTable`s, the feed, `training.train`) without Prefect around it.
Target: the 1M-row peak within 200 MB of the 10k-row peak. Results go to
benchmarks/results/train_memory.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.harness import provenance
from benchmarks.cpu.tokenize_scale import peak_rss_mb, status_mb, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "train_memory.json"
TARGET_MB = 200
CHUNK = 100_000  # rows per Arrow record batch written


def write_tables(folder: Path, rows: int, vocab: int, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa

    from jaxtune.data.tokenize import ARROW_SCHEMA, IGNORE_INDEX, write_arrow

    rng = np.random.default_rng(seed)

    def tables(n: int):
        for start in range(0, n, CHUNK):
            count = min(CHUNK, n - start)
            lengths = rng.integers(24, 256, count).astype(np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            ids = rng.integers(3, vocab, int(offsets[-1])).astype(np.int32)
            labels = ids.copy()
            prompt = lengths // 3
            for i in range(count):  # the prompt's labels are masked, as tokenize writes them
                labels[offsets[i] : offsets[i] + prompt[i]] = IGNORE_INDEX
            text = pa.array([""] * count, pa.string())
            yield pa.table(
                {
                    "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                    "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
                    "length": pa.array(lengths),
                    "prompt_length": pa.array(prompt),
                    "category": pa.array(["bench"] * count),
                    "prompt_text": text,
                    "response": text,
                    "source": pa.array(["generated"] * count),
                },
                schema=ARROW_SCHEMA,
            )

    folder.mkdir(parents=True)
    write_arrow(tables(rows), folder / "train.arrow")
    write_arrow(tables(64), folder / "eval.arrow")


def write_model(folder: Path) -> int:
    """The offline demo's tokenizer and tiny Gemma 3, as `build_tokenizer` and `build_model` make them."""
    from transformers import AutoTokenizer

    from jaxtune.config import load_config
    from jaxtune.tasks.build_model import build_tiny_model

    write_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    build_tiny_model(load_config(None).model.tiny, tokenizer).save_pretrained(folder)
    return len(tokenizer)


def child(data: Path, model_folder: Path, steps: int) -> None:
    """What the train stage does with its inputs, for `steps` steps; prints its figures as one JSON line."""
    from jaxtune.config import load_config
    from jaxtune.data.token_table import TokenTable
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling import model as rt_model
    from jaxtune.runtime.train import training

    config = load_config(
        None, [f"train.max_steps={steps}", "train.eval_every=null", "train.log_every=5", "train.warmup_steps=1"]
    )
    model = rt_model.open_model(str(model_folder), None, config.model, make_placement(config.mesh), lora=config.lora)
    before_data = peak_rss_mb()
    started = time.perf_counter()
    rows, evals = TokenTable(data / "train.arrow"), TokenTable(data / "eval.arrow")
    feed = training.feed_for(model, rows.lengths, config.train, rows.longest, config.data.packing)
    result = training.train(
        model,
        rows.input_ids,
        rows.labels,
        config.train,
        0,
        rows.longest,
        eval_data=(evals.input_ids, evals.labels),
        feed=feed,
    )
    print(
        json.dumps(
            {
                "rows": len(rows),
                "steps": steps,
                "packed": feed.packed,
                "micro_batches_per_epoch": feed.micro_batches_per_epoch,
                "seconds": time.perf_counter() - started,
                "final_loss": result.summary.final_loss,
                "peak_rss_before_data_mb": before_data,
                "peak_rss_mb": peak_rss_mb(),
                "anonymous_rss_mb": status_mb("RssAnon"),
                "file_rss_mb": status_mb("RssFile"),
                "file_mb": (data / "train.arrow").stat().st_size / 1e6,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", help="row counts (repeatable; default 10000 and 1000000)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", nargs=3, metavar=("DATA", "MODEL", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        data, model_folder, steps = args.child
        child(Path(data), Path(model_folder), int(steps))
        return
    results = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        vocab = write_model(work / "model")
        for n in args.rows or [10_000, 1_000_000]:
            data = work / f"data-{n}"
            write_tables(data, n, vocab)
            print(
                f"train_memory: {n:,} rows ({(data / 'train.arrow').stat().st_size / 1e6:,.0f} MB of Arrow)",
                file=sys.stderr,
            )
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.cpu.train_memory",
                    "--child",
                    str(data),
                    str(work / "model"),
                    str(args.steps),
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
                check=True,
                env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
            )
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            for file in data.iterdir():
                file.unlink()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d"), "provenance": provenance(), "results": results}, indent=2) + "\n"
    )
    print(
        "| rows | Arrow file | steps | seconds | peak RSS before "
        "the data | peak RSS | at the end: anonymous, file-backed |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['rows']:,} | {r['file_mb']:,.0f} MB | {r['steps']} | "
            f"{r['seconds']:.1f} | {r['peak_rss_before_data_mb']:,.0f} MB "
            f"| {r['peak_rss_mb']:,.0f} MB | {r['anonymous_rss_mb']:,.0f} MB, {r['file_rss_mb']:,.0f} MB |"
        )
    if len(results) > 1:
        small, large = min(results, key=lambda r: r["rows"]), max(results, key=lambda r: r["rows"])
        grew = large["peak_rss_mb"] - small["peak_rss_mb"]
        print(
            f"peak RSS at {large['rows']:,} rows - at {small['rows']:,} rows = {grew:+,.0f} MB "
            f"(target <= {TARGET_MB} MB: {'met' if grew <= TARGET_MB else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
