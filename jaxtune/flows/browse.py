"""Artifacts a person browses in the Prefect UI beside the report: where each stage's output is.

Each stage gets a markdown artifact naming its state, key, store folder and files, and the run
gets one table of all its stages. Keys come from `jaxtune.tracking.ui.artifact_key`, so each
deployment's artifacts keep their history in the UI.
"""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from jaxtune.artifacts import MANIFEST, ArtifactRef
from jaxtune.tracking import ui


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def stage_markdown(ref: ArtifactRef, state: str) -> str:
    manifest = ref.read_json(MANIFEST)
    files = manifest["files"]
    lines = [
        f"# {ref.stage}: {state}",
        "",
        f"- key: `{ref.key}`",
        f"- folder: `{ref.path}`",
        f"- created: {manifest['created_at']}",
        f"- inputs: {', '.join(f'{name} `{key}`' for name, key in manifest['inputs'].items()) or 'none'}",
        "",
        "| file | size |",
        "|---|---|",
        *[f"| `{name}` | {_size(entry['bytes'])} |" for name, entry in sorted(files.items())],
    ]
    return "\n".join(lines)


def publish_stage(ref: ArtifactRef, state: str) -> None:
    create_markdown_artifact(
        key=ui.artifact_key(f"stage-{ref.stage}"),
        markdown=stage_markdown(ref, state),
        description=f"{ref.stage} {state}: {ref.path}",
    )


def publish_stages(done: dict[str, ArtifactRef], states: dict[str, str]) -> None:
    rows = [
        {"stage": stage, "state": states.get(stage, ""), "key": ref.key, "folder": ref.path}
        for stage, ref in done.items()
    ]
    create_table_artifact(
        key=ui.artifact_key("stages"), table=rows, description="every stage of this run and its store folder"
    )
