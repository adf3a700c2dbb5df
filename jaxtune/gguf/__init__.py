"""GGUF files, read and written: `reader` opens a file's tensors in seconds, `blocks` keeps its
quantized linear weights as stored, `writer` turns an HF model folder into a file for llama.cpp.

May import: jaxtune.config, jaxtune.data, jaxtune.errors
"""
