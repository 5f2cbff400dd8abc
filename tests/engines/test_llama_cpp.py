"""llama.cpp in the loop: make-tiny checkpoints converted by llama.cpp's own converter (f32 GGUF) decode the same
greedy tokens as transformers and moe-offload, and the tensors llama.cpp itself reports overridden to the CPU under
`moe-offload export --engine llama.cpp`'s options are exactly the ones export says (its JSON `cpu_tensors`).

Models: make-tiny, 2 layers, 8 experts, top-2, hidden 256, float32; each converted once per session
(`fixtures_engines.convert`; Qwen3-Next with the converter's `--no-mtp`: released Qwen3-Next carries MTP layers,
make-tiny's does not, and the converter asserts on their count otherwise).

Families covered: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, gpt_oss, qwen3_vl_moe, olmoe, granitemoe, deepseek_v2,
glm4_moe, qwen3_next, jamba. Not covered:

- phimoe: llama.cpp has no converter for it ("ERROR:hf-to-gguf:Model PhimoeForCausalLM is not supported").

Export fixes these tests found (export was fixed, not the tests): DeepSeek's MLA `attn_kv_b` is written split
(`attn_k_b`, `attn_v_b`) by the pinned converter; Qwen3-Next's `in_proj_qkvz` becomes `attn_qkv` + `attn_gate`;
Mamba's `A_log` / `D` (jamba) are `blk.N.ssm_a` / `blk.N.ssm_d` with no suffix, which export's `-ot` pattern
did not match.

Agreement tolerance: llama.cpp's f32 log-probabilities differ from transformers' by about 1e-3 (its own kernels
and summation order), so two engines may pick different tokens only where the top-2 logit margin is within that
noise. A first differing position where transformers' margin exceeds MARGIN_TOL = 1e-2 (ten times the observed
difference) fails; within it, the prefix up to there must agree and the rest is not compared (the continuations
have diverged legitimately).
"""

from __future__ import annotations

import json

import pytest
import torch

import moe_offload as mo
from fixtures_cli import run_cli
from fixtures_engines import convert, llama_greedy, llama_overrides, require
from fixtures_models import BACKENDS, load, reference_model, run
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny

pytestmark = pytest.mark.engines

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_vl_moe", "olmoe", "granitemoe",
            "deepseek_v2", "glm4_moe", "qwen3_next", "jamba")
SIZES = dict(layers=2, experts=8, top_k=2, hidden=256)
PROMPT = [1, 100, 200, 300, 400, 77]
NEW = 8
MARGIN_TOL = 1e-2

_MODELS: dict = {}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """family -> (HF folder, GGUF), made and converted once per session."""
    require("llama.cpp")

    def get(family):
        if family not in _MODELS:
            folder = make_tiny(tmp_path_factory.mktemp("llama-tiny") / family, family=family, **SIZES)
            _MODELS[family] = (folder, convert(folder, family, tmp_path_factory))
        return _MODELS[family]
    return get


def _greedy_with_margins(model, ids: torch.Tensor):
    """Greedy tokens past any EOS (llama.cpp runs with ignore_eos) and each step's top-2 logit margin."""
    seq, logits, _ = run(model, ids, new_tokens=NEW, ignore_eos=True)
    top = torch.topk(logits.float(), 2, dim=-1).values
    return seq[0, ids.shape[1]:].tolist(), (top[:, 0] - top[:, 1]).tolist()


def _compare(name: str, ref: list[int], margins: list[float], got: list[int]) -> None:
    assert len(got) == len(ref), f"{name}: {len(got)} tokens, expected {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            assert margins[i] <= MARGIN_TOL, (
                f"{name}: first differing token at new position {i}: {b} against transformers' {a}, where "
                f"transformers' top-2 logit margin is {margins[i]:.4g} > {MARGIN_TOL} (beyond float noise); "
                f"transformers {ref}, {name} {got}")
            return


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_agree(tiny, family):
    folder, gguf = tiny(family)
    ids = torch.tensor([PROMPT])
    ref, margins = _greedy_with_margins(reference_model(folder, family), ids)
    plan0 = mo.plan(folder, offload_gb=0)
    routed = sum(t.bytes for t in plan0.tensors if t.role == "routed_expert")
    for backend in BACKENDS:
        model, plan = load(folder, offload_gb=routed / 2 / GiB, backend=backend)
        assert any(t.role == "routed_expert" and t.tier != "device" for t in plan.tensors), "no expert offloaded"
        got, _ = _greedy_with_margins(model, ids)
        _compare(f"moe-offload ({backend})", ref, margins, got)
    got, _ = llama_greedy(gguf, PROMPT, NEW)
    _compare("llama.cpp", ref, margins, got)


def _budgets(folder) -> dict[str, float]:
    """small: part of the first MoE layer's experts (an -ot by kind); middle: that layer's experts and part of
    the next's (-ot over two blocks, or one block's kinds); all: every routed expert (--n-cpu-moe)."""
    plan0 = mo.plan(folder, offload_gb=0)
    ts = plan0.tensors
    routed = [t for t in ts if t.role == "routed_expert"]
    embed = sum(t.bytes for t in ts if t.role == "embedding")
    first = routed[0].layer
    layer0 = sum(t.bytes for t in routed if t.layer == first)
    later = [t for t in routed if t.layer != first] or routed
    return {"small": (embed + routed[0].bytes // 2) / GiB,
            "middle": (embed + layer0 + later[0].bytes // 2) / GiB,
            "all": (embed + sum(t.bytes for t in routed)) / GiB}


def _engine_options(args: list[str]) -> list[str]:
    keep, i = [], 0
    while i < len(args):
        if args[i] in ("-ot", "--override-tensor", "--n-cpu-moe", "-ncmoe"):
            keep += args[i:i + 2]
            i += 2
        else:
            i += 1
    return keep


@pytest.mark.parametrize("family", FAMILIES)
def test_export_overrides_are_what_llama_cpp_applies(tiny, family, capsys):
    folder, gguf = tiny(family)
    seen_n_cpu_moe = False
    for label, gb in _budgets(folder).items():
        rc, out, err = run_cli(capsys, "export", folder, "--engine", "llama.cpp", "--offload-gb", repr(gb), "--json")
        assert rc == 0, err
        result = json.loads(out)
        options = _engine_options(result["args"])
        seen_n_cpu_moe |= "--n-cpu-moe" in options
        got = llama_overrides(gguf, options)
        want = set(result["cpu_tensors"])
        assert got, f"{family} {label}: llama.cpp overrode nothing under {options}"
        assert got == want, (f"{family} {label} {options}: llama.cpp only {sorted(got - want)}, "
                             f"export only {sorted(want - got)}")
    assert seen_n_cpu_moe, f"{family}: no budget exported as --n-cpu-moe"
