"""A plan in llama.cpp's words: GGUF tensor names, `-ot REGEX=CPU` and `--n-cpu-moe N`.

GGUF names come from the `gguf` package (llama.cpp's own Python package: MODEL_ARCH, MODEL_TENSORS,
TENSOR_NAMES and its tensor-name map), never from a table written here. What `convert_hf_to_gguf.py`
does in code rather than through that map is the little written below, each with its reason:

- transformers 5 holds routed experts fused (`mlp.experts.gate_up_proj` [E, 2I, H]); the converter
  writes them as `ffn_gate_exps` + `ffn_up_exps` (or, with `--fuse-gate-up-exps`, one `ffn_gate_up_exps`
  where the architecture has that tensor), and `down_proj` as `ffn_down_exps`;
- names are looked up as the checkpoint has them: transformers' own renamings are undone
  (`mlp` -> `block_sparse_moe` for Mixtral, Granite's `router.layer`), a `language_model.` segment is
  dropped (vision-language checkpoints), Qwen3-Next's `dt_bias` is its `dt_proj.bias`.

llama.cpp matches every `-ot` pattern with `std::regex_search` (ECMAScript) against each tensor name
and keeps the first pattern that matches (src/llama-model-loader.cpp). The patterns built here are
anchored with `^` and end at a `.`, so search semantics select exactly the names they spell out; they
use only `^ \\. ( | ) [0-9]`, on which Python's `re.search` and ECMAScript agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import ConfigError
from ..model.inventory import layer_of

# llama.cpp's regex for the expert tensors of a block (common/common.h LLM_FFN_EXPS_REGEX): `--n-cpu-moe N`
# adds `blk\.{i}` + this for every i < N, `--cpu-moe` adds it alone.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# -ngl above the layer count puts every layer (and the output head) on the GPU; -ot then sends the named
# tensors back to the CPU. Giving it also turns off the automatic fitting (--fit) of llama.cpp builds that have it.
ALL_LAYERS = "999"

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
        for candidate in self._candidates(t.name):
            key, suffix = _key_and_suffix(candidate)
            found = self._map.get_type_and_name(key)
            if found is None:
                continue
            kind, base = found
            layouts = [(f"{base}.{suffix}",)]
            if kind == MODEL_TENSOR.ATTN_KV_B:   # MLA: newer converters split kv_b into k_b and v_b
                split = tuple(self._fmt(k, t.layer, suffix) for k in (MODEL_TENSOR.ATTN_K_B, MODEL_TENSOR.ATTN_V_B))
                if all(split):
                    layouts.append(split)
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


def checkpoint_renamings(model_type: str) -> tuple[tuple[str, str], ...]:
    """transformers' checkpoint -> in-memory renamings for the family, reversed: (in-memory text, checkpoint text).

    Only plain renamings are undone (regex sources that are literal once `\\.` is read as `.`); the fused
    experts are handled by kind above."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    pairs = []
    for t in get_checkpoint_conversion_mapping(model_type) or ():
        if not isinstance(t, WeightRenaming) or len(t.source_patterns) != 1 or len(t.target_patterns) != 1:
            continue
        source = t.source_patterns[0].replace("\\.", ".")
        if not re.search(r"[\\^$*+?()\[\]{}|]", source):
            pairs.append((t.target_patterns[0], source))
    return tuple(reversed(pairs))


# ---------------------------------------------------------------------------------------
# What llama.cpp does with options


def overrides(args: Sequence[str]) -> list[str]:
    """The tensor patterns llama.cpp sends to the CPU for these command-line options, in its order:
    `-ot/--override-tensor P=CPU[,P=CPU...]`, `--n-cpu-moe N`, `--cpu-moe` (common/arg.cpp)."""
    out = []
    for i, arg in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else ""
        if arg in ("-ot", "--override-tensor"):
            for item in value.split(","):
                pattern, _, buft = item.partition("=")
                if buft == "CPU":
                    out.append(pattern)
        elif arg in ("-ncmoe", "--n-cpu-moe"):
            out += [rf"blk\.{b}{FFN_EXPS_REGEX}" for b in range(int(value))]
        elif arg in ("-cmoe", "--cpu-moe"):
            out.append(FFN_EXPS_REGEX)
    return out


def selected(names: Iterable[str], patterns: Sequence[str]) -> set[str]:
    """The names any pattern finds (std::regex_search semantics)."""
    compiled = [re.compile(p) for p in patterns]
    return {n for n in names if any(c.search(n) for c in compiled)}


# ---------------------------------------------------------------------------------------
# Writing patterns


def number_regex(numbers: Iterable[int]) -> str:
    """An alternation matching exactly these non-negative integers written in decimal: {10..23} ->
    `1[0-9]|2[0-3]`."""
    ns = sorted(set(numbers))
    pieces: list[str] = []
    start = 0
    for i in range(1, len(ns) + 1):
        if i == len(ns) or ns[i] != ns[i - 1] + 1:
            pieces += _range_pieces(ns[start], ns[i - 1])
            start = i
    return "|".join(pieces)


def _range_pieces(lo: int, hi: int) -> list[str]:
    out = []
    while lo <= hi:
        width = len(str(lo))
        top = min(hi, 10 ** width - 1)   # stay within one digit count: no leading zeros to match
        step = 1
        while step * 10 < 10 ** width and lo % (step * 10) == 0 and lo + step * 10 - 1 <= top:
            step *= 10
        first = (lo // step) % 10
        n = 1
        while first + n < 10 and lo + (n + 1) * step - 1 <= top:
            n += 1
        head = str(lo // step // 10) if lo // step >= 10 else ""
        digit = str(first) if n == 1 else ("[0-9]" if n == 10 else f"[{first}-{first + n - 1}]")
        out.append(head + digit + "[0-9]" * (len(str(step)) - 1))
        lo += n * step
    return out


def _words(words: Sequence[str]) -> str:
    """`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` -> `ffn_(gate|up|down)_exps`."""
    if len(words) == 1:
        return words[0]
    toks = [w.split("_") for w in words]
    shortest = min(len(t) for t in toks)
    pre = 0
    while pre < shortest - 1 and len({t[pre] for t in toks}) == 1:
        pre += 1
    suf = 0
    while suf < shortest - pre - 1 and len({t[-1 - suf] for t in toks}) == 1:
        suf += 1
    middles = ["_".join(t[pre:len(t) - suf]) for t in toks]
    return "_".join([*toks[0][:pre], f"({'|'.join(middles)})", *(toks[0][len(toks[0]) - suf:] if suf else [])])


def _entries(spec: Sequence[tuple[str, tuple[str, ...]]]) -> str:
    """The tensors of a block (or outside blocks) to match, as (kind, suffixes); no suffixes: the kind with
    every suffix it has there, which the pattern leaves open after the dot (`ffn_down_exps\\.`)."""
    clusters: dict[tuple[str, ...], list[str]] = {}
    for kind, suffixes in spec:
        clusters.setdefault(suffixes, []).append(kind)
    parts = []
    for suffixes, kinds in clusters.items():
        tail = "" if not suffixes else (suffixes[0] if len(suffixes) == 1 else f"({'|'.join(suffixes)})")
        parts.append(rf"{_words(kinds)}\.{tail}")
    return parts[0] if len(parts) == 1 else f"({'|'.join(parts)})"


def _blocks(numbers: Iterable[int]) -> str:
    text = number_regex(numbers)
    return text if "|" not in text else f"({text})"


def patterns_for(host: set[str], universe: dict[str, GgufTensor | None], layer: dict[str, int | None]
                 ) -> tuple[list[str], set[str]]:
    """-ot patterns that send exactly the GGUF tensors of the `host` in-memory tensors to the CPU.

    `universe`: the model's in-memory tensors that are in its GGUF (the language model), with their GGUF
    names. A block whose every tensor is host becomes `^blk\\.N\\.` (whatever its GGUF tensors are called);
    in other blocks the host tensors are named by kind, blocks with the same kinds sharing one pattern.
    Returns (patterns, host tensors that no pattern can name: in a block not wholly host, without a GGUF name).
    """
    by_block: dict[int | None, list[str]] = {}
    for name in universe:
        by_block.setdefault(layer[name], []).append(name)
    whole = sorted(b for b, names in by_block.items() if b is not None and all(n in host for n in names))
    groups: dict[tuple, list[int | None]] = {}
    unnamed = set()
    for block, names in by_block.items():
        if block in whole:
            continue
        want: dict[str, set[str]] = {}
        present: dict[str, set[str]] = {}
        for n in names:
            if universe[n] is None:
                unnamed |= {n} & host
                continue
            for gname in universe[n].names:
                kind, suffix = _kind(gname)
                present.setdefault(kind, set()).add(suffix)
                if n in host:
                    want.setdefault(kind, set()).add(suffix)
        spec = tuple((k, () if v == present[k] else tuple(sorted(v, key=lambda s: (s != "weight", s))))
                     for k, v in want.items())
        if spec:
            groups.setdefault((block is None, spec), []).append(block)
    out = [rf"^blk\.{_blocks(whole)}\."] if whole else []
    for (outside, spec), blocks in groups.items():
        out.append("^" + _entries(spec) if outside else rf"^blk\.{_blocks(blocks)}\." + _entries(spec))
    return out, unnamed


def _kind(gguf_name: str) -> tuple[str, str]:
    """`blk.3.ffn_down_exps.weight` -> (`ffn_down_exps`, `weight`); `output.weight` -> (`output`, `weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    return (stem.split(".", 2)[2] if stem.startswith("blk.") else stem), suffix


def block_of(gguf_name: str) -> int | None:
    return layer_of(gguf_name.replace("blk.", "layers.", 1)) if gguf_name.startswith("blk.") else None
