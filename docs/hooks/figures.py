"""Measured figures, read from the committed results: a MkDocs hook, a check and a rewriter.

A page writes each measured figure between two comments that name where it comes from:

    <!--fig accelerator-v5e-peers-gemma3:train/8x512/sides/jaxtune-lora/mfu {:.1%}-->68.7%<!--/fig-->

`accelerator-v5e-peers-gemma3` is `benchmarks/results/accelerator-v5e-peers-gemma3.json`; the path walks
its keys (a list by index); the last part is the Python format of the value, after an optional unit
that converts it first (`gib`: bytes as GiB, `gb`: bytes as GB, `ms`: seconds as milliseconds,
`min`: seconds as minutes, `refused`: the GiB of temporaries that XLA:TPU's refusal names,
"... temporaries (24.91G) exceeds ...").
GitHub shows the text between the comments. The site's build renders every figure again from its
result and fails (`make docs` is strict) when the result or a key is missing, when the text differs
from what the result holds, or when the result says a newer one replaced it (`superseded_by`): a page
cannot quote a number its source does not hold. On the site each figure names its result, date and
machine when pointed at, and every page that cites results ends with a table of them. A result that keeps
a history (`suite.json`: `{"runs": [oldest, ..., newest]}`) is cited by its newest run, `runs/-1/...`, and
described by it.

`python docs/hooks/figures.py` checks every page; `--write` rewrites the texts from the results.
Standard library only: the docs environment installs no jaxtune.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ("README.md", "benchmarks/README.md", "docs/*.md")
FIGURE = re.compile(r"<!--fig (?P<result>[\w.-]+):(?P<path>[^\s>]+?)(?: (?P<form>[^>]*?))?-->(?P<text>.*?)<!--/fig-->")
REFUSED = re.compile(r"\(([\d.]+)G\) exceeds")


def _refused_gib(words: str) -> float:
    found = REFUSED.search(words)
    if not found:
        raise FigureError(f"{words!r} names no GiB that exceed the device's memory")
    return float(found[1])


UNITS = {
    "gib": lambda n: n / 2**30,
    "gb": lambda n: n / 1e9,
    "ms": lambda s: s * 1e3,
    "min": lambda s: s / 60,
    "refused": _refused_gib,
}


class FigureError(ValueError):
    """A figure whose result, key or text does not hold."""


@dataclass(frozen=True)
class Cited:
    """A figure on a page: the result it reads, the path to its value, and its format."""

    result: str
    path: str
    form: str

    def value(self, results: Path | None = None):
        value = load(results or RESULTS, self.result)
        if value.get("superseded_by"):
            raise FigureError(f"{self.result}.json is superseded by {value['superseded_by']}.json: cite that")
        walked = []
        for key in self.path.split("/"):
            walked.append(key)
            try:
                value = value[int(key)] if isinstance(value, list) else value[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise FigureError(f"{self.result}.json holds no {'/'.join(walked)}") from None
        return value

    def render(self, results: Path | None = None) -> str:
        value = self.value(results)
        unit, _, form = self.form.partition(" ")
        if unit in UNITS:
            value = UNITS[unit](value)
        else:
            form = self.form
        try:
            return (form or "{}").format(value)
        except (ValueError, TypeError) as error:
            raise FigureError(
                f"{self.result}:{self.path}: {value!r} does not take the format {form!r}: {error}"
            ) from None


@cache
def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    if not path.is_file():
        raise FigureError(f"no result {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return _load(path)


def cited(match: re.Match) -> Cited:
    return Cited(match["result"], match["path"], (match["form"] or "").strip())


def problems(text: str, where: str, results: Path | None = None) -> list[str]:
    """What does not hold in a page's figures, one line each naming the page, line and figure."""
    found = []
    for match in FIGURE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        figure = cited(match)
        try:
            rendered = figure.render(results)
        except FigureError as error:
            found.append(f"{where}:{line}: {error}")
            continue
        if rendered != match["text"]:
            found.append(
                f"{where}:{line}: {figure.result}:{figure.path} is {rendered!r} in its result, the page says "
                f"{match['text']!r} (python docs/hooks/figures.py --write)"
            )
    return found


def rewrite(text: str, results: Path | None = None) -> str:
    """The page with every figure's text rendered from its result."""
    return FIGURE.sub(lambda m: m[0].replace(f"-->{m['text']}<!--", f"-->{cited(m).render(results)}<!--", 1), text)


def newest(result: dict) -> dict:
    """The run a result describes: its newest where it keeps a history of runs, else itself."""
    runs = result.get("runs")
    return runs[-1] if isinstance(runs, list) and runs else result


def machine(result: dict) -> str:
    """The machine a result ran on, in a few words."""
    result = newest(result)
    where = result.get("provenance", {}).get("machine") or result.get("machine") or {}
    if isinstance(where, str):
        return where
    device = where.get("jax_device") or (where if "device_kind" in where else {})
    if device.get("platform") in ("tpu", "gpu"):
        return f"{device.get('devices', 1)} × {device['device_kind']}"
    cores, model = where.get("cores"), where.get("cpu_model")
    return f"{cores}-core {model} CPU" if cores else "not recorded"


def sources(names: list[str], results: Path | None = None) -> str:
    """The table of results a page cites: date, machine, commit and command, as each records them. Its links
    are as a page in docs/ writes them (the repo_links hook, after this one, turns them into the repository's)."""
    rows = ["| result | date | machine | commit | command |", "|---|---|---|---|---|"]
    for name in names:
        result = newest(load(results or RESULTS, name))
        made = result.get("provenance", {})
        command = made.get("command") or result.get("command") or "not recorded"
        rows.append(
            f"| [`{name}`](../benchmarks/results/{name}.json) | "
            f"{str(result.get('date', 'not recorded'))[:10]} | {machine(result)} | "
            f"{made.get('commit', 'not recorded')} | `{command}` |"
        )
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    where = page.file.src_uri
    found = problems(markdown, where)
    if found:
        raise FigureError("figures that do not hold their results:\n" + "\n".join(found))
    names = list(dict.fromkeys(match["result"] for match in FIGURE.finditer(markdown)))
    if not names:
        return markdown

    def shown(match: re.Match) -> str:
        result = newest(load(RESULTS, match["result"]))
        title = f"{match['result']}.json, {str(result.get('date', ''))[:10]}, {machine(result)}"
        return f'<span class="figure" title="{title}">{match["text"]}</span>'

    table = sources(names)
    return FIGURE.sub(shown, markdown) + f"\n\n## Where these figures come from\n\n{table}\n"


def pages() -> list[Path]:
    return sorted({path for pattern in PAGES for path in ROOT.glob(pattern)})


def main(argv: list[str]) -> int:
    found = []
    for path in pages():
        text = path.read_text()
        if "--write" in argv and FIGURE.search(text):
            path.write_text(rewrite(text))
            text = path.read_text()
        found += problems(text, str(path.relative_to(ROOT)))
    print("\n".join(found) or f"every figure holds its result ({len(pages())} pages)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
