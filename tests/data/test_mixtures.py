"""Mixtures (`data.sources`): rows counted per source, weights that repeat or sample train rows
only, the `source` label of each row, seeding, config validation and the tokenize key."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from jaxtune.config import DataConfig, JaxtuneConfig, SourceConfig, StoreConfig, load_config
from jaxtune.data.tokenize import tokenize_sources
from jaxtune.errors import ConfigError

pytestmark = pytest.mark.data

N_A, N_B = 30, 21  # B odd, so weight 0.5 has a half to round


def alpaca_rows(dolly: list[dict]) -> list[dict]:
    """Dolly rows as alpaca under other column names (mapped back by `columns`), marked so no prompt repeats one of A's."""
    return [
        {
            "question": f"[B] {r['instruction']}",
            "input": r["context"],
            "answer": r["response"],
            "category": r["category"],
        }
        for r in dolly
    ]


ALPACA_COLUMNS = {"instruction": "question", "output": "answer"}


@pytest.fixture
def files(make_dolly, write_rows) -> tuple[Path, Path]:
    """Two JSONL files of distinct rows: A in dolly format, B in alpaca with renamed columns."""
    return write_rows(make_dolly(N_A, seed=0), "jsonl", name="a"), write_rows(
        alpaca_rows(make_dolly(N_B, seed=5)), "jsonl", name="b"
    )


@pytest.fixture
def mix(files, tokenizer, tmp_path):
    """mix(weight_b=1.0, seed=0, weight_a=1.0) -> TokenTables of sources A and B."""
    a, b = files

    def run(weight_b: float = 1.0, seed: int = 0, weight_a: float = 1.0):
        sources = [
            (SourceConfig(source=str(a), weight=weight_a), str(a)),
            (SourceConfig(source=str(b), format="alpaca", columns=ALPACA_COLUMNS, weight=weight_b, name="B"), str(b)),
        ]
        cfg = DataConfig(sources=[src for src, _ in sources], seed=seed, num_proc=1)
        work = Path(tempfile.mkdtemp(prefix="work-", dir=tmp_path))
        return tokenize_sources(sources, tokenizer, cfg, work)

    return run


def per_source(stats: dict) -> dict[str, dict]:
    return {s["name"]: s for s in stats["sources"]}


def labels(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        out[row["source"]] = out.get(row["source"], 0) + 1
    return out


def test_rows_are_counted_per_source(mix):
    tables = mix()
    stats = tables.stats
    a, b = per_source(stats)["a.jsonl"], per_source(stats)["B"]
    assert [s["name"] for s in stats["sources"]] == ["a.jsonl", "B"]  # the file name by default, else `name`
    assert (a["rows_in"], b["rows_in"]) == (N_A, N_B)
    assert stats["rows_in"] == N_A + N_B
    assert not any(stats["dropped"].values())
    # weight 1: every row is in train or eval, exactly once
    assert a["train_rows"] + a["eval_rows"] == N_A and b["train_rows"] + b["eval_rows"] == N_B
    assert a["eval_rows"] > 0 and b["eval_rows"] > 0  # the split is over both sources together
    assert (
        a["train_rows"] + b["train_rows"] == stats["train_rows"]
        and a["eval_rows"] + b["eval_rows"] == stats["eval_rows"]
    )
    assert (a["weight"], b["weight"], a["max_rows"]) == (1.0, 1.0, None)


def test_each_row_carries_its_source_label(mix):
    tables = mix()
    train, eval_ = tables.rows("train"), tables.rows("eval")
    stats = per_source(tables.stats)
    assert labels(train) == {name: s["train_rows"] for name, s in stats.items()}
    assert labels(eval_) == {name: s["eval_rows"] for name, s in stats.items()}
    # B's rows were read in its own format: alpaca, through the column mapping
    assert all(r["prompt_text"].startswith("[B] ") == (r["source"] == "B") for r in train + eval_)


def test_weight_2_doubles_a_sources_train_rows_and_leaves_eval_alone(mix):
    base, doubled = mix(), mix(weight_b=2.0)
    before, after = per_source(base.stats), per_source(doubled.stats)
    assert after["B"]["train_rows"] == 2 * before["B"]["train_rows"]
    assert after["B"]["eval_rows"] == before["B"]["eval_rows"]
    assert after["a.jsonl"] == before["a.jsonl"]
    assert after["B"]["weight"] == 2.0
    train = doubled.rows("train")
    assert doubled.stats["train_rows"] == len(train) == before["a.jsonl"]["train_rows"] + 2 * before["B"]["train_rows"]
    assert doubled.rows("eval") == base.rows("eval")
    # each of B's train rows exactly twice, A's once
    counts: dict[tuple, int] = {}
    for row in train:
        counts[(row["source"], tuple(row["input_ids"]))] = counts.get((row["source"], tuple(row["input_ids"])), 0) + 1
    assert {n for (source, _), n in counts.items() if source == "B"} == {2}
    assert {n for (source, _), n in counts.items() if source == "a.jsonl"} == {1}
    # and the same rows as with weight 1
    assert {key for key in counts} == {(r["source"], tuple(r["input_ids"])) for r in base.rows("train")}


def test_weight_half_keeps_half_of_a_sources_train_rows(mix):
    before, halved = per_source(mix().stats), mix(weight_b=0.5)
    after = per_source(halved.stats)
    n = before["B"]["train_rows"]
    assert after["B"]["train_rows"] == round(0.5 * n)
    assert after["B"]["eval_rows"] == before["B"]["eval_rows"]
    assert after["a.jsonl"] == before["a.jsonl"]
    kept = [tuple(r["input_ids"]) for r in halved.rows("train") if r["source"] == "B"]
    assert len(set(kept)) == len(kept), "a sample without repeats"


def test_weight_one_and_a_half_is_each_row_once_plus_a_half_again(mix):
    before, tables = per_source(mix().stats), mix(weight_b=1.5)
    n = before["B"]["train_rows"]
    assert per_source(tables.stats)["B"]["train_rows"] == n + round(0.5 * n)


def test_the_same_seed_gives_identical_tables_and_another_a_different_order(mix):
    first, again = mix(weight_b=1.5), mix(weight_b=1.5)
    assert first.rows("train") == again.rows("train") and first.rows("eval") == again.rows("eval")
    assert first.stats == again.stats
    other = mix(weight_b=1.5, seed=1)
    assert [r["input_ids"] for r in other.rows("train")] != [r["input_ids"] for r in first.rows("train")]
    # weight 1 everywhere: still a seeded split and order
    assert [r["input_ids"] for r in mix(seed=1).rows("train")] != [r["input_ids"] for r in mix().rows("train")]


def test_a_messages_source_mixes_in(files, make_dolly, tmp_path, tokenizer):
    a, _ = files
    conversations = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"[C] {r['instruction']}"},
                {"role": "assistant", "content": r["response"]},
            ],
            "category": "chat",
        }
        for r in make_dolly(12, seed=9)
    ]
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps(r) + "\n" for r in conversations), encoding="utf-8")
    sources = [(SourceConfig(source=str(a)), str(a)), (SourceConfig(source=str(c), format="messages"), str(c))]
    tables = tokenize_sources(
        sources, tokenizer, DataConfig(sources=[s for s, _ in sources], num_proc=1), tmp_path / "work"
    )
    stats = per_source(tables.stats)
    assert stats["c.jsonl"]["rows_in"] == 12 and stats["a.jsonl"]["rows_in"] == N_A
    rows = tables.rows("train") + tables.rows("eval")
    assert {r["source"] for r in rows if r["category"] == "chat"} == {"c.jsonl"}
    assert sum(r["source"] == "c.jsonl" for r in rows) == 12


# --- config ---------------------------------------------------------------------------------


def test_sources_and_source_together_are_refused():
    with pytest.raises(ValidationError, match=r"data\.sources replaces data\.source"):
        DataConfig(source="x.jsonl", sources=[SourceConfig(source="y.jsonl")])
    with pytest.raises(ValidationError, match=r"data\.sources replaces data\.format"):
        DataConfig(format="alpaca", sources=[SourceConfig(source="y.jsonl")])
    with pytest.raises(ConfigError, match=r"data\.sources replaces data\.source"):
        load_config(None, ["data.source=x.jsonl", "data.sources=[{source: y.jsonl}]"])


def test_a_single_data_source_is_a_mixture_of_one(dolly_rows, write_rows, tokenizer, tmp_path):
    path = write_rows(dolly_rows, "jsonl")
    cfg = DataConfig(source=str(path), num_proc=1)
    (src,) = cfg.mixture()
    assert src.source == str(path) and src.weight == 1.0
    tables = tokenize_sources([(src, str(path))], tokenizer, cfg, tmp_path / "work")
    assert tables.stats["sources"] == [
        {
            "name": "data.jsonl",
            "weight": 1.0,
            "max_rows": None,
            "rows_in": len(dolly_rows),
            "train_rows": tables.stats["train_rows"],
            "eval_rows": tables.stats["eval_rows"],
        }
    ]
    assert {r["source"] for r in tables.rows("train") + tables.rows("eval")} == {"data.jsonl"}


# --- the tokenize key -----------------------------------------------------------------------


def tokenize_key(tmp_path: Path, sources: list[SourceConfig]) -> str:
    from jaxtune.flows.finetune import planned_keys

    store = tmp_path / "store"
    key = planned_keys(JaxtuneConfig(data=DataConfig(sources=sources), store=StoreConfig(root=str(store))))["tokenize"]
    assert not store.exists(), "planned_keys runs no stage"
    return key


def test_the_tokenize_key_follows_a_sources_weight(files, tmp_path):
    a, b = files
    key = tokenize_key(
        tmp_path, [SourceConfig(source=str(a)), SourceConfig(source=str(b), format="alpaca", columns=ALPACA_COLUMNS)]
    )
    assert key == tokenize_key(
        tmp_path, [SourceConfig(source=str(a)), SourceConfig(source=str(b), format="alpaca", columns=ALPACA_COLUMNS)]
    )
    weighted = tokenize_key(
        tmp_path,
        [SourceConfig(source=str(a)), SourceConfig(source=str(b), format="alpaca", columns=ALPACA_COLUMNS, weight=2.0)],
    )
    assert weighted != key


def test_the_second_sources_rows_are_part_of_the_tokenize_key(files, tmp_path):
    a, b = files
    sources = [SourceConfig(source=str(a)), SourceConfig(source=str(b), format="alpaca", columns=ALPACA_COLUMNS)]
    key = tokenize_key(tmp_path, sources)
    lines = b.read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[5])
    row["answer"] += " Edited."
    lines[5] = json.dumps(row)
    b.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert tokenize_key(tmp_path, sources) != key
