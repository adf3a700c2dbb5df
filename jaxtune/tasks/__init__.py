"""One module per pipeline stage. Each stage is a pure function of its config section and
input artifact refs, writing one verified artifact folder and returning its `ArtifactRef`.

May import: jaxtune.config, jaxtune.errors, jaxtune.records, jaxtune.artifacts, jaxtune.data, jaxtune.gguf, jaxtune.host, jaxtune.offline, jaxtune.rewards, jaxtune.runtime, jaxtune.tracking
"""

# The pipeline's stages in order; `--refresh` and `--until` name them. build_tokenizer and
# build_model run first, for the offline default only.
# `reference` runs for train.objective=dpo alone.
STAGES = ("tokenize", "reference", "baseline_eval", "train", "final_eval", "export", "generate", "report")
# Before `tokenize`, making the base model: the offline model's tokenizer and weights, a GGUF
# file's import into an HF folder, or a LoRA adapter merged into its base; then, with
# model.base_quantization, its frozen layers quantized. `--refresh` names these too.
BUILD_STAGES = ("build_tokenizer", "build_model", "import_gguf", "merge_adapter", "quantize_base")
