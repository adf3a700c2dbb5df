"""The checks of `checks.py` as tests: each checkpoint's module subclasses `RealCheckpointTests`,
naming how to place its GGUF file, its chat template and the token that ends its turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flows.plain_torch import plain_torch_losses
from tests.real import checks


class RealCheckpointTests:
    """Every fixture is class-scoped: one model and one flow run per checkpoint, in the session's
    shared real store, where the checkpoint is imported once for every module that opens it."""

    name: str
    chat_template: str | None = None
    end_of_turn: str

    @staticmethod
    def place(folder: Path) -> Path:
        raise NotImplementedError

    @pytest.fixture(scope="class")
    def checkpoint(self, real_store):
        return checks.import_checkpoint(self.place, real_store, self.chat_template)

    @pytest.fixture(scope="class")
    def run(self, checkpoint, tmp_path_factory):
        return checks.three_lora_steps(checkpoint, tmp_path_factory.mktemp(self.name))

    @pytest.fixture(scope="class")
    def model(self, checkpoint):
        return checks.lora_model(checkpoint)

    @pytest.fixture(scope="class")
    def tokenizer(self, checkpoint):
        return checks.tokenizer_of(checkpoint)

    def test_decoding_stops_first_at_the_templates_end_of_turn(self, tokenizer):
        from jaxtune.data.templates import end_of_turn_ids, stop_ids

        assert tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer)) == [self.end_of_turn]
        assert stop_ids(tokenizer)[0] == tokenizer.convert_tokens_to_ids(self.end_of_turn)

    @pytest.mark.data
    def test_every_assistant_turn_of_a_conversation_carries_labels(self, tokenizer):
        """A system prompt and three turns: each answer and the end-of-turn tokens after it are labelled, nothing else."""
        from jaxtune.data.tokenize import encode_example
        from tests.data.test_tokenize import THREE_TURNS, labelled_spans

        row = encode_example(THREE_TURNS, tokenizer, "all_assistant")
        assert labelled_spans(row, tokenizer) == [
            f"{answer}{self.end_of_turn}\n" for answer in ("Blue", "Green", "White")
        ]
        last = encode_example(THREE_TURNS, tokenizer, "last_assistant")
        assert labelled_spans(last, tokenizer) == [f"White{self.end_of_turn}\n"]

    def test_logits_match_pytorch(self, checkpoint, run):
        check_logits(checkpoint.store, run["keys"])

    def test_loss_and_lora_gradients_match_pytorch(self, model, tokenizer):
        check_loss_and_gradients(model, tokenizer)

    def test_greedy_tokens_equal_generate(self, model, tokenizer):
        check_greedy(model, tokenizer)

    def test_three_lora_steps_export_an_adapter_plain_pytorch_scores_alike(self, checkpoint, run):
        check_three_steps_export(checkpoint, run)

    @pytest.mark.gguf
    def test_the_fine_tuned_model_exported_as_gguf_reads_back_alike(self, checkpoint, run, tmp_path_factory):
        """The same three steps (cached) exported with the LoRA merged and written as f16 and q8_0."""
        tmp = tmp_path_factory.mktemp(f"{self.name}-gguf")
        result = checks.three_lora_steps(checkpoint, tmp, "export.merge=true", "export.gguf=[f16, q8_0]")
        assert result["stages"]["train"] == "Cached" and result["stages"]["export"] == "Completed"
        checks.check_gguf_export(Path(result["path"]))


def check_logits(store: Path, keys: dict[str, str]) -> None:
    """The baseline eval's own parity check: the base model's logits on 4 eval rows, JAX against PyTorch."""
    parity = _metrics(store, keys, "baseline_eval")["parity"]
    assert parity["dtype"] == "float32" and parity["tokens"] >= 40
    diff, scale = parity["max_abs_diff"], parity["max_abs_logit"]
    assert diff <= checks.LOGITS_RTOL * scale, f"max |diff| {diff:.2e} at logits up to {scale:.1f}"
    assert parity["top1_agreement"] == 1.0


def check_loss_and_gradients(model, tokenizer) -> None:
    loss_diff, together, worst, worst_diff = checks.loss_and_gradient_errors(model, tokenizer)
    assert loss_diff <= checks.LOSS_RTOL, loss_diff
    assert together <= checks.GRADIENT_RTOL, together
    assert worst_diff <= checks.WORST_GRADIENT_RTOL, (worst, worst_diff)


def check_greedy(model, tokenizer) -> None:
    pairs = checks.greedy_pairs(model, tokenizer)
    for got, expected in pairs:
        assert len(got) == checks.GREEDY_TOKENS and got == expected, (tokenizer.decode(got), tokenizer.decode(expected))


def check_three_steps_export(checkpoint: checks.Checkpoint, result: dict) -> None:
    export, store, keys = Path(result["path"]), checkpoint.store, result["keys"]
    assert keys["import_gguf"] == checkpoint.folder.name  # the session's import, reused by the flow
    info = json.loads((export / "export.json").read_text())
    assert info["base_model"] == str(checkpoint.folder)  # the adapter names the imported HF folder as its base
    train = store / "train" / json.loads((export / "manifest.json").read_text())["inputs"]["train"]
    records = [json.loads(line) for line in (train / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    final = _metrics(store, keys, "final_eval")["loss"]
    baseline = _metrics(store, keys, "baseline_eval")["loss"]
    (plain,) = plain_torch_losses(
        [
            {
                "base": checkpoint.folder,
                "adapter": export / "adapter",
                "eval_arrow": store / "tokenize" / keys["tokenize"] / "eval.arrow",
            }
        ]
    )
    print(
        f"exported adapter: plain PyTorch loss {plain:.6f}, final eval {final:.6f}, relative {abs(plain - final) / final:.2e}; "
        f"baseline {baseline:.6f}"
    )
    assert abs(plain - final) <= checks.EXPORT_LOSS_RTOL * final, (plain, final)
    # The check above tells a trained adapter from an untrained one only if training moved the loss by more.
    assert baseline - final > 2 * checks.EXPORT_LOSS_RTOL * final, (baseline, final)


def _metrics(store: Path, keys: dict[str, str], stage: str) -> dict:
    return json.loads((store / stage / keys[stage] / "metrics.json").read_text())
