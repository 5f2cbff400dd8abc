"""What the tests of the experts' compute paths share (run/test_grouped.py, run/test_fused.py): a generation with
its logits, and the offload ways every path must be bit-identical under; the disk-tier test plans
(run/test_disk_tier.py, run/test_streamed.py, run/test_compiled.py)."""

from __future__ import annotations

import dataclasses

import torch

from fixtures_models import load, prompt_ids

import moe_offload as mo
from moe_offload.planning.placement import GiB, Tier
from moe_offload.run.runtime import runtime_of
from moe_offload.run.experts import is_experts_module
from moe_offload.tiny.make import make_tiny

NEW = 6


def disk_plan(folder, select):
    """A zero-budget plan of `folder` with every tensor `select(t)` accepts on the disk tier."""
    p0 = mo.plan(folder, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(dataclasses.replace(t, tier=Tier.DISK.value) if select(t) else t
                                                 for t in p0.tensors))


def experts_on_disk(path):
    """A zero-budget plan with every routed-expert tensor on the disk tier."""
    return disk_plan(path, lambda t: t.role == "routed_expert")


def resident_and_on_disk(path, whole_gate_up: bool):
    """Routed tensors split: experts 1 and 4 on the disk tier, the rest resident; `whole_gate_up`: gate_up_proj
    wholly resident instead (a layer of the released benchmark's plan: one tensor resident, the other split)."""
    p0 = mo.plan(path, offload_gb=0)

    def place(t):
        if t.role != "routed_expert" or (whole_gate_up and t.name.endswith("gate_up_proj")):
            return t
        return dataclasses.replace(t, tier=Tier.DISK.value, host_experts=2, host_expert_ids=(1, 4))
    return dataclasses.replace(p0, tensors=tuple(place(t) for t in p0.tensors))


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




SIZES = dict(layers=2, experts=8, hidden=64)


def folder_maker(root):
    """folder(family, **make_tiny options) -> a tiny model folder under `root` (SIZES), made once."""
    made = {}

    def get(family, **kw):
        key = (family, *sorted(kw.items()))
        if key not in made:
            name = "-".join([family, *(f"{k}{v}" for k, v in sorted(kw.items()))])
            made[key] = make_tiny(root / name, family=family, **SIZES, **kw)
        return made[key]

    return get


def resident_maker(folder, experts: str):
    """(family, make_tiny options) -> (prompt ids, generation of the model with nothing offloaded, `experts`)."""
    done = {}

    def get(family, **kw):
        key = (family, *sorted(kw.items()))
        if key not in done:
            path = folder(family, **kw)
            ids = prompt_ids(path, 10)
            model, _ = load(path, offload_gb=0, experts=experts)
            done[key] = ids, generate_new(model, ids)
        return done[key]

    return get


def offloaded_equals_resident(folder, resident, family: str, make: dict, way: str, experts: str, check=None):
    """Load `family` (make_tiny `make`) offloaded `way` with `experts`, generate, and assert its tokens and logits
    equal the resident run's bit for bit; `check(model, rt)` runs after generating, before the comparison."""
    path = folder(family, **make)
    ids, (want_seq, want_logits) = resident(family, **make)
    options, placed = offload_way(way, mo.plan(path, offload_gb=0))
    model, plan = load(path, experts=experts, **options)
    assert placed(plan), [(t.name, t.tier, t.host_experts) for t in routed_tensors(plan)]
    rt = runtime_of(model)
    seq, logits = generate_new(model, ids)
    if check is not None:
        check(model, rt)
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits.float() - want_logits.float()).abs().max()}"
    if way == "cache":
        stats = rt.cache.stats()
        assert stats["cache_hits"] + stats["cache_misses"] > 0
    if way == "disk":
        assert rt.disk_counter.decode_bytes_per_token() > 0
