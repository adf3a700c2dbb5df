"""The report's hardest examples: the eval rows whose loss fell least, or rose, from the baseline
eval to the final one (each row's mean token loss, from both evals' rows.json), with the final
model's answer where the generate stage decoded that row, and per category the share of rows
that got worse. For preference pairs, the pairs whose reward margin rose least, or fell (from
both evals' pairs.json), and per category the share of pairs whose margin fell."""

from __future__ import annotations

import json
from collections import defaultdict

from jaxtune.artifacts import ArtifactRef

HARDEST = 5
CELL = 120  # characters of a prompt, reference or answer shown in a table cell


def hardest_examples(inputs: dict[str, ArtifactRef], count: int = HARDEST) -> dict | None:
    """The `count` rows whose loss changed least for the better, and the share of rows that got
    worse per category (for preference pairs, `hardest_pairs`); None when the evals recorded neither."""
    from jaxtune.data.token_table import TokenTable
    from jaxtune.tasks.evaluate import PAIRS, ROWS

    if _both_have(inputs, PAIRS):
        return hardest_pairs(inputs, count)
    if not _both_have(inputs, ROWS):
        return None
    before = inputs["baseline_eval"].read_json(ROWS)["loss"]
    after = inputs["final_eval"].read_json(ROWS)["loss"]
    table = TokenTable(inputs["tokenize"].file("eval.arrow"))
    categories, prompts, references = (table.column(name) for name in ("category", "prompt_text", "response"))
    answers = [g["after"] for g in _generations(inputs["generate"])]  # the first eval rows, in order
    scored = [row for row, (b, a) in enumerate(zip(before, after)) if b is not None and a is not None]
    ranked = sorted(scored, key=lambda row: after[row] - before[row], reverse=True)[:count]
    rows = [
        {
            "row": row,
            "category": categories[row],
            "prompt": prompts[row],
            "reference": references[row],
            "generation": answers[row] if row < len(answers) else None,
            "baseline_loss": before[row],
            "final_loss": after[row],
            "change": round(after[row] - before[row], 6),
        }
        for row in ranked
    ]
    return {
        "rows": rows,
        "compared": len(scored),
        "generated": len(answers),
        "worse_by_category": _worse_by_category(
            [after[row] > before[row] for row in scored], [categories[row] for row in scored]
        ),
    }


def hardest_pairs(inputs: dict[str, ArtifactRef], count: int = HARDEST) -> dict:
    """The `count` pairs whose reward margin (chosen over rejected) rose least, or fell, from the
    baseline eval to the final one, and per category the share of pairs whose margin fell. A DPO
    baseline's margins are all 0 (the policy is its own reference), so these are the pairs the
    trained model ranks worst."""
    from jaxtune.data.token_table import TokenTable
    from jaxtune.tasks.evaluate import PAIR_FIGURES, PAIRS

    before, after = inputs["baseline_eval"].read_json(PAIRS), inputs["final_eval"].read_json(PAIRS)
    table = TokenTable(inputs["tokenize"].file("eval.arrow"))  # rows 2p (chosen) and 2p+1 (rejected) are pair p
    rows = len(before["margin"])
    categories, prompts, answers = (table.column(name, 2 * rows) for name in ("category", "prompt_text", "response"))
    categories, prompts, chosen, rejected = categories[0::2], prompts[0::2], answers[0::2], answers[1::2]
    pairs = list(range(rows))
    ranked = sorted(pairs, key=lambda p: after["margin"][p] - before["margin"][p])[:count]
    return {
        "pairs": [
            {
                "pair": p,
                "category": categories[p],
                "prompt": prompts[p],
                "chosen": chosen[p],
                "rejected": rejected[p],
                **{f"baseline_{k}": before[k][p] for k in PAIR_FIGURES},
                **{f"final_{k}": after[k][p] for k in PAIR_FIGURES},
                "change": round(after["margin"][p] - before["margin"][p], 6),
            }
            for p in ranked
        ],
        "compared": rows,
        "worse_by_category": _worse_by_category(
            [after["margin"][p] < before["margin"][p] for p in pairs], [categories[p] for p in pairs]
        ),
    }


def _both_have(inputs: dict[str, ArtifactRef], name: str) -> bool:
    return inputs["baseline_eval"].file(name).is_file() and inputs["final_eval"].file(name).is_file()


def _worse_by_category(worse: list[bool], categories: list[str]) -> dict:
    """Per category, of the rows (or pairs) given, how many got worse, and their share."""
    groups = defaultdict(list)
    for flag, category in zip(worse, categories):
        groups[category].append(flag)
    return {
        c: {"rows": len(flags), "worse": sum(flags), "share": sum(flags) / len(flags)}
        for c, flags in sorted(groups.items())
    }


def _generations(ref: ArtifactRef) -> list[dict]:
    return [json.loads(line) for line in ref.file("generations.jsonl").read_text().splitlines()]


def hardest_lines(hardest: dict | None) -> list[str]:
    """The report's section: the table of rows, then the share that got worse per category."""
    if not hardest:
        return []
    if "pairs" in hardest:
        return _pair_lines(hardest)
    lines = [
        "## Hardest examples",
        "",
        f"The {len(hardest['rows'])} of {hardest['compared']} eval rows whose loss (mean over the answer's tokens) "
        "fell least, or rose, from before training to after; the answer is the trained model's greedy one (the "
        f"generate stage decodes the first {hardest['generated']} eval rows).",
        "",
        "| row | category | prompt | reference | answer after | loss before | loss after |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['row']} | {r['category']} | {_cell(r['prompt'])} | {_cell(r['reference'])} "
        f"| {_cell(r['generation']) if r['generation'] is not None else '(not generated)'} "
        f"| {r['baseline_loss']:.4f} | {r['final_loss']:.4f} |"
        for r in hardest["rows"]
    ]
    lines += [
        "",
        "| category | eval rows | got worse | share |",
        "|---|---|---|---|",
        *[
            f"| {c} | {m['rows']} | {m['worse']} | {100 * m['share']:.1f}% |"
            for c, m in hardest["worse_by_category"].items()
        ],
        "",
    ]
    return lines


def _pair_lines(hardest: dict) -> list[str]:
    lines = [
        "## Hardest pairs",
        "",
        f"The {len(hardest['pairs'])} of {hardest['compared']} eval pairs whose reward margin (the chosen answer's "
        "reward less the rejected one's) rose least, or fell, from before training to after, with each answer's "
        "log-probability before and after.",
        "",
        "| pair | category | prompt | chosen | rejected | margin before | margin after | log-p chosen | log-p rejected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['pair']} | {p['category']} | {_cell(p['prompt'])} | {_cell(p['chosen'])} | {_cell(p['rejected'])} "
        f"| {p['baseline_margin']:.4f} | {p['final_margin']:.4f} "
        f"| {p['baseline_chosen_logp']:.2f} → {p['final_chosen_logp']:.2f} "
        f"| {p['baseline_rejected_logp']:.2f} → {p['final_rejected_logp']:.2f} |"
        for p in hardest["pairs"]
    ]
    lines += [
        "",
        "| category | eval pairs | margin fell | share |",
        "|---|---|---|---|",
        *[
            f"| {c} | {m['rows']} | {m['worse']} | {100 * m['share']:.1f}% |"
            for c, m in hardest["worse_by_category"].items()
        ],
        "",
    ]
    return lines


def _cell(text: str) -> str:
    """`text` on one line, cut to `CELL` characters, safe inside a Markdown table cell."""
    one_line = " ".join(text.split())
    cut = one_line if len(one_line) <= CELL else one_line[: CELL - 1] + "…"
    return cut.replace("|", "\\|").replace("`", "'") or "(empty)"
