"""Reading a test's own runs back from the session's Prefect server, which every test process
of the session records in: by the store the run was given, over every page."""

from __future__ import annotations

from pathlib import Path

PAGE = 200  # the server's largest page


def all_pages(read) -> list:
    """Everything `read(limit=, offset=)` returns, page after page."""
    items, offset = [], 0
    while page := read(limit=PAGE, offset=offset):
        items += page
        offset += len(page)
        if len(page) < PAGE:
            break
    return items


def flow_runs_of_store(client, store: Path) -> list:
    """The flow runs whose overrides set `store.root={store}`."""
    runs = all_pages(lambda limit, offset: client.read_flow_runs(limit=limit, offset=offset))
    return [r for r in runs if f"store.root={store}" in (r.parameters.get("overrides") or [])]
