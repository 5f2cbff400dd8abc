"""A decode step's attention on a CPU by moe-offload's kernels, per key-value head, instead of torch's flash kernel.

With the CPU kernels (`--experts fused`, the CLI's default on a CPU) the expert and dense reads of a decode step
run at memory speed, and what is left shows: torch's `scaled_dot_product_attention` sends a one-token query down
its CPU flash-attention kernel, whose fixed cost (a new shape every step, as the cache grows) is most of the call.
At Qwen3-30B-A3B's attention (32 query heads over 4 key-value heads of 128, bf16), measured on the 2-core EPYC with
a fresh cache length per call: ~100 cached tokens 0.91 ms a layer at one thread (0.93 at two) against 0.11 here;
4000 cached tokens 31.8 ms (19.1) against 2.0 (1.3). torch's bf16 matmul does no better (1.5 ms at 100 tokens: a
oneDNN primitive made per new shape). The resident decode step of its layer x 8: 90.6 -> 82.8 ms at one thread,
55.5 -> 50.5 at two (docs/cli.md).

So a model loaded with the fused experts whose attention is torch's SDPA (transformers' "sdpa", the default) is
set to the attention function registered here (transformers' AttentionInterface, its documented extension point;
the masks are SDPA's, registered beside it). A call with one query position on a CPU reads each key-value head's
cached keys once for the group of query heads that share it (`expert_gemv`, the kv heads as the stack, no copy per
query head), scales, masks, takes a float32 softmax, and reads the cached values once likewise (as a transposed
stack): float32 throughout, rounded to the model's dtype at the end, the same bits on every kernel path. Every
other call (a prompt, an accelerator, dropout, options only SDPA knows) is SDPA's own, unchanged. Resident and
offloaded runs of one model take the same function, so they still agree bit for bit; against SDPA a decode step
agrees within rounding, and a model's tokens are the plain model's (tests/run/test_decode_attention.py).

Continuous batching (serve) accepts only its own implementations: serve sets such a model back to "sdpa" first
(`plain_attention`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..kernels import FLOAT_DTYPES, best_isa, expert_gemv

DECODE_ATTENTION = "moe_offload_decode"
_DELEGATED = ("softcap", "s_aux", "sinks", "position_bias")   # options only SDPA (or eager) knows


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, *, isa=None, **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key / value [B, KV, N, D] ->
    ([B, Q, H, D], None). `isa`: the kernels' path, resolved once at registration (opaque to torch.compile)."""
    b, heads, q, d = query.shape
    kv_heads, n, dv = key.shape[1], key.shape[2], value.shape[-1]   # dv: MLA's values are narrower than its keys
    if (q != 1 or query.device.type != "cpu" or dropout or heads % kv_heads or kwargs.get("output_attentions")
            or any(kwargs.get(k) is not None for k in _DELEGATED)
            or key.shape[-1] != d or value.shape[:3] != key.shape[:3]
            or query.dtype not in FLOAT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
            or (attention_mask is not None and attention_mask.shape[-1] != n)):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else d ** -0.5
    keys = key.contiguous().view(b * kv_heads, n, d)                     # a stack of B x KV [N, D] matrices
    values = value.contiguous().view(b * kv_heads, n, dv)
    # Inside a compiled step the rows are made in the graph (fixed shapes: once per compile), not through the
    # cache, which dynamo would trace around with a warning.
    ids = (_kv_rows.__wrapped__ if torch.compiler.is_compiling() else _kv_rows)(b, heads, kv_heads)
    scores = expert_gemv(query.reshape(b * heads, d), keys, ids, isa=isa).view(b, heads, n) * scale
    if attention_mask is not None:                                       # [B or 1, 1, 1, N]: SDPA's mask
        mask = attention_mask.reshape(attention_mask.shape[0], 1, n)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).view(b * heads, n)
    out = expert_gemv(probs, values, ids, transposed=True, isa=isa)      # [B x H, DV] float32
    return out.to(query.dtype).view(b, 1, heads, dv), None


@functools.lru_cache(maxsize=64)
def _kv_rows(b: int, heads: int, kv_heads: int) -> torch.Tensor:
    """int64 [B x H]: query row (sequence, head) -> its stack row, the matrix of its sequence's kv head."""
    return (torch.arange(b).repeat_interleave(heads) * kv_heads
            + torch.arange(heads).div(heads // kv_heads, rounding_mode="floor").repeat(b))


def register_decode_attention() -> None:
    """Register the function and SDPA's masks under DECODE_ATTENTION (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if DECODE_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, functools.partial(decode_attention_forward,
                                                                             isa=best_isa()))
    if DECODE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)


def use_decode_attention(model: nn.Module) -> bool:
    """Set a model whose attention is SDPA to DECODE_ATTENTION; returns whether it was set."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    register_decode_attention()
    model.set_attn_implementation(DECODE_ATTENTION)
    return model.config._attn_implementation == DECODE_ATTENTION


def plain_attention(model: nn.Module) -> None:
    """Back to SDPA (for continuous batching, which accepts only its own implementations)."""
    if getattr(model.config, "_attn_implementation", None) == DECODE_ATTENTION:
        model.set_attn_implementation("sdpa")
