"""The report's Data section: rows in and kept, and for a mixture each source's share of the train rows."""

from __future__ import annotations

import pytest

from jaxtune.tasks.report import _data_section

pytestmark = pytest.mark.data


def stats(sources: list[dict]) -> dict:
    return {
        "rows_in": 130,
        "train_rows": sum(s["train_rows"] for s in sources),
        "eval_rows": 13,
        "truncated": 0,
        "dropped": {"duplicate": 2, "too_long": 0},
        "sources": sources,
    }


def test_a_mixture_shows_each_sources_rows_weight_and_share():
    lines = _data_section(
        stats(
            [
                {"name": "dolly.jsonl", "weight": 1.0, "rows_in": 100, "train_rows": 90, "eval_rows": 10},
                {"name": "chats", "weight": 2.0, "rows_in": 30, "train_rows": 54, "eval_rows": 3},
            ]
        )
    )
    assert "130 rows in: 144 train, 13 eval; dropped: duplicate 2; truncated: 0." in lines
    assert "| dolly.jsonl | 100 | 1 | 90 | 62.5% | 10 |" in lines
    assert "| chats | 30 | 2 | 54 | 37.5% | 3 |" in lines


def test_one_source_shows_no_mix_table():
    lines = _data_section(
        stats([{"name": "offline", "weight": 1.0, "rows_in": 130, "train_rows": 115, "eval_rows": 13}])
    )
    assert not any(line.startswith("| source |") for line in lines)
    assert lines[2].startswith("130 rows in: 115 train")
