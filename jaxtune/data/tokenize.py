"""Normalized chat examples -> token rows (ids + loss labels), a train/eval split, and Arrow tables.

Sequences are built with the tokenizer's own chat template and are not padded here.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from jaxtune.config import DataConfig
from jaxtune.data.rows import DataError
from jaxtune.data.templates import ChatTemplateError

IGNORE_INDEX = -100  # label value the loss skips
DROP_REASONS = ("duplicate", "duplicate_of_train", "empty_response", "too_long", "max_train_rows", "max_eval_rows")
ARROW_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("prompt_length", pa.int32()),
        ("category", pa.string()),
        ("prompt_text", pa.string()),
        ("response", pa.string()),
    ]
)


def pad_id_of(tokenizer: Any) -> int:
    """The id that fills padding: the tokenizer's pad token, else its eos (Llama 3 ships no pad
    token), else 0. Padding is masked out of attention and loss, so any id is correct."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def encode_example(example: dict, tokenizer: Any, loss_on: str = "all_assistant") -> dict | None:
    """Token ids and labels of one example; None if the response is empty.

    Labels are -100 except on what `loss_on` trains: every assistant turn ('all_assistant'), only
    the final answer ('last_assistant'), or every token ('all'). An assistant turn's labels cover
    its text and the template's end-of-turn tokens, so the model learns where an answer stops.
    """
    response = example["response"]
    if not response.strip():
        return None
    prompt_messages = example["messages"]
    full_ids = _chat_ids(tokenizer, [*prompt_messages, {"role": "assistant", "content": response}], add_generation_prompt=False)
    start, _ = _answer_span(tokenizer, prompt_messages, full_ids, response, final=True)
    if loss_on == "all":
        labels = list(full_ids)
    else:
        labels = [IGNORE_INDEX] * start + full_ids[start:]
        if loss_on == "all_assistant":
            for i, message in enumerate(prompt_messages):
                if message["role"] == "assistant":
                    begin, end = _answer_span(tokenizer, prompt_messages[:i], full_ids, message["content"])
                    labels[begin:end] = full_ids[begin:end]
    return {
        "input_ids": full_ids,
        "labels": labels,
        "length": len(full_ids),
        "prompt_length": start,
        "category": example["category"],
        "prompt_text": _prompt_text(prompt_messages),
        "response": response,
    }


def _answer_span(tokenizer: Any, before: list[dict], full_ids: list[int], answer: str, final: bool = False) -> tuple[int, int]:
    """[start, end) of the assistant turn that follows `before` in `full_ids`: from the end of
    `before` rendered with the generation prompt to the end of `before` plus the answer (the
    `final` answer ends the conversation). Each must render as a token prefix of the whole."""
    prompt_ids = _chat_ids(tokenizer, before, add_generation_prompt=True)
    through = full_ids if final else _chat_ids(tokenizer, [*before, {"role": "assistant", "content": answer}],
                                               add_generation_prompt=False)
    start, end = len(prompt_ids), len(through)
    if full_ids[:start] != prompt_ids or full_ids[:end] != through or end <= start:
        raise ChatTemplateError(_prefix_message(tokenizer, before, answer))
    return start, end


def tokenize_dataset(examples: Sequence[dict], tokenizer: Any, cfg: DataConfig) -> tuple[list[dict], list[dict], dict]:
    """Drop exact duplicates, shuffle with `cfg.seed`, split off eval rows, encode, filter and cap; returns (train, eval, stats)."""
    if len(examples) < 2:
        raise DataError(f"need at least 2 rows to split into train and eval, got {len(examples)}")
    unique = _unique(examples)
    if len(unique) < 2:
        raise DataError(
            f"need at least 2 distinct rows to split into train and eval, got {len(unique)} "
            f"({len(examples) - len(unique)} of the {len(examples)} rows are exact duplicates)"
        )
    train_ex, eval_ex = split_examples(unique, cfg.eval_fraction, cfg.seed)
    train_prompts = {_prompt_key(e) for e in train_ex}
    kept_eval = [e for e in eval_ex if _prompt_key(e) not in train_prompts]
    # Counted per split, so an empty split's error names only what emptied it.
    train_dropped, eval_dropped = Counter(), Counter(duplicate_of_train=len(eval_ex) - len(kept_eval))
    train_rows, train_truncated = _encode_all(train_ex, tokenizer, cfg, train_dropped)
    eval_rows, eval_truncated = _encode_all(kept_eval, tokenizer, cfg, eval_dropped)
    train_rows = _cap(train_rows, cfg.max_train_rows, "max_train_rows", train_dropped)
    eval_rows = _cap(eval_rows, cfg.max_eval_rows, "max_eval_rows", eval_dropped)
    dropped = train_dropped + eval_dropped + Counter(duplicate=len(examples) - len(unique))
    n_in = len(examples)
    if not train_rows and not eval_rows:
        raise DataError(f"no train rows left: all {n_in} rows were dropped ({_why(dropped, cfg)})")
    if not train_rows:
        raise DataError(
            f"no train rows left: every row of the train split ({len(train_ex)} of the {n_in} rows in) was dropped "
            f"({_why(train_dropped, cfg)})"
        )
    if not eval_rows:
        raise DataError(
            f"no eval rows left: every row held out for eval ({len(eval_ex)} of the {n_in} rows in) was dropped "
            f"({_why(eval_dropped, cfg)}); raise data.eval_fraction={cfg.eval_fraction} to hold out more"
        )
    return train_rows, eval_rows, _stats(n_in, train_rows, eval_rows, dropped, train_truncated + eval_truncated)


def split_examples(examples: Sequence[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic shuffle, then eval = the first max(1, round(eval_fraction * n)) rows, train = the rest."""
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    n_eval = min(max(1, round(eval_fraction * len(shuffled))), len(shuffled) - 1)
    return shuffled[n_eval:], shuffled[:n_eval]


def write_arrow(rows: Sequence[dict], path: str | Path) -> None:
    """Write token rows as an Arrow IPC file (Feather v2); the file appears atomically."""
    path = Path(path)
    table = pa.Table.from_pylist(list(rows), schema=ARROW_SCHEMA)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, ARROW_SCHEMA) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


def read_arrow(path: str | Path) -> pa.Table:
    """Read a table written by `write_arrow`, checking that it has the token-table columns."""
    with pa.OSFile(str(path), "rb") as source:
        table = pa.ipc.open_file(source).read_all()
    missing = [name for name in ARROW_SCHEMA.names if name not in table.column_names]
    if missing:
        raise DataError(f"{path}: not a token table (missing columns: {', '.join(missing)})")
    return table


def _chat_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids from `apply_chat_template`, which may return a list or a BatchEncoding depending on version."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(i) for i in out]


def _prefix_message(tokenizer: Any, prompt_messages: list[dict], response: str) -> str:
    prompt = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*prompt_messages, {"role": "assistant", "content": response}], tokenize=False)
    return (
        f"chat template of tokenizer {getattr(tokenizer, 'name_or_path', '?')!r}: the prompt rendered with "
        f"add_generation_prompt=True does not tokenize to a strict prefix of the conversation with the answer, "
        f"so prompt and answer tokens cannot be told apart.\n  prompt: {prompt!r}\n  full:   {full!r}"
    )


def _prompt_text(messages: list[dict]) -> str:
    """The last user turn, shown next to generations in reports."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")


def _prompt_key(example: dict) -> str:
    return json.dumps(example["messages"], sort_keys=True, ensure_ascii=False)


def _unique(examples: Sequence[dict]) -> list[dict]:
    """The examples without exact repeats, first occurrences in order: a repeat would be trained on twice,
    or land in eval as a copy of a train row."""
    seen: set[str] = set()
    unique = []
    for example in examples:
        key = json.dumps([example["messages"], example["response"], example["category"]], sort_keys=True, ensure_ascii=False)
        if key not in seen:
            seen.add(key)
            unique.append(example)
    return unique


def _encode_all(examples: list[dict], tokenizer: Any, cfg: DataConfig, dropped: Counter) -> tuple[list[dict], int]:
    """Encoded rows, without those dropped (counted in `dropped`) for an empty response or length; and how many
    were truncated to `cfg.max_length`."""
    out: list[dict] = []
    truncated = 0
    for example in tqdm(examples, desc="tokenize", unit="row", disable=None):
        row = encode_example(example, tokenizer, cfg.loss_on)
        if row is None:
            dropped["empty_response"] += 1
            continue
        if row["length"] > cfg.max_length:
            # Truncating keeps the prompt whole, so it must leave at least one answer token to learn from.
            if cfg.too_long == "drop" or row["prompt_length"] >= cfg.max_length:
                dropped["too_long"] += 1
                continue
            n = cfg.max_length
            row = {**row, "input_ids": row["input_ids"][:n], "labels": row["labels"][:n], "length": n}
            truncated += 1
        out.append(row)
    return out, truncated


def _why(dropped: Counter, cfg: DataConfig) -> str:
    """The non-zero drop counts, each with what it means and the setting that changes it."""
    too_long = (
        f"rows whose prompt alone has data.max_length={cfg.max_length} tokens or more; raise data.max_length"
        if cfg.too_long == "truncate"
        else f"rows longer than data.max_length={cfg.max_length} tokens; raise data.max_length or set data.too_long=truncate"
    )
    meaning = {
        "duplicate": "exact repeats of an earlier row",
        "duplicate_of_train": "eval rows whose prompt is also a train prompt",
        "empty_response": "rows whose response is empty",
        "too_long": too_long,
        "max_train_rows": f"over data.max_train_rows={cfg.max_train_rows}",
        "max_eval_rows": f"over data.max_eval_rows={cfg.max_eval_rows}",
    }
    return "; ".join(f"{reason}: {dropped[reason]}; {meaning[reason]}" for reason in DROP_REASONS if dropped[reason])


def _cap(rows: list[dict], cap: int | None, reason: str, dropped: Counter) -> list[dict]:
    if cap is None or len(rows) <= cap:
        return rows
    dropped[reason] += len(rows) - cap
    return rows[:cap]


def _stats(rows_in: int, train: list[dict], eval_: list[dict], dropped: Counter, truncated: int) -> dict:
    """Counts, token totals, length percentiles and category histograms of the kept rows."""
    lengths = sorted(row["length"] for row in [*train, *eval_])
    return {
        "rows_in": rows_in,
        "train_rows": len(train),
        "eval_rows": len(eval_),
        "dropped": {reason: dropped[reason] for reason in DROP_REASONS},
        "truncated": truncated,  # kept, cut to data.max_length (data.too_long=truncate)
        "tokens": {"train": sum(r["length"] for r in train), "eval": sum(r["length"] for r in eval_)},
        "label_tokens": {  # the tokens the loss covers (data.loss_on)
            "train": sum(_labelled(r) for r in train),
            "eval": sum(_labelled(r) for r in eval_),
        },
        "length_percentiles": {
            "p50": _percentile(lengths, 50),
            "p90": _percentile(lengths, 90),
            "p99": _percentile(lengths, 99),
            "max": lengths[-1],
        },
        "categories": {"train": _histogram(train), "eval": _histogram(eval_)},
    }


def _labelled(row: dict) -> int:
    return len(row["labels"]) - row["labels"].count(IGNORE_INDEX)


def _percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile: the smallest value with at least q% of values at or below it."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def _histogram(rows: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(row["category"] for row in rows).items()))
