"""GGUF tensor names: what each in-memory tensor is called in the GGUF llama.cpp's converter writes.

GGUF names come from the `gguf` package (llama.cpp's own Python package: MODEL_ARCH, MODEL_TENSORS,
TENSOR_NAMES and its tensor-name map), never from a table written here. What `convert_hf_to_gguf.py`
does in code rather than through that map is the little written below, each with its reason:

- transformers 5 holds routed experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]); the converter
  writes them as `ffn_gate_exps` + `ffn_up_exps` (or, with `--fuse-gate-up-exps`, one `ffn_gate_up_exps`
  where the architecture has that tensor), and `down_proj` as `ffn_down_exps`;
- names are looked up as the checkpoint has them: transformers' own renamings are undone
  (`mlp` -> `block_sparse_moe` for Mixtral, Granite's `router.layer`; checkpoint_names.py), a
  `language_model.` segment is dropped (vision-language checkpoints), Qwen3-Next's `dt_bias` is its
  `dt_proj.bias`;
- Qwen3-Next's `in_proj_qkvz` is split into `attn_qkv` + `attn_gate` (its `modify_tensors`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError
from .checkpoint_names import checkpoint_renamings

# Hugging Face families that convert_hf_to_gguf.py registers under another GGUF architecture: Mixtral converts
# as a Llama, DeepSeek-V3 (and configs built as it, such as Kimi-K2) as DeepSeek-V2's MLA architecture.
_ARCH_OF = {"mixtral": "llama", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "kimi_k2": "deepseek2"}


def _squash(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def gguf_arch(model_type: str):
    """gguf's MODEL_ARCH for a transformers model_type; ConfigError when llama.cpp has none."""
    import gguf
    from gguf.constants import MODEL_ARCH_NAMES

    want = _squash(_ARCH_OF.get(model_type, model_type))
    for arch, name in MODEL_ARCH_NAMES.items():
        if _squash(name) == want:
            return arch
    version = getattr(gguf, "__version__", "installed")
    raise ConfigError(f"llama.cpp export: the gguf package ({version}) has no architecture for model type "
                      f"{model_type!r}, so llama.cpp cannot load a GGUF of it and has no tensor names to target; "
                      "upgrade gguf (`pip install -U gguf`) if llama.cpp gained it, or export for --engine vllm "
                      "or sglang")


@dataclass(frozen=True)
class GgufTensor:
    """The GGUF tensors one in-memory tensor becomes. `layouts[0]` is what the converter writes by default;
    a second layout is its other spelling (fused gate/up experts, MLA's split kv_b)."""

    layouts: tuple[tuple[str, ...], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for layout in self.layouts for n in layout))


class GgufNames:
    """In-memory tensor name -> GgufTensor (None: not in the model's GGUF, or no name llama.cpp gives it)."""

    def __init__(self, tensors: Sequence, model_type: str):
        from gguf.constants import MODEL_TENSORS
        from gguf.tensor_mapping import get_tensor_name_map

        self.arch = gguf_arch(model_type)
        self._kinds = MODEL_TENSORS[self.arch]
        blocks = max((t.layer for t in tensors if t.layer is not None), default=-1) + 1
        self._map = get_tensor_name_map(self.arch, blocks)
        self._undo = checkpoint_renamings(model_type)
        self.of: dict[str, GgufTensor | None] = {
            t.name: (self._lookup(t) if t.component == "language" else None) for t in tensors}

    def _fmt(self, kind, layer: int | None, suffix: str) -> str | None:
        from gguf.constants import TENSOR_NAMES

        if kind is None or kind not in self._kinds:
            return None
        return f"{TENSOR_NAMES[kind].format(bid=layer)}.{suffix}"

    def _lookup(self, t) -> GgufTensor | None:
        from gguf.constants import MODEL_TENSOR

        key, suffix = _key_and_suffix(t.name)
        last = key.rpartition(".")[2]
        if t.role == "routed_expert" and key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            if last == "down_proj":
                down = self._fmt(MODEL_TENSOR.FFN_DOWN_EXP, t.layer, suffix)
                return GgufTensor(((down,),)) if down else None
            gate, up = (self._fmt(k, t.layer, suffix) for k in (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP))
            fused = self._fmt(getattr(MODEL_TENSOR, "FFN_GATE_UP_EXP", None), t.layer, suffix)
            layouts = tuple(x for x in ((gate, up) if gate and up else None, (fused,) if fused else None) if x)
            return GgufTensor(layouts) if layouts else None
        if key.endswith(".linear_attn.in_proj_qkvz") and t.layer is not None:
            # Qwen3-Next: the converter splits in_proj_qkvz into attn_qkv (q, k, v) and attn_gate (z)
            split = tuple(self._fmt(k, t.layer, suffix) for k in (MODEL_TENSOR.ATTN_QKV, MODEL_TENSOR.ATTN_GATE))
            if all(split):
                return GgufTensor((split,))
        for candidate in self._candidates(t.name):
            # The converter looks the whole name up before it strips a suffix: Mamba's `A_log` and `D` become
            # `blk.N.ssm_a` / `blk.N.ssm_d`, with no `.weight` (gpt-oss's converter adds one to `sinks` itself).
            exact = self._map.get_type_and_name(candidate)
            if exact is not None and not candidate.endswith(".sinks"):
                return GgufTensor(((exact[1],),))
            key, suffix = _key_and_suffix(candidate)
            found = self._map.get_type_and_name(key)
            if found is None:
                continue
            kind, base = found
            layouts = [(f"{base}.{suffix}",)]
            if kind == MODEL_TENSOR.ATTN_KV_B:   # MLA: newer converters (the one `make engines` builds) split kv_b
                split = tuple(self._fmt(k, t.layer, suffix) for k in (MODEL_TENSOR.ATTN_K_B, MODEL_TENSOR.ATTN_V_B))
                if all(split):
                    layouts.insert(0, split)
            return GgufTensor(tuple(layouts))
        return None

    def _candidates(self, name: str) -> list[str]:
        """The tensor's name as the converter sees it: the checkpoint's (transformers' renamings undone),
        then the in-memory one."""
        undone = name
        for target, source in self._undo:
            undone = undone.replace(target, source)
        out = []
        for n in (undone, name):
            n = re.sub(r"(^|\.)language_model\.", r"\1", n)   # the converter drops it for VL checkpoints
            out.append(re.sub(r"\.dt_bias$", ".dt_proj.bias", n))   # Qwen3-Next: dt_bias is dt_proj's bias to it
        return list(dict.fromkeys(out))


def _key_and_suffix(name: str) -> tuple[str, str]:
    """`...q_proj.weight` -> (`...q_proj`, weight); fused parameters (`experts.down_proj`) are weights, and
    `X_bias` (gpt-oss `gate_up_proj_bias`, `dt_bias`) is the bias of X."""
    base, _, last = name.rpartition(".")
    if last in ("weight", "bias"):
        return base, last
    if last.endswith("_bias"):
        return f"{base}.{last[:-len('_bias')]}" if base else last[:-len("_bias")], "bias"
    return name, "weight"
