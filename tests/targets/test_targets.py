"""Planning for accelerators this machine does not have: the train, eval and decode steps
compiled by libtpu for compile-only TPU devices, and by JAX's CUDA plugin for compile-only
NVIDIA GPUs, from a model's config alone (`jaxtune doctor MODEL --target`)."""

from __future__ import annotations

import contextlib
import re
import sys

import pytest

from jaxtune.cli import main as cli
from jaxtune.config import load_config
from jaxtune.runtime.devices import targets

pytestmark = pytest.mark.target

SEQUENCE = 64


@pytest.mark.parametrize(
    "name, topology, devices",
    [
        ("v5e-1", "v5e:1x1", 1),
        ("v5e-4", "v5e:2x2", 4),
        ("v5e-8", "v5e:2x4", 8),
        ("v6e-1", "v6e:1x1", 1),
        ("v6e-8", "v6e:2x4", 8),
        ("v5p-8", "v5p:2x2x1", 4),
        ("v4-8", "v4:2x2x1", 8),
        ("v5e:4x4", "v5e:4x4", 16),
    ],
)
def test_the_names_users_type_become_libtpu_topologies_of_that_many_devices(name, topology, devices):
    target = targets.resolve(name)
    assert target.topology == topology
    found = targets.devices(target)
    assert len(found) == devices and {d.platform for d in found} == {"tpu"}
    assert (
        found[0].device_kind
        == {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5", "v4": "TPU v4"}[target.chip.kind]
    )


@pytest.mark.parametrize(
    "name, kind, devices",
    [
        ("h100", "NVIDIA H100 80GB HBM3", 1),
        ("h200-8", "NVIDIA H200", 8),
        ("a100-4", "NVIDIA A100-SXM4-80GB", 4),
    ],
)
def test_gpu_names_become_compile_only_cuda_devices_with_jaxs_share_of_their_memory(name, kind, devices, monkeypatch):
    target = targets.resolve(name)
    found = targets.devices(target)
    assert len(found) == devices and {d.platform for d in found} == {"gpu"} and found[0].device_kind == kind
    # JAX's allocator takes 75% of a GPU unless told otherwise, and a run can use no more.
    memory = {"h100": 81559, "h200": 143771, "a100": 81920}[target.chip.kind] * 2**20
    assert target.chip.hbm == int(0.75 * memory)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert targets.resolve(name).chip.hbm == int(0.9 * memory)


def test_an_unknown_target_is_one_line_listing_the_known_ones_and_exit_status_2(capsys, tmp_path):
    # The model does not exist: had the target not been refused first, the error would be about the model.
    code = cli.main(["doctor", str(tmp_path / "no-model"), "--target", "v5e-3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == (
        "jaxtune doctor: unknown target 'v5e-3': use one of "
        + ", ".join(targets.KNOWN)
        + ", or a TPU topology such as v5e:2x4, v6e:4x4 or v5p:2x2x2 (GPUs: 1, 2, 4 or 8 on one host, as h100-4)"
    )


def test_without_libtpu_the_line_names_the_extra_to_install(capsys, monkeypatch, tiny_folder):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu raises ImportError
    code = cli.main(["doctor", str(tiny_folder), "--target", "v5e-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        "jaxtune doctor: planning for v5e-1 needs libtpu, which is not installed: pip install 'jaxtune[tpu-plan]'"
    ]


def test_without_the_cuda_plugin_the_line_names_the_extra_to_install(capsys, monkeypatch, tiny_folder):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda13", None)
    code = cli.main(["doctor", str(tiny_folder), "--target", "h100"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jaxtune doctor: planning for h100 needs JAX's CUDA plugin, "
        "which is not installed: pip install 'jaxtune[gpu-plan]'"
    ]


def _placed_model(folder, settings, target_name):
    from jaxtune.checks.doctor import as_trained
    from jaxtune.checks.target_plan import meta_model
    from jaxtune.runtime.devices.mesh import make_placement
    from jaxtune.runtime.modeling.model import to_jax

    config = load_config(None, settings)
    placement = make_placement(config.mesh, targets.devices(targets.resolve(target_name)))
    module = as_trained(meta_model(str(folder), None, False, "bfloat16"), config, randomize_lora=False)
    return config, to_jax(module, placement, shapes_only=True)


@pytest.fixture(scope="module")
def aligned_folder(tmp_path_factory):
    """A one-layer Llama whose every matrix is a whole number of XLA:TPU's (8, 128) tiles, so
    that a device's argument bytes are its shards' bytes and no padding."""
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("aligned-config")
    AutoConfig.for_model(
        "llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    return folder


def _argument_bytes(folder, method: str, mesh: list[str], target: str = "v5e:2x2") -> tuple[int, int]:
    """(the compiler's argument bytes per device of the train step on `target`, the bytes of what
    placement gives one device: weights, frozen tensors, optimizer state, batch rows, key and rate)."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.measures import memory

    config, model = _placed_model(
        folder, [f"train.method={method}", "train.batch_size=32", "lora.r=128", *mesh], target
    )
    optimizer = steps.make_optimizer(config.train)
    plan = steps.train_step_memory(model, optimizer, 1, 32, 128, steps.StepSpec("matmuls"))
    if model.placement.mesh.devices.flat[0].platform == "tpu":  # a compile-only GPU counts neither
        assert plan["flops"] > 0 and plan["code_bytes"] > 0
    opt_state = steps.optimizer_state_shapes(optimizer, model.weights, model.placement.replicated)
    # input_ids, attention_mask, segment_ids, position_ids and labels: int32, a device's share of 32 rows
    rows = 5 * (32 // model.placement.batch_shards) * 128 * 4
    placed = memory.device_bytes(model.weights) + memory.device_bytes(model.buffers) + memory.device_bytes(opt_state)
    return plan["argument_bytes"], placed + rows + 8 + 4


DATA4, FSDP4 = ["mesh.data=4"], ["mesh.data=1", "mesh.fsdp=4"]


KERNEL = """
import jax
from jax.experimental import pallas as pl


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def double(x):
    return pl.pallas_call(_double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
"""


def test_a_programs_key_is_the_same_wherever_its_kernels_source_is_installed(tmp_path):
    """A Pallas kernel's Mosaic bytecode names the file that traced it (splash attention's, under the
    environment's site-packages): the same program from two installs lowers to other text, yet takes the
    same key, so the plans a checkout records hold in a fresh clone, in CI and on a TPU machine."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxtune.runtime.devices import compile_cache

    devices = targets.devices(targets.resolve("v5e-1"))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=SingleDeviceSharding(devices[0]))
    texts, keys = [], []
    for install in ("one/site-packages", "another/lib/site-packages"):
        source = tmp_path / install / "kernel.py"
        source.parent.mkdir(parents=True)
        source.write_text(KERNEL)
        spec = importlib.util.spec_from_file_location(f"kernel_{len(keys)}", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        lowered = jax.jit(module.double).lower(x)
        texts.append(lowered.as_text())
        keys.append(compile_cache.program_key(lowered, devices))
    assert texts[0] != texts[1] and keys[0] == keys[1]
    doubled = jax.jit(lambda v: module.double(v) * 2).lower(x)  # another program: another key
    assert compile_cache.program_key(doubled, devices) != keys[0]


def test_a_plan_for_compile_only_devices_is_remembered_and_read_back_without_a_compile(
    aligned_folder, tmp_path, monkeypatch
):
    """A target's step is compiled only for its plan: planning the very same program again reads the
    plan remembered in the plans file instead of compiling for minutes, and gets the same figures; any
    other program, or other compiler flags, is compiled."""
    import json

    import jax

    from jaxtune.runtime.compiled import programs, steps
    from jaxtune.runtime.devices import compile_cache

    plans = tmp_path / "plans.json"
    monkeypatch.setenv(compile_cache.PLANS_FILE_VARIABLE, str(plans))
    config, model = _placed_model(aligned_folder, ["train.method=lora", *DATA4], "v5e:2x2")
    optimizer = steps.make_optimizer(config.train)
    compiles, compile = [], jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered, "compile", lambda self, *a, **k: compiles.append(self) or compile(self, *a, **k)
    )

    def plan(length: int) -> dict:
        programs.clear()  # as a new process would: nothing compiled in memory
        return steps.train_step_memory(model, optimizer, 1, 8, length, steps.StepSpec("matmuls"))

    first = plan(64)
    assert len(compiles) == 1 and len(json.loads(plans.read_text())) == 1
    assert first["peak_bytes"] > first["argument_bytes"] > 0 and first["flops"] > 0
    assert plan(64) == first and len(compiles) == 1  # read back, not compiled
    # The key: another program, or the same one under other compiler flags, is another compile.
    lowered, devices = compiles[0], list(model.placement.mesh.devices.flat)
    key = compile_cache.program_key(lowered, devices)
    programs.clear()
    spec = steps.StepSpec("matmuls")
    with model.env:
        longer = steps.shared_train_step(model, optimizer, spec).lower(
            model, *steps.train_step_arguments(model, optimizer, 1, 8, 128, spec)
        )
    assert compile_cache.program_key(longer, devices) != key
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
    assert compile_cache.program_key(lowered, devices) != key
    # Nothing of this machine's paths is in the key: a clone elsewhere finds the same records.
    assert str(compile_cache.Path(__file__).parents[2]) not in lowered.as_text()


def test_the_full_train_step_compiles_for_v5e_2x2_holding_the_shards_placement_gives_a_device(aligned_folder):
    """Measured: XLA:TPU's argument bytes are placement's to within 2,332 bytes of 13.4 MB on
    data=4 and of 3.4 MB on fsdp=4 (the 1-D norms and scalars, which XLA:TPU lays out in tiles of
    its own); fsdp=4 then holds 0.252 of data=4's state. A plan that ignored the mesh would hold it whole."""
    data, data_placed = _argument_bytes(aligned_folder, "full", DATA4)
    fsdp, fsdp_placed = _argument_bytes(aligned_folder, "full", FSDP4)
    assert abs(data - data_placed) <= 4096 and abs(fsdp - fsdp_placed) <= 4096, (data, data_placed, fsdp, fsdp_placed)
    assert fsdp <= 0.26 * data


def test_the_lora_train_step_compiles_for_v5e_2x2_with_its_frozen_weights_split_over_fsdp(aligned_folder):
    """Measured: fsdp=4 holds 0.444 of data=4's arguments (the frozen base split 4 ways, LoRA's
    float32 A and B and their moments too), and never more than placement gives the device: 1 MiB
    less on data=4 and 258 KiB less on fsdp=4, the size of the frozen embedding and output tables'
    shards, which XLA:TPU does not count as arguments of the LoRA step."""
    data, data_placed = _argument_bytes(aligned_folder, "lora", DATA4)
    fsdp, fsdp_placed = _argument_bytes(aligned_folder, "lora", FSDP4)
    assert data <= data_placed and fsdp <= fsdp_placed
    assert fsdp <= 0.5 * data


def test_the_full_train_step_for_two_h100s_holds_exactly_the_shards_placement_gives_a_gpu(aligned_folder):
    """XLA:GPU lays nothing out in tiles, so on fsdp=2 its argument bytes are placement's less
    exactly the 8,336 bytes jit leaves out because the step never reads them (measured; the same
    on data=2): a device's 16 x 128 attention mask (segment ids stand for it), the dropout key (no
    dropout), rotary's spare copy of its frequencies and two scalars of the optimizer state. A
    plan that ignored the mesh would hold every weight whole: 6.7 MB more."""
    fsdp, fsdp_placed = _argument_bytes(aligned_folder, "full", ["mesh.data=1", "mesh.fsdp=2"], "h100-2")
    assert fsdp_placed - fsdp == 16 * 128 * 4 + 8 + 32 * 4 + 2 * 4, (fsdp, fsdp_placed)


def test_the_eval_and_decode_steps_compile_for_v5e_2x2_holding_the_weight_shards_of_the_mesh(aligned_folder):
    """Their arguments are the weights as placed (a quarter of each matrix on fsdp=4), the frozen
    tensors, and the batch: eval rows split over the four devices, prompts whole (data=1 does not
    split them). Within 2,332 bytes, as the train step (XLA:TPU's tiles for the 1-D norms)."""
    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.decoding import decode
    from jaxtune.runtime.measures import memory

    config, model = _placed_model(aligned_folder, ["train.method=full", *FSDP4], "v5e:2x2")
    weights = memory.device_bytes(model.weights) + memory.device_bytes(model.buffers)
    assert memory.device_bytes(model.weights) < 0.26 * memory.tree_bytes(model.weights)
    evaluated = steps.eval_step_memory(model, 16, 128)
    assert abs(evaluated["argument_bytes"] - (weights + 4 * (16 // 4) * 128 * 4)) <= 4096, evaluated
    decoded = decode.generate_memory(model, 4, 64, 8)
    assert abs(decoded["argument_bytes"] - (weights + 2 * 4 * 64 * 4)) <= 4096, decoded
    # Decoding holds the KV cache, (rows, kv heads, prompt + new tokens, head dim) keys and values, bf16.
    assert decoded["temp_bytes"] >= 2 * 4 * 2 * (64 + 8) * 64 * 2


def test_on_a_tpu_mesh_attention_is_the_splash_kernel_run_per_device_and_on_a_gpu_flash(tiny_folder):
    """Each of the two layers' attention calls the splash kernel (a Pallas call for Mosaic, TPU's
    kernel compiler) inside a shard_map over the fsdp mesh; on one GPU, the flash kernel (a Pallas
    call for Triton) once per layer; forced to XLA's attention, neither does."""
    import jax
    import jax.numpy as jnp

    from jaxtune.runtime.compiled import steps
    from jaxtune.runtime.modeling import attention

    def kernels(target: str, choice: str | None = None) -> tuple[int, int, int, int]:
        config, model = _placed_model(tiny_folder, FSDP4 if target == "v5e:2x2" else [], target)
        rows = model.placement.batch_sharding
        batch = {name: jax.ShapeDtypeStruct((4, 128), jnp.int32, sharding=rows) for name in steps.BATCH_KEYS}
        with attention.choose(choice) if choice else contextlib.nullcontext():
            lowered = steps.shared_eval_step(model).lower(
                model, steps.shapes_of(model.weights), steps.shapes_of(model.buffers), batch, batch["input_ids"]
            )
        text = lowered.as_text()
        return (
            text.count("func.call @_splash_attention("),
            text.count("manual_computation"),
            text.count("@tpu_custom_call("),
            text.count("@__gpu$xla.gpu.triton("),
        )

    calls, per_device, pallas, triton = kernels("v5e:2x2")
    assert (calls, per_device, triton) == (2, 2, 0) and pallas >= 1
    assert kernels("h100") == (0, 0, 0, 2)
    assert kernels("v5e:2x2", "xla") == kernels("h100", "xla") == (0, 0, 0, 0)


def _tiny_plan(folder, capsys, target: str) -> str:
    """What `jaxtune doctor FOLDER --target TARGET` prints for 4 rows of SEQUENCE tokens, which fit."""
    code = cli.main(
        [
            "doctor",
            str(folder),
            "--target",
            target,
            "--set",
            "train.batch_size=4",
            "--set",
            f"data.max_length={SEQUENCE}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_a_step_that_fits_one_v5e_chip_says_so_with_the_compilers_estimate(tiny_folder, capsys):
    out = _tiny_plan(tiny_folder, capsys, "v5e-1")
    assert "XLA:TPU plan for v5e-1 (TPU v5e, topology v5e:1x1, 1 device), compiled here without them" in out
    assert (
        "15.75 GiB HBM  ok" in out
        and "roofline (estimate)" in out
        and out.rstrip().splitlines()[-1].startswith("fits:")
    )
    checks = [line.split()[0:3] for line in out.splitlines() if " memory, peak " in line and line.endswith("HBM  ok")]
    assert checks == [["train", "step", "memory,"], ["eval", "step", "memory,"], ["decode", "memory,", "peak"]], out


def test_the_tiny_models_steps_fit_one_h100_as_xla_gpu_plans_them(tiny_folder, capsys):
    out = _tiny_plan(tiny_folder, capsys, "h100")
    assert "XLA:GPU plan for h100 (1 x NVIDIA H100 80GB HBM3, 59.74 GiB each to JAX), compiled here without them" in out
    rows = [line for line in out.splitlines() if " memory, peak " in line]
    assert len(rows) == 3 and all(line.endswith("59.74 GiB HBM  ok") for line in rows), out
    assert "roofline" not in out  # a compile-only GPU counts no flops


def test_a_full_fine_tune_too_big_for_one_v5e_chip_is_a_fail_line_with_the_figures(tmp_path, capsys):
    """A 2-layer model with a 6144-wide, 262k-token embedding, fully fine-tuned: 1.6e9 float32
    master weights and Adam's two moments are 18 GiB before any gradient or activation (at 4096
    wide, XLA:TPU fits the same step in 14.2 GiB by never holding every gradient at once)."""
    from transformers import AutoConfig

    AutoConfig.for_model(
        "llama",
        vocab_size=262144,
        hidden_size=6144,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    code = cli.main(
        [
            "doctor",
            str(tmp_path),
            "--target",
            "v5e-1",
            "--set",
            "train.method=full",
            "--set",
            "train.batch_size=1",
            "--set",
            "data.max_length=16",
        ]
    )
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("train step memory, peak"))
    assert code == 1, out
    assert row.endswith("15.75 GiB  FAIL") or row.endswith("15.75 GiB HBM  FAIL"), row
    assert out.rstrip().splitlines()[-1] == "MEMORY: a step does not fit the target as configured"
    assert re.search(r"HLO temporaries \((\d+\.\d+)G\) exceeds available HBM \(15\.75G\)", row), row
    advice = next(line for line in out.splitlines() if line.startswith("  to fit")).split(maxsplit=2)[2]
    named = re.match(
        r"(v5e-\d+) fits: (\d+\.\d+) GiB of 15\.75 GiB per device with "
        r"(mesh\.data=1, mesh\.fsdp=\d+, mesh\.tensor=\d+) \(compiled\)",
        advice,
    )
    assert named and "train.optimizer=adafactor" in advice, advice
    # The slice it names, on the mesh it names, plans the same train step within the chip's HBM.
    from jaxtune.checks.doctor import render
    from jaxtune.checks.target_plan import plan_for_target
    from jaxtune.config import config_from_dict

    settings = ["train.method=full", "train.batch_size=1", "data.max_length=16", *named[3].split(", ")]
    again = plan_for_target(
        str(tmp_path), config_from_dict({}, settings), named[1], train_only=True
    )  # as the doctor reads --set
    assert again.ok and f"{named[2]} GiB with its code" in render(again), render(again)


def test_target_alone_plans_for_the_configs_plan_target_which_no_stage_key_hashes(tiny_folder, tmp_path, capsys):
    from jaxtune.flows.finetune import planned_keys

    assert cli.main(["doctor", str(tiny_folder), "--target"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxtune doctor: --target names no accelerator and the config sets no "
        "plan.target: give one, e.g. --target v5e-1"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("plan:\n  target: v5e-4\ntrain:\n  batch_size: 4\ndata:\n  max_length: 64\n")
    code = cli.main(["doctor", str(tiny_folder), "--config", str(recipe), "--target"])
    out = capsys.readouterr().out
    assert code == 0 and "XLA:TPU plan for v5e-4 (TPU v5e, topology v5e:2x2, 4 devices)" in out, out
    assert "data=4, fsdp=1, tensor=1 on 4 devices" in out
    store = [f"store.root={tmp_path / 'store'}"]
    assert planned_keys(load_config(None, store)) == planned_keys(load_config(None, [*store, "plan.target=v5e-8"]))


def test_a_gguf_files_header_gives_the_meta_model_without_reading_its_tensors(tmp_path):
    """SmolLM2-135M's GGUF file (pip-installed): the architecture and every shape from its header,
    on the meta device, so planning a quantized checkpoint dequantizes nothing."""
    from jaxtune.checks.target_plan import meta_model
    from jaxtune.offline.checkpoints import place_smollm2

    module = meta_model(str(place_smollm2(tmp_path)), None, False, "bfloat16")
    config = module.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert all(p.is_meta and p.dtype.is_floating_point for p in module.parameters())
    assert sum(p.numel() for p in module.parameters()) == 134_515_008
    # The header is read once a process: a second model from it is built from the config read then,
    # a copy, so that a change to one model's config reaches neither the cache nor the next.
    from jaxtune.checks.target_plan import _gguf_config

    module.config.num_hidden_layers = 2
    hits = _gguf_config.cache_info().hits
    again = meta_model(str(place_smollm2(tmp_path)), None, False, "bfloat16")
    assert _gguf_config.cache_info().hits == hits + 1
    assert again.config.num_hidden_layers == 30 and len(again.model.layers) == 30
