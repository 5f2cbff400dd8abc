"""A decode step does not wait on the device for the runtime's own bookkeeping: the device-to-host reads our code
makes in one decode step, counted. On an accelerator each read stalls the queue of the next kernels.

Counted (a torch function mode on the main thread, attributed to the innermost frame outside torch): `.tolist()`,
`.item()`, `int()` / `float()` / `bool()` / `__index__` of a tensor, `unique`, `unique_consecutive`, `nonzero`,
`masked_select` and `.cpu()`, when that frame is moe-offload's code. What the model's own code does (transformers'
eager experts loop reads its expert ids) is not ours and not counted. Host-side byte views of host buffers
(`.numpy()` of a CPU staging tensor) are not device reads and not counted either.

The rule: at most one read per MoE layer whose experts are staged (the selected ids, read once: staging needs
them on the host), plus one for a staged embedding; none on the uva path for whole host tensors (the distinct
experts are counted on the device and read back when the counts are read); none inside the look-ahead's hooks
(its predicted ids are read on its worker thread).

Model: make_tiny qwen3_moe, float32, hidden 32, 4 layers, 8 experts top-2."""

from __future__ import annotations

import collections
import dataclasses
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache

import moe_offload as mo
from moe_offload.planning.placement import GiB, Tier
from moe_offload.tiny.make import make_tiny

from fixtures_models import prompt_ids

LAYERS = 4
READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "unique", "unique_consecutive",
         "nonzero", "masked_select", "cpu"}


class Reads(TorchFunctionMode):
    """Device-to-host reads made by moe-offload's code while active: file:line name -> count."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            ours = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            if ours and "moe_offload" in ours[-1].filename:
                self.where[f"{ours[-1].filename.rsplit('moe_offload/', 1)[-1]}:{ours[-1].lineno} {name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.where.values())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("syncs") / "m", family="qwen3_moe", layers=LAYERS, experts=8, top_k=2,
                     hidden=32)


def decode_step_reads(folder, **load) -> Reads:
    """The reads of the third forward call (a decode step after a prefill and a first decode step)."""
    with mo.load(folder, **load) as loaded:
        model = loaded.model
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            ids = prompt_ids(folder, 6)
            for _ in range(2):
                ids = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            with Reads() as reads:
                model(ids, past_key_values=cache, use_cache=True)
        assert loaded.runtime.counter.calls   # the counts read back after the step, all at once
    return reads


def whole_experts_on_host(folder):
    p0 = mo.plan(folder, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(
        dataclasses.replace(t, tier=Tier.HOST.value) if t.role == "routed_expert" else t for t in p0.tensors))


def experts_layers(plan) -> int:
    return len({t.layer for t in plan.tensors if t.role == "routed_expert" and t.tier != Tier.DEVICE})


@pytest.mark.parametrize("experts", ["fused", "eager"])
def test_uva_with_whole_host_tensors_reads_nothing_back(folder, experts):
    reads = decode_step_reads(folder, plan=whole_experts_on_host(folder), backend="uva", experts=experts)
    assert reads.total == 0, dict(reads.where)


@pytest.mark.parametrize("experts", ["fused", "eager"])
def test_staged_experts_read_their_ids_once_per_layer(folder, experts):
    plan = whole_experts_on_host(folder)
    reads = decode_step_reads(folder, plan=plan, backend="prefetch", experts=experts)
    assert reads.total == experts_layers(plan) == LAYERS, dict(reads.where)


@pytest.mark.parametrize("backend", ["uva", "prefetch"])
def test_split_tensors_and_the_device_cache_read_once_per_layer(folder, backend):
    p0 = mo.plan(folder, offload_gb=0)
    plan = dataclasses.replace(p0, tensors=tuple(   # every routed tensor split: experts 1 and 4 on the host
        dataclasses.replace(t, tier=Tier.HOST.value, host_experts=2, host_expert_ids=(1, 4))
        if t.role == "routed_expert" else t for t in p0.tensors))
    for extra in ({}, {"cache_gb": 4 * 18432 / GiB}):
        reads = decode_step_reads(folder, plan=plan, backend=backend, **extra)
        assert reads.total <= experts_layers(plan), (extra, dict(reads.where))


@pytest.mark.parametrize("lookahead", [0, 1])
def test_the_disk_tier_reads_once_per_layer_and_never_in_the_lookahead_hook(folder, lookahead):
    total = mo.plan(folder, offload_gb=0).total_bytes
    plan = mo.plan(folder, device_memory_gb=total // 3 / GiB + 1, reserve_gb=1, cpu_only=True)
    embedding_on_disk = any(t.role == "embedding" and t.tier == Tier.DISK for t in plan.tensors)
    reads = decode_step_reads(folder, plan=plan, host_cache_gb=2 * 18432 / GiB, lookahead=lookahead)
    assert reads.total <= experts_layers(plan) + embedding_on_disk, dict(reads.where)
    assert not [w for w in reads.where if w.startswith("run/lookahead.py")], dict(reads.where)


@pytest.mark.parametrize("backend", ["uva", "prefetch"])
def test_hooks_rebind_their_staged_parameters_instead_of_making_new_ones(folder, backend, monkeypatch):
    # everything offloaded (dense weights staged per call by the prefetch ring, the embedding by rows), and a disk
    # tier below (dense disk weights read per call): no nn.Parameter is made during a decode step
    total = mo.plan(folder, offload_gb=0).total_bytes
    plans = [mo.plan(folder, offload_gb=total / GiB), mo.plan(folder, device_memory_gb=total // 4 / GiB + 1,
                                                             reserve_gb=1, cpu_only=True)]
    made = []
    new = torch.nn.Parameter.__new__

    def counting(cls, data=None, requires_grad=True):
        made.append(tuple(data.shape) if data is not None else None)
        return new(cls, data, requires_grad)

    for plan in plans:
        with mo.load(folder, plan=plan, backend=backend) as loaded:
            model = loaded.model
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                ids = prompt_ids(folder, 6)
                for step in range(3):
                    if step == 2:
                        monkeypatch.setattr(torch.nn.Parameter, "__new__", counting)
                    ids = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                monkeypatch.setattr(torch.nn.Parameter, "__new__", new)
        assert made == [], f"{len(made)} Parameters made in one decode step (shapes {made[:5]})"


def test_staged_rows_cross_the_link_one_copy_per_run_of_consecutive_rows():
    from moe_offload.run.state import RunState
    from moe_offload.storage.host import row_runs

    assert row_runs([0, 1, 2, 3, 4], [5, 6, 7, 9, 10]) == [(0, 5, 3), (3, 9, 2)]
    assert row_runs([4, 5, 0], [1, 2, 3]) == [(4, 1, 2), (0, 3, 1)]
    # host memory seen from an accelerator (here the meta device stands in for it): one copy_ per run

    class Copies(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Copies.n += getattr(func, "__name__", "") == "copy_"
            return func(*args, **(kwargs or {}))

    rt = RunState(device=torch.device("meta"), backend="prefetch")
    host, out = torch.arange(40.0).view(10, 4), torch.empty(6, 4, device="meta")
    with Copies():
        rt.copy_rows(host, [2, 3, 4, 8, 9, 0], out)
    assert Copies.n == 3
