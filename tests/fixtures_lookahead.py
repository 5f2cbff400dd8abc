"""What the look-ahead tests share (tests/run/test_lookahead*.py): a greedy generation that returns its logits, the
routing recorder, and a predictor that replays a recorded run's routing. Imported explicitly (not a conftest)."""

from __future__ import annotations

import torch


def generate(model, ids, new_tokens: int = 8):
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
