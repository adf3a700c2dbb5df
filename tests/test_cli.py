"""The command line: help, and config errors that exit 2 naming the key."""

import re
from pathlib import Path

import pytest

from jaxtune.cli.main import main


def test_help_lists_run_and_doctor(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # Each command on a line of its own with its own help ("run" alone would match launch's example).
    commands = dict(re.findall(r"^ {4}(\w+) +(\S.*)$", out, flags=re.MULTILINE))
    assert commands["run"].startswith("run the finetune flow")
    assert commands["doctor"].startswith("check a model's JAX numerics") and "exit 1 when parity fails" in out
    assert set(commands) >= {"run", "serve", "doctor", "chat", "generate", "launch"}


def test_run_help_names_every_stage(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for stage in ("tokenize", "baseline_eval", "train", "final_eval", "export", "generate", "report"):
        assert stage in out


def test_bad_override_exits_2_naming_the_key(capsys):
    assert main(["run", "--set", "train.batch_size=-1"]) == 2
    assert "train.batch_size" in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_doctor_on_a_missing_model_exits_2_naming_it(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_the_command_runs_under_a_fixed_hash_seed(monkeypatch):
    """Under a random seed, Gemma 3's `set(layer_types)` traces a differently ordered program in
    each process and the persistent compilation cache misses; the command re-executes itself once."""
    import os
    import sys

    from jaxtune.cli import main as cli

    execs = []

    def execv(executable, args):
        execs.append((executable, args, os.environ["PYTHONHASHSEED"]))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["jaxtune", "run", "--set", "train.max_steps=3"])
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    with pytest.raises(SystemExit):
        cli.entry()
    assert execs == [(sys.executable, [sys.executable, "-m", "jaxtune.cli", "run", "--set", "train.max_steps=3"], "0")]
    monkeypatch.setattr(cli, "main", lambda: 0)  # already fixed: runs in place
    with pytest.raises(SystemExit) as done:
        cli.entry()
    assert done.value.code == 0 and len(execs) == 1


PREFECT_YAML = str(Path(__file__).parents[1] / "prefect.yaml")


def test_serve_of_an_undeclared_deployment_exits_2_naming_those_declared(capsys):
    assert main(["serve", "--prefect-yaml", PREFECT_YAML, "--only", "no-such-deployment"]) == 2
    err = capsys.readouterr().err
    assert "declares no deployment no-such-deployment" in err and "offline-nightly" in err


def test_serve_builds_each_declared_deployment_with_its_schedule_and_recipe():
    from jaxtune.flows.serve import read_deployments, runner_deployments

    [nightly] = runner_deployments(read_deployments(PREFECT_YAML, only=["offline-nightly"]))
    assert nightly.name == "offline-nightly" and nightly.parameters == {"recipe": "offline"}
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    assert nightly.entrypoint == "jaxtune/flows/finetune.py:finetune"
    [restart] = nightly.triggers  # served, a crashed run is started again as with a work pool
    assert restart.name == "restart offline-nightly after a crash" and restart.expect == {"prefect.flow-run.Crashed"}
    assert restart.parameters["restart_of"] == "{{ flow_run.id | string }}"


def test_serve_builds_the_plan_deployments_with_the_plan_flow_and_the_hub_recipes_schedules():
    from jaxtune.flows.serve import read_deployments, runner_deployments

    deployments = {d.name: d for d in runner_deployments(read_deployments(PREFECT_YAML))}
    planned = deployments["gemma3-1b-dolly-lora-plan"]
    assert planned.flow_name == "plan" and planned.entrypoint == "jaxtune/flows/plan.py:plan"
    assert planned.parameters == {
        "recipe": "configs/gemma3-1b-dolly-lora.yaml",
        "then": "finetune/gemma3-1b-dolly-lora",
    }
    assert [s.schedule.cron for s in planned.schedules] == ["0 4 * * 6"] and not planned.triggers
    run = deployments["gemma3-1b-dolly-lora"]
    assert run.flow_name == "finetune" and not run.schedules  # queued by its plan, once the plan fits


def test_a_step_that_fits_no_device_exits_2_as_a_failure_that_repeats(monkeypatch, capsys):
    """What `jaxtune launch --ray` reads to leave a job unrestarted: status 2 for a plan refused, as for a config."""
    from jaxtune.checks import preflight
    from jaxtune.cli import main as cli
    from jaxtune.errors import PlanDoesNotFit
    from jaxtune.flows import finetune as flow
    from jaxtune.host import temporary_server
    from jaxtune.runtime.measures.fit import NothingFits

    assert issubclass(NothingFits, PlanDoesNotFit)

    def refused(**kwargs):
        raise NothingFits("train.remat=auto: no way of running 8 x 1024 fits v5e's 15.75 GiB", None)

    monkeypatch.setattr(preflight, "check", lambda config: None)
    monkeypatch.setattr(temporary_server, "start_guarded", lambda: None)
    monkeypatch.setattr(cli, "_console_without_tracebacks", lambda: None)
    monkeypatch.setattr(flow, "finetune", refused)
    assert main(["run"]) == 2
    assert "no way of running 8 x 1024 fits" in capsys.readouterr().err
