"""`moe-offload export`: the options each engine gets select exactly the planned tensors, by the engine's own rule.

The engines' rules are re-stated here from their sources, independently of export.py:
- llama.cpp: each `-ot PATTERN=CPU` is tried with std::regex_search on every GGUF tensor name (src/llama-model-
  loader.cpp); `--n-cpu-moe N` adds `blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps` for i < N (common/arg.cpp);
  the input embedding is built in host memory whatever the options.
- vLLM (UVAOffloader._maybe_offload_to_cpu): decoder layers in order, each layer's parameters in order, a parameter
  is taken when `f".{sel}." in f".{name}."` for a selector (all when none), until int(gb * 2**30) bytes.
- SGLang (OffloaderV1): the same walk without selectors.
GGUF names come from the gguf package, never from this file.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from conftest import tiny_config_dict

from moe_offload.engines import gguf_names, llama_cpp as lc
from moe_offload.planning import planner
from moe_offload.model import published
from moe_offload.cli.main import main
from moe_offload.errors import ConfigError
from moe_offload.engines.engine import Engine
from moe_offload.engines.export import export
from moe_offload.engines.vllm import engine_params, gib_value
from moe_offload.model.inventory import inventory
from moe_offload.tiny.families import FAMILIES

GiB = 1 << 30


def _write(folder, config: dict):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def inventories(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    sources = {f: tiny_config_dict(f) for f in FAMILIES}
    sources["qwen3_moe_tied"] = tiny_config_dict("qwen3_moe", tie_word_embeddings=True)
    return {name: inventory(_write(root / name, cfg)) for name, cfg in sources.items()}


def _budgets(inv) -> dict[str, dict]:
    """Plans that exercise every case: nothing, the embedding alone, a split expert tensor, exactly the experts of
    the first MoE layer, every expert, dense tensors too, the whole model, declaration order, explicit selectors."""
    p0 = planner.plan(inv)
    embed = sum(t.bytes for t in p0.tensors if t.role == "embedding")
    routed = [t for t in p0.tensors if t.role == "routed_expert"]
    first = min(t.layer for t in routed)
    first_layer = sum(t.bytes for t in routed if t.layer == first)
    experts = sum(t.bytes for t in routed)
    head = next(t for t in p0.tensors if t.role == "lm_head")
    return {
        "none": dict(offload_gb=0),
        "embedding": dict(offload_gb=embed / 2 / GiB),
        "split": dict(offload_gb=(embed + first_layer // 3) / GiB),
        "first_layer": dict(offload_gb=(embed + first_layer) / GiB),
        "all_experts": dict(offload_gb=(embed + experts) / GiB),
        "dense_too": dict(offload_gb=(embed + experts + (p0.total_bytes - embed - experts) // 3) / GiB),
        "everything": dict(offload_gb=p0.total_bytes / GiB),
        "declaration": dict(offload_gb=p0.total_bytes / 2 / GiB, policy="declaration"),
        "explicit": dict(offload_gb=first_layer / GiB, offload_params=["experts"]),
        # The output head alone: outside the blocks, and `output` is also the tail of `attn_output`.
        "head": dict(offload_gb=head.bytes / GiB, offload_params=[head.name.removesuffix(".weight")]),
    }


def _cases(inventories):
    for name, inv in inventories.items():
        for label, kw in _budgets(inv).items():
            yield name, label, planner.plan(inv, **kw)


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp


def _arch_names(plan) -> set[str]:
    """Every tensor name the gguf package defines for the model's architecture and block count."""
    from gguf.constants import MODEL_TENSORS, TENSOR_NAMES

    arch = gguf_names.gguf_arch(plan.model_type)
    blocks = max(t.layer for t in plan.tensors if t.layer is not None) + 1
    return {TENSOR_NAMES[k].format(bid=b) for k in MODEL_TENSORS[arch] for b in range(blocks)}


def test_every_tensor_of_every_family_has_its_gguf_name(inventories):
    for name, inv in inventories.items():
        plan = planner.plan(inv)
        gg = gguf_names.GgufNames(plan.tensors, plan.model_type)
        allowed = _arch_names(plan)
        for t in plan.tensors:
            if t.component != "language":
                assert gg.of[t.name] is None, t.name   # towers go to the separate mmproj file
                continue
            g = gg.of[t.name]
            assert g is not None, f"{name}: {t.name} has no GGUF name"
            for gname in g.names:
                # a name with a suffix (`blk.0.attn_q.weight`), or one the converter writes bare (`blk.1.ssm_a`)
                assert gname.rpartition(".")[0] in allowed or gname in allowed, (
                    f"{name}: {t.name} -> {gname} is not a {gg.arch.name} name")
                assert gname.startswith(f"blk.{t.layer}.") if t.layer is not None else not gname.startswith("blk.")
        # Distinct tensors never share a GGUF name, in any layout.
        for layout in (0, -1):
            names = [n for g in gg.of.values() if g for n in g.layouts[layout]]
            assert len(names) == len(set(names)), name


def _expected_host(plan) -> set[str]:
    """What llama.cpp should place in host memory for this plan: whole tensors (an expert tensor cannot be split),
    the input embedding always, and the whole mmproj tower when any of it is offloaded."""
    host = {t.name for t in plan.tensors if t.tier != "device"}
    host |= {t.name for t in plan.tensors if t.role == "embedding"}
    towers = {t.name for t in plan.tensors if t.component != "language"}
    return host | towers if host & towers else host


def test_llama_cpp_patterns_select_exactly_the_planned_tensors(inventories):
    for name, label, plan in _cases(inventories):
        e = export(plan, "llama.cpp")
        gg = gguf_names.GgufNames(plan.tensors, plan.model_type)
        patterns = lc.overrides(list(e.args))
        for p in patterns:
            assert "," not in p and "=" not in p, p   # -ot splits its value on both
        want = _expected_host(plan)
        assert {t.name for t in e.placement.tensors if t.tier == "host"} == want, (name, label)
        # Both converter layouts (fused or split gate/up experts, MLA's kv_b or k_b + v_b).
        for layout in (0, -1):
            names = {n: g.layouts[layout] for n, g in gg.of.items() if g}
            universe = {x for xs in names.values() for x in xs}
            chosen = {x for x in universe if any(re.search(p, x) for p in patterns)}
            expected = {x for n, xs in names.items() if n in want and plan_role(plan, n) != "embedding" for x in xs}
            assert chosen == expected, (name, label, sorted(chosen ^ expected)[:4], e.args)
        exact = all((t.tier != "device") == (t.name in want) and not t.host_ids for t in plan.tensors)
        assert e.expressible == exact, (name, label)


def plan_role(plan, name: str) -> str:
    return next(t.role for t in plan.tensors if t.name == name)


def test_n_cpu_moe_only_when_the_plan_is_the_experts_of_the_first_layers(inventories):
    seen = 0
    for name, label, plan in _cases(inventories):
        e = export(plan, "llama.cpp")
        # The towers are a separate file (--mmproj, placed by --no-mmproj-offload), the embedding always host.
        host = {t.name: t for t in plan.tensors if t.tier != "device" and t.role != "embedding"
                and t.component == "language"}
        routed = [t for t in plan.tensors if t.role == "routed_expert"]
        n = max((t.layer for t in host.values() if t.layer is not None), default=-1) + 1
        exact = bool(host) and all(not t.host_ids for t in host.values()) and \
            set(host) == {t.name for t in routed if t.layer < n}
        args = list(e.args)
        if exact:
            seen += 1
            assert args[args.index("--n-cpu-moe") + 1] == str(n) and "-ot" not in args, (name, label, args)
        else:
            assert "--n-cpu-moe" not in args, (name, label, args)
    assert seen >= 2 * len(inventories)   # first_layer and all_experts of every family


def test_llama_cpp_patterns_are_few_and_readable_on_published_models(tmp_path):
    for model in published.CONFIGS:
        inv = inventory(published.write(model, tmp_path / model))
        for gb in (24, 48, 80):
            plan = planner.plan(inv, device_memory_gb=gb)
            e = export(plan, "llama.cpp")
            patterns = lc.overrides(list(e.args))
            # One pattern for the layers whose experts all go, one for the layer the budget ends in.
            ot = [e.args[i + 1] for i, a in enumerate(e.args) if a == "-ot"]
            assert len(ot) <= 2 and not ("--n-cpu-moe" in e.args and ot), (model, gb, e.args)
            assert ot or "--n-cpu-moe" in e.args or not plan.offloaded_bytes
            assert all(p.startswith(r"^blk\.") and "_exps" in p and p.endswith("=CPU") for p in ot), ot
            gg = gguf_names.GgufNames(plan.tensors, plan.model_type)
            names = {n: g.layouts[0] for n, g in gg.of.items() if g}
            chosen = lc.selected({x for xs in names.values() for x in xs}, patterns)
            want = _expected_host(plan)
            assert chosen == {x for n, xs in names.items() if n in want and plan_role(plan, n) != "embedding"
                              for x in xs}


def test_number_regex_matches_exactly_its_numbers():
    import random

    rng = random.Random(0)
    sets = [set(range(0, 16)), set(range(10, 24)), {0}, {7, 9, 10, 99, 100, 101, 250}, set(range(3, 61))]
    sets += [set(rng.sample(range(0, 300), rng.randint(1, 40))) for _ in range(200)]
    for s in sets:
        text = lc.number_regex(s)
        assert all(bool(re.fullmatch(f"({text})", str(i))) == (i in s) for i in range(0, 400)), (sorted(s), text)
    assert lc.number_regex(range(10, 24)) == "1[0-9]|2[0-3]"
    assert lc.number_regex(range(0, 16)) == "[0-9]|1[0-5]"


def test_unknown_architecture_is_a_clear_error(inventories):
    plan = dataclasses.replace(planner.plan(inventories["qwen3_moe"]), model_type="no_such_family")
    with pytest.raises(ConfigError, match="gguf package .* no architecture for model type 'no_such_family'"):
        export(plan, "llama.cpp")
    assert export(plan, "vllm").args == ()   # the other engines need no GGUF names


# ---------------------------------------------------------------------------------------------------------------
# vLLM and SGLang


def _walk(params, selectors, budget: int) -> set[str]:
    """vLLM's UVAOffloader loop over the layer stack, as its source writes it: our tensors it takes."""
    done, out = 0, set()
    for layer in sorted({p.layer for p in params}):
        if done >= budget:
            break
        for p in (p for p in params if p.layer == layer):
            if done >= budget:
                break
            if selectors and not any(f".{s}." in f".{p.names[0]}." for s in selectors):
                continue
            out |= set(p.tensors)
            done += p.bytes
    return out


def _options(args) -> tuple[int, list[str]]:
    args = list(args)
    if not args:
        return 0, []
    budget = int(float(args[args.index("--cpu-offload-gb") + 1]) * GiB)
    sel = args[args.index("--cpu-offload-params") + 1:] if "--cpu-offload-params" in args else []
    return budget, sel


def test_vllm_selectors_and_budget_select_the_placement(inventories):
    for name, label, plan in _cases(inventories):
        e = export(plan, "vllm")
        params = engine_params(plan, Engine.VLLM)
        budget, selectors = _options(e.args)
        # The walk takes exactly the placement reported.
        got = _walk(params, selectors, budget)
        assert got == {t.name for t in e.placement.tensors if t.tier == "host"}, (name, label, e.args)
        # A selector matches all the names of a parameter (weight and scales) or none.
        for p in params:
            assert len({any(planner.matches_selector(n, s) for s in selectors) for n in p.names}) == 1
        # vLLM's rule and matches_selector agree.
        for p in params:
            for n in p.names:
                for s in selectors:
                    assert (f".{s}." in f".{n}.") == planner.matches_selector(n, s)
        # Selectors name only kinds the plan offloads (or routed experts standing in for what vLLM cannot offload).
        offloaded = {t.name for t in plan.tensors if t.tier != "device"}
        kinds = {n for p in params if set(p.tensors) & offloaded or all(plan_role(plan, x) == "routed_expert"
                                                                         for x in p.tensors) for n in p.names}
        for s in selectors:
            assert all(n in kinds for p in params for n in p.names if planner.matches_selector(n, s)), (s, label)
        if budget:
            assert e.placement.offloaded_bytes >= min(plan.budget_bytes, sum(p.bytes for p in params))


def test_vllm_applies_an_explicit_experts_plan_exactly(inventories):
    for name, inv in inventories.items():
        plan = planner.plan(inv, **_budgets(inv)["explicit"])
        e = export(plan, "vllm")
        assert e.expressible, (name, e.notes)
        assert list(e.args[2:]) == ["--cpu-offload-params", "experts"]
        assert e.link_bytes_per_token == pytest.approx(plan.link_bytes_per_token())
        names = {n for p in engine_params(plan, Engine.VLLM) for n in p.names if planner.matches_selector(n, "experts")}
        assert names and all(".experts.routed_experts.w13_" in f".{n}" or ".experts.routed_experts.w2_" in f".{n}"
                             for n in names), names


def test_vllm_names_the_fused_moe_parameters(tmp_path):
    inv = inventory(published.write("deepseek-v3", tmp_path / "ds"))
    params = engine_params(planner.plan(inv), Engine.VLLM)
    names = {n for p in params if p.layer == 5 for n in p.names}
    assert {"mlp.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w13_weight_scale_inv",
            "mlp.experts.routed_experts.w2_weight", "mlp.experts.routed_experts.w2_weight_scale_inv",
            "self_attn.fused_qkv_a_proj.weight",
            "mlp.shared_experts.gate_up_proj.weight"} <= names, sorted(names)
    inv = inventory(published.write("mixtral-8x7b", tmp_path / "mx"))
    names = {n for p in engine_params(planner.plan(inv), Engine.VLLM) if p.layer == 0 for n in p.names}
    assert {"block_sparse_moe.experts.routed_experts.w13_weight", "block_sparse_moe.experts.routed_experts.w2_weight",
            "self_attn.qkv_proj.weight"} <= names, sorted(names)


def test_sglang_walks_every_layer_parameter_and_reads_them_whole(inventories):
    for name, label, plan in _cases(inventories):
        e = export(plan, "sglang")
        assert "--cpu-offload-params" not in e.args
        budget, _ = _options(e.args)
        params = engine_params(plan, Engine.SGLANG)
        taken = _walk(params, [], budget)
        host = {t.name for t in e.placement.tensors if t.tier == "host"}
        assert taken == host, (name, label)
        # Every offloaded byte of the language model crosses the link at each step.
        full = sum(t.bytes for t in plan.tensors if t.name in host and t.component == "language")
        assert e.link_bytes_per_token == pytest.approx(full / plan.batch)


def test_gib_value_lands_inside_the_last_parameter():
    for low, high in ((0, 10), (5 * GiB, 5 * GiB + 384 << 20), (13 * GiB, 13 * GiB + 1), (1, 2)):
        text = gib_value(low, high)
        assert low < int(float(text) * GiB) <= high, (low, high, text)


def test_frequency_plans_go_whole_and_say_so(inventories):
    inv = inventories["qwen3_moe"]
    layers = sorted({r.layer for r in inv.records if r.name.endswith("experts.down_proj")})
    stats = {layer: [50, 1, 30, 2] for layer in layers}
    p0 = planner.plan(inv)
    embed = sum(t.bytes for t in p0.tensors if t.role == "embedding")
    plan = planner.plan(inv, policy="frequency", stats=stats, offload_gb=(embed + 20000) / GiB)
    assert any(t.host_ids for t in plan.tensors)
    for engine in ("llama.cpp", "vllm", "sglang"):
        e = export(plan, engine)
        assert not e.expressible
        assert any("split" in n and "whole" in n for n in e.notes) or engine != "llama.cpp", e.notes
        assert any(n.startswith("cost of the difference") for n in e.notes)


def test_a_disk_tier_goes_to_host_memory_and_is_not_the_plan(inventories):
    plan = planner.plan(inventories["mixtral"], **_budgets(inventories["mixtral"])["all_experts"])
    down = {t.name for t in plan.tensors if t.name.endswith("down_proj")}
    plan = dataclasses.replace(plan, tensors=tuple(dataclasses.replace(t, tier="disk") if t.name in down else t
                                                    for t in plan.tensors))
    for engine in ("llama.cpp", "vllm", "sglang"):
        e = export(plan, engine)
        assert not e.expressible
        assert {t.tier for t in e.placement.tensors} <= {"host", "device"}
        assert any("no disk tier" in n for n in e.notes), e.notes


def test_unknown_engine_in_the_api(inventories):
    with pytest.raises(ConfigError, match="unknown engine 'tgi'"):
        export(planner.plan(inventories["qwen3_moe"]), "tgi")


# ---------------------------------------------------------------------------------------------------------------
# The command


@pytest.fixture
def qwen_dir(tmp_path):
    return _write(tmp_path / "qwen", tiny_config_dict("qwen3_moe"))


SMALL = f"{20000 / GiB:.9f}"   # the embedding and part of the first layer's experts


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_export_json_fields(qwen_dir, engine, capsys):
    import shlex

    assert main(["export", str(qwen_dir), "--engine", engine, "--offload-gb", SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == engine
    assert isinstance(out["args"], list) and all(isinstance(a, str) for a in out["args"])
    assert isinstance(out["notes"], list) and all(isinstance(n, str) for n in out["notes"])
    assert isinstance(out["expressible"], bool)
    assert isinstance(out["link_bytes_per_token"], (int, float)) and out["link_bytes_per_token"] > 0
    assert out["command"].endswith(" ".join(map(shlex.quote, out["args"])))


def test_export_human_output_is_the_command_line(qwen_dir, capsys):
    assert main(["export", str(qwen_dir), "--engine", "vllm", "--offload-gb", SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"vllm serve {qwen_dir} --cpu-offload-gb ")
    assert all(line.startswith(("- ", "-- ")) for line in lines[1:])


def test_bad_engine_exits_2_with_one_error_line(qwen_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["export", str(qwen_dir), "--engine", "tgi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "tgi" in err[0]


def test_export_of_a_saved_plan(qwen_dir, tmp_path, capsys):
    saved = tmp_path / "plan.json"
    assert main(["plan", str(qwen_dir), "--offload-gb", SMALL, "--save", str(saved), "--json"]) == 0
    capsys.readouterr()
    assert main(["export", str(qwen_dir), "--engine", "llama.cpp", "--plan", str(saved), "--json"]) == 0
    from_plan = json.loads(capsys.readouterr().out)
    assert main(["export", str(qwen_dir), "--engine", "llama.cpp", "--offload-gb", SMALL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_plan
    # A plan and budget options together, or a plan of another model, are user errors.
    assert main(["export", str(qwen_dir), "--engine", "vllm", "--plan", str(saved), "--offload-gb", "1"]) == 2
    other = _write(tmp_path / "mixtral", tiny_config_dict("mixtral"))
    assert main(["export", str(other), "--engine", "vllm", "--plan", str(saved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)
