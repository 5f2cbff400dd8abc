"""vLLM's CPU build in the loop: our checkpoints, greedy tokens and `export --engine vllm` against running vLLM.

One vLLM process (tests/engines/vllm_probe.py, run with the python and environment of `tools/engines.py where
--json`) loads every make-tiny checkpoint below in turn (hidden 256, 4 heads: head_dim 64, which vLLM's CPU
attention accepts), greedy-decodes one fixed token-id prompt, lists its own model's parameters
(`LLM.apply_model`), and parses every option list export printed in vLLM's own parser
(`EngineArgs.add_cli_args` on its FlexibleArgumentParser, then `EngineArgs.from_cli_args`).

Agreement: the tokens of transformers (fp32, eager experts, fresh allocations: fixtures_models), of
moe-offload's offloaded model (both backends, every routed expert on the host) and of vLLM agree. A differing
token fails unless the reference's logit margin between the two tokens there is within MARGIN_TOL (a near tie,
where float noise may pick either; the comparison stops there); vLLM's log-probability of each agreed token
must be within LOGPROB_TOL of transformers' log-softmax. Tolerances: fp32 throughout; vLLM's CPU kernels
(oneDNN GEMMs, its own attention and fused-MoE) sum in another order than torch's, which moves a logit by
~1e-6 at these sizes (vLLM's log-probabilities match transformers' to ~1e-6 when it was installed). 1e-4 is well above that noise
and far below any real difference (a wrong weight, layout, norm or routing moves logits by >= 1e-2).
moe-offload against transformers is exact in the suite (tests/run, marker `exact`); here its tokens must equal
the reference's and its logits agree within LOGPROB_TOL.

Export: the options `export --engine vllm --json` prints at several budgets (and with --offload-params) parse
in vLLM's own parser and give the cpu_offload_gb / cpu_offload_params export printed; the decoder-layer
parameters vLLM's own model class builds (recorded as its offloader walks them: layer, name, bytes, in order)
are exactly the ones export walks (`engine_params`), and vLLM's offloader rule (`_uva_walk`), applied to vLLM's
own parameters with the parsed options, takes the bytes export's walk takes. (This check found export's names
and order wrong for vLLM 0.32: FusedMoE weights under `experts.routed_experts.`, gpt-oss attention `attn.`,
GraniteMoE's router `gate`, MoE blocks and layer norms in vLLM's own order; export was fixed.)

Families vLLM 0.32's CPU build does not run here (see UNSUPPORTED): a make-tiny family is added to FAMILIES
when vLLM loads it unmodified.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import moe_offload as mo
from fixtures_engines import require
from fixtures_models import load, reference_model, run
from moe_offload.cli.main import main
from moe_offload.engines.engine import Engine
from moe_offload.engines.vllm import engine_params, walk
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny

pytestmark = pytest.mark.engines

PROBE = Path(__file__).with_name("vllm_probe.py")
SIZES = dict(layers=2, experts=8, top_k=2, hidden=256)
PROMPT = [1, 100, 200, 300, 400]
NEW = 8
MARGIN_TOL = 1e-4
LOGPROB_TOL = 1e-4

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "olmoe", "granitemoe", "glm4_moe")
UNSUPPORTED = {
    # MLA's head (kv_lora_rank + qk_rope_head_dim) is 160 at hidden 256; vLLM's CPU MLA takes the released
    # models' 576 (512 + 64), which make-tiny reaches only at hidden >= 1024. (Before make-tiny wrote
    # `topk_method: noaux_tc`, as released DeepSeek-V3 does, vLLM failed earlier: no e_score_correction_bias.)
    "deepseek_v3": "ValueError: Head dimension 160 is not supported by MLA.",
    # vLLM's Qwen3-VL imports transformers' Qwen2-VL image processor, which needs torchvision; the engine venv
    # removes torchvision (its wheels do not match the CPU torch pin).
    "qwen3_vl_moe": "No module named 'torchvision'",
}


def _export(folder, *extra) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", str(folder), "--engine", "vllm", "--json", *extra]) == 0
    return json.loads(out.getvalue())


def _budgets(folder) -> dict[str, list[str]]:
    """export options: the first MoE layer's experts, every expert, experts plus a third of the dense bytes,
    declaration order, the whole model, and explicit selectors."""
    p0 = mo.plan(folder, offload_gb=0)
    routed = [t for t in p0.tensors if t.role == "routed_expert"]
    first = min(t.layer for t in routed)
    one = sum(t.bytes for t in routed if t.layer == first)
    experts = sum(t.bytes for t in routed)
    dense = sum(t.bytes for t in p0.tensors if t.role not in ("routed_expert", "embedding"))
    gb = lambda b: ["--offload-gb", repr(b / GiB)]   # noqa: E731
    return {
        "first-layer": gb(one),
        "experts": gb(experts),
        "more": gb(experts + dense // 3),
        "declaration": gb(one) + ["--policy", "declaration"],
        "all": gb(p0.total_bytes),
        "selectors": gb(experts // 2) + ["--offload-params", "experts"],
    }


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    entry = require("vllm")
    root = tmp_path_factory.mktemp("vllm")
    dirs = {f: make_tiny(root / f, family=f, **SIZES) for f in FAMILIES}
    exports = {(f, name): _export(dirs[f], *opts) for f in FAMILIES for name, opts in _budgets(dirs[f]).items()}
    parse = [e["args"] for e in exports.values()]
    job = {"models": [{"name": f, "dir": str(d), "prompt_ids": PROMPT, "max_tokens": NEW} for f, d in dirs.items()],
           "parse": parse}
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, **entry["env"]}
    done = subprocess.run([entry["python"], str(PROBE), str(root / "job.json"), str(root / "out.json")], env=env,
                          capture_output=True, text=True, timeout=1500)
    if not (root / "out.json").exists():
        pytest.fail(f"vllm_probe.py exited {done.returncode}: {done.stderr[-3000:]}", pytrace=False)
    result = json.loads((root / "out.json").read_text())
    parsed = {tuple(p["args"]): p for p in result["parse"]}
    return {"dirs": dirs, "exports": exports, "parsed": parsed, "models": result["models"],
            "returncode": done.returncode, "stderr": done.stderr}


def _model(vllm, family) -> dict:
    m = vllm["models"].get(family)
    if m is None or "error" in m:
        why = (m or {}).get("trace") or vllm["stderr"][-3000:]
        pytest.fail(f"vLLM did not run make-tiny {family}: {(m or {}).get('error')}\n{why}", pytrace=False)
    return m


def _first_difference(ref_tokens, logits, tokens) -> tuple[int, str] | None:
    """(position, message) of the first token that differs beyond a near tie, or None."""
    for i, (a, b) in enumerate(zip(ref_tokens, tokens)):
        if a != b:
            margin = float(logits[i, a] - logits[i, b])
            msg = (f"first differing position {i} (new token {i}): transformers {a}, other {b}; transformers' logit "
                   f"margin there {margin:.3g} (tolerance {MARGIN_TOL:g})")
            return i, msg
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_agree_transformers_moe_offload_vllm(vllm, family):
    folder = vllm["dirs"][family]
    m = _model(vllm, family)
    ids = torch.tensor([PROMPT])
    seq, logits, _ = run(reference_model(folder, family), ids, new_tokens=NEW, ignore_eos=True)
    ref = seq[0, len(PROMPT):].tolist()
    logp = torch.log_softmax(logits.double(), dim=-1)

    diff = _first_difference(ref, logits, m["tokens"])
    upto = NEW
    if diff is not None:
        i, msg = diff
        assert abs(float(logits[i, ref[i]] - logits[i, m["tokens"][i]])) <= MARGIN_TOL, f"vLLM: {msg}"
        upto = i   # a near tie: float noise may pick either token; what follows is not comparable
    for i in range(upto):
        tid, lp = m["top"][i][0]
        assert tid == ref[i]
        assert abs(lp - float(logp[i, tid])) <= LOGPROB_TOL, (
            f"vLLM step {i}: log-probability of token {tid} {lp} against transformers' {float(logp[i, tid])}")

    for backend in ("uva", "prefetch"):
        p0 = mo.plan(folder, offload_gb=0)
        experts = sum(t.bytes for t in p0.tensors if t.role == "routed_expert")
        model, plan = load(folder, backend=backend, offload_gb=experts / GiB)
        assert any(t.tier == "host" and t.role == "routed_expert" for t in plan.tensors)
        got_seq, got_logits, _ = run(model, ids, new_tokens=NEW, ignore_eos=True)
        got = got_seq[0, len(PROMPT):].tolist()
        diff = _first_difference(ref, logits, got)
        assert diff is None, f"moe-offload ({backend}): {diff[1]}"
        err = float((got_logits - logits).abs().max())
        assert err <= LOGPROB_TOL, f"moe-offload ({backend}): logits differ from transformers' by {err:.3g}"


def _vllm_layer_params(m) -> list[tuple[int, str, int]]:
    """vLLM's decoder-layer parameters as its offloader walks them: (layer, layer-relative name, bytes), in
    order, recorded when `make_layers` hands each layer to the offloader, before weights are loaded."""
    return [(layer, name, nbytes) for layer, name, _shape, _dtype, nbytes in m["params"]]


def _uva_walk(params, gb: float, selectors: set[str]) -> int:
    """UVAOffloader._maybe_offload_to_cpu over the decoder layers, restated from vLLM 0.32
    (model_executor/offloader/uva.py): bytes offloaded."""
    limit, done = int(gb * GiB), 0
    for _layer, name, nbytes in params:
        if done >= limit:
            break
        if selectors and not any(f".{s}." in f".{name}." for s in selectors):
            continue
        done += nbytes
    return done


@pytest.mark.parametrize("family", FAMILIES)
def test_export_args_parse_in_vllms_parser(vllm, family):
    budgets = [name for f, name in vllm["exports"] if f == family]
    for name in budgets:
        e = vllm["exports"][(family, name)]
        args = e["args"]
        p = vllm["parsed"][tuple(args)]
        assert "error" not in p, f"{name}: vLLM's parser refuses {args}: {p.get('error')}"
        gb = float(args[args.index("--cpu-offload-gb") + 1]) if "--cpu-offload-gb" in args else 0.0
        sel = args[args.index("--cpu-offload-params") + 1:] if "--cpu-offload-params" in args else []
        assert p["cpu_offload_gb"] == gb, name
        assert set(p["cpu_offload_params"]) == set(sel), name


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_builds_the_parameters_export_walks(vllm, family):
    m = _model(vllm, family)
    theirs = _vllm_layer_params(m)
    params = engine_params(mo.plan(vllm["dirs"][family], offload_gb=0), Engine.VLLM)
    ours = [(p.layer, p.names[0], p.bytes) for p in params]
    assert ours == theirs, next((f"first difference at {i}: export {a}, vLLM {b}"
                                 for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), (len(ours), len(theirs)))
    for name in [n for f, n in vllm["exports"] if f == family]:
        args = vllm["exports"][(family, name)]["args"]
        p = vllm["parsed"][tuple(args)]
        gb, sel = p["cpu_offload_gb"], set(p["cpu_offload_params"])
        taken = walk(params, sorted(sel), int(gb * GiB))
        assert _uva_walk(theirs, gb, sel) == sum(t.bytes for t in taken), (name, args)
