"""A prefill whose selected experts exceed the staging bound is staged and computed a chunk at a time
(run/chunked.py): the same tokens, logits within rounding, the same bytes charged, buffers within the bound."""

from __future__ import annotations

import pytest
import torch

from fixtures_models import BACKENDS, load, prompt_ids
from fixtures_placement import three_tier_plan
from moe_offload.run import chunked
from moe_offload.tiny.make import make_tiny

E, K = 6, 2
SPLIT = {"gate_up_proj": (1, 3, 4), "down_proj": (1, 3, 4)}
NEW = 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("chunked") / "m", family="qwen3_moe", layers=3, experts=E, top_k=K,
                     hidden=32)


def _run(folder, backend, bound=None):
    mp = pytest.MonkeyPatch()
    calls = []
    if bound is not None:
        mp.setattr(chunked, "STAGING_BOUND", bound)
        real = chunked.chunked_step

        def counted(*args, **kw):
            calls.append(1)
            return real(*args, **kw)
        mp.setattr("moe_offload.run.experts.chunked_step", counted)
    try:
        with load(folder, plan=three_tier_plan(folder, SPLIT), backend=backend, experts="eager") as loaded:
            ids = prompt_ids(folder, 10)
            with torch.no_grad():
                out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                            do_sample=False, eos_token_id=[], pad_token_id=0, output_logits=True,
                                            return_dict_in_generate=True)
            rt = loaded.runtime
            staged = max(b.numel() * b.element_size() for b in rt._staging.values())
            return (out.sequences, torch.cat(out.logits), rt.counter.calls, rt.disk_counter.calls, staged,
                    len(calls))
    finally:
        mp.undo()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chunked_prefill_reads_and_computes_what_an_unchunked_one_does(folder, backend):
    whole = _run(folder, backend)
    per_expert = 18432 * 1        # one expert's rows over both routed tensors (fp32, hidden 32)
    got = _run(folder, backend, bound=2 * per_expert)
    assert got[5] > 0                                   # the prefill's layer steps were chunked
    assert torch.equal(got[0], whole[0])                # the same tokens
    assert torch.allclose(got[1], whole[1], atol=1e-5, rtol=1e-5)
    assert got[2] == whole[2] and got[3] == whole[3]    # the same bytes, call by call
    assert got[4] <= 2 * per_expert < whole[4]          # no buffer beyond the bound: the unchunked prefill's was


def test_a_prefill_dequantizes_resident_quantized_experts_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Quantized experts held resident: a prefill's eager loop dequantizes its selected experts into the compute dtype,
    four times their stored bytes at gpt-oss's dimensions; the bound counts those buffers, so the largest one stays
    within it, and the tokens are those of the unbounded prefill."""
    path = make_tiny(tmp_path / "m", family="gpt_oss", quant="mxfp4", layers=2, experts=8, hidden=64)
    ids = prompt_ids(path, 12)

    def run(bound):
        if bound is not None:
            monkeypatch.setattr(chunked, "STAGING_BOUND", bound)
        calls = []
        real = chunked.chunked_step
        monkeypatch.setattr("moe_offload.run.experts.chunked_step", lambda *a, **k: calls.append(1) or real(*a, **k))
        with load(path, offload_gb=0, experts="eager") as loaded:
            with torch.no_grad():
                seq = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                            do_sample=False, eos_token_id=[], pad_token_id=0)
            widest = max(b.numel() * b.element_size() for b in loaded.runtime.dequantizer.buffers())
            state = next(m._moe_offload_state for m in loaded.model.modules() if hasattr(m, "_moe_offload_state"))
            return seq, widest, len(calls), chunked.stage_bytes(state)

    whole, widest, chunks, per_expert = run(None)
    assert chunks == 0
    got, bounded, chunks, _ = run(2 * per_expert)
    assert chunks > 0 and torch.equal(got, whole)
    assert bounded <= 2 * per_expert < widest
