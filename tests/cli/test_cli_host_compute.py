"""--expert-compute on the command line: generate's JSON and text, plan's crossover line, and the errors."""

from __future__ import annotations

import pytest

import moe_offload as mo
from fixtures_cli import cli_json, run_cli
from moe_offload.planning.cost_model import Hardware, crossover_tokens, layer_shape
from moe_offload.tiny.make import make_tiny

OFF = ["--offload-params", "experts", "--offload-gb", "0.00105"]    # every routed expert on the host
RATES = ["--host-gbps", "80", "--host-gflops", "1000"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli-hc") / "m", family="qwen3_moe", layers=2, experts=8, top_k=2,
                     hidden=64)


def test_generate_host_sends_activations_only_and_keeps_the_tokens(folder, capsys):
    args = [folder, "--prompt", "The river", "--max-new-tokens", "6", "--ignore-eos", *OFF, "--json"]
    host = cli_json(capsys, "generate", *args, "--expert-compute", "host")
    device = cli_json(capsys, "generate", *args, "--expert-compute", "device")
    assert host["token_ids"] == device["token_ids"]
    assert host["expert_compute"] == "host" and host["host_compute_steps"] > 0 and host["experts_on_host"] > 0
    assert host["link_weight_bytes_per_token"] == 0 < host["link_activation_bytes_per_token"]
    assert host["link_bytes_per_token"] == host["link_activation_bytes_per_token"]
    assert device["link_activation_bytes_per_token"] == 0 < device["link_weight_bytes_per_token"]
    assert device["expert_compute"] == "device" and device["host_compute_steps"] == 0


def test_generate_says_where_experts_ran(folder, capsys):
    rc, _, err = run_cli(capsys, "generate", folder, "--prompt", "The river", "--max-new-tokens", "4", *OFF,
                         "--expert-compute", "host")
    assert rc == 0 and "expert compute: host" in err and "were activations, 0 B weights" in err


def test_plan_prints_the_crossover_for_an_accelerator(folder, capsys):
    rc, out, _ = run_cli(capsys, "plan", folder, *OFF, "--device", "cuda", "--link-gbps", "25", *RATES)
    n = crossover_tokens(Hardware(80e9, 1000e9, 25e9), layer_shape(mo.plan(folder, offload_gb=0.00105,
                                                                           offload_params="experts")))
    assert rc == 0 and n is not None and n > 1
    assert f"computed on the host up to {n - 1} tokens per step, sent to the device from {n}" in " ".join(out.split())


def test_plan_on_a_cpu_says_there_is_no_link(folder, capsys):
    rc, out, _ = run_cli(capsys, "plan", folder, *OFF, "--device", "cpu")
    assert rc == 0 and "CPU only, the device is the host" in " ".join(out.split())


@pytest.mark.parametrize("argv,match", [
    (["plan", "{m}", *OFF, "--device", "cpu", "--link-gbps", "25"], "CPU-only plan: a CPU has no link"),
    (["plan", "{m}", *OFF, "--device", "cuda", "--link-gbps", "-1", *RATES], "--link-gbps -1.0 is not a rate"),
    (["generate", "{m}", "--prompt", "x", "--host-gbps", "0"], "host_gbps=0.0 is not a rate"),
])
def test_bad_rates_are_errors(folder, capsys, argv, match):
    rc, _, err = run_cli(capsys, *[str(folder) if a == "{m}" else a for a in argv])
    assert rc == 2 and err.startswith("error:") and match in err, err


def test_an_unknown_choice_is_refused(folder, capsys):
    rc, _, err = run_cli(capsys, "generate", folder, "--prompt", "x", "--expert-compute", "gpu")
    assert rc == 2 and "--expert-compute" in err
