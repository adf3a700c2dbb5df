"""MkDocs hook: the site's home page is the repository's README.md, its links made relative to docs/."""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "<!-- readme -->"
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)\)")


def from_docs(target: str) -> str:
    """A README link as docs/index.md must write it: docs/x.md -> x.md, Makefile -> ../Makefile."""
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return target
    return target.removeprefix("docs/") if target.startswith("docs/") else f"../{target}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    readme = (Path(config.config_file_path).parent / "README.md").read_text()
    readme = LINK.sub(lambda m: f"{m.group(1)}{from_docs(m.group(2))})", readme)
    if MARKER not in markdown:
        raise ValueError(f"docs/index.md lost its {MARKER} line, where README.md goes")
    return readme  # the whole page: index.md's own line is for readers of the file, on GitHub
