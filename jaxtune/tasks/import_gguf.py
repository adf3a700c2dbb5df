"""Stage `import_gguf`: a local GGUF checkpoint -> a normal HF model folder in the store.

transformers reads GGUF (given the `gguf` package) by dequantising every tensor to float32,
which takes tens of seconds and leaves a model it refuses to `save_pretrained`. Doing it once
here, keyed by the file's content, gives every later stage, `jaxtune doctor` and plain PyTorch
users a folder of float32 safetensors plus tokenizer (and chat template, when the file has one)
that loads in a second like any HF checkpoint.

The file is read with its header parsed once, through a plain array view of its memory map
(`jaxtune.gguf.reader`): SmolLM2-135M's import takes 25 s here rather than 73, the folder byte
for byte the same.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from jaxtune.artifacts import ArtifactRef
from jaxtune.errors import ModelError, first_line
from jaxtune.gguf.reader import parsed_once
from jaxtune.tasks.stage import build_artifact, built_outside_flow

STAGE = "import_gguf"
SECTION = {"dtype": "float32"}  # dequantised values are exact in float32; bf16 would round them


def write_hf_folder(gguf: Path, folder: Path) -> None:
    """Dequantise `gguf` and save it, tokenizer included, as an HF model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    try:
        with parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as error:
        # A short file fails wherever numpy or struct first runs out of bytes, in words that do not
        # say so; errors of a file the gguf package can parse (an unsupported architecture) pass as they are.
        if _parses(gguf):
            raise
        raise ModelError(
            f"{gguf}: cannot read this GGUF file, it may be truncated or corrupt ({first_line(error)})"
        ) from error
    # The tensors are plain float32 now; what marks the model as quantized is only bookkeeping.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _parses(gguf: Path) -> bool:
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)  # maps every tensor, so a file cut short fails here
    except Exception:
        return False
    return True


@task(name=STAGE, result_serializer="json")
def import_gguf(section: dict, inputs: dict[str, ArtifactRef], store_root: str) -> ArtifactRef:
    """inputs: `gguf`, the checkpoint file (keyed by its sha256)."""
    return build_artifact(
        store_root, STAGE, __name__, section, inputs, lambda folder: write_hf_folder(inputs["gguf"].folder, folder)
    )


def imported(store_root: str | Path, gguf_ref: ArtifactRef) -> ArtifactRef:
    """The HF folder for a GGUF file outside any flow (doctor, chat): built once, then reused."""
    inputs = {"gguf": gguf_ref}
    return built_outside_flow(
        store_root, STAGE, __name__, SECTION, inputs, lambda: import_gguf.fn(SECTION, inputs, str(store_root))
    )
