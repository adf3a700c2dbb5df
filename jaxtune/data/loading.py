"""Sources -> normalized rows as a `datasets.Dataset`, in bounded memory whatever the row count.

Every source becomes a memory-mapped `datasets.Dataset` before any row is normalized:
- JSONL, JSON and CSV files are copied into an Arrow file of (row number, JSON text) by readers
  that know each row's line or row number (JSONL is streamed line by line, CSV in Arrow blocks; a
  JSON array is one document, so it is parsed whole: use JSONL for big data), then mapped with
  `Dataset.from_file`;
- Parquet files, folders written by `save_to_disk` and hub datasets open as Arrow directly.

Normalization is then a batched `map` over `num_proc` processes, written to Arrow files batch by
batch. A bad row never raises inside a worker: its message lands in the `problem` column, and
the first one is raised here, with the file and the line or row it names.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from jaxtune.config import OFFLINE, SourceConfig
from jaxtune.data import rows as raw
from jaxtune.errors import DataError

RECORD, ROW, PROBLEM = "_jaxtune_record", "_jaxtune_row", "_jaxtune_problem"  # raw rows of the text formats
BATCH = 1000  # rows per map batch and per Arrow record batch written
ROWS_PER_PROCESS = 10_000  # fewer rows stay in this process: forking workers and merging their files would cost more


def normalized_features():
    import datasets

    return datasets.Features(
        {
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
            "response": datasets.Value("string"),
            "rejected": datasets.Value("string"),  # a preference pair's worse answer; '' for other formats
            "category": datasets.Value("string"),
            "source": datasets.Value("int32"),  # index of the source in the mixture
            "row": datasets.Value("int64"),  # the line (JSONL) or 1-based row its error messages name
            "row_key": datasets.Value("int64"),  # what exact-duplicate detection compares
            "prompt_key": datasets.Value("int64"),  # what the eval split's duplicate-of-train check compares
            "problem": datasets.Value("string"),  # why the row cannot be read, with its location; null if it can
        }
    )


def processes(rows: int, num_proc: int | None) -> int | None:
    """Worker processes for `rows` rows: at most `num_proc` (default: the cores), one per
    ROWS_PER_PROCESS rows; None (work in this process) when that is one."""
    cores = num_proc or len(os.sched_getaffinity(0))
    n = max(1, min(cores, -(-rows // ROWS_PER_PROCESS)))
    return n if n > 1 else None


def load_normalized(src: SourceConfig, path_or_id: str, index: int, work: Path, num_proc: int | None = None):
    """The rows of one source, normalized, as a `datasets.Dataset` written under `work`; raises
    DataError naming the first bad row's file and line (or row)."""
    raw._check_columns(src)
    name = location(path_or_id, src.format)
    source = _raw_dataset(src, name, work / f"raw-{index}")
    if src.max_rows is not None and len(source) > src.max_rows:
        source = source.select(range(src.max_rows))
    if len(source) == 0:
        raise DataError(f"{name}: no rows")
    unit = unit_of(name)
    out = parallel_map(
        source,
        _normalize_batch,
        num_proc,
        with_indices=True,
        features=normalized_features(),
        fn_kwargs={"src": src, "index": index, "name": name, "unit": unit},
        cache_file_name=str(work / f"normalized-{index}.arrow"),
        desc=f"normalize {src.label}",
    )
    raise_first_problem(out.data.column("problem"))
    return out


def parallel_map(dataset, function, num_proc: int | None, cache_file_name: str, **kwargs):
    """`dataset.map(function)` in batches, over `processes()` forked workers, written to `cache_file_name`
    (one file per worker) and never read back from an earlier run's files."""
    workers = processes(len(dataset), num_proc)
    with warnings.catch_warnings(), _one_thread_each(workers):
        # JAX, when this process has loaded it, warns that forking a multithreaded process may deadlock.
        # The workers run only the tokenizer and the standard library, never JAX or its threads' locks.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        return dataset.map(
            function,
            batched=True,
            batch_size=BATCH,
            remove_columns=dataset.column_names,
            num_proc=workers,
            writer_batch_size=BATCH,
            cache_file_name=cache_file_name,
            new_fingerprint=Path(cache_file_name).stem,
            load_from_cache_file=False,
            **kwargs,
        )


@contextlib.contextmanager
def _one_thread_each(workers: int | None) -> Iterator[None]:
    """Workers forked meanwhile tokenize on one thread each: a process per core already fills the
    cores, and each one's own thread pool would only contend (measured 10% slower on 2 cores).
    A user's own TOKENIZERS_PARALLELISM wins."""
    if workers is None:
        yield
        return
    # The workers share this process's pages until they write to them, and the garbage collector
    # writes to every object it visits: frozen, the objects here are left alone in the workers.
    gc.freeze()
    ours = "TOKENIZERS_PARALLELISM" not in os.environ
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        yield
    finally:
        gc.unfreeze()
        if ours:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


def raise_first_problem(problems: Any, error: type[Exception] = DataError) -> None:
    """Raise the first non-null message of an Arrow string column, if any."""
    valid = pc.is_valid(problems)
    if pc.any(valid).as_py():
        first = pc.index(valid, True).as_py()
        raise error(problems[first].as_py())


def _raw_dataset(src: SourceConfig, name: str, cache: Path):
    """The source as a `datasets.Dataset` of raw rows: columns as the source has them (Parquet,
    saved folders, hub), or one JSON text per row with its number (JSONL, JSON, CSV)."""
    import datasets

    problem = raw.source_problem(name)
    if problem is not None:
        raise DataError(f"{name}{problem}")
    path = Path(name).expanduser()
    if path.is_dir():
        return raw.saved_dataset(path, src)
    if not path.exists():
        return _hub(name, src)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        _check_parquet_schema(path, src)
        return datasets.Dataset.from_parquet(str(path), cache_dir=str(cache))
    if suffix == ".csv":
        raw.check_csv_header(path, src)
    cache.mkdir(parents=True)
    file = cache / "records.arrow"
    _write_records(_text_records(path, src.max_rows), file)
    return datasets.Dataset.from_file(str(file))


RECORDS_SCHEMA = pa.schema([(ROW, pa.int64()), (RECORD, pa.string()), (PROBLEM, pa.string())])


def _write_records(
    records: Iterator[tuple[int, str | None, str | None]], file: Path, rows_per_batch: int = 10_000
) -> None:
    """The (row, text, problem) records as an Arrow file that `datasets.Dataset.from_file` maps,
    written a batch at a time (0.2 s for 100,000 JSONL rows here, against 1.4 s through `Dataset.from_generator`)."""
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, RECORDS_SCHEMA) as writer:
        while batch := list(itertools.islice(records, rows_per_batch)):
            numbers, texts, problems = zip(*batch)
            writer.write_batch(
                pa.record_batch(
                    [pa.array(numbers, pa.int64()), pa.array(texts, pa.string()), pa.array(problems, pa.string())],
                    schema=RECORDS_SCHEMA,
                )
            )


def _text_records(path: Path, max_rows: int | None) -> Iterator[tuple[int, str | None, str | None]]:
    """(row, JSON text, problem) per row of a JSONL, JSON or CSV file, in file order."""
    suffix = path.suffix.lower()
    rows: Iterator[tuple[int, str | None, str | None]]
    if suffix == ".jsonl":
        rows = raw.jsonl_lines(path)  # parsed later, in the workers
    elif suffix == ".csv":
        rows = ((n, json.dumps(row, ensure_ascii=False), None) for n, row in raw.csv_rows(path))
    else:
        rows = ((n, json.dumps(row, ensure_ascii=False), None) for n, row in enumerate(raw.json_rows(path), start=1))
    return itertools.islice(rows, max_rows)


def _check_parquet_schema(path: Path, src: SourceConfig) -> None:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    raw.check_arrow_schema(str(path), schema, src)


def _hub(dataset_id: str, src: SourceConfig):
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=src.hub_split, revision=src.revision)
    except Exception as e:  # the hub raises many unrelated types; all mean "could not load"
        raise DataError(
            f"{dataset_id}: could not load hub dataset (split {src.hub_split!r}, revision {src.revision!r}): {e}"
        ) from e
    raw.check_arrow_schema(dataset_id, ds.data.schema, src)
    return ds


def _normalize_batch(
    batch: dict[str, list], indices: list[int], src: SourceConfig, index: int, name: str, unit: str
) -> dict:
    """A batch of raw rows -> normalized rows; a row that cannot be read keeps only its `problem`."""
    out: dict[str, list] = {
        key: []
        for key in ("messages", "response", "rejected", "category", "source", "row", "row_key", "prompt_key", "problem")
    }
    for number, row, problem in _rows_of(batch, indices):
        where = f"{name} {unit} {number}"
        example = None
        if problem is None:
            try:
                example = raw.normalize_row(raw.parse_json(row, where) if isinstance(row, str) else row, src, where)
            except DataError as e:
                problem = str(e)
        if problem is not None and not problem.startswith(name):
            problem = f"{where}: {problem}"
        example = example or {"messages": [], "response": "", "category": ""}
        out["messages"].append(example["messages"])
        out["response"].append(example["response"])
        out["rejected"].append(example.get("rejected", ""))
        out["category"].append(example["category"])
        out["source"].append(index)
        out["row"].append(number)
        out["row_key"].append(row_key(example))
        out["prompt_key"].append(prompt_key(example))
        out["problem"].append(problem)
    return out


def _rows_of(batch: dict[str, list], indices: list[int]) -> Iterator[tuple[int, Any, str | None]]:
    """(row number, raw row, problem) of each row of a map batch."""
    if RECORD in batch:
        yield from zip(batch[ROW], batch[RECORD], batch[PROBLEM])
        return
    names = list(batch)
    for i, values in enumerate(zip(*(batch[n] for n in names))):
        yield indices[i] + 1, dict(zip(names, values)), None


def location(path_or_id: str, data_format: str = "dolly") -> str:
    """What error messages call a source: its path or hub id (for 'offline', the bundled file of `data_format`)."""
    return str(raw.offline_file(data_format)) if path_or_id == OFFLINE else str(path_or_id)


def unit_of(path_or_id: str) -> str:
    """'line' where row numbers are a text file's lines (JSONL, the bundled files among them); 'row' elsewhere."""
    return "line" if Path(location(path_or_id)).suffix.lower() == ".jsonl" else "row"


def row_key(example: dict) -> int:
    """A pair's key holds both answers: the same prompt and chosen answer against another rejected one is another pair."""
    rejected = [example["rejected"]] if example.get("rejected") else []
    return _digest([example["messages"], example["response"], example["category"], *rejected])


def prompt_key(example: dict) -> int:
    return _digest(example["messages"])


def _digest(value: Any) -> int:
    """64 bits of a row's canonical JSON: two different rows share a key with odds of about n^2 / 2^65
    (1 in 37 million for a million rows), and then the later one is dropped as a repeat."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
