"""Read raw rows (local file or hub dataset) and normalize them to chat examples.

A normalized example is `{"messages": [...prompt turns...], "response": str, "category": str}`:
the prompt turns exclude the final assistant answer, which is `response`. A preference pair
(format 'preference') adds `rejected`, the worse answer; `response` is then the chosen one. A
prompt_answer row's `response` is the answer its rewards check, which no loss trains on. Files
and columns are read here; each row's values are checked and read by `fields`.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from jaxtune.config import OFFLINE, DataConfig, SourceConfig
from jaxtune.data import fields
from jaxtune.errors import DataError, first_line

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
OFFLINE_DATA = Path(__file__).resolve().parents[1] / "offline" / "data" / "dolly_offline.jsonl"
# What `source: offline` reads with `format: preference`: pairs built from the same rows (jaxtune.offline.pairs).
OFFLINE_PAIRS = OFFLINE_DATA.with_name("preference_offline.jsonl")
# And with `format: prompt_answer`: arithmetic questions with a numeric answer (jaxtune.offline.arithmetic).
OFFLINE_ARITHMETIC = OFFLINE_DATA.with_name("arithmetic_offline.jsonl")


def offline_file(data_format: str) -> Path:
    """The bundled file `source: offline` names: the Dolly-style rows, for format 'preference' their
    pairs, for format 'prompt_answer' the arithmetic questions."""
    return {"preference": OFFLINE_PAIRS, "prompt_answer": OFFLINE_ARITHMETIC}.get(data_format, OFFLINE_DATA)


# (required, optional) source names per format; `category` is optional everywhere.
FORMAT_COLUMNS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dolly": (("instruction", "response"), ("context", "category")),
    "alpaca": (("instruction", "output"), ("input", "category")),
    "prompt_completion": (("prompt", "completion"), ("category",)),
    "messages": (("messages",), ("category",)),
    # The prompt is `prompt` (text) or `messages` (the conversation before the answers), not both.
    "preference": (("chosen", "rejected"), ("prompt", "messages", "category")),
    # The same prompt, and the answer the rewards check (text or a number).
    "prompt_answer": (("answer",), ("prompt", "messages", "category")),
}
# instruction, context, response field of each instruction-style format.
_FIELDS = {
    "dolly": ("instruction", "context", "response"),
    "alpaca": ("instruction", "input", "output"),
    "prompt_completion": ("prompt", None, "completion"),
}
_LISTS = ("messages", "chosen", "rejected")  # columns that may hold lists of messages
_NUMBERS = ("answer",)  # columns that may hold numbers
_PROMPT_FIRST = ("preference", "prompt_answer")  # formats whose prompt is `prompt` or `messages`
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


Record = tuple[str, Any]  # (location such as "data.jsonl line 7", raw row)


def read_rows(cfg: DataConfig, path_or_id: str | Path | None = None) -> list[dict]:
    """Read `path_or_id` (default: `cfg.source`; 'offline' is the bundled Dolly file) as normalized examples."""
    source = cfg.source if path_or_id is None else str(path_or_id)
    if source == OFFLINE:
        bundled = offline_file(cfg.format)
        if not bundled.exists():
            raise DataError(f"{bundled}: the bundled offline data file is missing")
        source = str(bundled)
    _check_columns(cfg)
    examples = [normalize_row(row, cfg, where) for where, row in _records(source, cfg)]
    if not examples:
        raise DataError(f"{source}: no rows")
    return examples


def source_texts(cfg: DataConfig, path_or_id: str | Path) -> Iterator[str]:
    """The non-empty text fields of every row, in row order, for training a tokenizer on the data:
    instruction, context and response (or the format's equivalents), or each message's content."""
    source = str(offline_file(cfg.format)) if str(path_or_id) == OFFLINE else str(path_or_id)
    _check_columns(cfg)
    required, _ = FORMAT_COLUMNS[cfg.format]
    keys = [name for name in _FIELDS.get(cfg.format, ()) if name] or list(required)  # messages: ("messages",)
    if cfg.format in _PROMPT_FIRST:
        keys = ["prompt", "messages", *required]
    max_rows = getattr(cfg, "max_rows", None)  # a source of a mixture may read only its first rows
    for count, (where, row) in enumerate(_records(source, cfg)):
        if max_rows is not None and count >= max_rows:
            return
        # The checks training reads with, so a bad row is reported by the first stage that reads the file.
        normalize_row(row, cfg, where)
        row = _rename(row, cfg.columns)
        for name in keys:
            value = row.get(name)
            if name == "messages" and cfg.format in _PROMPT_FIRST:
                values = (
                    [m["content"] for m in fields.prompt_turns(value, where, cfg.format)] if value is not None else []
                )
            elif name in ("chosen", "rejected"):
                values = [fields.pair_answer(row, name, where)]
            elif name == "answer":
                values = [fields.answer_text(row, where)]
            elif name == "messages":
                prompt, response = fields.split_messages(value, where)
                values = [m["content"] for m in prompt] + [response]
            else:
                values = [value]
            yield from (v for v in values if isinstance(v, str) and v.strip())


def normalize_row(row: Any, cfg: DataConfig, where: str) -> dict:
    """One raw row -> normalized example; `where` prefixes error messages."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with named columns, got {fields.type_name(row)}")
    row = _rename(row, cfg.columns)
    _require_columns(row, cfg, where)
    category = fields.category_of(row, where)
    if cfg.format == "messages":
        messages, response = fields.split_messages(row["messages"], where)
        return {"messages": messages, "response": response, "category": category}
    if cfg.format == "preference":
        return fields.preference_pair(row, where, category)
    if cfg.format == "prompt_answer":
        return fields.prompt_answer(row, where, category)
    key_instruction, key_context, key_response = _FIELDS[cfg.format]
    instruction = fields.text_of(row, key_instruction, where, required=True, non_empty=True)
    context = fields.text_of(row, key_context, where) if key_context else ""
    response = fields.text_of(row, key_response, where, required=True)  # may be empty: dropped and counted later
    content = f"{instruction}\n\n{context}" if context else instruction
    return {"messages": [{"role": "user", "content": content}], "response": response, "category": category}


def source_problem(source: str) -> str | None:
    """What makes `source` unreadable before any row is read, worded to follow its name (': file is
    empty'); None for a local file of a supported type, or a hub dataset id."""
    path = Path(source).expanduser()
    supported = ", ".join(SUPPORTED_EXTENSIONS)
    if not path.exists():
        return (
            None if looks_like_hub_id(source) else ": no such file, and not a hub dataset id of the form 'owner/name'"
        )
    if path.is_dir():
        return (
            None
            if is_saved_dataset(path)
            else f" is a folder, but not one written by datasets' save_to_disk; give a {supported} file or such a folder"
        )
    if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
        return f": unsupported file type {path.suffix.lower() or '(none)'!r}; supported: {supported}"
    return ": file is empty" if path.stat().st_size == 0 else None


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def saved_dataset(folder: Path, src: DataConfig | SourceConfig):
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (then its `hub_split`)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(f"{folder}: not a folder written by datasets' save_to_disk ({first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if src.hub_split not in ds:
            raise DataError(f"{folder}: no split {src.hub_split!r} (splits: {', '.join(ds)}); set hub_split")
        ds = ds[src.hub_split]
    check_arrow_schema(str(folder), ds.data.schema, src)
    return ds


def _records(source: str, cfg: DataConfig) -> Iterator[Record]:
    """Raw rows of a local file or hub dataset, each with its location for error messages."""
    problem = source_problem(source)
    if problem is not None:
        raise DataError(f"{source}{problem}")
    path = Path(source).expanduser()
    if path.is_dir():
        return _numbered(source, saved_dataset(path, cfg))
    if not path.exists():
        return _hub_records(source, cfg)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _csv_records(path, cfg)
    if suffix == ".parquet":
        return _parquet_records(path, cfg)
    return _jsonl_records(path) if suffix == ".jsonl" else _json_records(path)


def _jsonl_records(path: Path) -> Iterator[Record]:
    """One JSON object per line; blank lines are skipped but still counted."""
    for number, text, problem in jsonl_lines(path):
        if problem is not None:
            raise DataError(problem)
        where = f"{path} line {number}"
        yield where, parse_json(text, where)


def jsonl_lines(path: Path) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, problem) of each non-blank line, not yet parsed."""
    with path.open("rb") as f:  # bytes, so a bad encoding is reported with its line too
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield (
                    number,
                    line.decode("utf-8").rstrip("\r\n"),
                    None,
                )  # else an error at the line end reports column 1 of the next
            except UnicodeDecodeError as e:
                yield number, None, f"{path} line {number}: not valid UTF-8 ({e.reason} at byte {e.start})"


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None


def _json_records(path: Path) -> Iterator[Record]:
    return _numbered(str(path), json_rows(path))


def json_rows(path: Path) -> list:
    """A JSON list of objects, or an object holding that list under 'data' or 'train'."""
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text) if text.strip() else []  # only blank lines: no rows, not a JSON syntax error
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(doc, dict):
        key = next((k for k in ("data", "train") if isinstance(doc.get(k), list)), None)
        if key is None:
            keys = ", ".join(map(str, doc)) or "(none)"
            raise DataError(
                f"{path}: expected a list of rows, or an object with a 'data' or 'train' list; got keys {keys}"
            )
        doc = doc[key]
    if not isinstance(doc, list):
        raise DataError(f"{path}: expected a list of rows, got {fields.type_name(doc)}")
    return doc


def _parquet_records(path: Path, cfg: DataConfig) -> Iterator[Record]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    check_arrow_schema(str(path), table.schema, cfg)
    return _numbered(str(path), table.to_pylist())


def check_arrow_schema(name: str, schema: pa.Schema, cfg: DataConfig) -> None:
    """A column has one type, so a wrong one is reported once here rather than as a puzzling value in every row."""
    for column, source in _source_columns(cfg).items():
        if source in schema.names and not _arrow_type_fits(column, schema.field(source).type):
            expected = (
                "a list of {role, content} objects (list<struct>)"
                if column in _LISTS
                else "text (string) or a number"
                if column in _NUMBERS
                else "text (string)"
            )
            raise DataError(
                f"{name}: column {_column_label(column, cfg)} is {schema.field(source).type}, expected {expected}"
            )


def _arrow_type_fits(name: str, arrow_type: pa.DataType) -> bool:
    """Null columns (all values missing) pass: the row check reports a missing required value with its row."""
    if pa.types.is_dictionary(arrow_type):  # pandas categoricals are stored dictionary-encoded
        arrow_type = arrow_type.value_type
    text = pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_null(arrow_type)
    if name in _NUMBERS:
        return text or pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
    if name not in _LISTS:
        return text
    listed = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
    return text or (listed and pa.types.is_struct(arrow_type.value_type))  # text: the list as JSON, as in CSV


def _csv_records(path: Path, cfg: DataConfig) -> Iterator[Record]:
    header = check_csv_header(path, cfg)
    if header is None:
        return iter(())
    return ((f"{path} row {number}", row) for number, row in csv_rows(path, header))


def csv_rows(path: Path, header: list[str] | None = None) -> Iterator[tuple[int, dict]]:
    """(row number, row) of a CSV file, read in Arrow blocks. Cells are read as text (no type
    inference), so '007' stays '007' and empty cells are ''."""
    header = header if header is not None else _csv_header(path)
    if header is None:
        return
    convert = pacsv.ConvertOptions(column_types={name: pa.string() for name in header})
    number = 0
    try:
        with pacsv.open_csv(
            path, parse_options=pacsv.ParseOptions(newlines_in_values=True), convert_options=convert
        ) as reader:
            for batch in reader:
                for row in batch.to_pylist():
                    number += 1
                    yield number, row
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable CSV file ({e})") from None


def _csv_header(path: Path) -> list[str] | None:
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            # Arrow skips empty lines before the header too; a file of only blank lines has no rows.
            return next((row for row in csv.reader(f) if any(cell.strip() for cell in row)), None)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not a readable CSV file ({e})") from None


def check_csv_header(path: Path, cfg: DataConfig) -> list[str] | None:
    """The header of a CSV file (None if it has no rows). A CSV without a header row would have its
    first data row taken as column names, and then every row would miss every column; say so once."""
    header = _csv_header(path)
    if header is None:
        return None
    sources = _source_columns(cfg)
    if set(header) & set(sources.values()):
        return header
    required, _ = FORMAT_COLUMNS[cfg.format]
    needs = ", ".join(sources[name] for name in required)
    found = ", ".join(repr(cell if len(cell) <= 40 else cell[:37] + "...") for cell in header)
    raise DataError(
        f"{path}: the first line is read as the CSV header, but it names none of the columns format "
        f"{cfg.format!r} needs ({needs}); found: {found}"
    )


def _hub_records(dataset_id: str, cfg: DataConfig) -> Iterator[Record]:
    """Rows of a Hugging Face hub dataset split at the configured revision."""
    import datasets  # slow import; only needed for hub sources

    try:
        ds = datasets.load_dataset(dataset_id, split=cfg.hub_split, revision=cfg.revision)
    except Exception as e:  # the hub raises many unrelated types; all mean "could not load"
        raise DataError(
            f"{dataset_id}: could not load hub dataset (split {cfg.hub_split!r}, revision {cfg.revision!r}): {e}"
        ) from e
    return _numbered(dataset_id, ds)


def _numbered(name: str, rows: Any) -> Iterator[Record]:
    for number, row in enumerate(rows, start=1):
        yield f"{name} row {number}", row


def _check_columns(cfg: DataConfig) -> None:
    """`cfg.columns` maps the format's column names to source column names."""
    required, optional = FORMAT_COLUMNS[cfg.format]
    allowed = required + optional
    for name in cfg.columns:
        if name not in allowed:
            raise DataError(
                f"data.columns: {name!r} is not a column of format {cfg.format!r} ({', '.join(allowed)}); "
                f"keys are the format's names and values the source columns, e.g. {{{allowed[0]}: my_column}}"
            )


def _rename(row: dict, columns: dict[str, str]) -> dict:
    """Copy of `row` where each mapped format name takes its source column's value (absent if that is)."""
    if not columns:
        return row
    # Built afresh so swaps such as {instruction: response, response: instruction} work.
    renamed = {k: v for k, v in row.items() if k not in columns and k not in columns.values()}
    renamed.update({name: row[source] for name, source in columns.items() if source in row})
    return renamed


def _source_columns(cfg: DataConfig) -> dict[str, str]:
    """Each of the format's column names -> the source column it is read from."""
    required, optional = FORMAT_COLUMNS[cfg.format]
    return {name: cfg.columns.get(name, name) for name in required + optional}


def _column_label(name: str, cfg: DataConfig) -> str:
    source = cfg.columns.get(name)
    return f"{source!r} (mapped to {name!r} by data.columns)" if source else repr(name)


def _require_columns(row: dict, cfg: DataConfig, where: str) -> None:
    required, _ = FORMAT_COLUMNS[cfg.format]
    for name in required:
        if name not in row:
            # A file that mixes formats fails at its first row of the other one; naming that format explains it.
            others = [repr(fmt) for fmt in FORMAT_COLUMNS if fmt != cfg.format and _looks_like(row, fmt)]
            hint = f" (this row looks like format {' or '.join(others)})" if others else ""
            raise DataError(
                f"{where}: missing column {_column_label(name, cfg)} (format {cfg.format!r} needs {', '.join(required)}; "
                f"columns present: {', '.join(map(str, row)) or '(none)'}){hint}"
            )


def _looks_like(row: dict, data_format: str) -> bool:
    """`row` has the columns `data_format` needs (its prompt included, for a format whose prompt is optional by name)."""
    needs, _ = FORMAT_COLUMNS[data_format]
    prompted = data_format not in _PROMPT_FIRST or "prompt" in row or "messages" in row
    return prompted and all(c in row for c in needs)


def looks_like_hub_id(source: str) -> bool:
    """`owner/name` with no file extension jaxtune reads: a hub dataset id, not a local path."""
    return bool(_HUB_ID.fullmatch(source)) and Path(source).suffix.lower() not in SUPPORTED_EXTENSIONS
