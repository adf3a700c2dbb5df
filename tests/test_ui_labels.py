"""Artifact keys: each flow run asks Prefect for its label once, however many artifacts it keys."""

from __future__ import annotations

from jaxtune.tracking import ui


def test_a_flow_run_asks_for_its_label_once(monkeypatch):
    asked = []
    monkeypatch.setattr(ui, "_asked_run_label", lambda: asked.append(1) or f"label-{len(asked)}")
    monkeypatch.setenv(
        "PREFECT__FLOW_RUN_ID", "11111111-1111-1111-1111-111111111111"
    )  # a run's process, outside any task
    keys = [ui.artifact_key(what) for what in ("report", "metrics", "stage-train")]
    assert keys == ["label-1-report", "label-1-metrics", "label-1-stage-train"] and len(asked) == 1
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "22222222-2222-2222-2222-222222222222")
    assert ui.artifact_key("report") == "label-2-report" and len(asked) == 2, "another run asks for its own"
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID")
    assert ui.artifact_key("report") == "label-3-report" and ui.artifact_key("report") == "label-4-report", (
        "outside a run nothing is remembered"
    )
