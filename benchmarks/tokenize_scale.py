"""The tokenize stage at scale: N generated Dolly-style rows read, tokenised and written as Arrow,
each implementation in a fresh process, reporting rows/s and the process's peak RSS.

    .venv/bin/python benchmarks/tokenize_scale.py --rows 1000000
    .venv/bin/python benchmarks/tokenize_scale.py --rows 100000 --rows 1000000 --impl current

The rows are the bundled offline rows repeated, each copy's instruction numbered so that no two
rows are equal (none is dropped as a duplicate); the tokenizer is the offline demo's BPE (vocab
1024) with its chat template. Results go to benchmarks/results/tokenize_scale.json and a table on
stdout; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "tokenize_scale.json"
IMPLEMENTATIONS = ("current",)


def write_rows(path: Path, n: int) -> None:
    """`n` distinct Dolly rows: the bundled ones, the instruction of each later copy numbered."""
    from jaxtune.data.rows import OFFLINE_DATA

    base = [json.loads(line) for line in OFFLINE_DATA.read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        for i in range(n):
            row = dict(base[i % len(base)])
            if i >= len(base):
                row["instruction"] = f"{row['instruction']} (variant {i // len(base)})"
            f.write(json.dumps(row) + "\n")


def write_tokenizer(folder: Path) -> None:
    from jaxtune.data.rows import OFFLINE_DATA
    from jaxtune.offline.tokenizer import texts_for_tokenizer, train_tokenizer

    rows = [json.loads(line) for line in OFFLINE_DATA.read_text().splitlines() if line.strip()]
    train_tokenizer(texts_for_tokenizer(rows), 1024, folder)


def run_current(rows: Path, tokenizer_folder: Path, out: Path) -> dict:
    """The tokenize stage's code as it stands: every row read into Python, encoded, then written."""
    from transformers import AutoTokenizer

    from jaxtune.config import DataConfig
    from jaxtune.data.rows import read_rows
    from jaxtune.data.tokenize import tokenize_dataset, write_arrow

    cfg = DataConfig(source=str(rows), max_length=512)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    examples = read_rows(cfg)
    train, evals, stats = tokenize_dataset(examples, tokenizer, cfg)
    write_arrow(train, out / "train.arrow")
    write_arrow(evals, out / "eval.arrow")
    return {"train_rows": stats["train_rows"], "eval_rows": stats["eval_rows"], "dropped": stats["dropped"]}


def child(impl: str, rows: Path, tokenizer_folder: Path) -> None:
    """Run one implementation and print its figures as one JSON line (the parent reads it)."""
    imports_rss = _peak_rss_mb()
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = {"current": run_current}[impl](rows, tokenizer_folder, Path(out))
        seconds = time.perf_counter() - started
    print(json.dumps({**result, "seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "rss_after_imports_mb": imports_rss}))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", help="row counts (repeatable; default 1000000)")
    parser.add_argument("--impl", action="append", choices=IMPLEMENTATIONS, help="implementations (default: all)")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "ROWS", "TOKENIZER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, rows, tokenizer_folder = args.child
        child(impl, Path(rows), Path(tokenizer_folder))
        return
    results = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        write_tokenizer(work / "tokenizer")
        for n in args.rows or [1_000_000]:
            rows = work / f"rows-{n}.jsonl"
            write_rows(rows, n)
            for impl in args.impl or IMPLEMENTATIONS:
                print(f"tokenize_scale: {impl} on {n} rows ({rows.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
                done = subprocess.run([sys.executable, __file__, "--child", impl, str(rows), str(work / "tokenizer")],
                                      cwd=ROOT, capture_output=True, text=True, check=True)
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                results.append({"impl": impl, "rows": n, "file_mb": rows.stat().st_size / 1e6, **figures,
                                "rows_per_second": n / figures["seconds"]})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=2) + "\n")
    print("| impl | rows | file | seconds | rows/s | peak RSS |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['impl']} | {r['rows']:,} | {r['file_mb']:.1f} MB | {r['seconds']:.1f} | {r['rows_per_second']:,.0f} "
              f"| {r['peak_rss_mb']:,.0f} MB |")


if __name__ == "__main__":
    main()
