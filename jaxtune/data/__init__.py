"""Data layer: raw rows -> normalized chat examples (`rows`) -> token tables (`tokenize`)."""
