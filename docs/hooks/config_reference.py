"""MkDocs hook: the config reference page, rendered from `jaxtune.config`'s pydantic models at build time.

Every key, type, default and description comes from the models themselves, so the page cannot
drift from what `jaxtune run` accepts. Only pydantic and PyYAML are needed to import the config.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- config-reference -->"
PAGE = "config.md"


def _config_module() -> types.ModuleType:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import jaxtune.config

    return jaxtune.config


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The section model a field holds (itself, or the items of a tuple of them), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and args and _model_in(args[0]):
        return args[0]
    return None


def type_name(annotation: object) -> str:
    """A YAML reader's name for a field's type: `lora | full`, `int or null`, `list of str`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{arg}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(named) + (" or `null`" if type(None) in args else "")
    if origin in (tuple, list):
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field) -> str:
    """The field's numeric and length bounds, as `> 0`, `< 1`."""
    signs = {
        annotated_types.Gt: ("> ", "gt"),
        annotated_types.Ge: ("≥ ", "ge"),
        annotated_types.Lt: ("< ", "lt"),
        annotated_types.Le: ("≤ ", "le"),
        annotated_types.MinLen: ("length ≥ ", "min_length"),
    }
    found = [signs[type(m)][0] + str(getattr(m, signs[type(m)][1])) for m in field.metadata if type(m) in signs]
    return ", ".join(found)


def yaml_value(value: object) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value) if value != "" else "''"


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default as YAML or "" when required, description) for every setting under `model`.

    A nested section's settings are listed under its key; a list of sections (data.sources) as key[].name.
    """
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        section = _model_in(field.annotation)
        if section is not None and typing.get_origin(field.annotation) is not tuple:
            out += rows(section, key)
            continue
        kind = type_name(field.annotation) if section is None else "list of mappings, keys below"
        limit = bounds(field)
        default = "" if field.is_required() else yaml_value(field.get_default(call_default_factory=True))
        out.append((key, kind + (f", {limit}" if limit else ""), default, field.description or ""))
        if section is not None:
            out += rows(section, f"{key}[]")
    return out


def _cell(text: str) -> str:
    """Text as one Markdown table cell, shown as written: `export/<key>` is no HTML tag, `a * b` no emphasis."""
    for raw, escaped in (("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;"), ("\n", " ")):
        text = text.replace(raw, escaped)
    return text


def reference_markdown() -> str:
    """The whole reference: one table per top-level section, with the section's docstring above it."""
    config = _config_module()
    parts = []
    for section, field in config.JaxtuneConfig.model_fields.items():
        model = field.annotation
        parts += [f"## `{section}`", ""]
        if model.__doc__ and model.__doc__ != BaseModel.__doc__:
            parts += [" ".join(model.__doc__.split()), ""]
        parts += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, kind, default, description in rows(model, section):
            shown = "`" + default.replace("|", "\\|") + "`" if default else "required"
            parts.append(f"| `{key}` | {kind} | {shown} | {_cell(description)} |")
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its {MARKER} line, where the generated reference goes")
    return markdown.replace(MARKER, reference_markdown())
