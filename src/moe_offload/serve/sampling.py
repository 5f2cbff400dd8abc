"""Per-request sampling inside transformers' continuous batching.

The batch is decoded greedily (argmax, `do_sample=False`: a greedy request's tokens are the argmax of its
logits, as `generate` picks them). For a request that asked for sampling (temperature > 0), this logits
processor draws its token from its own distribution, temperature and top-p applied, with the request's own
`torch.Generator` (seeded by `seed`, else from the OS), and leaves that row's logits one-hot on the draw, so
the argmax takes it. A seeded request draws the same tokens whatever else is in the batch.

It is a `ContinuousBatchingLogitsProcessor` (transformers' interface for per-request processors): each step,
`prepare_tensor_args` gives every row of the batch the slot of its request's sampler (-1: greedy), and
`__call__` rewrites the sampled rows. `install` adds it to a manager before the manager starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

try:   # transformers' continuous batching (>= 5.x): the per-request processor interface
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor
except ImportError:   # pragma: no cover - an older transformers: sampled requests are refused (Sampler.usable)
    ContinuousBatchingLogitsProcessor = object


@dataclass
class Draw:
    temperature: float
    top_p: float
    generator: torch.Generator


class Sampler(ContinuousBatchingLogitsProcessor):
    supported_kwargs: dict = {}
    ignored_kwargs: tuple = ()

    def __init__(self):
        self._draws: dict[str, Draw] = {}
        self._slots: list[Draw] = []
        self._lock = threading.Lock()
        self.usable = False          # set by install(): the manager took it

    def add(self, request_id: str, temperature: float, top_p: float, seed: int | None) -> None:
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed % 2**64)
        with self._lock:
            self._draws[request_id] = Draw(temperature, top_p, gen)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._draws.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._draws)

    # --- the ContinuousBatchingLogitsProcessor interface (called on the batch's thread) ---

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        slots, out = [], []
        with self._lock:
            for request in requests_with_new_token:
                draw = self._draws.get(request.state.request_id)
                if draw is None:
                    out.append(-1)
                else:
                    out.append(len(slots))
                    slots.append(draw)
        self._slots = slots
        return torch.tensor(out, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = tensor_arg[: scores.size(0)].tolist()
        if all(s < 0 for s in rows):
            return scores
        scores = scores.clone()
        for row, slot in enumerate(rows):
            if slot < 0 or slot >= len(self._slots):
                continue
            token = draw_token(scores[row], self._slots[slot])
            scores[row].fill_(float("-inf"))
            scores[row, token] = 0.0
        return scores


def draw_token(logits: torch.Tensor, draw: Draw) -> int:
    """One token from softmax(logits / temperature), restricted to the smallest top-p set (at least one)."""
    probs = torch.softmax(logits.float() / draw.temperature, dim=-1)
    if draw.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < draw.top_p   # the tokens before the mass reaches top_p, and it
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=draw.generator))


def install(manager, sampler: Sampler) -> bool:
    """Add the sampler to a continuous batching manager that has not started; False where this transformers'
    manager has no place for it (sampled requests are then refused with a clear error)."""
    processors = getattr(manager, "logit_processor", None)
    if ContinuousBatchingLogitsProcessor is object or processors is None or not hasattr(processors, "logits_processor"):
        return False
    processors.logits_processor.append(sampler)
    processors.tensors_required += 1
    processors.do_processing = True
    sampler.usable = True
    return True
