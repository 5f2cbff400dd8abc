"""run/decode_attention.py: with the fused experts, a decode step's SDPA is computed by the CPU kernels per kv head.

- a model loaded with the fused experts takes the decode attention (attention of every family whose
  implementation is SDPA), one with the eager experts keeps SDPA; serve's continuous batching gets SDPA back;
- a one-query call agrees with torch's SDPA within the rounding of the model's dtype, with grouped query heads,
  several sequences and a padding mask, and with MLA's narrower values; it is the same on every kernel path
  (the portable one against the best this CPU runs, bit for bit);
- every other call (a prompt's, one with options only SDPA knows) is SDPA's own, bit for bit;
- traced by torch.compile it agrees with the eager call, with no dynamo warning about its lru_cache;
- a fused model still generates the plain transformers model's tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fixtures_experts import folder_maker, generate_new
from fixtures_models import load, prompt_ids, reference_model
from moe_offload.kernels import Isa, best_isa
from moe_offload.run.decode_attention import (DECODE_ATTENTION, decode_attention_forward, plain_attention,
                                              use_decode_attention)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_maker(tmp_path_factory.mktemp("decode-attention"))


class Attn(nn.Module):   # what transformers' attention functions read from their module
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def qkv(b=1, heads=8, kv_heads=2, n=37, d=32, dv=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, 1, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, n, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, n, dv or d, generator=g).to(dtype)
    return q, k, v


def sdpa(q, k, v, mask=None, scale=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral", "deepseek_v3"))
def test_fused_models_take_the_decode_attention_and_eager_ones_keep_sdpa(folder, family):
    fused, _ = load(folder(family), offload_gb=0, experts="fused")
    assert fused.config._attn_implementation == DECODE_ATTENTION
    eager, _ = load(folder(family), offload_gb=0)
    assert eager.config._attn_implementation == "sdpa"
    plain_attention(fused)       # as serve does before continuous batching
    assert fused.config._attn_implementation == "sdpa"
    assert use_decode_attention(fused) and fused.config._attn_implementation == DECODE_ATTENTION


@pytest.mark.parametrize("dtype,tol", ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)))
@pytest.mark.parametrize("shape", (dict(), dict(heads=4, kv_heads=4), dict(b=3, n=5), dict(d=48, dv=16)))
def test_one_query_agrees_with_sdpa(dtype, tol, shape):
    q, k, v = qkv(dtype=dtype, **shape)
    out, weights = decode_attention_forward(Attn(q.shape[1] // k.shape[1]), q, k, v, None, scaling=0.3,
                                            isa=best_isa())
    assert weights is None and out.dtype == dtype
    assert out.shape == (q.shape[0], 1, q.shape[1], v.shape[-1])
    torch.testing.assert_close(out.float(), sdpa(q, k, v, scale=0.3), atol=tol, rtol=tol)


def test_padding_mask_is_sdpas():
    q, k, v = qkv(b=2, dtype=torch.float32)
    mask = torch.ones(2, 1, 1, k.shape[2], dtype=torch.bool)
    mask[0, ..., :9] = False                       # the first sequence's left padding
    out, _ = decode_attention_forward(Attn(4), q, k, v, mask, isa=best_isa())
    torch.testing.assert_close(out, sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)
    unmasked, _ = decode_attention_forward(Attn(4), q, k, v, None, isa=best_isa())
    assert not torch.allclose(out[0], unmasked[0]) and torch.equal(out[1], unmasked[1])


def test_every_kernel_path_computes_the_same_bits():
    q, k, v = qkv(b=2, n=300)
    outs = [decode_attention_forward(Attn(4), q, k, v, None, isa=isa)[0] for isa in {Isa.PORTABLE, best_isa()}]
    assert all(torch.equal(outs[0], o) for o in outs)


def test_compiled_call_makes_its_rows_in_the_graph_without_dynamos_warning(monkeypatch):
    """Traced by torch.compile (a `--compile` decode step), the call agrees with the eager one and its kv-head rows
    are made in the graph, not through the lru_cache dynamo warns about tracing around."""
    import warnings

    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set(), raising=False)   # dynamo warns once a process
    q, k, v = qkv(b=2, dtype=torch.float32)
    isa = best_isa()
    compiled = torch.compile(lambda q, k, v: decode_attention_forward(Attn(4), q, k, v, None, isa=isa)[0],
                             fullgraph=True, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(q, k, v)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    torch.testing.assert_close(out, decode_attention_forward(Attn(4), q, k, v, None, isa=isa)[0], atol=1e-6,
                               rtol=1e-6)


@pytest.mark.parametrize("case", ("prompt", "position_bias"))
def test_other_calls_are_sdpas_own(case):
    q, k, v = qkv(n=6, dtype=torch.float32)
    kw = {}
    if case == "prompt":
        q = torch.randn(1, 8, 6, 32)
    else:
        kw = dict(position_bias=torch.zeros(1, 8, 1, 6))   # an option only SDPA knows
    ours, _ = decode_attention_forward(Attn(4), q, k, v, None, isa=best_isa(), **kw)
    theirs, _ = sdpa_attention_forward(Attn(4), q, k, v, None, **kw)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral"))
def test_a_fused_model_generates_the_plain_models_tokens(folder, family):
    path = folder(family)
    ids = prompt_ids(path, 10)
    fused, _ = load(path, offload_gb=0, experts="fused")
    assert fused.config._attn_implementation == DECODE_ATTENTION
    tokens, logits = generate_new(fused, ids)
    ref_tokens, ref_logits = generate_new(reference_model(path, family), ids)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
