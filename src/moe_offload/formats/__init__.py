"""Formats: what lies in files, with no model behind it.

Checkpoint key layouts (layouts), the safetensors format's dtype names and header (safetensors), quantized
encodings (quant: the spec a config gives and tensors held as stored; quant_codecs: the FP8 / MXFP4
arithmetic), routing traces (traces) and the streaming safetensors writer (stream_save). May import: errors.
"""
