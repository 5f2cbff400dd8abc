"""Engines: a plan expressed as another engine's options (vLLM, SGLang, llama.cpp), and what that costs.

May import: errors, formats, model, planning.
"""
