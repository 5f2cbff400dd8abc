"""A tensor's name as the checkpoint has it: transformers' own checkpoint -> in-memory renamings, reversed.

The engines load checkpoints by their own names (vLLM's and SGLang's loaders, llama.cpp's converter), so a
plan's in-memory names are turned back into the checkpoint's before they are matched to an engine's.
"""

from __future__ import annotations

import re


def checkpoint_renamings(model_type: str) -> tuple[tuple[str, str], ...]:
    """transformers' checkpoint -> in-memory renamings for the family, reversed: (in-memory text, checkpoint text).

    Only plain renamings are undone (regex sources that are literal once `\\.` is read as `.`); the fused
    experts are handled by kind where they are used (gguf_names, vllm)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    pairs = []
    for t in get_checkpoint_conversion_mapping(model_type) or ():
        if not isinstance(t, WeightRenaming) or len(t.source_patterns) != 1 or len(t.target_patterns) != 1:
            continue
        source = t.source_patterns[0].replace("\\.", ".")
        if not re.search(r"[\\^$*+?()\[\]{}|]", source):
            pairs.append((t.target_patterns[0], source))
    return tuple(reversed(pairs))
