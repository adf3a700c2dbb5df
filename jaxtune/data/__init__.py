"""Data layer: raw rows -> normalized chat examples (`rows`) -> token tables (`tokenize`).

May import: jaxtune.config, jaxtune.errors
"""
