"""The documentation: a short README, a site whose nav names only pages that exist, and a config
reference that covers every key `jaxtune run` reads. Cheap: no MkDocs build (that is `make docs`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml
from pydantic import BaseModel

from jaxtune.config import JaxtuneConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
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
