"""The settings of benchmarks/train_tiny.py and their hash: the cache key of the trained model folder.

The hash covers every field and training_data.DATA_RULES; a model folder whose train_info.json holds
another hash is retrained.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from training_data import DATA_RULES


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    vocab_size: int = 4096
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    experts: int = 32
    top_k: int = 2
    expert_ffn: int = 64
    seq_len: int = 256
    batch: int = 8
    # 1000 steps x 2048 tokens (2 M tokens, ~2/3 of one pass over the training text): measured
    # 0.47 s a step, 469 s in all, with one thread on a 2-core VM that other jobs were using.
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.01
    # Per-layer Switch load-balancing loss (see training_model.balance_loss), at the usual Switch coefficient.
    aux_loss_coef: float = 0.01
    heldout_every: int = 10   # 1 stdlib file in 10 is held out
    eval_prompts: int = 200   # per kind, in eval_texts.json
    prompt_chars: int = 600

    def digest(self) -> str:
        blob = json.dumps({"settings": asdict(self), "data_rules": DATA_RULES}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
