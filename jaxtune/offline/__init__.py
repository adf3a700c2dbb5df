"""Bundled data and tiny-model pieces that let jaxtune run without network access."""
