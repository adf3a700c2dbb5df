"""The toy model shape flow tests train: 2 layers of width 32, so a whole run takes seconds."""

TOY_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 300,
}
TOY_MODEL = [f"model.tiny.{key}={value}" for key, value in TOY_SHAPE.items()]
