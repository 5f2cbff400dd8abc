"""Engines: a plan expressed as another engine's options (vLLM, SGLang, llama.cpp), and what that costs.

export (the Export result and the dispatch), engine (the engines' names), vllm (vLLM's options and the layer
walk SGLang shares), sglang, llama_cpp (-ot / --n-cpu-moe), gguf_names (GGUF tensor names),
checkpoint_names (transformers' renamings undone). May import: errors, formats, model, planning.
"""
