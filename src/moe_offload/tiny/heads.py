"""make-tiny's attention heads: how many query and key/value heads, and how wide, for a family and hidden size.

`attention_sizes` resolves `heads`, `kv_heads` and `head_dim` (None: the defaults, which are exactly what
make-tiny always wrote: 4 heads, 2 key/value heads, head_dim = hidden // 4) and refuses, before anything is
built, a combination the family's transformers model (and the engines that read its config) cannot take:

- a head is rotated in pairs and partial / decoupled rotary (GLM, DeepSeek's MLA, Qwen3-VL's M-RoPE) rotates
  half a head, so head_dim is a multiple of 4;
- grouped-query attention shares each key/value head among a whole number of query heads;
- families whose head size is hidden / heads (`families.HEAD_DIM_FIELD` lists the others) cannot take a
  head_dim that disagrees with it;
- DeepSeek's MLA and OLMoE have as many key/value heads as query heads (`families.KV_HEADS_ARE_HEADS`).

Why a caller wants other heads: engines' attention kernels take the head sizes real models have (64, 128,
256); vLLM's CPU attention refuses the 16 and 384 that hidden // 4 gives at hidden 64 and 1536.
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import HEAD_DIM_FIELD, HEADS, KV_HEADS_ARE_HEADS

__all__ = ["AttentionSizes", "attention_sizes", "invalid"]


def invalid(what: str, why: str, fix: str) -> ValueError:
    """make-tiny's refusal of an argument: what is wrong, why, and the fix, in one sentence each."""
    return ValueError(f"{what}: {why}. Fix: {fix}.")


@dataclass(frozen=True)
class AttentionSizes:
    heads: int
    kv_heads: int
    head_dim: int


def _default_kv_heads(heads: int) -> int:
    # Two query heads per key/value head (grouped-query attention, as 4 -> 2 always was); plain multi-head
    # attention where heads is odd.
    return heads // 2 if heads % 2 == 0 else heads


def attention_sizes(family: str, hidden: int, heads: int | None = None, kv_heads: int | None = None,
                    head_dim: int | None = None) -> AttentionSizes:
    """The heads of a tiny `family` model of hidden size `hidden`; ValueError (what / why / fix) if impossible.
    `hidden` is already known to be a positive integer."""
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise invalid(f"{name}={value!r} is not an integer", f"{name} counts attention units", "pass an int")
        if value is not None and value < 1:
            raise invalid(f"{name}={value} is invalid", f"attention needs {name} >= 1", f"pass {name} >= 1")
    heads = HEADS if heads is None else heads
    own_field = family in HEAD_DIM_FIELD
    if head_dim is None:
        if hidden % heads or (hidden // heads) % 4:
            fix = (f"pass a hidden size that is a multiple of {4 * heads}"
                   + (", or give head_dim" if own_field else f", or other heads ({family} has no head_dim: "
                      "each head is hidden / heads wide)"))
            raise invalid(f"hidden={hidden} is invalid for heads={heads}",
                          f"it must split into {heads} attention heads whose size is divisible by 4 (rotary "
                          "embeddings rotate pairs, and partial/decoupled rotary uses half a head)", fix)
        head_dim = hidden // heads
    elif head_dim % 4:
        raise invalid(f"head_dim={head_dim} is invalid",
                      "rotary embeddings rotate pairs, and partial/decoupled rotary uses half a head, so a head's "
                      "size must be divisible by 4", "pass a multiple of 4, e.g. 64 or 128")
    elif not own_field and head_dim * heads != hidden:
        other = f", or heads={hidden // head_dim}" if hidden % head_dim == 0 else ""
        raise invalid(f"head_dim={head_dim} is invalid for {family} with hidden={hidden} and heads={heads}",
                      f"{family}'s config has no head_dim of its own: transformers, vLLM and llama.cpp take each "
                      f"head as hidden / heads = {hidden / heads:g} wide",
                      f"pass hidden={head_dim * heads} (heads x head_dim){other}, or leave head_dim out")
    why_equal = KV_HEADS_ARE_HEADS.get(family)
    if why_equal is not None:
        if kv_heads is not None and kv_heads != heads:
            raise invalid(f"kv_heads={kv_heads} is invalid for {family}", why_equal,
                          f"leave kv_heads out, or pass kv_heads={heads} (= heads)")
        kv_heads = heads
    elif kv_heads is None:
        kv_heads = _default_kv_heads(heads)
    elif heads % kv_heads:
        raise invalid(f"kv_heads={kv_heads} is invalid for heads={heads}",
                      "grouped-query attention shares each key/value head among a whole number of query heads",
                      "pass a kv_heads that divides heads")
    return AttentionSizes(heads, kv_heads, head_dim)
