"""`profile`: a trace of every prefill and decode token's routing, recorded through the runtime's experts
function, for every family make-tiny writes; and the runtime's measured link bytes for a generation equal
`replay` of that generation's own trace.

Models: fixtures_models (E=6 experts, top-2, 2 layers; DeepSeek/GLM/Jamba route in layer 1 only).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import moe_offload as mo
from fixtures_models import BACKENDS, EXPERTS, FAMILIES, TOP_K, budgets
from moe_offload.cli.main import main
from moe_offload.loading.loader import load_tokenizer
from moe_offload.planning.placement import GiB
from moe_offload.measure.profile import profile, record, trace_header
from moe_offload.routing.replay import replay
from moe_offload.formats.traces import TraceWriter, expert_counts, read_trace

PROMPTS = ["The harbour master counted seven ships", "Rain fell on the quiet valley all night long"]
NEW = 3
_FIRST_DENSE = {"deepseek_v3", "deepseek_v2", "glm4_moe", "jamba"}
MOE_LAYERS = {f: (1,) if f in _FIRST_DENSE else (0, 1) for f in FAMILIES}


def _prompt_lengths(folder) -> list[int]:
    tok = load_tokenizer(folder)
    return [len(tok(p).input_ids) for p in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_writes_every_token_of_every_family(models, tmp_path, family):
    folder = models[family]
    result = profile(folder, tmp_path / "t.jsonl", prompts=PROMPTS, max_new_tokens=NEW, ignore_eos=True,
                     device="cpu")
    trace = read_trace(tmp_path / "t.jsonl")        # the checking reader accepts what profile wrote
    h = trace.header
    assert (h.model_type, h.num_experts, h.top_k, h.layers) == (family, EXPERTS, TOP_K, MOE_LAYERS[family])
    assert result.header == h
    lengths = _prompt_lengths(folder)
    assert len(trace.rows) == sum(lengths) + NEW * len(PROMPTS)
    for seq, n in enumerate(lengths):
        rows = [r for r in trace.rows if r.seq == seq]
        assert [r.pos for r in rows] == list(range(n + NEW))
        assert [r.phase for r in rows] == ["prefill"] * n + ["decode"] * NEW
        for r in rows:
            assert len(r.experts) == len(h.layers)
            assert all(len(ids) == TOP_K == len(set(ids)) and all(0 <= e < EXPERTS for e in ids) for ids in r.experts)
    assert [r.seq for r in trace.rows] == sorted(r.seq for r in trace.rows)    # in processing order
    assert [s.decode_tokens for s in result.sequences] == [NEW] * len(PROMPTS)
    assert [row["layer"] for row in result.skew] == list(h.layers)
    assert all(row["tokens"] == NEW * len(PROMPTS) for row in result.skew)


class RouterHooks:
    """What each transformers `*TopKRouter` returned (its top_k_index), per call: independent of the runtime."""

    def __init__(self, model):
        self.picked: list[tuple[int, torch.Tensor]] = []
        self.handles = []
        for name, mod in model.named_modules():
            if type(mod).__name__.lower().endswith("topkrouter"):
                layer = int(re.search(r"\.layers\.(\d+)\.", name).group(1))
                self.handles.append(mod.register_forward_hook(
                    lambda m, a, out, layer=layer: self.picked.append((layer, out[-1].clone()))))


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routing_is_what_the_routers_picked(models, tmp_path, family):
    folder = models[family]
    model, plan = mo.load(folder, device="cpu", offload_gb=0)
    hooks = RouterHooks(model)
    assert hooks.handles
    with TraceWriter(tmp_path / "t.jsonl", trace_header(plan, "test")) as writer:
        record(model, load_tokenizer(folder), PROMPTS[:1], writer, max_new_tokens=NEW, ignore_eos=True)
    rows = read_trace(tmp_path / "t.jsonl").rows
    layers = MOE_LAYERS[family]
    # hooks.picked: per forward call, one (layer, [tokens, k]) per routed layer, in layer order
    per_call = [hooks.picked[i:i + len(layers)] for i in range(0, len(hooks.picked), len(layers))]
    want = []
    for call in per_call:
        assert [layer for layer, _ in call] == list(layers)
        for t in range(call[0][1].shape[0]):
            want.append(tuple(tuple(index[t].tolist()) for _, index in call))
    assert [r.experts for r in rows] == want


def test_generation_stops_at_eos_and_the_eos_token_has_no_row(models, tmp_path):
    folder = models["qwen3_moe"]
    model, plan = mo.load(folder, device="cpu", offload_gb=0)
    tok = load_tokenizer(folder)
    n = _prompt_lengths(folder)[0]
    with TraceWriter(tmp_path / "free.jsonl", trace_header(plan, "test")) as writer:
        (free,) = record(model, tok, PROMPTS[:1], writer, max_new_tokens=4, ignore_eos=True)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                eos_token_id=[])[0, n:]
    model.generation_config.eos_token_id = int(greedy[2])       # the third generated token is EOS
    with TraceWriter(tmp_path / "eos.jsonl", trace_header(plan, "test")) as writer:
        (stopped,) = record(model, tok, PROMPTS[:1], writer, max_new_tokens=4)
    rows = read_trace(tmp_path / "eos.jsonl").rows
    # tokens 1 and 2 were run through the model as decode steps; the EOS token (3) never was
    assert stopped.decode_tokens == 2 and len(rows) == n + 2 and free.decode_tokens == 4
    assert rows == read_trace(tmp_path / "free.jsonl").rows[:n + 2]


def test_nothing_is_written_on_error(models, tmp_path, monkeypatch):
    """An error on the second prompt, after the first one's rows were written: no trace, no temporary file."""
    import moe_offload.measure.profile as prof

    rows = prof._rows

    def failing(seq, calls, header, predictions=None):
        if seq == 1:
            raise mo.MoeOffloadError("second prompt fails")
        return rows(seq, calls, header, predictions)

    monkeypatch.setattr(prof, "_rows", failing)
    out = tmp_path / "t.jsonl"
    with pytest.raises(mo.MoeOffloadError, match="second prompt fails"):
        profile(models["qwen3_moe"], out, prompts=PROMPTS, max_new_tokens=2, device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_a_model_without_routed_experts_has_nothing_to_profile(family_dir):
    with pytest.raises(mo.MoeOffloadError, match="no routed experts"):
        trace_header(mo.plan(family_dir("llama")), "test")


# --- CLI ------------------------------------------------------------------------------------------------------


def _run(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_profile_json_and_table(models, tmp_path, capsys):
    folder = models["mixtral"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    code, out, err = _run(capsys, "profile", folder, "--out", tmp_path / "t.jsonl", "--prompts", prompts,
                          "--max-new-tokens", NEW, "--ignore-eos", "--device", "cpu", "--json")
    assert code == 0, err
    summary = json.loads(out)                       # one JSON document and nothing else on stdout
    trace = read_trace(tmp_path / "t.jsonl")
    assert summary["sequences"] == 2 and summary["decode_tokens"] == 2 * NEW == len(trace.decode_rows)
    assert summary["prefill_tokens"] + summary["decode_tokens"] == len(trace.rows)
    assert [row["layer"] for row in summary["skew"]] == [0, 1]
    for row in summary["skew"]:
        assert set(row) >= {"top10_share", "effective_experts", "max_over_mean", "unused", "tokens"}
        assert 0 < row["top10_share"] <= 1
    code, out, err = _run(capsys, "profile", folder, "--out", tmp_path / "t2.jsonl", "--prompts", prompts,
                          "--max-new-tokens", NEW, "--device", "cpu")
    assert code == 0 and "busiest 10% share" in out and "t2.jsonl" in out


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", 0], "at least 1"),
    (["--prompts", "EMPTY"], "no prompts"),
    (["--out", "NODIR/t.jsonl"], "does not exist"),
])
def test_cli_profile_user_errors_exit_2(models, tmp_path, capsys, args, message):
    (tmp_path / "empty.txt").write_text("\n  \n")
    args = [str(a).replace("EMPTY", str(tmp_path / "empty.txt")).replace("NODIR", str(tmp_path / "no"))
            for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "t.jsonl")]
    code, out, err = _run(capsys, "profile", models["qwen3_moe"], "--device", "cpu", *args)
    assert code == 2 and out == "" and err.startswith("error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "t.jsonl").exists()


# --- the runtime's measured bytes == replay of the generation's own trace --------------------------------------


@pytest.mark.exact   # the offloaded model must route exactly as the resident one
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_measured_link_bytes_equal_replay_of_the_generations_own_trace(models, plans0, tmp_path, family, backend):
    folder = models[family]
    tok = load_tokenizer(folder)
    resident = profile(folder, tmp_path / "resident.jsonl", prompts=PROMPTS, max_new_tokens=4, ignore_eos=True,
                       device="cpu")
    stats = expert_counts(read_trace(resident.out))
    plan0 = plans0(family)
    routed = sum(t.bytes for t in plan0.tensors if t.role == "routed_expert")
    embed = sum(t.bytes for t in plan0.tensors if t.role == "embedding")   # density 1/vocab: offloaded first
    arms = budgets(plan0)
    plans = {
        "sparse-partial": mo.plan(folder, **arms["sparse-partial"]),
        "sparse-first": mo.plan(folder, **arms["sparse-first"]),
        "declaration": mo.plan(folder, **arms["declaration"]),
        "frequency": mo.plan(folder, offload_gb=(embed + routed // 2) / GiB, policy="frequency", stats=stats),
    }
    freq = plans["frequency"]
    assert any(t.host_expert_ids and len(t.host_expert_ids) < t.shape[0] for t in freq.tensors)
    for arm, plan in plans.items():
        model, plan = mo.load(folder, device="cpu", backend=backend, plan=plan)
        counter = model.moe_offload_runtime.counter
        counter.reset()
        own = tmp_path / f"{arm}.jsonl"
        with TraceWriter(own, trace_header(plan, arm)) as writer:
            record(model, tok, PROMPTS, writer, max_new_tokens=4, ignore_eos=True)
        trace = read_trace(own)
        assert trace.rows == read_trace(resident.out).rows       # offloading changes no routing
        measured = counter.decode_bytes_per_token()
        assert len([d for d in counter.decode if d]) == len(trace.decode_rows) == 2 * 4
        assert measured > 0, arm
        assert replay(plan, trace).link_bytes_per_token == measured, arm


@pytest.mark.exact   # the offloaded model must route exactly as the resident one
def test_cli_generate_one_token_longer_agrees_with_replay_of_the_profile(models, tmp_path, capsys):
    # profile --max-new-tokens N runs its N-th token through the model too (N decode rows); generate N runs N - 1
    # decode steps. So `generate --max-new-tokens N+1` is the generation whose trace `profile N` writes (README,
    # profile), and under a frequency subset placement (routing decides the bytes) the two must agree exactly.
    folder = models["qwen3_moe"]
    prompt = PROMPTS[0]
    (tmp_path / "p.txt").write_text(prompt + "\n")
    trace = tmp_path / "t.jsonl"
    code, _, err = _run(capsys, "profile", folder, "--out", trace, "--prompts", tmp_path / "p.txt",
                        "--max-new-tokens", NEW, "--ignore-eos", "--device", "cpu", "--json")
    assert code == 0, err
    assert len(read_trace(trace).decode_rows) == NEW
    plan0 = mo.plan(folder)
    routed = sum(t.bytes for t in plan0.tensors if t.role == "routed_expert")
    embed = sum(t.bytes for t in plan0.tensors if t.role == "embedding")
    placement = ["--offload-gb", repr((embed + routed // 2) / GiB), "--policy", "frequency", "--stats", trace]
    code, out, err = _run(capsys, "replay", folder, "--trace", trace, *placement, "--json")
    assert code == 0, err
    replayed = json.loads(out)
    assert replayed["tokens"] == NEW
    measured = {}
    for new in (NEW, NEW + 1):
        code, out, err = _run(capsys, "generate", folder, "--prompt", prompt, "--max-new-tokens", new, "--ignore-eos",
                              "--device", "cpu", *placement, "--json")
        assert code == 0, err
        measured[new] = json.loads(out)["link_bytes_per_token"]
    assert measured[NEW + 1] == replayed["link_bytes_per_token"] > 0, (measured, replayed)
