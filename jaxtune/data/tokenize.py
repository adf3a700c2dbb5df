"""Normalized chat examples -> token rows (ids + loss labels), a train/eval split, and Arrow tables.

Sequences are built with the tokenizer's own chat template and are not padded here. The rows
stay in Arrow files throughout (`datasets` maps over `num_proc` processes): only per-row keys,
lengths and indices are held in memory, as numpy arrays, so memory does not grow with the text.

A prompt_answer row becomes its prompt alone, rendered through the generation prompt, with
nothing labelled: its answers are sampled and scored while training.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jaxtune.config import PREFERENCE_FORMAT, PROMPT_ANSWER_FORMAT, DataConfig, SourceConfig
from jaxtune.data import loading
from jaxtune.errors import ChatTemplateError, DataError

IGNORE_INDEX = -100  # label value the loss skips
DROP_REASONS = (
    "duplicate",
    "duplicate_of_train",
    "empty_response",
    "too_long",
    "identical_pair",
    "max_train_rows",
    "max_eval_rows",
)
ARROW_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("prompt_length", pa.int32()),
        ("category", pa.string()),
        ("prompt_text", pa.string()),
        ("response", pa.string()),
        ("source", pa.string()),  # the name of the source it came from (data.sources)
    ]
)
WRITE_ROWS = 10_000  # rows per Arrow record batch of train.arrow and eval.arrow
KEEP, EMPTY, TOO_LONG, IDENTICAL = 0, 1, 2, 3  # the encoded `drop` column


def is_preference(cfg: DataConfig) -> bool:
    """Rows are preference pairs: each becomes two token rows, the chosen answer's and then the rejected one's."""
    return cfg.mixture()[0].format == PREFERENCE_FORMAT


def is_prompt_answer(cfg: DataConfig) -> bool:
    """Rows are prompts to sample answers to (train.objective grpo): each becomes one token row, the prompt alone."""
    return cfg.mixture()[0].format == PROMPT_ANSWER_FORMAT


def pad_id_of(tokenizer: Any) -> int:
    """The id that fills padding: the tokenizer's pad token, else its eos (Llama 3 ships no pad
    token), else 0. Padding is masked out of attention and loss, so any id is correct."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def encode_batch(
    messages: Sequence[list[dict]],
    responses: Sequence[str],
    tokenizer: Any,
    loss_on: str = "all_assistant",
    wheres: Sequence[str] | None = None,
) -> list[dict | None]:
    """Token ids and labels of a batch of examples (prompt turns and final answer); None for an empty answer.

    Labels are -100 except on what `loss_on` trains: every assistant turn ('all_assistant'), only
    the final answer ('last_assistant'), or every token ('all'). An assistant turn's labels cover
    its text and the template's end-of-turn tokens, so the model learns where an answer stops.

    The template renders each conversation and, per trained turn, the prefix before it (with the
    generation prompt) and through it, batched (two calls); one batched tokenizer call then encodes
    every text. A prefix must tokenize to a prefix of the whole, else prompt and answer cannot be
    told apart. A row the template refuses to render raises DataError naming `wheres[i]`.
    """
    requests: list[tuple[list[dict], bool, str]] = []  # (turns, add_generation_prompt, where) of each text

    def add(turns: list[dict], prompt: bool, where: str) -> int:
        requests.append((turns, prompt, where))
        return len(requests) - 1

    plans: list[tuple[int, list[tuple[int, int | None, list[dict], str]]] | None] = []
    for i, (prompt, response) in enumerate(zip(messages, responses)):
        where = wheres[i] if wheres else f"row {i + 1}"
        if not response.strip():
            plans.append(None)
            continue
        full = add([*prompt, {"role": "assistant", "content": response}], False, where)
        spans = [(add(prompt, True, where), None, prompt, response)]  # None: through the end
        if loss_on == "all_assistant":
            spans += [
                (add(prompt[:j], True, where), add(prompt[: j + 1], False, where), prompt[:j], turn["content"])
                for j, turn in enumerate(prompt)
                if turn["role"] == "assistant"
            ]
        plans.append((full, spans))
    texts: list[str] = [""] * len(requests)
    for generation_prompt in (False, True):
        which = [k for k, (_, flag, _) in enumerate(requests) if flag == generation_prompt]
        rendered = _render(
            tokenizer, [requests[k][0] for k in which], generation_prompt, [requests[k][2] for k in which]
        )
        for k, text in zip(which, rendered):
            texts[k] = text
    ids = token_ids(tokenizer, texts)
    return [None if plan is None else _labelled_row(plan, ids, tokenizer, loss_on) for plan in plans]


def encode_prompts(messages: Sequence[list[dict]], tokenizer: Any, wheres: Sequence[str] | None = None) -> list[dict]:
    """Token rows of prompts to sample answers to: each conversation rendered with the generation
    prompt, so its ids end where decoding continues (the opening of the assistant's turn); no
    token is labelled, and the whole row is the prompt (`prompt_length` == `length`). A row the
    template refuses to render raises DataError naming `wheres[i]`."""
    wheres = list(wheres) if wheres else [f"row {i + 1}" for i in range(len(messages))]
    ids = token_ids(tokenizer, _render(tokenizer, list(messages), True, wheres))
    return [
        {
            "input_ids": [int(i) for i in row],
            "labels": [IGNORE_INDEX] * len(row),
            "length": len(row),
            "prompt_length": len(row),
        }
        for row in ids
    ]


def _render(
    tokenizer: Any, conversations: list[list[dict]], add_generation_prompt: bool, wheres: list[str]
) -> list[str]:
    """The chat template applied to each conversation, in one batched call."""
    if not conversations:
        return []
    try:
        return list(
            tokenizer.apply_chat_template(conversations, add_generation_prompt=add_generation_prompt, tokenize=False)
        )
    except Exception:  # jinja's raise_exception or a template bug: find the row it cannot render
        for conversation, where in zip(conversations, wheres):
            try:
                tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
            except Exception as e:
                raise DataError(
                    f"{where}: the chat template cannot render this row ({str(e).splitlines()[0]})"
                ) from None
        raise


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts, add_special_tokens=False)["input_ids"]`, which `apply_chat_template(tokenize=True)`
    computes, straight from a fast tokenizer's Rust backend when it neither truncates nor pads:
    that skips building offsets and attention masks nobody reads (a third of the time)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and hasattr(backend, "encode_batch_fast")
    ):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _labelled_row(plan, ids: list[list[int]], tokenizer: Any, loss_on: str) -> dict:
    full, spans = plan
    full_ids = [int(i) for i in ids[full]]
    (start, _), *earlier = [
        _answer_span(ids[before], full_ids if through is None else ids[through], full_ids, tokenizer, turns, answer)
        for before, through, turns, answer in spans
    ]
    if loss_on == "all":
        labels = list(full_ids)
    else:
        labels = [IGNORE_INDEX] * start + full_ids[start:]
        for begin, end in earlier:
            labels[begin:end] = full_ids[begin:end]
    return {"input_ids": full_ids, "labels": labels, "length": len(full_ids), "prompt_length": start}


def _answer_span(
    prompt_ids: list[int], through: list[int], full_ids: list[int], tokenizer: Any, before: list[dict], answer: str
) -> tuple[int, int]:
    """[start, end) of the assistant turn after `before` in `full_ids`: from the end of `before`
    rendered with the generation prompt to the end of `before` plus the answer. Each must be a
    token prefix of the whole."""
    start, end = len(prompt_ids), len(through)
    if list(full_ids[:start]) != list(prompt_ids) or list(full_ids[:end]) != list(through) or end <= start:
        raise ChatTemplateError(_prefix_message(tokenizer, before, answer))
    return start, end


def encode_example(example: dict, tokenizer: Any, loss_on: str = "all_assistant") -> dict | None:
    """`encode_batch` of one normalized example, with the columns a token table keeps; None if its response is empty."""
    (row,) = encode_batch([example["messages"]], [example["response"]], tokenizer, loss_on)
    if row is None:
        return None
    return {
        **row,
        "category": example["category"],
        "prompt_text": _prompt_text(example["messages"]),
        "response": example["response"],
    }


def _encode_map(
    batch: dict[str, list], tokenizer: Any, cfg: DataConfig, wheres: list[tuple[str, str]], names: list[str]
) -> dict[str, list]:
    """The `datasets.map` function: normalized rows -> token rows, each with its drop reason
    (EMPTY, TOO_LONG, IDENTICAL or KEEP) and, for a row the template cannot handle, the problem.
    A preference pair encodes both answers, each labelled on its own tokens alone; a prompt_answer
    row its prompt alone, which is too long whatever data.too_long says when it passes max_length."""
    out: dict[str, list] = {key: [] for key in ENCODED_COLUMNS}
    where = [f"{wheres[s][0]} {wheres[s][1]} {r}" for s, r in zip(batch["source"], batch["row"])]
    pairs = is_preference(cfg)
    n = len(where)
    try:
        if pairs:  # one batched call for both answers; the labels cover the answer alone
            encoded = encode_batch(
                batch["messages"] * 2, batch["response"] + batch["rejected"], tokenizer, "last_assistant", where * 2
            )
            rows, rejected = encoded[:n], encoded[n:]
        elif is_prompt_answer(cfg):
            rows, rejected = encode_prompts(batch["messages"], tokenizer, where), [None] * n
        else:
            rows, rejected = (
                encode_batch(batch["messages"], batch["response"], tokenizer, cfg.loss_on, where),
                [None] * n,
            )
        problem = template_problem = None
    except ChatTemplateError as e:
        rows, rejected, problem, template_problem = [None] * n, [None] * n, None, str(e)
    except DataError as e:
        rows, rejected, problem, template_problem = [None] * n, [None] * n, str(e), None
    empty = {"input_ids": [], "labels": [], "length": 0, "prompt_length": 0}
    for i, (row, other) in enumerate(zip(rows, rejected)):
        drop, truncated = EMPTY, False  # (a batch with a problem is raised by the caller)
        if row is not None and (other is not None or not pairs):
            drop = KEEP
            if pairs and batch["response"][i] == batch["rejected"][i]:
                drop = IDENTICAL
            cut = [r for r in (row, other) if r is not None and r["length"] > cfg.max_length]
            # Truncating keeps the prompt whole, so it must leave at least one answer token to learn from.
            if drop == KEEP and cut and (cfg.too_long == "drop" or row["prompt_length"] >= cfg.max_length):
                drop = TOO_LONG
            elif drop == KEEP and cut:
                row, other, truncated = (
                    _truncated(row, cfg.max_length),
                    other and _truncated(other, cfg.max_length),
                    True,
                )
        row, other = row or empty, other or empty
        out["input_ids"].append(row["input_ids"])
        out["labels"].append(row["labels"])
        out["length"].append(row["length"])
        out["prompt_length"].append(row["prompt_length"])
        out["rejected_input_ids"].append(other["input_ids"])
        out["rejected_labels"].append(other["labels"])
        out["rejected_length"].append(other["length"])
        out["category"].append(batch["category"][i])
        out["prompt_text"].append(_prompt_text(batch["messages"][i]))
        out["response"].append(batch["response"][i])
        out["rejected"].append(batch["rejected"][i])
        out["source"].append(names[batch["source"][i]])
        out["labelled"].append(sum(1 for label in (*row["labels"], *other["labels"]) if label != IGNORE_INDEX))
        out["drop"].append(drop)
        out["truncated"].append(truncated)
        out["problem"].append(problem if i == 0 else None)
        out["template_problem"].append(template_problem if i == 0 else None)
    return out


def _truncated(row: dict, n: int) -> dict:
    return (
        row
        if row["length"] <= n
        else {**row, "input_ids": row["input_ids"][:n], "labels": row["labels"][:n], "length": n}
    )


ENCODED_COLUMNS = (
    "input_ids",
    "labels",
    "length",
    "prompt_length",
    "rejected_input_ids",
    "rejected_labels",
    "rejected_length",
    "category",
    "prompt_text",
    "response",
    "rejected",
    "source",
    "labelled",
    "drop",
    "truncated",
    "problem",
    "template_problem",
)


def _encoded_features():
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    text = datasets.Value("string")
    return datasets.Features(
        {
            "input_ids": ids,
            "labels": ids,
            "length": datasets.Value("int32"),
            "prompt_length": datasets.Value("int32"),
            "rejected_input_ids": ids,
            "rejected_labels": ids,
            "rejected_length": datasets.Value("int32"),
            "category": text,
            "prompt_text": text,
            "response": text,
            "rejected": text,
            "source": text,
            "labelled": datasets.Value("int32"),
            "drop": datasets.Value("int8"),
            "truncated": datasets.Value("bool"),
            "problem": text,
            "template_problem": text,
        }
    )


REJECTED = {
    "input_ids": "rejected_input_ids",
    "labels": "rejected_labels",
    "length": "rejected_length",
    "response": "rejected",
}


class TokenTables:
    """The outcome of tokenizing: encoded rows in Arrow (`encoded`), which of them form the train
    and eval splits, in order (positions may repeat: weighted sources), and the stats."""

    def __init__(self, encoded, train: np.ndarray, eval_: np.ndarray, stats: dict, pairs: bool = False):
        self.encoded, self.train, self.eval, self.stats, self.pairs = encoded, train, eval_, stats, pairs

    def batches(self, split: str) -> Iterable[pa.Table]:
        """The split's rows in ARROW_SCHEMA, WRITE_ROWS at a time. Preference pairs are two rows
        each, the chosen answer's (an even row) and then the rejected one's."""
        positions = self.train if split == "train" else self.eval
        table = self.encoded.data.table  # memory-mapped; `encoded` is a map's output, not a view
        step = WRITE_ROWS // 2 if self.pairs else WRITE_ROWS
        for start in range(0, len(positions), step):
            taken = table.take(pa.array(positions[start : start + step], pa.int64()))
            chosen = taken.select(ARROW_SCHEMA.names).cast(ARROW_SCHEMA)
            if not self.pairs:
                yield chosen
                continue
            rejected = (
                taken.select([REJECTED.get(name, name) for name in ARROW_SCHEMA.names])
                .rename_columns(ARROW_SCHEMA.names)
                .cast(ARROW_SCHEMA)
            )
            n = len(chosen)
            order = np.stack([np.arange(n), np.arange(n) + n], axis=1).reshape(-1)  # chosen, rejected, chosen, ...
            yield pa.concat_tables([chosen, rejected]).take(pa.array(order, pa.int64()))

    def rows(self, split: str) -> list[dict]:
        return [row for table in self.batches(split) for row in table.to_pylist()]


def tokenize_sources(
    sources: Sequence[tuple[SourceConfig, str]], tokenizer: Any, cfg: DataConfig, work: Path
) -> TokenTables:
    """Read every (source, path or hub id), normalize, drop exact duplicates, split, encode, drop,
    weight and cap. `work` holds the intermediate Arrow files, and must outlive the result."""
    import datasets

    parts = [loading.load_normalized(src, path, i, work, cfg.num_proc) for i, (src, path) in enumerate(sources)]
    normalized = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    wheres = [(str(loading.location(path, src.format)), loading.unit_of(path)) for src, path in sources]
    return _tokenize_normalized(normalized, tokenizer, cfg, [src for src, _ in sources], wheres, work)


def write_token_tables(
    sources: Sequence[tuple[SourceConfig, str]], tokenizer: Any, cfg: DataConfig, folder: Path
) -> dict:
    """`tokenize_sources` written as folder/train.arrow and folder/eval.arrow (its intermediate files
    in a temporary folder beside `folder`, removed after); returns the stats."""
    with tempfile.TemporaryDirectory(prefix=".tokenize-", dir=folder.parent) as work:
        tables = tokenize_sources(sources, tokenizer, cfg, Path(work))
        write_arrow(tables.batches("train"), folder / "train.arrow")
        write_arrow(tables.batches("eval"), folder / "eval.arrow")
    return tables.stats


def tokenize_dataset(examples: Sequence[dict], tokenizer: Any, cfg: DataConfig) -> tuple[list[dict], list[dict], dict]:
    """`tokenize_sources` for examples already normalized in memory (one source); returns (train, eval, stats) rows."""
    import datasets

    rows = [
        {
            "rejected": "",
            **e,
            "source": 0,
            "row": n,
            "row_key": loading.row_key(e),
            "prompt_key": loading.prompt_key(e),
            "problem": None,
        }
        for n, e in enumerate(examples, start=1)
    ]
    normalized = datasets.Dataset.from_list(rows, features=loading.normalized_features())
    with tempfile.TemporaryDirectory(prefix="jaxtune-tokenize-") as work:
        tables = _tokenize_normalized(
            normalized, tokenizer, cfg, list(cfg.mixture()), [("examples", "row")], Path(work)
        )
        return tables.rows("train"), tables.rows("eval"), tables.stats


def _tokenize_normalized(
    normalized, tokenizer: Any, cfg: DataConfig, sources: list[SourceConfig], wheres: list[tuple[str, str]], work: Path
) -> TokenTables:
    n_in = len(normalized)
    if n_in < 2:
        raise DataError(f"need at least 2 rows to split into train and eval, got {n_in}")
    unique = first_occurrences(normalized.data.column("row_key").to_numpy())
    if len(unique) < 2:
        raise DataError(
            f"need at least 2 distinct rows to split into train and eval, got {len(unique)} "
            f"({n_in - len(unique)} of the {n_in} rows are exact duplicates)"
        )
    train_idx, eval_idx = split_indices(unique, cfg.eval_fraction, cfg.seed)
    prompts = normalized.data.column("prompt_key").to_numpy()
    kept_eval = eval_idx[~np.isin(prompts[eval_idx], prompts[train_idx])]
    # Encoded in file order, so each worker reads its rows in one sweep (in split order the reads
    # jump across the whole file, a fifth slower at 1M rows); the splits' orders are positions into it.
    keep = np.sort(np.concatenate([train_idx, kept_eval]))
    chosen = normalized if len(keep) == n_in else normalized.select(keep)
    names = [src.label for src in sources]
    encoded = loading.parallel_map(
        chosen,
        _encode_map,
        cfg.num_proc,
        features=_encoded_features(),
        cache_file_name=str(work / "encoded.arrow"),
        fn_kwargs={"tokenizer": tokenizer, "cfg": cfg, "wheres": wheres, "names": names},
        desc="tokenize",
    )
    loading.raise_first_problem(encoded.data.column("template_problem"), ChatTemplateError)
    loading.raise_first_problem(encoded.data.column("problem"))

    drop = encoded.data.column("drop").to_numpy()
    train_enc, eval_enc = np.searchsorted(keep, train_idx), np.searchsorted(keep, kept_eval)
    train_pos, eval_pos = train_enc[drop[train_enc] == KEEP], eval_enc[drop[eval_enc] == KEEP]
    # Counted per split, so an empty split's error names only what emptied it.
    train_dropped = _drop_counts(drop[train_enc])
    eval_dropped = _drop_counts(drop[eval_enc]) + Counter(duplicate_of_train=len(eval_idx) - len(kept_eval))
    n_train = len(train_idx)
    source_of_row = np.asarray(normalized.data.column("source").to_numpy(), dtype=np.int64)
    source_of = source_of_row[keep]
    train_pos = weighted(train_pos, source_of, [src.weight for src in sources], cfg.seed)
    train_pos = _cap(train_pos, cfg.max_train_rows, "max_train_rows", train_dropped)
    eval_pos = _cap(eval_pos, cfg.max_eval_rows, "max_eval_rows", eval_dropped)
    dropped = train_dropped + eval_dropped + Counter(duplicate=n_in - len(unique))
    if not len(train_pos) and not len(eval_pos):
        raise DataError(f"no train rows left: all {n_in} rows were dropped ({_why(dropped, cfg)})")
    if not len(train_pos):
        raise DataError(
            f"no train rows left: every row of the train split ({n_train} of the {n_in} rows in) was dropped "
            f"({_why(train_dropped, cfg)})"
        )
    if not len(eval_pos):
        raise DataError(
            f"no eval rows left: every row held out for eval ({len(eval_idx)} of the {n_in} rows in) was dropped "
            f"({_why(eval_dropped, cfg)}); raise data.eval_fraction={cfg.eval_fraction} to hold out more"
        )
    rows_in = np.bincount(source_of_row, minlength=len(sources))
    stats = _stats(encoded, train_pos, eval_pos, dropped, n_in, sources, rows_in, source_of)
    pairs = is_preference(cfg)
    if pairs:
        stats["preference"] = True  # train_rows and eval_rows count pairs, each two rows of the tables
    if is_prompt_answer(cfg):
        stats["prompt_answer"] = True  # rows are prompts alone: label_tokens are 0, tokens count prompt tokens
    return TokenTables(encoded, train_pos, eval_pos, stats, pairs)


def first_occurrences(keys: np.ndarray) -> np.ndarray:
    """Indices of the first row of each distinct key, in row order: a repeat would be trained on
    twice, or land in eval as a copy of a train row."""
    _, first = np.unique(keys, return_index=True)
    return np.sort(first)


def split_indices(indices: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`split_examples` of row indices: the same shuffle, so a row lands in the same split either way."""
    order = list(range(len(indices)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(eval_fraction * len(order))), len(order) - 1)
    order = np.asarray(order, dtype=np.int64)
    return indices[order[n_eval:]], indices[order[:n_eval]]


def weighted(positions: np.ndarray, source_of: np.ndarray, weights: Sequence[float], seed: int) -> np.ndarray:
    """The train positions with each source's rows repeated `weight` times: whole copies, and a
    seeded sample for the fraction; then shuffled together (with every weight 1, unchanged)."""
    if all(w == 1.0 for w in weights):
        return positions
    rng = np.random.default_rng([seed, len(weights)])
    parts = []
    for k, w in enumerate(weights):
        rows = positions[source_of[positions] == k]
        parts += [rows] * int(w)
        extra = round((w - int(w)) * len(rows))
        if extra:
            parts.append(np.sort(rng.choice(rows, extra, replace=False)))
    mixed = np.concatenate(parts) if parts else positions[:0]
    return mixed[rng.permutation(len(mixed))]


def split_examples(examples: Sequence[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic shuffle, then eval = the first max(1, round(eval_fraction * n)) rows, train = the rest."""
    train, eval_ = split_indices(np.arange(len(examples)), eval_fraction, seed)
    return [examples[i] for i in train], [examples[i] for i in eval_]


def write_arrow(rows: Sequence[dict] | Iterable[pa.Table], path: str | Path) -> None:
    """Write token rows (dicts, or ARROW_SCHEMA tables written one after another, so memory holds
    one at a time) as an Arrow IPC file (Feather v2); the file appears atomically."""
    path = Path(path)
    if isinstance(rows, Sequence) and not (rows and isinstance(rows[0], pa.Table)):
        rows = [pa.Table.from_pylist(list(rows), schema=ARROW_SCHEMA)]
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, ARROW_SCHEMA) as writer:
        for table in rows:
            writer.write_table(table, max_chunksize=WRITE_ROWS)
    os.replace(tmp, path)


def read_arrow(path: str | Path) -> pa.Table:
    """A table written by `write_arrow`, memory-mapped (columns are read from disk as they are
    used), checked to have the token-table columns."""
    return check_token_table(pa.ipc.open_file(pa.memory_map(str(path))).read_all(), path)


def check_token_table(table: pa.Table, path: str | Path) -> pa.Table:
    missing = [name for name in ARROW_SCHEMA.names if name not in table.column_names]
    if missing:
        raise DataError(f"{path}: not a token table (missing columns: {', '.join(missing)})")
    return table


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


def _why(dropped: Counter, cfg: DataConfig) -> str:
    """The non-zero drop counts, each with what it means and the setting that changes it."""
    if is_prompt_answer(cfg):  # a prompt cannot be truncated: its end is where the answers start
        too_long = f"prompts longer than data.max_length={cfg.max_length} tokens; raise data.max_length"
    elif cfg.too_long == "truncate":
        too_long = f"rows whose prompt alone has data.max_length={cfg.max_length} tokens or more; raise data.max_length"
    else:
        too_long = f"rows longer than data.max_length={cfg.max_length} tokens; raise data.max_length or set data.too_long=truncate"
    meaning = {
        "duplicate": "exact repeats of an earlier row",
        "duplicate_of_train": "eval rows whose prompt is also a train prompt",
        "empty_response": "rows whose response is empty",
        "too_long": too_long,
        "identical_pair": "preference pairs whose chosen and rejected answers are the same",
        "max_train_rows": f"over data.max_train_rows={cfg.max_train_rows}",
        "max_eval_rows": f"over data.max_eval_rows={cfg.max_eval_rows}",
    }
    return "; ".join(f"{reason}: {dropped[reason]}; {meaning[reason]}" for reason in DROP_REASONS if dropped[reason])


def _drop_counts(drop: np.ndarray) -> Counter:
    return Counter(
        empty_response=int(np.count_nonzero(drop == EMPTY)),
        too_long=int(np.count_nonzero(drop == TOO_LONG)),
        identical_pair=int(np.count_nonzero(drop == IDENTICAL)),
    )


def _cap(positions: np.ndarray, cap: int | None, reason: str, dropped: Counter) -> np.ndarray:
    if cap is None or len(positions) <= cap:
        return positions
    dropped[reason] += len(positions) - cap
    return positions[:cap]


def _stats(
    encoded,
    train: np.ndarray,
    eval_: np.ndarray,
    dropped: Counter,
    rows_in: int,
    sources: list[SourceConfig],
    source_rows_in: np.ndarray,
    source_of: np.ndarray,
) -> dict:
    """Counts, token totals, length percentiles, category histograms and the mix of the kept rows."""
    table = encoded.data
    chosen, rejected = table.column("length").to_numpy(), table.column("rejected_length").to_numpy()
    length = chosen + rejected  # a pair's tokens are both rows'
    labelled = table.column("labelled").to_numpy()
    truncated = table.column("truncated").to_numpy(zero_copy_only=False)
    kept = np.concatenate([train, eval_])
    lengths = np.sort(np.maximum(chosen, rejected)[kept])  # per row: a pair's rows each fit data.max_length
    return {
        "rows_in": rows_in,
        "train_rows": len(train),
        "eval_rows": len(eval_),
        "dropped": {reason: dropped[reason] for reason in DROP_REASONS},
        "truncated": int(np.count_nonzero(truncated[kept])),  # kept, cut to data.max_length (data.too_long=truncate)
        "tokens": {"train": int(length[train].sum()), "eval": int(length[eval_].sum())},
        "label_tokens": {
            "train": int(labelled[train].sum()),
            "eval": int(labelled[eval_].sum()),
        },  # what the loss covers (data.loss_on)
        "length_percentiles": {
            "p50": _percentile(lengths, 50),
            "p90": _percentile(lengths, 90),
            "p99": _percentile(lengths, 99),
            "max": int(lengths[-1]),
        },
        "categories": {
            "train": _histogram(table.column("category"), train),
            "eval": _histogram(table.column("category"), eval_),
        },
        "sources": [
            {
                "name": src.label,
                "weight": src.weight,
                "max_rows": src.max_rows,
                "rows_in": int(source_rows_in[k]),
                "train_rows": int(np.count_nonzero(source_of[train] == k)),
                "eval_rows": int(np.count_nonzero(source_of[eval_] == k)),
            }
            for k, src in enumerate(sources)
        ],
    }


def _percentile(sorted_values: np.ndarray, q: float) -> int:
    """Nearest-rank percentile: the smallest value with at least q% of values at or below it."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return int(sorted_values[int(rank) - 1])


def _histogram(column: pa.ChunkedArray, positions: np.ndarray) -> dict[str, int]:
    counts = pc.value_counts(column.take(pa.array(positions, pa.int64())))
    return dict(sorted((c["values"].as_py(), c["counts"].as_py()) for c in counts))
