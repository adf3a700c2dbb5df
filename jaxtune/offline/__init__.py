"""Bundled data and tiny-model pieces that let jaxtune run without network access: the tiny
random configs of every model family (`architectures`), the bundled data, the tokenizer trained
on it, and the two pip-installed checkpoints.

May import: jaxtune.config, jaxtune.errors
"""
