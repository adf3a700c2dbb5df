"""Running a trained model forward: greedy decoding compiled as one program (`decode`), choosing
each next token (`sampling`), decoding one prompt a token at a time for a chat (`stream`), and
the host loops that evaluate and generate over a split (`inference`).

May import: jaxtune.config, jaxtune.errors, jaxtune.data, jaxtune.runtime.compat, jaxtune.runtime.devices, \
jaxtune.runtime.modeling, jaxtune.runtime.compiled
"""
