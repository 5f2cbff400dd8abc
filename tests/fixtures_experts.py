"""What the tests of the experts' compute paths share (run/test_grouped.py, run/test_fused.py): a generation with
its logits, and the offload ways every path must be bit-identical under."""

from __future__ import annotations

import torch

from moe_offload.planning.placement import GiB
from moe_offload.run.experts import is_experts_module

NEW = 6


def experts_module(model):
    return next(m for m in model.modules() if is_experts_module(m))


def generate_new(model, ids):
    """(sequences [1, n + NEW], logits of every new token [NEW, V]); EOS never stops it."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=[], pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape[1] == ids.shape[1] + NEW
    return out.sequences, torch.cat(out.logits)


def routed_tensors(plan):
    return [t for t in plan.tensors if t.role == "routed_expert"]


def is_split(t) -> bool:
    return 0 < t.host_experts < t.shape[0]


def offload_way(way: str, plan0) -> tuple[dict, callable]:
    """Load options of an offload way, from a zero-budget plan's sizes, and the check its plan must pass."""
    embed = sum(t.bytes for t in plan0.tensors if t.role == "embedding")
    routed = sum(t.bytes for t in routed_tensors(plan0))
    whole = dict(offload_gb=(embed + routed) / GiB)         # the embedding and every routed tensor, whole

    def whole_on_host(p):
        return all(t.tier == "host" and t.host_experts == t.shape[0] for t in routed_tensors(p))

    if way == "uva":
        return whole, whole_on_host
    if way == "prefetch":
        return dict(whole, backend="prefetch"), whole_on_host
    if way == "cache":
        return dict(whole, cache_gb=(routed // 8) / GiB), whole_on_host
    if way == "split":
        return dict(offload_gb=(embed + routed * 5 // 8) / GiB), lambda p: any(map(is_split, routed_tensors(p)))
    assert way == "disk"
    return (dict(device_memory_gb=(plan0.total_bytes - routed // 2) / GiB, reserve_gb=0,
                 host_memory_gb=(routed // 4) / GiB),
            lambda p: any(t.tier == "disk" for t in routed_tensors(p)) and any(t.tier == "host" for t in routed_tensors(p)))


