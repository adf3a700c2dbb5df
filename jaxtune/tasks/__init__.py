"""One module per pipeline stage. Each stage is a pure function of its config section and
input artifact refs, writing one verified artifact folder and returning its `ArtifactRef`."""

# The pipeline's stages in order; `--refresh` and `--until` name them. build_tokenizer and
# build_model run first, for the offline default only.
STAGES = ("tokenize", "baseline_eval", "train", "final_eval", "export", "generate", "report")
# Before `tokenize`, making the base model: the offline model's tokenizer and weights, or a GGUF
# file's import into an HF folder. `--refresh` names these too.
BUILD_STAGES = ("build_tokenizer", "build_model", "import_gguf")
