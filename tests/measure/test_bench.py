"""`moe_offload.measure.bench` and `moe-offload bench`: every row measured, warm-up excluded, settings read back.

The model is a make_tiny Qwen3-MoE: hidden 64, 2 layers, 8 experts, top-k 2, vocab 512, float32.

    model.embed_tokens.weight         (512, 64)      131072 B   embedding (density 1/512)
    per layer (x2):
      self_attn.q/k/v/o_proj.weight                  49152 B   attention (q, o 16384 B; k, v 8192 B)
      self_attn.q/k_norm, 2 layernorms                  640 B   norm
      mlp.gate.weight                 (8, 64)          2048 B   router
      mlp.experts.gate_up_proj        (8, 192, 64)   393216 B   routed expert
      mlp.experts.down_proj           (8, 64, 96)    196608 B   routed expert
    lm_head.weight                    (512, 64)      131072 B

BUDGET is layer 0's experts, 589824 B. In declaration order that offloads the embedding,
layer 0's attention (with its q/k norms), then its experts (770176 B); sparse-first offloads the
embedding (lowest density), layer 0's gate_up_proj and, to finish the budget with the least
overshoot, the last 3 of the 8 experts of layer 0's down_proj (24576 B each): 598016 B, and no
attention. Both read
the same experts for the same prompts, so declaration reads at least 49152 B more per token.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

import moe_offload as mo
from moe_offload.measure import arms, bench, plots, runtime_rows, timing
from moe_offload.cli import report
from moe_offload.cli.main import main
from moe_offload.errors import MoeOffloadError
from moe_offload.planning.planner import matches_selector
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny
from fixtures_cli import unwritable_dir

EXPERTS_L0 = 393216 + 196608
BUDGET_GB = EXPERTS_L0 / GiB          # exact in binary: the planner's target is 589824 B
ATTENTION_L0 = 49152
ARMS = "resident,declaration,sparse-first,explicit:experts"
LEVELS = (1, 3)
RUNS, NEW = 2, 4

ROW_TYPES = {
    "arm": str, "concurrency": int, "runs": int, "itl_p50_ms": float, "itl_p90_ms": float, "tok_s_itl": float,
    "tok_s_wall": float, "ttft_ms": float, "spread_pct": float, "offloaded_bytes": int,
    "link_bytes_per_token": float, "host_bytes": int, "device_bytes": int, "same_prompt": bool, "mechanism": str,
    "link_ms_per_token": float, "settings": dict, "prompts": list, "itl_samples": int, "max_new_tokens": int,
    "planned_link_bytes_per_token": float,
}
SETTINGS_TYPES = {
    "policy": str, "offload_params": list, "budget_bytes": int, "backend": str, "device": str,
    "host_bytes_by_role": dict, "offloaded_tensor_count": int, "offloaded_tensors": list,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("bench") / "m", family="qwen3_moe", layers=2, experts=8, top_k=2,
                     hidden=64)


@pytest.fixture(scope="module")
def rows(model_dir) -> list[dict]:
    return bench.run_bench(model_dir, arms=ARMS, concurrency=LEVELS, runs=RUNS, max_new_tokens=NEW,
                           offload_gb=BUDGET_GB, device="cpu", link_gbps=25.0)


def _by(rows):
    return {(r["arm"], r["concurrency"]): r for r in rows}


def test_every_arm_and_level_has_a_row_with_every_field(rows):
    assert [(r["arm"], r["concurrency"]) for r in rows] == [(a, c) for a in ARMS.split(",") for c in LEVELS]
    for r in json.loads(json.dumps(rows)):             # the JSON document, not the Python objects
        for field, kind in ROW_TYPES.items():
            assert isinstance(r[field], kind), (r["arm"], field, r[field])
            if kind in (int, float):
                assert not isinstance(r[field], bool)
        for field, kind in SETTINGS_TYPES.items():
            assert isinstance(r["settings"][field], kind), (r["arm"], field)
        assert all(isinstance(v, int) for v in r["settings"]["host_bytes_by_role"].values())
        assert r["itl_p90_ms"] >= r["itl_p50_ms"] > 0 and r["ttft_ms"] > 0
        assert r["tok_s_itl"] == pytest.approx(r["concurrency"] / (r["itl_p50_ms"] / 1e3))
        assert r["link_ms_per_token"] == pytest.approx(r["link_bytes_per_token"] / 25e9 * 1e3)
        assert r["settings"]["backend"] == "uva" and r["settings"]["device"] == "cpu"
        assert r["device_bytes"] > 0


def test_runs_and_itl_samples_count_only_measured_runs(rows):
    for r in rows:
        assert r["runs"] == RUNS
        assert r["itl_samples"] == RUNS * (NEW - 1)     # one ITL sample per decode step of each measured run


def test_the_warm_up_run_is_discarded(model_dir, monkeypatch):
    """The first run of each (arm, concurrency) is made absurdly slow: no figure may show it."""
    real, calls, measured = timing.greedy, [], {}

    def greedy(model, enc, max_new_tokens, device):
        run = real(model, enc, max_new_tokens, device)
        calls.append(enc["input_ids"].shape[0])
        if len(calls) % (RUNS + 1) == 1:             # warm-up
            run.ttft_s, run.wall_s, run.itl_s = 1e6, 1e6, [1e6] * len(run.itl_s)
        else:
            measured.setdefault(enc["input_ids"].shape[0], []).append(run)
        return run

    monkeypatch.setattr(timing, "greedy", greedy)
    out = bench.run_bench(model_dir, arms="sparse-first", concurrency=LEVELS, runs=RUNS, max_new_tokens=NEW,
                          offload_gb=BUDGET_GB, device="cpu")
    assert calls == [c for c in LEVELS for _ in range(RUNS + 1)]
    for r in out:
        runs = measured[r["concurrency"]]
        assert len(runs) == RUNS
        # Each figure is exactly that of the measured runs alone.
        assert r["ttft_ms"] == pytest.approx(statistics.median(x.ttft_s for x in runs) * 1e3)
        assert r["itl_p90_ms"] < 1e6
        wall = [r["concurrency"] * NEW / x.wall_s for x in runs]
        assert r["tok_s_wall"] == pytest.approx(r["concurrency"] * NEW * RUNS / sum(x.wall_s for x in runs))
        assert r["spread_pct"] == pytest.approx((max(wall) - min(wall)) / statistics.median(wall) * 100)


def test_settings_are_the_applied_plan(rows):
    by = _by(rows)
    for c in LEVELS:
        res, dec, sf, ex = (by[(a, c)] for a in ARMS.split(","))
        assert res["offloaded_bytes"] == res["host_bytes"] == res["settings"]["offloaded_tensor_count"] == 0
        assert res["link_bytes_per_token"] == 0
        assert dec["settings"]["policy"] == "declaration" and sf["settings"]["policy"] == "sparse-first"
        assert ex["settings"]["policy"] == "explicit" and ex["settings"]["offload_params"] == ["experts"]
        # Read back from the arena: declaration holds layer 0's attention there, sparse-first none.
        assert dec["settings"]["host_bytes_by_role"]["attention"] == ATTENTION_L0
        assert sf["settings"]["host_bytes_by_role"].get("attention", 0) == 0
        assert "model.layers.0.self_attn.q_proj.weight" in dec["settings"]["offloaded_tensors"]
        assert not any("self_attn" in n for n in sf["settings"]["offloaded_tensors"])
        # explicit:experts: only tensors under an `experts` segment, and they are layer 0's experts.
        names = ex["settings"]["offloaded_tensors"]
        assert names == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
        assert all(matches_selector(n, "experts") for n in names)
        assert ex["settings"]["host_bytes_by_role"] == {"routed_expert": EXPERTS_L0}
        for r in (dec, sf, ex):
            s = r["settings"]
            assert r["offloaded_bytes"] == sum(s["host_bytes_by_role"].values())
            assert s["offloaded_tensor_count"] == len(s["offloaded_tensors"])
            assert r["host_bytes"] >= r["offloaded_bytes"]
        assert dec["offloaded_bytes"] == 770176 and sf["offloaded_bytes"] == 598016
        assert sf["settings"]["split_tensors"] == {"model.layers.0.mlp.experts.down_proj": 3}
        assert dec["settings"]["split_tensors"] == {} == ex["settings"]["split_tensors"]


def test_declaration_reads_more_over_the_link_than_sparse_first(rows):
    by = _by(rows)
    for c in LEVELS:
        dec, sf = by[("declaration", c)], by[("sparse-first", c)]
        assert sf["link_bytes_per_token"] > 0
        # Same routing, same experts offloaded; declaration also reads layer 0's attention on every step.
        assert dec["link_bytes_per_token"] >= sf["link_bytes_per_token"] + ATTENTION_L0 / c


def test_prompts_are_distinct_per_sequence(rows):
    for r in rows:
        assert r["same_prompt"] is False
        assert len(r["prompts"]) == r["concurrency"] == len(set(r["prompts"]))


def test_same_prompt_is_labelled(model_dir, capsys):
    out = bench.run_bench(model_dir, arms="sparse-first", concurrency=[2], runs=1, max_new_tokens=2,
                          offload_gb=BUDGET_GB, device="cpu", same_prompt=True, prompts=["only one prompt"])
    assert out[0]["same_prompt"] is True and out[0]["prompts"] == ["only one prompt"] * 2
    report.print_table(out)
    assert "SAME prompt" in capsys.readouterr().out


def test_the_decode_loop_is_greedy_decoding(model_dir):
    """Cached one-token steps give generate()'s tokens, and a left-padded sequence decodes as it does alone."""
    model, _ = mo.load(model_dir, device="cpu", offload_gb=BUDGET_GB)
    tok = bench._load_tokenizer(model_dir)
    short, long = "The river.", "A much longer prompt about the slow history of printing presses in Europe."
    with torch.no_grad():
        alone = tok([short], return_tensors="pt")
        mine = timing.greedy(model, alone, 6, torch.device("cpu")).token_ids
        ref = model.generate(**alone, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert mine.tolist() == ref[:, alone["input_ids"].shape[1]:].tolist()
        padded = timing.greedy(model, tok([long, short], return_tensors="pt", padding=True), 6,
                               torch.device("cpu")).token_ids
    assert padded[1].tolist() == mine[0].tolist()


def test_resident_is_skipped_when_the_model_does_not_fit(model_dir):
    total = mo.plan(model_dir).total_bytes
    said = []
    out = bench.run_bench(model_dir, arms="resident,sparse-first", concurrency=[1], runs=1, max_new_tokens=2,
                          device_memory_gb=(total - EXPERTS_L0) / GiB, reserve_gb=0, device="cpu", log=said.append)
    assert [r["arm"] for r in out] == ["sparse-first"]
    assert len(said) == 1 and said[0].startswith("resident skipped")


def test_prefetch_backend_counts_staging_on_the_device(model_dir):
    out = bench.run_bench(model_dir, arms="declaration", concurrency=[1], runs=1, max_new_tokens=2,
                          offload_gb=BUDGET_GB, device="cpu", backend="prefetch")
    r = out[0]
    assert r["settings"]["backend"] == "prefetch" and r["link_bytes_per_token"] > ATTENTION_L0
    resident = mo.plan(model_dir).total_bytes - r["offloaded_bytes"]
    assert r["device_bytes"] > resident             # staged experts and dense tensors live on the device too


def test_plot_writes_a_png(rows, tmp_path):
    path = plots.plot(rows, tmp_path / "bench.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(tmp_path.glob(".*"))            # no temporary file left behind


def _cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:                       # argparse errors
        rc = exc.code
    return rc, *capsys.readouterr()


def test_cli_writes_json_and_plot(model_dir, tmp_path, capsys):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc, out, err = _cli(["bench", str(model_dir), "--arms", "declaration,explicit:experts", "--concurrency", "2",
                         "--runs", "1", "--max-new-tokens", "2", "--offload-gb", repr(BUDGET_GB), "--device", "cpu",
                         "--json", str(js), "--plot", str(png)], capsys)
    assert rc == 0, err
    data = json.loads(js.read_text())
    assert [(r["arm"], r["concurrency"], r["runs"]) for r in data] == [("declaration", 2, 1),
                                                                       ("explicit:experts", 2, 1)]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "declaration" in out and "explicit:experts" in out and "cpu only" in out
    assert not out.lstrip().startswith("[")          # the JSON went to the file, the table to stdout


def test_cli_json_to_stdout_is_only_json(model_dir, capsys):
    rc, out, err = _cli(["bench", str(model_dir), "--arms", "sparse-first", "--concurrency", "1", "--runs", "1",
                         "--max-new-tokens", "2", "--offload-gb", repr(BUDGET_GB), "--device", "cpu", "--json", "-"],
                        capsys)
    assert rc == 0, err
    assert [r["arm"] for r in json.loads(out)] == ["sparse-first"]


@pytest.mark.parametrize("extra", [
    ["--arms", "resident,fastest"],                 # unknown arm
    ["--arms", "explicit:"],                        # malformed explicit arm
    ["--arms", "explicit:experts+"],
    ["--arms", "sparse-first,sparse-first"],        # duplicate
    ["--arms", "explicit:nothing_here"],            # selector that matches nothing
    ["--concurrency", "1,x"],
    ["--concurrency", "0,4"],
    ["--runs", "0"],
    ["--max-new-tokens", "1"],
    ["--link-gbps", "0"],
    ["--threads", "0"],
    ["--policy", "declaration"],                    # arms choose the policy
    ["--offload-params", "experts"],
    ["--json", "/nonexistent-dir/b.json"],
    ["--plot", "chart.txt"],
    ["--concurrency", "3", "--prompts", "PROMPTS_FILE"],   # 2 prompts for 3 sequences
    ["--offload-gb", "1000"],                       # more than the model
    ["--runs", "many"],                             # argparse type error
])
def test_cli_user_errors_exit_2_with_one_error_line(model_dir, tmp_path, capsys, extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    extra = [str(prompts) if a == "PROMPTS_FILE" else a for a in extra]
    budget = [] if "--offload-gb" in extra else ["--offload-gb", repr(BUDGET_GB)]
    rc, out, err = _cli(["bench", str(model_dir), "--device", "cpu", *budget, *extra], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert out == ""


def test_cli_bench_needs_a_budget(model_dir, capsys):
    rc, _, err = _cli(["bench", str(model_dir), "--device", "cpu"], capsys)
    assert rc == 2 and err.startswith("error:") and "--offload-gb" in err


def test_row_metrics_from_known_timings(model_dir):
    """Every time metric of a row, from three hand-made runs (concurrency 2, 4 new tokens each)."""
    model, plan = mo.load(model_dir, device="cpu", offload_gb=BUDGET_GB)
    runs = [timing.Run(0.1, [0.01, 0.02, 0.03], 0.16, [100, 200, 300], torch.zeros(2, 4)),
            timing.Run(0.2, [0.02, 0.02, 0.04], 0.28, [100, 100, 100], torch.zeros(2, 4)),
            timing.Run(0.3, [0.01, 0.01, 0.01], 0.33, [400, 400, 400], torch.zeros(2, 4))]
    row = runtime_rows.make_row(arms.parse_arms("sparse-first")[0], 2, runs, model, plan, prompts=["a", "b"],
                     same_prompt=False, max_new_tokens=4, link_gbps=25.0, model_name="m", budget_label="b")
    # ITL samples sorted: .01 .01 .01 .01 .02 .02 .02 .03 .04 -> p50 = the 5th = 0.02 s;
    # p90 at position 7.2: 0.03 + 0.2 x (0.04 - 0.03) = 0.032 s
    assert row["itl_samples"] == 9
    assert row["itl_p50_ms"] == pytest.approx(20.0) and row["itl_p90_ms"] == pytest.approx(32.0)
    assert row["tok_s_itl"] == pytest.approx(2 / 0.02)                 # both sequences: 100 tok/s
    assert row["tok_s_wall"] == pytest.approx(2 * 4 * 3 / 0.77)        # 24 tokens in 0.77 s
    assert row["ttft_ms"] == pytest.approx(200.0)                      # median of 100, 200, 300 ms
    # per-run wall tok/s: 8/0.16 = 50, 8/0.28 = 28.57, 8/0.33 = 24.24 -> (50 - 24.24) / 28.57
    assert row["spread_pct"] == pytest.approx((50 - 8 / 0.33) / (8 / 0.28) * 100)
    # link: 600 + 300 + 1,200 = 2,100 bytes over 9 decode steps of 2 sequences
    assert row["link_bytes_per_token"] == pytest.approx(2100 / 18)
    assert row["link_ms_per_token"] == pytest.approx(2100 / 18 / 25e9 * 1e3)


def test_measured_link_bytes_equal_the_plan_at_concurrency_1(rows):
    # One sequence picks exactly top-k experts per layer: for whole tensors the uniform-routing expectation
    # is the measurement. (A split tensor reads only the picked experts that are on the host, which depends
    # on the routing: test_runtime counts those by hand.)
    checked = 0
    for r in rows:
        if r["concurrency"] == 1 and not r["settings"]["split_tensors"]:
            assert r["link_bytes_per_token"] == pytest.approx(r["planned_link_bytes_per_token"], rel=1e-12)
            checked += 1
    assert checked == 3   # resident, declaration, explicit:experts


def test_repeated_prompts_are_refused_unless_same_prompt(model_dir):
    with pytest.raises(MoeOffloadError, match="repeat"):
        bench.run_bench(model_dir, arms="sparse-first", concurrency=[2], runs=1, max_new_tokens=2,
                        offload_gb=BUDGET_GB, device="cpu", prompts=["same line", "same line"])


def test_resident_rows_report_what_the_arm_did(rows):
    for r in rows:
        if r["arm"] == "resident":
            s = r["settings"]
            assert s["policy"] == "resident" and s["budget_bytes"] == 0 and s["offload_params"] == []
            assert s["host_bytes_by_role"] == {} and r["offloaded_bytes"] == 0
        else:
            assert r["settings"]["policy"] != "resident"


def test_a_model_that_fits_the_device_memory_says_so(model_dir):
    total = mo.plan(model_dir).total_bytes
    said = []
    out = bench.run_bench(model_dir, arms="resident,sparse-first", concurrency=[1], runs=1, max_new_tokens=2,
                          device_memory_gb=(total + 1024) / GiB, reserve_gb=0, device="cpu", log=said.append)
    assert [r["arm"] for r in out] == ["resident", "sparse-first"]
    assert all(r["offloaded_bytes"] == 0 for r in out)
    assert [s["policy"] for s in (r["settings"] for r in out)] == ["resident", "sparse-first"]
    notes = [m for m in said if m.startswith("note: the model fits")]
    assert len(notes) == 1 and "no arm offloads anything" in notes[0]


@pytest.mark.parametrize("option, where, message", [
    ("--json", "a-directory", "is a directory"),
    ("--json", "unwritable", "not writable"),
    ("--json", "missing-folder", "does not exist"),
    ("--json", "through-a-file", "is not a folder"),
    ("--plot", "a-directory.png", "is a directory"),
    ("--plot", "unwritable", "not writable"),
])
def test_cli_output_paths_are_checked_before_measuring(model_dir, tmp_path, capsys, monkeypatch, option, where,
                                                       message):
    def measured(*args, **kwargs):
        raise AssertionError("bench measured before checking where its output goes")

    monkeypatch.setattr(bench, "run_bench", measured)
    (tmp_path / "a-file").write_text("")
    name = "b.json" if option == "--json" else "b.png"
    path = {"a-directory": tmp_path, "a-directory.png": tmp_path / "charts.png", "missing-folder": tmp_path / "no" / name,
            "unwritable": unwritable_dir(tmp_path) / name, "through-a-file": tmp_path / "a-file" / name}[where]
    if where == "a-directory.png":
        path.mkdir()
    rc, out, err = _cli(["bench", str(model_dir), "--device", "cpu", "--offload-gb", repr(BUDGET_GB), option,
                         str(path)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error:") and err.count("\n") == 1 and message in err, err
    assert not [p for p in tmp_path.rglob(".*")], "a probe file was left behind"


def _listed_options(command: str, capsys) -> tuple[str, set[str]]:
    """(usage, options) of `moe-offload COMMAND --help`: the options are the entries argparse lists."""
    import re

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    return out.split("\n\n")[0], set(re.findall(r"^  (--[\w-]+)", out, re.M))


def test_bench_help_lists_no_policy_options_but_refuses_them(model_dir, capsys):
    usage, listed = _listed_options("bench", capsys)
    assert {"--arms", "--offload-gb", "--device-memory"} <= listed
    assert not {"--policy", "--offload-params"} & listed
    assert "--policy" not in usage and "--offload-params" not in usage
    _, plan_listed = _listed_options("plan", capsys)
    assert {"--policy", "--offload-params"} <= plan_listed
    rc, _, err = _cli(["bench", str(model_dir), "--offload-gb", repr(BUDGET_GB), "--policy", "declaration"], capsys)
    assert rc == 2 and "--arms" in err


# --- the accelerate arm: transformers + accelerate device_map="auto" at the same budget ------------------------
# On this CPU-only run the "device" is host memory: accelerate may keep total - budget = 955904 B in RAM
# (max_memory {"cpu": 955904}) and the rest goes to disk, re-read (page cache released) at every step.

ACCEL_LEVELS = (1, 2)


@pytest.fixture(scope="module")
def accel_rows(model_dir) -> list[dict]:
    return bench.run_bench(model_dir, arms="sparse-first,accelerate", concurrency=ACCEL_LEVELS, runs=1,
                           max_new_tokens=3, offload_gb=BUDGET_GB, device="cpu", link_gbps=25.0)


def _accel(rows) -> list[dict]:
    return [r for r in rows if r["arm"] == "accelerate"]


def _under(name: str, device_map: dict) -> str:
    """The placement hf_device_map gives tensor `name` (its deepest enclosing entry)."""
    parts = name.split(".")
    return next(device_map[".".join(parts[:i])] for i in range(len(parts), -1, -1)
                if ".".join(parts[:i]) in device_map)


def test_accelerate_rows_have_the_contract_fields(accel_rows):
    assert [(r["arm"], r["concurrency"]) for r in accel_rows] == \
        [(a, c) for a in ("sparse-first", "accelerate") for c in ACCEL_LEVELS]
    contract = {k: ROW_TYPES[k] for k in ("arm", "concurrency", "runs", "itl_p50_ms", "itl_p90_ms", "tok_s_itl",
                                          "tok_s_wall", "ttft_ms", "spread_pct", "offloaded_bytes",
                                          "link_bytes_per_token", "settings", "mechanism", "link_ms_per_token")}
    contract.update(disk_read_bytes_per_token=float, host_link_bytes_per_token=float, link_measurement=str,
                    peak_rss_bytes=int, offload_loaded_bytes_per_token=float)
    for r in json.loads(json.dumps(_accel(accel_rows))):
        for field, kind in contract.items():
            assert isinstance(r[field], kind) and not isinstance(r[field], bool), (field, r[field])
        assert r["runs"] == 1 and r["itl_samples"] == 2          # the warm-up run is not in the row
        assert "read_bytes" in r["link_measurement"] and "POSIX_FADV_DONTNEED" in r["link_measurement"]
    # every arm reports its peak resident memory (VmHWM, restarted before each arm loads)
    assert all(isinstance(r["peak_rss_bytes"], int) and r["peak_rss_bytes"] > 100e6 for r in accel_rows)


def test_accelerate_runs_at_the_bench_budget_read_back(model_dir, accel_rows):
    plan = mo.plan(model_dir, offload_gb=BUDGET_GB)
    assert plan.budget_bytes == EXPERTS_L0
    for r in _accel(accel_rows):
        s = r["settings"]
        assert s["max_memory"] == {"cpu": plan.total_bytes - EXPERTS_L0} == {"cpu": 955904}
        assert s["budget_bytes"] == EXPERTS_L0 and s["device"] == "cpu"
        placed = s["bytes_by_placement"]
        assert set(s["hf_device_map"].values()) <= {"cpu", "disk"} and sum(placed.values()) == plan.total_bytes
        # read back from the model: every planned tensor under its hf_device_map entry
        expect: dict[str, int] = {}
        for t in plan.tensors:
            expect[_under(t.name, s["hf_device_map"])] = expect.get(_under(t.name, s["hf_device_map"]), 0) + t.bytes
        assert placed == expect
        assert placed.get("cpu", 0) <= 955904                    # accelerate kept within max_memory
        assert r["offloaded_bytes"] == placed["disk"] >= EXPERTS_L0
        assert not Path(s["offload_folder"]).exists()             # removed with the arm


def test_accelerate_disk_bytes_per_token_are_measured(model_dir, accel_rows):
    plan = mo.plan(model_dir, offload_gb=BUDGET_GB)
    for r in _accel(accel_rows):
        c, dmap = r["concurrency"], r["settings"]["hf_device_map"]
        on_disk = [t for t in plan.tensors if _under(t.name, dmap) == "disk"]
        experts = sum(t.bytes for t in on_disk if t.role == "routed_expert")
        assert experts >= EXPERTS_L0
        per_step = r["disk_read_bytes_per_token"] * c
        # Fused experts are re-saved to the offload folder and never stay mapped: with the page cache released
        # before each step, every step reads them from disk again (the kernel may read a little ahead).
        checkpoint = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        assert experts <= per_step <= checkpoint + experts
        # accelerate's hooks load every tensor of each disk module at each step: all of them, whatever routed
        assert r["offload_loaded_bytes_per_token"] * c == sum(t.bytes for t in on_disk)
        assert r["host_link_bytes_per_token"] == 0.0              # no host link on a CPU
        assert r["link_bytes_per_token"] == r["disk_read_bytes_per_token"]
        assert r["link_ms_per_token"] == pytest.approx(r["link_bytes_per_token"] / 25e9 * 1e3)


def test_accelerate_is_timed_by_the_same_loop(model_dir, monkeypatch):
    from moe_offload.measure.accelerate_arm import AccelerateArm

    calls = []
    real = timing.greedy

    def counting(model, enc, new, device, meter=None):
        calls.append(type(meter).__name__)
        return real(model, enc, new, device, meter)

    monkeypatch.setattr(timing, "greedy", counting)
    rows = bench.run_bench(model_dir, arms="accelerate", concurrency=(1,), runs=2, max_new_tokens=2,
                           offload_gb=BUDGET_GB, device="cpu")
    assert calls == [AccelerateArm.__name__] * 3                   # warm-up + 2 measured, bench's own loop
    assert rows[0]["runs"] == 2 and rows[0]["itl_samples"] == 2


def test_cli_bench_accelerate_arm(model_dir, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc, _, err = _cli(["bench", str(model_dir), "--arms", "accelerate", "--offload-gb", repr(BUDGET_GB),
                       "--device", "cpu", "--concurrency", "1", "--runs", "1", "--max-new-tokens", "2",
                       "--json", str(out)], capsys)
    assert rc == 0, err
    (row,) = json.loads(out.read_text())
    assert row["arm"] == "accelerate" and row["settings"]["max_memory"] == {"cpu": 955904}
    rc, _, err = _cli(["bench", str(model_dir), "--arms", "accelerate", "--device", "cpu"], capsys)
    assert rc == 2 and err.startswith("error:") and "budget" in err


def test_frequency_arm_places_experts_from_stats(model_dir, tmp_path, capsys):
    # A hand-made trace of 40 decode tokens: layer 0 picks experts 0 and 1 every time, layer 1 experts 6 and 7.
    # Densities: the embedding 1/512, a never-picked expert 2 x 1 / (80 + 8) = 1/44, a hot one 2 x 41 / 88.
    # The budget (589824 B) takes the embedding (131072 B), then never-picked experts of 73728 B each (their
    # slices of gate_up_proj and down_proj), ties by layer then id: layer 0's 2-7 and layer 1's 0 (7 x 73728
    # = 516096 B, the 7th crosses the target). The hot experts all stay resident.
    from moe_offload.formats.traces import TraceHeader, TraceRow, write_trace

    trace = tmp_path / "hot.jsonl"
    rows = [TraceRow(0, 4 + i, "decode", ((0, 1), (6, 7))) for i in range(40)]
    write_trace(trace, TraceHeader("qwen3_moe", 8, 2, (0, 1), "hand-made"), rows)
    rc, out, err = _cli(["bench", str(model_dir), "--arms", "frequency,sparse-first", "--offload-gb", repr(BUDGET_GB),
                         "--stats", str(trace), "--concurrency", "1", "--runs", "1", "--max-new-tokens", "3",
                         "--json", "-"], capsys)
    assert rc == 0, err
    freq, sparse = json.loads(out)
    assert freq["arm"] == "frequency" and freq["settings"]["policy"] == "frequency"
    plan = mo.plan(model_dir, offload_gb=BUDGET_GB, policy="frequency",
                   stats={0: [40, 40, 0, 0, 0, 0, 0, 0], 1: [0, 0, 0, 0, 0, 0, 40, 40]})
    host_ids = {t.name: t.host_ids for t in plan.tensors if t.role == "routed_expert" and t.tier == "host"}
    assert host_ids == {f"model.layers.{n}.mlp.experts.{w}": ids for n, ids in ((0, (2, 3, 4, 5, 6, 7)), (1, (0,)))
                        for w in ("gate_up_proj", "down_proj")}
    assert plan.offloaded_bytes == 131072 + 7 * 73728
    assert freq["offloaded_bytes"] == plan.offloaded_bytes and sparse["settings"]["policy"] == "sparse-first"
    # --stats without the frequency arm, and the frequency arm without --stats, are refused before measuring
    rc, _, err = _cli(["bench", str(model_dir), "--arms", "sparse-first", "--offload-gb", repr(BUDGET_GB),
                       "--stats", str(trace)], capsys)
    assert rc == 2 and "add frequency to --arms" in err
    rc, _, err = _cli(["bench", str(model_dir), "--arms", "frequency", "--offload-gb", repr(BUDGET_GB)], capsys)
    assert rc == 2 and "give it --stats TRACE" in err
