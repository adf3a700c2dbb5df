"""python -m benchmarks.accelerator.bench --tiny: every part of the accelerator benchmark runs on this CPU and its
figures hold together, so the benchmark cannot rot between the runs on a real accelerator."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_flops import counted_keys

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
ACCELERATOR = BENCHMARKS / "accelerator"
SIDES = ("jaxtune-lora", "jaxtune-full", "torch-eager", "torch-compile")
# Both sides compute the step-0 loss in float32 on the same weights and batch, summing in different orders
# (jaxtune's chunked loss and fused attention): about sqrt(terms) x float32's 6e-8, 1e-6 over the tiny model's
# few thousand terms per token (7.6e-8 seen). A wrong input moves it far more: on these weights, masking 5
# tokens of 32 moves the loss 1.3e-3 relatively, labels shifted by one more position 2e-2.
# Tunix's side holds to the same bound (2.3e-7 seen): its own Gemma 3 on the same weights, its einsum attention and
# whole-logits loss summing in yet another order. Its toy model scaling queries by 1/sqrt(256) where the others took
# 1/sqrt(head_dim) moved its loss 1.2e-3.
LOSS_TOLERANCE = 1e-5
PARTS = ("jaxtune", "torch-eager", "torch-compile")


@pytest.fixture(scope="module")
def tunix_site(tmp_path_factory) -> tuple[Path | None, str]:
    """(site folder, "") holding Tunix's side (TUNIX_SITE where it holds it), or (None, why not). Not in the test
    extra: google-tunix asks for safetensors<0.8 (jaxtune >=0.8) and datasets stacks its step never imports; so
    benchmarks/accelerator/tunix_requirements.txt's 9 pins, without dependencies, from the package index
    (8.8 MiB, 2 s)."""
    given = os.environ.get("TUNIX_SITE")
    if given and (Path(given) / "tunix").is_dir():
        return Path(given), ""
    site = tmp_path_factory.mktemp("tunix-site")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-compile",
            "--target",
            str(site),
            "-r",
            str(ACCELERATOR / "tunix_requirements.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0:
        return None, f"Tunix's packages did not install: {run.stderr.strip().splitlines()[-1:]}"
    return site, ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tunix_site) -> tuple[dict, str]:
    stem = tmp_path_factory.mktemp("accelerator") / "tiny"
    site, _ = tunix_site
    env = (
        {**os.environ, "TUNIX_SITE": str(site)} if site else {k: v for k, v in os.environ.items() if k != "TUNIX_SITE"}
    )
    run = subprocess.run(
        # 14 of the 15 minutes the test waits, not --tiny's 10: each part's limit is its share of the time
        # left, and on a loaded 2-core machine torch-eager's share of 10 (48 s) once cut it short
        [sys.executable, "-m", "benchmarks.accelerator.bench", "--tiny", "--profile", "--minutes", "14"]
        + ["--out", str(stem)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(Path(f"{stem}.json").read_text()), Path(f"{stem}.md").read_text()


@pytest.mark.slow
def test_every_part_runs_and_measures_every_case(tiny):
    report, md = tiny
    assert {name: part["status"] for name, part in report["parts"].items() if name in PARTS} == dict.fromkeys(
        PARTS, "done"
    )
    assert len(report["train"]) == len(report["settings"]["cases"])
    made = report["provenance"]  # what the docs name beside a figure they quote from it
    assert made["command"].startswith("python -m benchmarks.accelerator.bench --tiny --profile --minutes 14 --out ")
    assert (
        made["commit"].split()[0]
        == subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], text=True).strip()
    )
    # jaxtune's own load lines, one a method: the torch and Tunix sides log theirs too, without one
    assert set(report["loaded"]) == {"lora", "full"} and all(v["seconds"] > 0 for v in report["loaded"].values())
    # where the time before each method's first step went, phase by phase, in the report and as it happened
    for method, phases in report["time_to_first_step"].items():
        assert {"weights_built", "traced", "lowered", "compiled", "first_step_run"} <= set(phases), method
        assert "read_and_placed" in phases or {"read", "placed"} <= set(phases), method
    assert "Time to the first step, phase by phase:" in md and "- lora, first case 8x32: weights built" in md
    for case, result in report["train"].items():
        for side in SIDES:
            figures = result["sides"][side]
            assert figures["tokens_per_second"] > 0 and figures["first_step_seconds"] > 0, (case, side)
            assert len(figures["step_times"]) == report["settings"]["steps"], (case, side)
            assert figures["peak_bytes"] > 0 and figures["memory_source"], (case, side)
        assert result["sides"]["jaxtune-lora"]["plan_peak_bytes"] > 0
        assert {"jaxtune_vs_torch-eager", "jaxtune_vs_torch-compile"} <= set(result["ratios"])
        assert f"| LoRA {case}: tokens/s |" in md
    assert report["settings"]["compile_backend"] == "aot_eager" and "torch.compile backend aot_eager" in md
    assert "| case | jaxtune | PyTorch eager | torch.compile | Tunix |" in md and "PyTorch/XLA: not measured" in md


@pytest.mark.slow
def test_profile_breaks_every_jaxtune_case_down(tiny):
    """--profile: 3 more steps of each jaxtune case under jax.profiler, their device time by category (the
    chunked loss and the optimizer among them, by their name scopes), in the report."""
    report, md = tiny
    assert "## Step breakdown" in md
    for case, result in report["train"].items():
        for side in ("jaxtune-lora", "jaxtune-full"):
            found = result["sides"][side]["profile"]
            rows = {r["category"]: r for r in found["rows"]}
            assert found["steps"] == 3 and found["hlo"] == ["train_step.hlo"], (case, side)
            assert rows["matmuls"]["seconds"] > 0 and rows["matmuls"]["flops"] > 0, (case, side)
            assert rows["loss"]["seconds"] > 0 and rows["optimizer"]["seconds"] > 0, (case, side)
            assert sum(r["share"] for r in found["rows"]) == pytest.approx(1.0), (case, side)
            assert found["program_flops"] >= rows["matmuls"]["flops"], (case, side)
            assert Path(found["trace"]).is_relative_to(Path(report["settings"]["profile"]) / f"{side}-{case}")
            assert f"### {side} {case}: the timed steps' median" in md and "| matmuls |" in md


@pytest.mark.slow
def test_tunix_runs_every_case_from_the_same_weights(tiny, tunix_site):
    """Tunix's LoRA step on the same weights and batches: timed like the others, and its step-0 loss that of the same
    model (qwix, as PEFT, starts LoRA's B at zero). Its adapters' A is drawn otherwise, so later losses may differ."""
    site, why = tunix_site
    if site is None:
        pytest.skip(why)
    report, md = tiny
    assert report["parts"]["tunix"]["status"] == "done"
    assert report["machine"]["tunix_device"]["google-tunix"] and "Tunix's side: google-tunix" in md
    for case, result in report["train"].items():
        figures = result["sides"]["tunix"]
        assert figures["tokens_per_second"] > 0 and len(figures["step_times"]) == report["settings"]["steps"], case
        assert figures["mfu"] == pytest.approx(
            figures["tokens_per_second"] * figures["flops_per_token"] / report["peak"]["peak_flops"]
        )
        assert math.isfinite(figures["step0_loss"]) and result["step0_loss_rel_diff"]["tunix"] < LOSS_TOLERANCE, (
            case,
            figures,
        )
        assert result["ratios"]["jaxtune_vs_tunix"] > 0
        # Its memory plan, as jaxtune's: the step's arguments alone hold every weight of the model.
        assert figures["plan_peak_bytes"] > report["parameters"] * 2, figures
        # ... taken from the program the steps ran, not compiled again (0.013 s against a 0.73 s first step here)
        assert figures["plan_seconds"] < figures["first_step_seconds"] / 5, figures


@pytest.mark.slow
def test_step0_loss_agrees_with_pytorch(tiny):
    report, _ = tiny
    for case, result in report["train"].items():
        losses = {side: result["sides"][side]["step0_loss"] for side in SIDES}
        assert all(math.isfinite(v) for v in losses.values()), losses
        for side in ("torch-eager", "torch-compile"):
            assert result["step0_loss_rel_diff"][side] < LOSS_TOLERANCE, (case, side, losses)
        # both methods start from the same base weights: the same loss before any update
        assert losses["jaxtune-full"] == pytest.approx(losses["jaxtune-lora"], rel=LOSS_TOLERANCE)


@pytest.mark.slow
def test_decoded_tokens_match_generate(tiny):
    report, _ = tiny
    decode, settings = report["decode"], report["settings"]
    ours, theirs = decode["jaxtune"]["tokens"], decode["torch_generate"]["tokens"]
    assert ours == theirs and decode["tokens_identical"]
    assert [len(row) for row in ours] == [settings["new_tokens"]] * settings["prompts"]
    assert decode["jaxtune"]["new_tokens_per_second"] > 0 and decode["jaxtune_vs_generate"] > 0
    # Decoding again at each larger batch, from the same first prompts: one row per batch, the first the one above.
    batches = decode["jaxtune_batches"]
    assert [b["prompts"] for b in batches] == [settings["prompts"], *settings["decode_batches"]]
    assert batches[0]["new_tokens_per_second"] == decode["jaxtune"]["new_tokens_per_second"]
    weights = decode["jaxtune"]["weight_bytes"]
    assert all(b["weight_bytes"] == weights > report["parameters"] * 4 * 0.99 for b in batches)  # float32 weights


@pytest.mark.slow
def test_mfu_follows_from_tokens_per_second_and_the_model_flops(tiny):
    report, _ = tiny
    peak, matmul = report["peak"]["peak_flops"], report["measured_matmul"]["flops_per_second"]
    assert matmul == pytest.approx(2 * report["measured_matmul"]["n"] ** 3 / report["measured_matmul"]["seconds"])
    config = json.loads((BENCHMARKS / "configs" / report["model"] / "config.json").read_text())
    shape = tiny_shape(report)
    for case, result in report["train"].items():
        length = int(case.split("x")[1])
        for side in SIDES:
            figures = result["sides"][side]
            achieved = figures["tokens_per_second"] * figures["flops_per_token"]
            assert figures["mfu"] == pytest.approx(achieved / peak, rel=1e-9)
            assert figures["mfu_vs_matmul"] == pytest.approx(achieved / matmul, rel=1e-9)
        # full fine-tuning: 6 FLOPs per matmul weight and token, attention 3 x 2 x 2 x keys x heads x head_dim per
        # layer, the keys each query's mask lets through (a sliding layer's at most its window)
        keys = sum(counted_keys([kind], shape["sliding_window"], length) for kind in shape["layer_types"])
        attention = 12 * keys * shape["num_attention_heads"] * shape["head_dim"]
        full = result["sides"]["jaxtune-full"]["flops_per_token"]
        assert full == pytest.approx(6 * shape["matmul_weights"] + attention, rel=1e-12), config["model_type"]
        assert (
            result["sides"]["torch-eager"]["flops_per_token"]
            == result["sides"]["jaxtune-lora"]["flops_per_token"]
            < full
        )


@pytest.mark.slow
def test_a_grpo_step_splits_into_sampling_the_update_and_the_rest(tiny):
    """--tiny runs the grpo section: every answer runs all its new tokens (the end token is past the vocabulary),
    the update reads every prompt and answer token, and the shares of the step add up."""
    report, md = tiny
    settings = report["settings"]
    assert report["grpo"] and "grpo" in settings["sections"]
    for case, fig in report["grpo"].items():
        n_prompts, generations, new_tokens = (int(n) for n in case.split("x"))
        answers = n_prompts * generations
        assert fig["answers"] == answers and fig["timed_steps"] == settings["steps"], case
        assert fig["truncated"] == 1.0 and fig["completion_length"] == new_tokens, case  # no end token emitted
        assert fig["sampled_tokens"] == answers * new_tokens, case
        assert fig["update_tokens"] == answers * (settings["grpo_prompt_length"] + new_tokens), case
        assert fig["sampling_tokens_per_second"] == pytest.approx(fig["sampled_tokens"] / fig["sample_seconds"])
        assert fig["update_tokens_per_second"] == pytest.approx(fig["update_tokens"] / fig["update_seconds"])
        shares = (fig["sample_share"], fig["update_share"], fig["rest_share"])
        assert all(0 < x < 1 for x in shares[:2]) and 0 <= shares[2] < 1 and sum(shares) == pytest.approx(1.0), shares
        assert fig["first_step_seconds"] > fig["step_seconds"] > 0 and fig["fit_seconds"] > 0, case
        assert fig["plan_peak_bytes"] > 0 and fig["remat"] in ("none", "matmuls", "layer") and fig["message"], case
        assert "weight_read_bound" not in fig  # no memory bandwidth known for a CPU
        assert f"| GRPO {case}: a step | " in md and "| no GRPO step | no GRPO step | no GRPO step |" in md
        assert f"| {case} | " in md.split("## A GRPO step (jaxtune)")[1]


def test_grpo_figures_sum_the_timed_steps_and_say_what_is_missing():
    """The figures of hand-made result lines: the first step and the warm-ups left out, seconds and tokens
    summed over the rest, the weight-read bound where the device's bandwidth is known; a cut case says why."""
    from benchmarks.accelerator.grpo import case_figures

    def step(i: int, sample: float, update: float, rest: float) -> dict:
        return {
            "event": "grpo_step",
            "case": "2x4x8",
            "step": i,
            "sample_seconds": sample,
            "update_seconds": update,
            "step_seconds": sample + update + rest,
            "tokens": 192,
            "completion_length": 8.0,
            "truncated": 1.0,
            "reward": 0.5,
        }

    lines = [
        {"event": "grpo", "case": "2x4x8", "answers": 8, "weight_bytes": 1000},
        step(1, 5.0, 5.0, 0.0),
        step(2, 9.0, 9.0, 9.0),
        step(3, 0.2, 0.5, 0.3),
        step(4, 0.6, 0.5, 0.1),
    ]
    fig = case_figures(lines, "2x4x8", warmups=1, parts={}, bandwidth=4000.0)
    assert (fig["first_step_seconds"], fig["first_sample_seconds"], fig["first_update_seconds"]) == (10.0, 5.0, 5.0)
    assert fig["timed_steps"] == 2
    assert fig["step_seconds"] == pytest.approx(1.1) and fig["sampled_tokens"] == 64
    assert fig["sampling_tokens_per_second"] == pytest.approx(128 / 0.8)
    assert fig["update_tokens_per_second"] == pytest.approx(384 / 1.0)
    shares = (fig["sample_share"], fig["update_share"], fig["rest_share"])
    assert shares == pytest.approx((0.8 / 2.2, 1.0 / 2.2, 0.4 / 2.2))
    assert fig["weight_read_bound"] == 8 * 4000 / 1000 and fig["sampling_of_bound"] == pytest.approx(160 / 32)
    cut = case_figures(
        lines[:3], "2x4x8", warmups=1, parts={"jaxtune": {"status": "cut at its limit of 60 s"}}, bandwidth=None
    )
    assert cut["missing"] == "not measured: jaxtune cut at its limit of 60 s" and cut["first_step_seconds"] == 10.0


@pytest.mark.slow
def test_tunix_side_builds_tunix_own_configs_of_the_published_shapes(tunix_site, monkeypatch):
    """From the shipped config.json alone, Tunix's side builds the configs Tunix ships for Gemma 3 1B and Llama 3.2 1B,
    and Gemma's layers alternate as Tunix's own pattern has them (Llama 3.2's RoPE scaling, which Tunix
    lacks, aside)."""
    import itertools

    site, why = tunix_site
    if site is None:
        pytest.skip(why)
    monkeypatch.setenv("TUNIX_SITE", str(site))
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_tunix puts the site folder first: gone after the test
    monkeypatch.setitem(sys.modules, "tunix", None)  # import_tunix's bare package, gone after the test
    from benchmarks.accelerator.shared import Settings, model_config
    from benchmarks.accelerator.tunix_side import import_tunix, tunix_config

    import_tunix()
    from tunix.models.gemma3 import model as gemma3
    from tunix.models.llama3 import model as llama3

    raw = model_config(Settings.make("gemma-3-1b", tiny=False)).to_dict()
    config, kinds = tunix_config(raw, "bfloat16")
    assert config == gemma3.ModelConfig.gemma3_1b_pt()
    assert kinds == tuple(itertools.islice(itertools.cycle(gemma3.GEMMA3_ATTENTION_PATTERN), 26))
    raw = model_config(Settings.make("llama-3.2-1b", tiny=False)).to_dict()
    assert tunix_config(raw, "bfloat16") == (llama3.ModelConfig.llama3p2_1b(), None)


def tiny_shape(report: dict) -> dict:
    """The tiny model's sizes, and its matmul weights counted from its modules: every Linear, and the
    (tied) output head once."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.accelerator.shared import Settings, model_config

    config = model_config(Settings.make(report["model"], tiny=True))
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    return {
        "num_attention_heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers,
        "sliding_window": getattr(config, "sliding_window", None),
        "matmul_weights": linear,
    }


def test_shipped_shapes_are_the_published_models():
    """The config-only folders build the published sizes (nothing downloaded: a meta-device model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    expected = {
        "gemma-3-1b": 999_885_952,
        "gemma-3-4b": 3_880_099_328,  # the text decoder of Gemma 3 4B and 12B, as published without the vision tower
        "gemma-3-12b": 11_765_788_416,
        # the text decoder of Gemma 3 27B as its published config builds it (the published 27.4B counts the vision
        # tower too)
        "gemma-3-27b": 27_009_002_240,
        "llama-3.1-8b": 8_030_261_248,  # as published for Llama 3.1 8B
        "llama-3.1-70b": 70_553_706_496,  # as published for Llama 3.1 70B
        "llama-3.2-1b": 1_235_814_400,
        "qwen2.5-0.5b": 494_032_768,
    }
    assert sorted(p.name for p in (BENCHMARKS / "configs").iterdir()) == sorted(expected)
    for name, parameters in expected.items():
        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(BENCHMARKS / "configs" / name))
        assert sum(p.numel() for p in module.parameters()) == parameters, name


def test_a_report_shows_only_what_the_run_asked_for_and_what_a_cut_case_did_run():
    """The v5e reports kept in benchmarks/unrecorded: a run of fixed policies alone has no auto column and no
    rows of sections it did not run; a case cut during its timed steps still shows its first step and the choice."""
    from benchmarks.accelerator.report import markdown

    results = BENCHMARKS / "unrecorded"
    fixed = markdown(json.loads((results / "accelerator-v5e-layer-2048.json").read_text()))
    assert "| case | remat layer |" in fixed and "auto (chosen)" not in fixed
    assert "not measured: jaxtune done" not in fixed and "greedy decode" not in fixed
    cut = markdown(json.loads((results / "accelerator-v5e-full.json").read_text()))
    assert "LoRA 8x512" not in cut
    row = next(line for line in cut.splitlines() if line.startswith("| full fine-tune 8x2048"))
    assert "first step ran in 321 s" in row and "layer, chunk 1024" in row and "cut at its limit" in row


def test_the_load_phases_follow_one_another_and_add_up_to_the_whole():
    """A quantized base reports its read and its quantizing (which overlaps the read): each phase is the seconds after
    the one before, and with placing the model they add up to the seconds it took to open."""
    from benchmarks.accelerator.jaxtune_model import load_phases

    assert load_phases({"read": 10.0, "quantized": 14.0}, 20.0) == {
        "read": 10.0,
        "quantized_after_read": 4.0,
        "placed": 6.0,
    }
    assert load_phases({"read": 3.0}, 5.0) == {"read": 3.0, "placed": 2.0}
    assert load_phases({}, 5.0) == {"read_and_placed": 5.0}


def test_a_few_layers_of_a_shape_keep_its_width():
    """--layers 2: the shape's first two layers at its own width, each a layer as in the whole (Gemma 3: its first
    two layer types)."""
    from benchmarks.accelerator.shared import Settings, model_config

    llama = model_config(Settings.make("llama-3.1-8b", False, layers=2))
    assert (llama.num_hidden_layers, llama.hidden_size, llama.intermediate_size) == (2, 4096, 14336)
    gemma = model_config(Settings.make("gemma-3-1b", False, layers=2))
    assert gemma.num_hidden_layers == 2 and len(gemma.layer_types) == 2 and gemma.hidden_size == 1152


def test_a_runs_recipe_overrides_reach_jaxtunes_side_through_its_children():
    """`--set model.scan_layers=true`: saved with the settings a child reads, applied to the recipe it runs."""
    from benchmarks.accelerator.jaxtune_model import recipe
    from benchmarks.accelerator.shared import Settings

    made = Settings.make("gemma-3-1b", tiny=True, overrides=("model.scan_layers=true", "train.remat=layer"))
    folder = Path(__import__("tempfile").mkdtemp())
    made.save(folder)
    loaded = Settings.load(folder)
    assert loaded == made and loaded.overrides == ("model.scan_layers=true", "train.remat=layer")
    cfg = recipe(loaded, "lora")
    assert (cfg.model.scan_layers, cfg.train.remat, cfg.model.dtype) == (True, "layer", "float32")
    assert recipe(Settings.make("gemma-3-1b", tiny=True), "lora").model.layers_stacked is False  # auto, a bf16 base


def test_a_remat_set_as_a_config_override_is_refused_naming_the_option_that_sets_it(capsys):
    """The train cases run each of --remat's policies (default auto), which would silently replace a
    `--set train.remat=...`: that is an error naming --remat."""
    from benchmarks.accelerator.bench import main

    with pytest.raises(SystemExit) as exit_:
        main(["--tiny", "--set", "train.remat=matmuls"])
    assert exit_.value.code == 2 and "--remat" in capsys.readouterr().err
