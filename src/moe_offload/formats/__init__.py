"""Formats: what lies in files, with no model behind it.

Checkpoint key layouts (layouts), quantized encodings (quant), routing traces (traces) and the
streaming safetensors writer (stream_save). May import: errors.
"""
