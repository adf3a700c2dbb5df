"""MkDocs hook: links from a page to the repository's own files (`../configs/x.yaml`).

They work on GitHub as written, but lie outside the site. Each must name a file that exists (a
missing one is a warning, which `mkdocs build --strict` turns into a failure); the site shows
the link's text, or a link into the repository when mkdocs.yml sets `repo_url`.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def outside_docs(page_uri: str, target: str) -> str | None:
    """The repository path a page's relative link names when it leaves docs/, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    return None if joined.startswith("docs/") or joined.startswith("..") else joined


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config.config_file_path).parent
    repo_url = (config.repo_url or "").rstrip("/")

    def rewrite(match: re.Match) -> str:
        bang, text, target, anchor = match.groups()
        path = outside_docs(page.file.src_uri, target)
        if path is None:
            return match.group(0)
        if not (root / path).exists():
            log.warning("docs/%s links to %s, which is not in the repository", page.file.src_uri, path)
        if repo_url:
            return f"{bang}[{text}]({repo_url}/blob/main/{path}{anchor or ''})"
        return text

    return LINK.sub(rewrite, markdown)
