"""`export.gguf`: a LoRA run on a tiny Llama (unscaled RoPE, the offline data's own BPE tokenizer)
exported as f16 and q8_0 GGUF files, read back by transformers' GGUF reader and opened by
`jaxtune chat`'s session; and a model the writer cannot write refused before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxtune.errors import ModelError
from tests.flows.toy import run_toy, states

pytestmark = [pytest.mark.gguf, pytest.mark.slow]

# As in tests/gguf_export: the f16 file computes what the merged float32 model computes with its
# matrices rounded to f16 (measured: the same logits; the bound allows float32's last bit), and
# q8_0 stays within 4x the 7.6e-3 measured on a model of this size.
SAME_ARITHMETIC = 1e-6
Q8_0_BOUND = 3e-2


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama with unscaled RoPE and a tokenizer trained on the offline data, as a model folder."""
    from jaxtune.data.rows import OFFLINE_DATA
    from tests.gguf_export.llama import save_tiny_llama

    rows = [json.loads(line) for line in OFFLINE_DATA.read_text().splitlines()]
    texts = [" ".join(str(v) for v in row.values()) for row in rows]
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), texts, 32, 2, 1, eos_id=1)


def _logits(folder: Path, ids: list[int], gguf_file: str | None = None, round_to=None) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32).eval()
    if round_to is not None:
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.data = parameter.data.to(round_to).float()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_a_lora_run_writes_each_gguf_type_that_reads_back_as_its_merged_model(llama, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from jaxtune.cli.chat import open_session, prompt_ids
    from jaxtune.runtime.measures.parity import torch_greedy

    store = tmp_path / "store"
    result = run_toy(store, f"model.name={llama}", "export.merge=true", "export.gguf=[f16, q8_0]", until="report")
    assert states(result)["export"] == "Completed"
    (export,) = (store / "export").iterdir()
    info = json.loads((export / "export.json").read_text())
    gguf = export / "gguf"
    assert [(f["file"], f["type"]) for f in info["gguf"]] == [("llama-f16.gguf", "f16"), ("llama-q8_0.gguf", "q8_0")]
    assert sorted(p.name for p in gguf.iterdir()) == [
        "llama-f16.Modelfile",
        "llama-f16.gguf",
        "llama-q8_0.Modelfile",
        "llama-q8_0.gguf",
    ]
    assert [f["bytes"] for f in info["gguf"]] == [(gguf / f["file"]).stat().st_size for f in info["gguf"]]
    assert not any(p.name.startswith(".") for p in export.iterdir())  # the float32 source folder is gone
    assert (gguf / "llama-f16.Modelfile").read_text().startswith("FROM ./llama-f16.gguf\n")
    report = next((store / "report").glob("*/report.md")).read_text()
    assert f"| `{gguf / 'llama-q8_0.gguf'}` | q8_0 | {info['gguf'][1]['bytes'] / 2**20:,.1f} MiB |" in report

    tokenizer = AutoTokenizer.from_pretrained(export / "merged")
    ids = tokenizer.encode("Which river runs through the city of the example?")
    merged = _logits(export / "merged", ids)
    base = _logits(llama, ids)
    assert np.abs(merged - base).max() > 100 * SAME_ARITHMETIC  # the adapter moved the model
    np.testing.assert_allclose(
        _logits(gguf, ids, "llama-f16.gguf"),
        _logits(export / "merged", ids, None, torch.float16),
        rtol=0,
        atol=SAME_ARITHMETIC,
    )
    q8 = _logits(gguf, ids, "llama-q8_0.gguf")
    assert np.abs(q8 - merged).max() <= Q8_0_BOUND
    # A random model's top two logits are often closer than the rounding: only a gap of more than
    # twice the bound guarantees the top token, and there it must be kept.
    top2 = np.sort(merged, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * Q8_0_BOUND
    print(
        f"q8_0: max |logit difference| {np.abs(q8 - merged).max():.2e}; top-1 kept at {int(clear.sum())} clear "
        f"positions of {len(ids)}, at {int((q8.argmax(-1) == merged.argmax(-1)).sum())} in all"
    )
    assert clear.sum() >= 4 and (q8.argmax(-1) == merged.argmax(-1))[clear].all()

    # `jaxtune chat` / `generate` open the exported file (as `model.name` can), imported into the store.
    session = open_session(str(gguf / "llama-f16.gguf"), str(store), max_new_tokens=8, seed=0)
    prompt = prompt_ids(session.tokenizer, [{"role": "user", "content": "Who has the book?"}])
    from jaxtune.runtime.modeling.model import load_torch_model

    imported = session.description.split("(imported as ")[1].rstrip(")")
    expected = torch_greedy(
        load_torch_model(imported, None, False, "float32"),
        prompt,
        8,
        tokenizer.pad_token_id,
        eos_ids=session.decoder.stop_ids,
    )
    tokens = list(session.decoder.stream(prompt, 8))  # a stop token ends the stream, unyielded
    assert expected in (tokens, [*tokens, *[t for t in expected[len(tokens) :] if t in session.decoder.stop_ids][:1]])


def test_a_model_the_writer_cannot_write_is_refused_before_training(tmp_path):
    store = tmp_path / "store"
    # The toy recipes' Gemma 3 alternates sliding and global layers, a pattern llama.cpp would not run.
    with pytest.raises(
        ModelError,
        match=r"^GGUF export: Gemma 3 layers must be five sliding-window layers to one "
        r"global, as llama\.cpp runs them; this model's are sliding, full$",
    ):
        run_toy(store, "export.gguf=[f16]")
    assert (store / "baseline_eval").is_dir() and not (store / "train").exists()
