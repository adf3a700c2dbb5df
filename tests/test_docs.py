"""The documentation: a short README, a site whose nav names only pages that exist, and a config
reference that covers every key `jaxtune run` reads. Cheap: no MkDocs build (that is `make docs`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from jaxtune.config import JaxtuneConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in it looks its module up
    spec.loader.exec_module(module)
    return module


def _mkdocs_yml() -> dict:
    """mkdocs.yml, its `!!python/...` tags (the toc's slugify) read as nothing."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return [page for item in nav for page in _nav_pages(item)]


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every setting's dotted key, walked independently of the hook: sections nested, a list's items as key[]."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        inner = getattr(annotation, "__args__", (None,))[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _keys(annotation, f"{key}.")
            continue
        keys.append(key)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            keys += _keys(inner, f"{key}[].")
    return keys


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages(_mkdocs_yml()["nav"])
    assert [page for page in nav if not (DOCS / page).is_file()] == []
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md") if "hooks" not in path.parts}
    assert sorted(pages - set(nav)) == []


def test_readme_links_name_files_that_exist():
    targets = re.findall(r"\]\(([^)#\s]+)[^)]*\)", (ROOT / "README.md").read_text())
    local = [target for target in targets if "://" not in target]
    assert local, "the README links to its docs pages"
    assert [target for target in local if not (ROOT / target).exists()] == []


def test_config_reference_has_every_key_with_its_meaning():
    reference = _hook("config_reference").reference_markdown()
    rows = {
        match.group(1): match.group(2) for match in re.finditer(r"^\| `([^`]+)` \|.*\| ([^|]*) \|$", reference, re.M)
    }
    keys = _keys(JaxtuneConfig)
    assert len(keys) > 80
    assert [key for key in keys if key not in rows] == []
    assert [key for key in keys if not rows[key].strip()] == [], "every setting needs a Field(description=...)"


def test_config_reference_types_and_defaults():
    reference = _hook("config_reference").reference_markdown()
    assert "| `train.method` | `lora` \\| `full` | `lora` |" in reference
    assert "| `train.max_steps` | int or `null`, > 0 | `100` |" in reference
    assert "| `lora.target_modules` | list of str or `all-linear` | `[q_proj, k_proj, v_proj, o_proj]` |" in reference
    assert "| `data.sources[].source` | str | required |" in reference


def test_every_cited_figure_is_the_value_its_result_holds():
    figures = _hook("figures")
    cited = [path for path in figures.pages() if figures.FIGURE.search(path.read_text())]
    assert cited, "the pages cite their measured figures"
    assert [line for path in cited for line in figures.problems(path.read_text(), path.name)] == []


def _page(text: str):
    import types

    return types.SimpleNamespace(file=types.SimpleNamespace(src_uri="performance.md")), text


def test_a_figure_whose_result_or_key_is_gone_or_stale_fails_the_build(tmp_path):
    """What `make docs` sees: the hook raises, naming the page's line and the figure, for a result removed,
    a key missing, a value the text no longer shows and a result a newer one replaced."""
    import json
    import shutil

    figures = _hook("figures")
    figures.RESULTS = tmp_path
    shutil.copy(ROOT / "benchmarks" / "results" / "latest.json", tmp_path)
    page, text = _page("the ratio: <!--fig latest:ratios/mfu {:.2f}-->0.52<!--/fig-->, measured\n")
    assert figures.on_page_markdown(text, page, None, None).startswith(
        'the ratio: <span class="figure" title="latest.json, 2026-11-30, 2-core AMD EPYC CPU">0.52</span>, measured'
    )
    for broken, named in [
        (text.replace("ratios/mfu", "ratios/mfu_gone"), "latest.json holds no ratios/mfu_gone"),
        (text.replace(">0.52<", ">0.53<"), "latest:ratios/mfu is '0.52' in its result, the page says '0.53'"),
    ]:
        with pytest.raises(figures.FigureError, match=re.escape(f"performance.md:1: {named}")):
            figures.on_page_markdown(broken, page, None, None)
    assert figures.rewrite(text.replace(">0.52<", ">0.53<"), tmp_path) == text
    record = json.loads((tmp_path / "latest.json").read_text())
    figures._load.cache_clear()
    (tmp_path / "latest.json").write_text(json.dumps({**record, "superseded_by": "newer"}))
    with pytest.raises(figures.FigureError, match="latest.json is superseded by newer.json"):
        figures.on_page_markdown(text, page, None, None)
    figures._load.cache_clear()
    (tmp_path / "latest.json").unlink()
    with pytest.raises(figures.FigureError, match=re.escape("performance.md:1: no result")):
        figures.on_page_markdown(text, page, None, None)


def test_a_figure_reads_the_gib_a_compilers_refusal_names_and_fails_on_words_that_name_none(tmp_path):
    import json

    figures = _hook("figures")
    figures.RESULTS = tmp_path
    words = "the total memory required for HLO temporaries (24.91G) exceeds available HBM (15.75G)."
    (tmp_path / "plan.json").write_text(json.dumps({"tried": [{"refused": words}, {"refused": "some other error"}]}))
    page, text = _page("<!--fig plan:tried/0/refused refused {:.1f} GiB-->24.9 GiB<!--/fig-->")
    assert figures.problems(text, "p.md") == []
    with pytest.raises(figures.FigureError, match="names no GiB that exceed"):
        figures.on_page_markdown(text.replace("tried/0", "tried/1"), page, None, None)


def test_no_page_cites_the_newest_suite_run():
    """fresh_clone appends each run to results/suite.json: a figure of its newest run (runs/-1) would be
    outdated by the next recorded run, and that clone's suite would fail the figure check."""
    figures = _hook("figures")
    cited = [m.group(0) for path in figures.pages() for m in figures.FIGURE.finditer(path.read_text())]
    suite = [c for c in cited if "suite:" in c]
    assert suite and not [c for c in suite if "suite:runs/-" in c or "suite:date" in c or "suite:provenance" in c]
