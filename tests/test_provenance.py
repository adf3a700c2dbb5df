"""Where a result comes from (benchmarks/common/harness.provenance): the commit, the command as typed, the
machine. A figure the docs quote names them (docs/hooks/figures.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import harness


def test_the_commit_is_the_checkouts_and_says_when_files_differ_from_it(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXTUNE_COMMIT", raising=False)
    head = subprocess.check_output(["git", "-C", str(harness.ROOT), "rev-parse", "--short=12", "HEAD"], text=True)
    changed = subprocess.check_output(["git", "-C", str(harness.ROOT), "status", "--porcelain", "-uno"], text=True)
    assert harness.commit() == head.strip() + (" + changes" if changed.strip() else "")
    monkeypatch.setenv("JAXTUNE_COMMIT", "0c969e4")  # named by whoever made the copy: it wins over a checkout's HEAD
    assert harness.commit() == "0c969e4"
    monkeypatch.setattr(harness, "ROOT", tmp_path)  # a copy without .git, as a TPU machine runs
    assert harness.commit() == "0c969e4"
    monkeypatch.delenv("JAXTUNE_COMMIT")
    assert harness.commit() == "not known (no git checkout, JAXTUNE_COMMIT unset)"


def test_the_command_is_the_module_run_from_the_root_with_its_arguments_quoted(monkeypatch):
    script = harness.ROOT / "benchmarks" / "accelerator" / "bench.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--cases", "8x1024", "--set", "lora.target_modules=[q, v]"])
    assert (
        harness.command() == "python -m benchmarks.accelerator.bench --cases 8x1024 --set 'lora.target_modules=[q, v]'"
    )
    made = harness.provenance()
    assert made["machine"]["cores"] > 0 and "versions" in made["machine"]
    assert "machine" not in harness.provenance(machine=False)


def test_a_fresh_clones_outputs_are_read_into_the_figures_a_result_keeps():
    from benchmarks.cpu import fresh_clone

    run = "JAX_PLATFORMS=cpu .venv/bin/jaxtune run\nbuild_model   Completed\ntrain         Cached\n/tmp/x/report/ab12\n"
    assert fresh_clone.stage_states(run) == {"build_model": "Completed", "train": "Cached"}
    pytest_tail = (
        "============ slowest 25 durations ============\n"
        "485.56s call     tests/targets/test_recipes_fit.py::test_the_recipe_fits_its_chip[gemma3-1b-dolly-lora]\n"
        "289.62s setup    tests/real/test_gemma3.py::TestGemma3::test_logits_match_pytorch\n"
        "1298 passed, 1 skipped, 303 warnings in 3361.25s (0:56:01)\n"
    )
    summary = fresh_clone.SUMMARY.search(pytest_tail)
    assert (summary["counts"], summary["seconds"]) == ("1298 passed, 1 skipped, 303 warnings", "3361.25")
    failed_tail = "FAILED tests/test_docs.py::test_figures - Assert\n1 failed, 1358 passed, 1 skipped in 2593.43s"
    failed = fresh_clone.SUMMARY.search(failed_tail)
    assert (failed["counts"], failed["seconds"]) == ("1 failed, 1358 passed, 1 skipped", "2593.43")
    assert [m["test"] for m in fresh_clone.FAILED.finditer(failed_tail)] == ["tests/test_docs.py::test_figures"]
    slow = [(m["seconds"], m["when"], m["test"].split("::")[0]) for m in fresh_clone.SLOW.finditer(pytest_tail)]
    assert slow == [
        ("485.56", "call", "tests/targets/test_recipes_fit.py"),
        ("289.62", "setup", "tests/real/test_gemma3.py"),
    ]


def test_a_fresh_clones_suite_run_is_appended_to_the_runs_before_it(tmp_path):
    from benchmarks.cpu import fresh_clone

    path = tmp_path / "suite.json"

    def run(seconds: float) -> dict:
        return {"date": f"day {seconds:g}", "provenance": {"commit": f"c{seconds:g}"}, "seconds": seconds}

    def history(*runs: dict) -> dict:  # the file is dated and attributed as its newest run
        return {"date": runs[-1]["date"], "provenance": runs[-1]["provenance"], "runs": list(runs)}

    assert fresh_clone.with_runs_before(path, run(1.0)) == history(run(1.0))
    path.write_text(json.dumps(run(1.0)))  # one run, as the file held before it kept a history
    assert fresh_clone.with_runs_before(path, run(2.0)) == history(run(1.0), run(2.0))
    path.write_text(json.dumps(history(run(1.0), run(2.0))))
    assert fresh_clone.with_runs_before(path, run(3.0)) == history(run(1.0), run(2.0), run(3.0))


def lacking_provenance(result: dict) -> list[str]:
    """What a result (or each run of one that keeps a history) does not record of its date, commit, command
    and machine: a field missing, empty, or 'not recorded ...'."""
    missing = []
    runs = result.get("runs")
    for run in runs if isinstance(runs, list) and runs else [result]:
        made = run.get("provenance") if isinstance(run.get("provenance"), dict) else {}
        fields = {
            "date": run.get("date"),
            "commit": made.get("commit"),
            "command": made.get("command"),
            "machine": made.get("machine") or run.get("machine"),
        }
        missing += [name for name, value in fields.items() if not value or str(value).startswith("not ")]
    return missing


def test_every_committed_result_records_its_date_commit_command_and_machine():
    """A figure the pages quote names where it comes from (docs/hooks/figures.py's table): a result that
    cannot say it is not committed. Runs that predate provenance and cannot be run again here (the v5e
    chip's) wait in benchmarks/unrecorded, cited nowhere. latest.json (`make bench`: 20 min on 2 idle
    cores) is the one left to measure again at a recorded commit; the count of the others is held at 0."""
    results = sorted((harness.ROOT / "benchmarks" / "results").glob("*.json"))
    without = {path.name: lacking_provenance(json.loads(path.read_text())) for path in results}
    without = {name: missing for name, missing in without.items() if missing}
    assert set(without) <= {"latest.json"}, f"{len(without)} of {len(results)} results lack provenance: {without}"
