"""The report's hardest examples: the eval rows whose loss fell least, or rose, from the baseline
eval to the final one (each row's mean token loss, from both evals' rows.json), with the final
model's answer where the generate stage decoded that row, and per category the share of rows
that got worse."""

from __future__ import annotations

import json
from collections import defaultdict

from jaxtune.artifacts import ArtifactRef

HARDEST = 5
CELL = 120  # characters of a prompt, reference or answer shown in a table cell


def hardest_examples(inputs: dict[str, ArtifactRef], count: int = HARDEST) -> dict | None:
    """The `count` rows whose loss changed least for the better, and the share of rows that got
    worse per category; None when an eval did not record its rows (preference pairs)."""
    from jaxtune.data.token_table import TokenTable
    from jaxtune.tasks.evaluate import ROWS

    if not (inputs["baseline_eval"].file(ROWS).is_file() and inputs["final_eval"].file(ROWS).is_file()):
        return None
    before = inputs["baseline_eval"].read_json(ROWS)["loss"]
    after = inputs["final_eval"].read_json(ROWS)["loss"]
    table = TokenTable(inputs["tokenize"].file("eval.arrow"))
    categories, prompts, references = (table.column(name) for name in ("category", "prompt_text", "response"))
    answers = [g["after"] for g in _generations(inputs["generate"])]  # the first eval rows, in order
    scored = [row for row, (b, a) in enumerate(zip(before, after)) if b is not None and a is not None]
    ranked = sorted(scored, key=lambda row: after[row] - before[row], reverse=True)[:count]
    rows = [{"row": row, "category": categories[row], "prompt": prompts[row], "reference": references[row],
             "generation": answers[row] if row < len(answers) else None, "baseline_loss": before[row],
             "final_loss": after[row], "change": round(after[row] - before[row], 6)} for row in ranked]
    return {"rows": rows, "compared": len(scored), "generated": len(answers),
            "worse_by_category": _worse_by_category(scored, before, after, categories)}


def _worse_by_category(scored: list[int], before: list, after: list, categories) -> dict:
    groups = defaultdict(list)
    for row in scored:
        groups[categories[row]].append(after[row] > before[row])
    return {c: {"rows": len(worse), "worse": sum(worse), "share": sum(worse) / len(worse)}
            for c, worse in sorted(groups.items())}


def _generations(ref: ArtifactRef) -> list[dict]:
    return [json.loads(line) for line in ref.file("generations.jsonl").read_text().splitlines()]


def hardest_lines(hardest: dict | None) -> list[str]:
    """The report's section: the table of rows, then the share that got worse per category."""
    if not hardest:
        return []
    lines = ["## Hardest examples", "",
             f"The {len(hardest['rows'])} of {hardest['compared']} eval rows whose loss (mean over the answer's tokens) "
             "fell least, or rose, from before training to after; the answer is the trained model's greedy one (the "
             f"generate stage decodes the first {hardest['generated']} eval rows).", "",
             "| row | category | prompt | reference | answer after | loss before | loss after |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['category']} | {_cell(r['prompt'])} | {_cell(r['reference'])} "
              f"| {_cell(r['generation']) if r['generation'] is not None else '(not generated)'} "
              f"| {r['baseline_loss']:.4f} | {r['final_loss']:.4f} |" for r in hardest["rows"]]
    lines += ["", "| category | eval rows | got worse | share |", "|---|---|---|---|",
              *[f"| {c} | {m['rows']} | {m['worse']} | {100 * m['share']:.1f}% |"
                for c, m in hardest["worse_by_category"].items()], ""]
    return lines


def _cell(text: str) -> str:
    """`text` on one line, cut to `CELL` characters, safe inside a Markdown table cell."""
    one_line = " ".join(text.split())
    cut = one_line if len(one_line) <= CELL else one_line[: CELL - 1] + "…"
    return cut.replace("|", "\\|").replace("`", "'") or "(empty)"
