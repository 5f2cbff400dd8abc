"""`experts="grouped"` (run/grouped.py): a call's selected experts in one gather-GEMV per projection.

- grouped_experts on a real experts module equals the class's eager forward within fp32 rounding, for the
  conventions transformers' families use (gate_up concatenated, gpt-oss's transposed + biased + interleaved gate);
  calls of more than GROUPED_MAX_ROWS rows run the class's own forward, bit for bit;
- the promise: a grouped model with anything offloaded (uva in place, prefetch, a split tensor, the disk tier, a
  device cache; bf16; FP8-quantized) gives logits bitwise equal to the same model loaded with nothing offloaded,
  grouped;
- link bytes do not depend on the compute: eager and grouped count the same bytes for the same routing.

Models: make_tiny, 2 layers, hidden 64, 8 experts top-2, float32 unless said (qwen3_moe: gate_up [8, 192, 64]).
"""

from __future__ import annotations

import pytest
import torch

import moe_offload as mo
from fixtures_experts import (SIZES, experts_module as _experts_module, folder_maker, offload_way,
                              offloaded_equals_resident, resident_maker)
from fixtures_models import load, prompt_ids
from moe_offload.errors import MoeOffloadError
from moe_offload.measure.timing import _forward_keywords
from moe_offload.run.compute import ExpertsCompute, ExpertsMode
from moe_offload.run.grouped import GROUPED_MAX_ROWS, grouped_experts, original_forward

CONVENTIONS = ("qwen3_moe", "gpt_oss", "mixtral", "granitemoe", "deepseek_v3", "olmoe")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_maker(tmp_path_factory.mktemp("grouped"))


def _call(model, rows: int, seed: int = 0):
    """(hidden [rows, H], top_k_index [rows, k], top_k_weights [rows, k]) routed as a softmax top-k router does."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    hidden = torch.randn(rows, cfg.hidden_size, generator=g)
    weights, index = torch.randn(rows, SIZES["experts"], generator=g).softmax(-1).topk(cfg.num_experts_per_tok, -1)
    return hidden, index, weights


# --- the kernel against the class's forward ------------------------------------------------------------------

@pytest.mark.parametrize("family", CONVENTIONS)
def test_grouped_experts_equals_the_class_forward(folder, family):
    model, _ = load(folder(family), offload_gb=0)
    module = _experts_module(model)
    eager = original_forward(module)
    for rows in (1, 5, GROUPED_MAX_ROWS):
        hidden, index, weights = _call(model, rows, seed=rows)
        with torch.no_grad():
            want = eager(module, hidden, index, weights)
            got = grouped_experts(module, {}, hidden, index, weights)
        assert got.shape == want.shape == hidden.shape and got.dtype == want.dtype
        assert want.abs().max() > 0.1                      # a real output, not zeros on both sides
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.exact
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gathered_stack_with_renumbered_ids_is_bitwise_the_full_stack(folder, family):
    """What the gathering path hands the kernel (the selected experts' rows, ids renumbered 0..U-1) computes the
    same bits as indexing the module's own stacks."""
    model, _ = load(folder(family), offload_gb=0)
    module = _experts_module(model)
    hidden, index, weights = _call(model, 3)
    selected = torch.unique(index)
    local = torch.searchsorted(selected, index)
    stacks = {n: p.index_select(0, selected) for n, p in module.named_parameters(recurse=False)
              if p.shape[0] == SIZES["experts"]}
    assert {"down_proj"} <= set(stacks) and selected.numel() < SIZES["experts"]
    with torch.no_grad():
        assert torch.equal(grouped_experts(module, stacks, hidden, local, weights),
                           grouped_experts(module, {}, hidden, index, weights))


@pytest.mark.exact
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_large_calls_prefills_and_eager_mode_run_the_class_forward_exactly(folder, family):
    model, _ = load(folder(family), offload_gb=0)
    module = _experts_module(model)
    grouped, eager = ExpertsCompute("grouped"), ExpertsCompute(ExpertsMode.EAGER)
    # decode steps of more than GROUPED_MAX_ROWS sequences, and prefills of any length, keep the class's loop
    for rows, decode in ((GROUPED_MAX_ROWS + 1, True), (13, True), (3, False), (GROUPED_MAX_ROWS + 2, False)):
        hidden, index, weights = _call(model, rows)
        assert not grouped.grouped_for(hidden, decode=decode)
        with torch.no_grad():
            want = original_forward(module)(module, hidden, index, weights)
            assert torch.equal(grouped(module, {}, hidden, index, weights, decode=decode), want)
    assert grouped._kernel is None                         # the fallback never built the grouped kernel
    hidden, index, weights = _call(model, 1)
    assert grouped.grouped_for(hidden, decode=True) and not eager.grouped_for(hidden, decode=True)
    with torch.no_grad():
        assert torch.equal(eager(module, {}, hidden, index, weights, decode=True),
                           original_forward(module)(module, hidden, index, weights))


def test_unknown_experts_mode_is_refused(folder):
    with pytest.raises(MoeOffloadError) as err:
        load(folder("qwen3_moe"), experts="fast")
    assert "'fast'" in str(err.value) and "eager" in str(err.value) and "grouped" in str(err.value)


# --- bit-identity with the resident grouped model ------------------------------------------------------------

@pytest.fixture(scope="module")
def resident(folder):
    return resident_maker(folder, "grouped")


CASES = [(f, {}, way) for f in ("qwen3_moe", "gpt_oss") for way in ("uva", "prefetch", "split", "disk", "cache")]
CASES += [("qwen3_moe", {"dtype": "bfloat16"}, way) for way in ("uva", "split")]
CASES += [("qwen3_moe", {"quant": "fp8"}, way) for way in ("uva", "split")]   # quantized: always gathered


@pytest.mark.exact
@pytest.mark.parametrize("family, make, way", CASES,
                         ids=[f"{f}-{'-'.join(map(str, m.values())) or 'fp32'}-{w}" for f, m, w in CASES])
def test_offloaded_grouped_is_bitwise_the_resident_grouped(folder, resident, family, make, way):
    def check(model, rt):
        assert rt.compute.mode is ExpertsMode.GROUPED
        assert rt.compute._kernel is not None                  # the decode steps ran the grouped kernel
        if make.get("dtype"):
            assert _experts_module(model).down_proj.dtype == torch.bfloat16   # the experts compute in bf16

    offloaded_equals_resident(folder, resident, family, make, way, "grouped", check)


# --- byte counts do not depend on the compute -------------------------------------------------------------

def _teacher_forced(model, ids, prompt: int):
    """Prefill ids[:, :prompt], then one forward per later id of `ids` (a fixed sequence, so the routing can only
    differ through the arithmetic): (host link calls, disk calls, routing of every call)."""
    rt = model.moe_offload_runtime
    cache_kw, _, _ = _forward_keywords(model)
    routed = []
    rt.recorder = routed.append
    try:
        with torch.no_grad():
            out = model(input_ids=ids[:, :prompt], use_cache=True)
            for i in range(prompt, ids.shape[1]):
                out = model(input_ids=ids[:, i:i + 1], use_cache=True, **{cache_kw: getattr(out, cache_kw)})
    finally:
        rt.recorder = None
    return list(rt.counter.calls), list(rt.disk_counter.calls), routed


@pytest.mark.parametrize("way", ["uva", "split", "disk"])
def test_link_bytes_are_the_same_for_eager_and_grouped(folder, way):
    path = folder("qwen3_moe")
    ids = prompt_ids(path, 16)
    options, placed = offload_way(way, mo.plan(path, offload_gb=0))
    runs = {}
    for mode in ("eager", "grouped"):
        model, plan = load(path, experts=mode, **options)
        assert placed(plan)
        runs[mode] = _teacher_forced(model, ids, prompt=10), model.moe_offload_runtime
    (host_e, disk_e, routed_e), rt_e = runs["eager"]
    (host_g, disk_g, routed_g), rt_g = runs["grouped"]
    assert rt_g.compute._kernel is not None and rt_e.compute._kernel is None
    # the precondition: the same experts were selected in every call
    assert len(routed_e) == len(routed_g) == 7
    for a, b in zip(routed_e, routed_g):
        assert a.experts.keys() == b.experts.keys() and all(torch.equal(a.experts[k], b.experts[k]) for k in a.experts)
    assert [n for n, _ in host_g] == [10] + [1] * 6
    assert host_g == host_e and disk_g == disk_e
    assert rt_g.counter.decode_bytes_per_token() == rt_e.counter.decode_bytes_per_token() > 0
    assert rt_g.disk_counter.decode_bytes_per_token() == rt_e.disk_counter.decode_bytes_per_token()
