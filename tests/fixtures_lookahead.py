"""What the look-ahead tests share (tests/run/test_lookahead*.py): their model, a greedy generation that returns its
logits, the routing recorder, and a predictor that replays a recorded run's routing. Imported explicitly (not a
conftest).

Model: make_tiny qwen3_moe, float32, hidden 32, 4 layers, E=8, top-2. One expert is 12,288 B of gate_up_proj
+ 6,144 B of down_proj = 18,432 B per layer.
"""

from __future__ import annotations

import torch

from moe_offload.tiny.make import make_tiny

LAYERS, E = 4, 8
EXPERT = 18432
NEW = 8
SPLIT_IDS = {"gate_up_proj": (1, 3, 4, 6), "down_proj": (1, 4)}   # the experts a split plan offloads, per tensor


def tiny_model(folder):
    return make_tiny(folder, family="qwen3_moe", layers=LAYERS, experts=E, top_k=2, hidden=32)


def generate(model, ids, new_tokens: int = NEW):
    """(greedy tokens, per-step logits), EOS ignored so that every step decodes."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=[], pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.cat(out.logits)


def routing(rt) -> list:
    """The runtime's forward calls (state.RoutedCall) from now on, as they happen."""
    calls = []
    rt.recorder = calls.append
    return calls


class Replay:
    """Predicts, for each decode step, the experts a recorded run picked (or, `invert`, exactly the others of
    `experts`); layer 0 is not covered (no layer before it)."""

    def __init__(self, recorded, rt, experts: int, invert=False):
        self.steps = [c.experts for c in recorded if c.decode]
        self.seen = routing(rt)        # this run's calls so far: the step under way is the next decode one
        self.experts = experts
        self.invert = invert
        self.asked = 0

    def covers(self, layer):
        return layer > 0

    def predict(self, layer, hidden):
        step = sum(1 for c in self.seen if c.decode)
        picked = set(torch.unique(self.steps[step][layer]).tolist())
        self.asked += 1
        return sorted(set(range(self.experts)) - picked) if self.invert else sorted(picked)
