"""A plan in llama.cpp's options: `-ot REGEX=CPU` and `--n-cpu-moe N` over GGUF tensor names (gguf_names.py).

llama.cpp matches every `-ot` pattern with `std::regex_search` (ECMAScript) against each tensor name
and keeps the first pattern that matches (src/llama-model-loader.cpp). The patterns built here are
anchored with `^` and end at a `.`, so search semantics select exactly the names they spell out; they
use only `^ \\. ( | ) [0-9]`, on which Python's `re.search` and ECMAScript agree. llama.cpp builds its
input embedding in host memory whatever the options, and places tensors whole: an expert tensor cannot
be split.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from ..model.inventory import layer_of
from ..planning.placement import Plan
from .engine import OFFLOADED
from .gguf_names import GgufNames, GgufTensor

# llama.cpp's regex for the expert tensors of a block (common/common.h LLM_FFN_EXPS_REGEX): `--n-cpu-moe N`
# adds `blk\.{i}` + this for every i < N, `--cpu-moe` adds it alone.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# -ngl above the layer count puts every layer (and the output head) on the GPU; -ot then sends the named
# tensors back to the CPU. Giving it also turns off the automatic fitting (--fit) of llama.cpp builds that have it.
ALL_LAYERS = "999"


# ---------------------------------------------------------------------------------------
# The options for a plan


def llama_cpp_options(plan: Plan) -> tuple[list[str], set[str], list[str]]:
    """llama.cpp's options for `plan`: (args, the in-memory tensors they send to host memory, notes)."""
    gg = GgufNames(plan.tensors, plan.model_type)
    by_name = {t.name: t for t in plan.tensors}
    planned = {t.name for t in plan.tensors if t.tier in OFFLOADED}
    # llama.cpp builds the input embedding in host memory whatever the options (it never offloads its input
    # layer). A table tied to the output head is the head too: that copy follows -ngl and -ot.
    embed = {n for n, g in gg.of.items() if g and "token_embd.weight" in g.names and by_name[n].role == "embedding"}
    tied = {n for n, g in gg.of.items() if g and "token_embd.weight" in g.names} - embed
    universe = {n: g for n, g in gg.of.items() if by_name[n].component == "language" and n not in embed}
    patterns, unnamed = patterns_for(planned & set(universe), universe, {n: by_name[n].layer for n in universe})
    gguf = {name: g.layouts[0] for name, g in universe.items() if g is not None}
    names = {x for layout in gguf.values() for x in layout}
    chosen = selected(names, patterns)
    args, notes = ["-ngl", ALL_LAYERS], []
    n = max((block_of(x) for x in chosen if block_of(x) is not None), default=-1) + 1
    first_n = selected({x for x in names if block_of(x) is not None and block_of(x) < n}, [FFN_EXPS_REGEX])
    if chosen and chosen == first_n:
        args += ["--n-cpu-moe", str(n)]
        notes.append(f"--n-cpu-moe {n} sends exactly the routed experts of the first {n} layers to the CPU")
    else:
        args += [item for p in patterns for item in ("-ot", f"{p}=CPU")]
    # What those options do, by llama.cpp's rule; a tensor without a GGUF name goes with its block's pattern.
    sent = selected(names, overrides(args))
    host = {name for name, layout in gguf.items() if set(layout) <= sent}
    assert not any(set(layout) & sent for name, layout in gguf.items() if name not in host)   # tensors go whole
    host |= embed | (planned & {n for n, g in universe.items() if g is None}) - unnamed
    towers = {t.name for t in plan.tensors if t.component != "language"}
    if planned & towers:
        # The towers are the separate --mmproj GGUF, which llama.cpp places as one piece.
        args.append("--no-mmproj-offload")
        host |= towers
        if not towers <= planned:
            notes.append("llama.cpp places the vision/audio tower (the --mmproj file) as one piece: all of it goes "
                         "to host memory")
    if embed - planned:
        notes.append("llama.cpp keeps the input embedding (token_embd.weight) in host memory whatever the options; "
                     "a token reads one row of it there")
    if tied - planned:
        notes.append("the output head shares the input embedding's table (tied): llama.cpp keeps it on the GPU as "
                     "planned and reads the input rows from a second copy in host memory")
    if unnamed:
        notes.append(f"{len(unnamed)} offloaded tensors have no GGUF name from llama.cpp's converter "
                     f"({', '.join(sorted(unnamed)[:3])}) and share a layer with resident ones: they stay on the GPU")
    notes.append("MODEL.gguf: the model converted by llama.cpp's convert_hf_to_gguf.py. -ngl 999 puts everything "
                 "else on the GPU (and so turns off --fit); llama.cpp computes with CPU-resident weights on the CPU "
                 "at decode, so the link bytes here are bytes read from host memory")
    return args, host, notes


def cpu_tensors(plan: Plan, args: Sequence[str]) -> set[str]:
    """The GGUF tensors (names as llama.cpp's converter writes them) that these options override to the CPU
    buffer: what `llama-completion -v` logs as "tensor ... buffer type overridden to CPU". The input
    embedding, which llama.cpp keeps in host memory without an override, is not among them."""
    gg = GgufNames(plan.tensors, plan.model_type)
    names = {x for t in plan.tensors if t.component == "language" and gg.of.get(t.name) is not None
             for x in gg.of[t.name].layouts[0]}
    return selected(names, overrides(args))


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
        if "" in suffixes:   # a tensor without a suffix (`blk.N.ssm_a`): the name ends at the kind
            alts = [rf"\.{x}" if x else "$" for x in suffixes]
            parts.append(_words(kinds) + (alts[0] if len(alts) == 1 else f"({'|'.join(alts)})"))
            continue
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
        spec = tuple((k, () if v == present[k] and "" not in v else tuple(sorted(v, key=lambda s: (s != "weight", s))))
                     for k, v in want.items())
        if spec:
            groups.setdefault((block is None, spec), []).append(block)
    out = [rf"^blk\.{_blocks(whole)}\."] if whole else []
    for (outside, spec), blocks in groups.items():
        out.append("^" + _entries(spec) if outside else rf"^blk\.{_blocks(blocks)}\." + _entries(spec))
    return out, unnamed


def _kind(gguf_name: str) -> tuple[str, str]:
    """`blk.3.ffn_down_exps.weight` -> (`ffn_down_exps`, `weight`); `output.weight` -> (`output`, `weight`);
    `blk.3.ssm_a` -> (`ssm_a`, ``)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk.") and stem.count(".") < 2 or not stem:   # no suffix: `blk.3.ssm_a`, `rope_freqs`
        return (gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name), ""
    return (stem.split(".", 2)[2] if stem.startswith("blk.") else stem), suffix


def block_of(gguf_name: str) -> int | None:
    return layer_of(gguf_name.replace("blk.", "layers.", 1)) if gguf_name.startswith("blk.") else None
