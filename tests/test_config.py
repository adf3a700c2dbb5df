"""Config: every shipped YAML loads; bad keys and values are errors that name the key."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from jaxtune.config import DEFAULT_CONFIG, JaxtuneConfig, load_config
from jaxtune.errors import ConfigError

SHIPPED = sorted(Path(__file__).parents[1].joinpath("configs").glob("*.yaml")) + [DEFAULT_CONFIG]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_names_its_command(path):
    config = load_config(path)
    assert isinstance(config, JaxtuneConfig)
    assert path.read_text().startswith("# jaxtune run")


def test_no_path_means_the_offline_demo():
    config = load_config()
    assert config.model.name == "offline" and config.data.source == "offline"
    assert config.train.method == "lora"


def test_overrides_are_typed_by_yaml():
    config = load_config(None, ["train.max_steps=7", "lora.target_modules=[q_proj, v_proj]", "data.loss_on=all"])
    assert config.train.max_steps == 7
    assert config.lora.target_modules == ("q_proj", "v_proj")
    assert config.data.loss_on == "all"


def test_unknown_key_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError) as raised:
        load_config(bad)
    assert str(raised.value) == f"{bad}: train.max_stepz: unknown key; did you mean train.max_steps?"


def test_unparsable_yaml_is_one_line_with_the_1_based_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 3\n  lr: a: b\n")  # a second colon on line 3, its 8th character
    with pytest.raises(ConfigError) as raised:
        load_config(bad)
    assert str(raised.value) == f"{bad}: line 3, column 8: mapping values are not allowed here"


def test_a_yaml_error_without_a_position_keeps_its_first_line(tmp_path, monkeypatch):
    import yaml

    def fail(text):
        raise yaml.YAMLError("the reader gave up\nsecond line")

    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {}\n")
    monkeypatch.setattr(yaml, "safe_load", fail)
    with pytest.raises(ConfigError) as raised:
        load_config(bad)
    assert str(raised.value) == f"{bad}: the reader gave up"


def test_an_unknown_key_far_from_any_lists_the_section_keys():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["export.zzz=1"])
    assert str(raised.value) == "--set: export.zzz: unknown key; export has dtype, merge, gguf"


def test_an_override_whose_value_is_not_yaml_is_one_line_naming_it():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["train.max_steps=[3"])
    assert str(raised.value) == (
        "--set 'train.max_steps=[3': the value is not YAML "
        "(line 1, column 3: expected ',' or ']', but got '<stream end>')"
    )


def test_each_bad_setting_is_one_line_naming_its_key_and_the_value_given():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["train.learning_rate=-0.1", "train.batch_size=eight"])
    assert str(raised.value).splitlines() == [
        "--set: train.learning_rate: Input should be greater than 0 (got -0.1)",
        "--set: train.batch_size: Input should be a valid integer, unable to parse string as an integer (got 'eight')",
    ]


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"train\.method"):
        load_config(None, ["train.method=adapters"])
    with pytest.raises(ConfigError, match=r"data\.eval_fraction"):
        load_config(None, ["data.eval_fraction=1.5"])


def test_model_and_data_pair_freely():
    own_data = load_config(None, ["data.source=rows.jsonl"])  # the offline model, its tokenizer trained on rows.jsonl
    assert own_data.model.name == "offline" and own_data.data.source == "rows.jsonl"
    assert own_data.lora.r == 64  # still the offline demo's settings: the model is the offline one
    real_model = load_config(None, ["model.name=models/smol.gguf"])
    assert real_model.data.source == "offline"


def test_a_real_model_without_a_config_gets_the_recipe_defaults_not_the_toys():
    config = load_config(None, ["model.name=google/gemma-3-1b-it"])
    assert (config.lora.r, config.lora.alpha, config.lora.modules_to_save) == (8, 16, ())
    assert config.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert config.train.learning_rate == 1e-4 and config.train.method == "lora"
    assert config.model.compute_dtype == "bfloat16"
    offline = load_config(None, [])
    assert (offline.lora.r, offline.train.learning_rate) == (64, 3e-3)  # the offline YAML


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        config.train.max_steps = 3


def test_lora_targets_are_names_or_all_linear():
    assert load_config(None, ["lora.target_modules=all-linear"]).lora.target_modules == "all-linear"
    with pytest.raises(ConfigError, match=r"lora\.target_modules"):
        load_config(None, ["lora.target_modules=every-layer"])


def test_architecture_and_optimizer_are_checked():
    assert load_config(None, ["model.tiny.architecture=gpt2"]).model.tiny.architecture == "gpt2"
    with pytest.raises(ConfigError, match=r"model\.tiny\.architecture"):
        load_config(None, ["model.tiny.architecture=bert"])
    with pytest.raises(ConfigError, match=r"train\.optimizer"):
        load_config(None, ["train.optimizer=lion"])


def test_every_family_in_the_config_has_a_tiny_config():
    from jaxtune.config import ARCHITECTURES
    from jaxtune.offline.architectures import FAMILIES

    assert tuple(FAMILIES) == ARCHITECTURES


DEPLOYMENTS = Path(__file__).parents[1] / "prefect.yaml"


def test_every_recipe_has_a_deployment_that_names_its_file():
    """prefect.yaml names each recipe's file, the one place its settings are written."""
    import yaml

    from jaxtune.flows.finetune import finetune, load_recipe
    from jaxtune.flows.plan import plan
    from jaxtune.flows.ray_job import ray_job

    root = Path(__file__).parents[1]
    deployments = {d["name"]: d for d in yaml.safe_load(DEPLOYMENTS.read_text())["deployments"]}
    recipes = sorted(root.joinpath("configs").glob("*.yaml"))
    for path in recipes:
        parameters = deployments[path.stem]["parameters"]
        assert parameters == {"recipe": f"configs/{path.name}"}, path.name
        assert load_recipe(str(root / parameters["recipe"])) == load_config(path)
    assert deployments["offline-nightly"]["parameters"] == {"recipe": "offline"}
    local = (".gguf", ".yaml")  # a pip-installed checkpoint, an earlier run's recipe
    hub = {p.stem for p in recipes if (name := load_config(p).model.name) != "offline" and not name.endswith(local)}
    assert hub == {"gemma3-1b-dolly-lora", "gemma3-1b-dolly-full-adafactor", "llama3.2-1b-dolly-lora"}
    named = {p.stem for p in recipes} | {"offline-nightly", "ray-offline"} | {f"{stem}-plan" for stem in hub}
    assert set(deployments) == named
    for name, deployment in deployments.items():  # what the flow accepts, as the UI's form will send it
        flow = plan if name.endswith("-plan") else ray_job if name == "ray-offline" else finetune
        validated = flow.validate_parameters(deployment["parameters"])
        assert {name: validated[name] for name in deployment["parameters"]} == deployment["parameters"]
        assert deployment["entrypoint"] == f"{flow.fn.__module__.replace('.', '/')}.py:{flow.fn.__name__}"
    for stem in hub:  # written for accelerators: the schedule runs the plan, which queues the run if it fits
        assert deployments[f"{stem}-plan"]["parameters"] == {
            "recipe": f"configs/{stem}.yaml",
            "then": f"finetune/{stem}",
        }
        assert deployments[f"{stem}-plan"]["schedules"] and not deployments[stem].get("schedules")


def test_the_renamed_train_on_prompt_names_its_replacement():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["data.train_on_prompt=true"])
    assert str(raised.value) == (
        "--set: data.train_on_prompt: renamed; use data.loss_on=all (true) or data.loss_on=all_assistant (false)"
    )


def test_scan_layers_auto_stacks_the_layers_over_a_quantized_base_only():
    from jaxtune.config import ModelConfig

    assert ModelConfig().scan_layers == "auto" and not ModelConfig().layers_stacked
    assert all(ModelConfig(base_quantization=q).layers_stacked for q in ("int8", "int4", "nf4", "gguf"))
    assert ModelConfig(scan_layers=True).layers_stacked
    assert not ModelConfig(scan_layers=False, base_quantization="nf4").layers_stacked
