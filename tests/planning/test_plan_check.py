"""A saved plan is input: host_expert_ids under every policy, older plans read as today's, and every field of a
saved plan checked against the model wherever a plan is read (`replay --plan`, `export --plan`,
`moe_offload.load(plan=...)`): an edited field is one `error:` line naming the tensor and the field, exit 2.
"""
from __future__ import annotations

import json

import pytest

import moe_offload as mo
from fixtures_cli import QWEN3_CONFIG, run_cli as run
from moe_offload.errors import MoeOffloadError, PlanMismatchError
from moe_offload.formats.traces import TraceHeader, TraceRow, write_trace
from moe_offload.planning.placement import GiB, Plan

EMBED, SLICE_DOWN, DOWN_BYTES = 16384, 2048, 8192   # QWEN3_CONFIG: E = 4, down_proj [4, 32, 16] float32
DOWN0 = "model.layers.0.mlp.experts.down_proj"
DOWN1 = "model.layers.1.mlp.experts.down_proj"


def _saved(p: Plan) -> dict:
    return {t["name"]: t for t in json.loads(p.to_json())["tensors"]}


@pytest.fixture
def qwen(write_config):
    return write_config(QWEN3_CONFIG, name="qwen") / "config.json"


# --- one meaning per field: host_expert_ids under every policy -----------------------------------------------


def test_sparse_first_in_part_lists_the_last_experts(qwen):
    saved = _saved(mo.plan(qwen, offload_gb=(EMBED + SLICE_DOWN) / GiB))   # the embedding, then one expert
    down = saved[DOWN0]
    assert (down["tier"], down["host_experts"], down["host_expert_ids"]) == ("host", 1, [3])
    assert saved["model.embed_tokens.weight"]["host_expert_ids"] == [] and \
        saved["model.embed_tokens.weight"]["host_experts"] == 0                # no expert axis: whole, no ids
    resident = [t for t in saved.values() if t["tier"] == "device"]
    assert resident and all(t["host_experts"] == 0 and t["host_expert_ids"] == [] for t in resident)


def test_a_tensor_offloaded_whole_lists_all_its_experts(qwen):
    p = mo.plan(qwen, offload_gb=(EMBED + DOWN_BYTES) / GiB)   # the embedding, then one down_proj whole
    down = _saved(p)[DOWN0]
    assert (down["tier"], down["host_experts"], down["host_expert_ids"]) == ("host", 4, [0, 1, 2, 3])
    t = next(t for t in p.tensors if t.name == DOWN0)
    assert not t.is_split and t.host_ids == () and t.offloaded_bytes == DOWN_BYTES and t.resident_experts == 0
    # every expert tensor whole under explicit selectors (declaration order), and whole on disk
    every = mo.plan(qwen, offload_gb=2 * (16384 + DOWN_BYTES) / GiB, policy="declaration",
                    offload_params=["experts"])
    experts = [t for t in every.tensors if ".experts." in t.name]
    assert experts and all(t.tier == "host" and t.host_expert_ids == (0, 1, 2, 3) and t.host_experts == 4
                           for t in experts)
    disk = mo.plan(qwen, offload_gb=(EMBED + DOWN_BYTES) / GiB, host_memory_gb=0)
    down = next(t for t in disk.tensors if t.name == DOWN0)
    assert (down.tier, down.host_expert_ids, down.disk_ids, down.disk_bytes) == ("disk", (0, 1, 2, 3), (), DOWN_BYTES)


def test_frequency_lists_its_experts_and_a_whole_layer_all_of_them(qwen):
    stats = {0: [100, 100, 100, 100], 1: [100, 100, 0, 0]}
    p = mo.plan(qwen, offload_gb=(EMBED + 4 * 6144) / GiB, policy="frequency", stats=stats)
    saved = _saved(p)
    # the embedding first, then layer 1's two cold experts (both tensors), then layer 0's least picked
    assert saved[DOWN1]["host_expert_ids"] == [2, 3] and saved[DOWN1]["host_experts"] == 2
    assert all(t["host_experts"] == len(t["host_expert_ids"]) for t in saved.values())
    whole = mo.plan(qwen, offload_gb=(EMBED + 8 * 6144) / GiB, policy="frequency", stats=stats)
    for name in (DOWN0, DOWN1):
        t = next(t for t in whole.tensors if t.name == name)
        assert (t.host_expert_ids, t.host_experts, t.is_split, t.offloaded_bytes) == ((0, 1, 2, 3), 4, False,
                                                                                       DOWN_BYTES)


def _old_form(text: str, *, drop_key: bool) -> str:
    """A plan as moe-offload saved it before every offloaded expert tensor listed its ids."""
    data = json.loads(text)
    for t in data["tensors"]:
        ids, e = t["host_expert_ids"], t["shape"][0] if t["shape"] else 0
        if ids == list(range(e)):
            t["host_experts"] = 0        # whole: no count, no ids
        if drop_key:
            del t["host_expert_ids"]     # before frequency plans wrote ids at all
        else:
            t["host_expert_ids"] = []
    return json.dumps(data)


@pytest.mark.parametrize("drop_key", [False, True])
@pytest.mark.parametrize("budget", [dict(offload_gb=(EMBED + SLICE_DOWN) / GiB),            # in part
                                    dict(offload_gb=(EMBED + DOWN_BYTES) / GiB),            # whole
                                    dict(offload_gb=(EMBED + 2 * DOWN_BYTES + SLICE_DOWN) / GiB),  # whole, part
                                    dict(offload_gb=(EMBED + DOWN_BYTES) / GiB, host_memory_gb=0)])   # on disk
def test_an_old_form_plan_loads_identically(qwen, budget, drop_key):
    p = mo.plan(qwen, **budget)
    old = _old_form(p.to_json(), drop_key=drop_key)
    assert json.loads(old)["tensors"] != json.loads(p.to_json())["tensors"]
    back = Plan.from_json(old)
    assert back == p
    assert (back.offloaded_bytes, back.disk_bytes, back.link_bytes_by_tier()) == \
        (p.offloaded_bytes, p.disk_bytes, p.link_bytes_by_tier())


def test_an_old_form_plan_still_loads_into_the_model(models, tmp_path):
    folder = models["qwen3_moe"]
    size = {t.name: t.bytes for t in mo.plan(folder).tensors}
    # the embedding, layer 0's experts whole, then the last expert of layer 1's down_proj
    budget = size["model.embed_tokens.weight"] + size["model.layers.0.mlp.experts.gate_up_proj"] + size[DOWN0] + \
        size[DOWN1] // 6
    p = mo.plan(folder, offload_gb=budget / GiB)
    assert [t.name for t in p.tensors if t.host_experts and not t.is_split] == \
        ["model.layers.0.mlp.experts.gate_up_proj", DOWN0]
    assert [(t.name, t.host_expert_ids) for t in p.tensors if t.is_split] == [(DOWN1, (5,))]
    path = tmp_path / "old.json"
    path.write_text(_old_form(p.to_json(), drop_key=True))
    model, loaded = mo.load(folder, device="cpu", plan=path)
    assert loaded.tiers == p.tiers and loaded.offloaded_bytes == p.offloaded_bytes
    assert model.moe_offload_runtime.arena.nbytes == p.offloaded_bytes and mo.audit(model, loaded) == []


# --- every field of a saved plan is checked -----------------------------------------------------------------

def _tensor(tensor, **change):
    """An edit of one tensor's fields (_DROP: remove the field)."""
    def edit(d):
        t = next(t for t in d["tensors"] if t["name"] == tensor)
        for k, v in change.items():
            if v is _DROP:
                del t[k]
            else:
                t[k] = v
    return edit


_DROP = object()
# (label, edit of the saved JSON, words the error names: the tensor and the field). The plan: the embedding and
# layer 0's down_proj in part (its last 2 of 4 experts), on the host; everything else resident.
EDITS = [
    ("shape", _tensor(DOWN0, shape=[4, 32, 17]), (DOWN0, "shape")),
    ("dtype", _tensor(DOWN0, dtype="bfloat16"), (DOWN0, "dtype")),
    ("bytes-negative", _tensor(DOWN0, bytes=-5), (DOWN0, "bytes")),
    ("bytes", _tensor(DOWN0, bytes=DOWN_BYTES * 2), (DOWN0, "bytes")),
    ("layer", _tensor(DOWN0, layer=1), (DOWN0, "layer")),
    ("component", _tensor(DOWN0, component="vision"), (DOWN0, "component")),
    ("role", _tensor(DOWN0, role="attention"), (DOWN0, "role")),
    ("is_buffer", _tensor(DOWN0, is_buffer=True), (DOWN0, "is_buffer")),
    ("experts", _tensor(DOWN0, experts=8), (DOWN0, "experts")),
    ("top_k", _tensor(DOWN0, top_k=4), (DOWN0, "top_k")),
    ("tier", _tensor(DOWN0, tier="gpu"), (DOWN0, "tier")),
    ("id-out-of-range", _tensor(DOWN0, host_experts=1, host_expert_ids=[99]), (DOWN0, "host_expert_ids", "0..3")),
    ("ids-unsorted", _tensor(DOWN0, host_expert_ids=[3, 2]), (DOWN0, "host_expert_ids", "sorted")),
    ("ids-twice", _tensor(DOWN0, host_expert_ids=[2, 2]), (DOWN0, "host_expert_ids", "more than once")),
    ("count", _tensor(DOWN0, host_experts=3), (DOWN0, "host_experts", "says 3")),
    ("ids-on-device", _tensor(DOWN1, host_experts=1, host_expert_ids=[0]), (DOWN1, "host_expert_ids")),
    ("ids-of-embedding", _tensor("model.embed_tokens.weight", host_experts=1, host_expert_ids=[127]),
     ("model.embed_tokens.weight", "host_expert_ids")),
    ("disk-ids-on-host", _tensor(DOWN0, disk_expert_ids=[3]), (DOWN0, "disk_expert_ids")),
    ("disk-ids-not-off", _tensor(DOWN0, tier="disk", disk_expert_ids=[0]), (DOWN0, "disk_expert_ids")),
    ("missing-field", _tensor(DOWN0, dtype=_DROP), (DOWN0, "dtype", "missing")),
    ("wrong-type", _tensor(DOWN0, shape="4x32x16"), (DOWN0, "shape")),
    ("ids-wrong-type", _tensor(DOWN0, host_expert_ids=[2.0, 3.0]), (DOWN0, "host_expert_ids")),
    ("unknown-field", _tensor(DOWN0, colour="red"), (DOWN0, "colour")),
    ("name", _tensor(DOWN0, name="model.layers.0.mlp.experts.up_proj"), ("model.layers.0.mlp.experts.up_proj",)),
    ("model_type", lambda d: d.update(model_type="mixtral"), ("model_type", "mixtral")),
    ("batch", lambda d: d.update(batch=0), ("batch",)),
    ("policy", lambda d: d.update(policy="magic"), ("policy", "magic")),
    ("densities", lambda d: d.update(expert_densities={"0": [0.5] * 4, "1": [0.5] * 4}), ("expert_densities",)),
]


def _budget(folder_embed: int, slice_: int) -> float:
    return (folder_embed + slice_ + 1) / GiB   # the embedding, then the last 2 experts of a down_proj


@pytest.fixture
def cli_files(tmp_path, capsys, qwen):
    rc, _, err = run(capsys, "plan", qwen, "--offload-gb", repr(_budget(EMBED, SLICE_DOWN)), "--save",
                     tmp_path / "plan.json")
    assert rc == 0, err
    saved = json.loads((tmp_path / "plan.json").read_text())
    down = next(t for t in saved["tensors"] if t["name"] == DOWN0)
    assert (down["tier"], down["host_expert_ids"]) == ("host", [2, 3])
    rows = [TraceRow(0, i, "decode", ((0, 1), (2, 3))) for i in range(3)]
    write_trace(tmp_path / "trace.jsonl", TraceHeader("qwen3_moe", 4, 2, (0, 1), "test"), rows)
    return tmp_path, qwen


def _command(command: str, root, model, plan) -> list:
    extra = ["--trace", root / "trace.jsonl"] if command == "replay" else ["--engine", "vllm"]
    return [command, model, "--plan", plan, *extra, "--json"]


def _edited(path, edit, out):
    data = json.loads(path.read_text())
    edit(data)
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("command", ["replay", "export"])
def test_the_unedited_saved_plan_works(cli_files, capsys, command):
    root, model = cli_files
    rc, out, err = run(capsys, *_command(command, root, model, root / "plan.json"))
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["offloaded_bytes" if command == "replay" else "plan_offloaded_bytes"] == EMBED + 2 * SLICE_DOWN


@pytest.mark.parametrize("command", ["replay", "export"])
@pytest.mark.parametrize("label, edit, words", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_field_is_one_error_naming_tensor_and_field(cli_files, capsys, command, label, edit, words):
    root, model = cli_files
    plan = _edited(root / "plan.json", edit, root / "edited.json")
    rc, out, err = run(capsys, *_command(command, root, model, plan))
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in err


def test_a_plan_saved_with_dtype_is_checked_at_that_dtype(cli_files, capsys, tmp_path):
    root, model = cli_files
    rc, _, err = run(capsys, "plan", model, "--dtype", "bf16", "--offload-gb", "0.00002",
                     "--save", tmp_path / "bf16.json")
    assert rc == 0, err
    rc, out, err = run(capsys, *_command("replay", root, model, tmp_path / "bf16.json"))
    assert rc == 0, err
    edited = _edited(tmp_path / "bf16.json", _tensor(DOWN0, dtype="float16"), tmp_path / "mixed.json")
    rc, out, err = run(capsys, *_command("replay", root, model, edited))
    assert rc == 2 and DOWN0 in err and "dtype" in err


@pytest.fixture(scope="module")
def saved_checkpoint_plan(models, tmp_path_factory):
    """A saved plan of the tiny qwen3_moe checkpoint (E = 6): the embedding and the last 2 experts of layer 0's
    down_proj on the host."""
    folder = models["qwen3_moe"]
    embed = next(t.bytes for t in mo.plan(folder).tensors if t.role == "embedding")
    down = next(t for t in mo.plan(folder).tensors if t.name == DOWN0)
    p = mo.plan(folder, offload_gb=_budget(embed, down.bytes // 6))
    assert next(t for t in p.tensors if t.name == DOWN0).host_expert_ids == (4, 5)
    path = tmp_path_factory.mktemp("saved") / "plan.json"
    path.write_text(p.to_json())
    return folder, path


CHECKPOINT_EDITS = [
    ("shape", _tensor(DOWN0, shape=[6, 32, 47]), (DOWN0, "shape")),
    ("bytes", _tensor(DOWN0, bytes=-5), (DOWN0, "bytes")),
    ("bytes-more", _tensor(DOWN0, bytes=1), (DOWN0, "bytes")),
    ("role", _tensor(DOWN0, role="attention"), (DOWN0, "role")),
    ("tier", _tensor(DOWN0, tier="gpu"), (DOWN0, "tier")),
    ("id-out-of-range", _tensor(DOWN0, host_experts=1, host_expert_ids=[99]), (DOWN0, "host_expert_ids", "0..5")),
    ("count", _tensor(DOWN0, host_experts=1), (DOWN0, "host_experts")),
    ("name", _tensor(DOWN0, name="model.layers.0.mlp.experts.w9"), ("model.layers.0.mlp.experts.w9",)),
    ("model_type", lambda d: d.update(model_type="mixtral"), ("model_type",)),
]


@pytest.mark.parametrize("label, edit, words", CHECKPOINT_EDITS, ids=[e[0] for e in CHECKPOINT_EDITS])
def test_load_checks_every_field_of_a_saved_plan(saved_checkpoint_plan, tmp_path, label, edit, words):
    folder, path = saved_checkpoint_plan
    with pytest.raises(MoeOffloadError) as err:
        mo.load(folder, device="cpu", plan=_edited(path, edit, tmp_path / "edited.json"))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_load_takes_the_unedited_saved_plan(saved_checkpoint_plan):
    folder, path = saved_checkpoint_plan
    model, plan = mo.load(folder, device="cpu", plan=path)
    assert plan == Plan.from_json(path.read_text()) and mo.audit(model, plan) == []
    assert model.moe_offload_runtime.splits[DOWN0].host_ids == (4, 5)


def test_a_plan_object_is_checked_too(saved_checkpoint_plan):
    import dataclasses

    folder, path = saved_checkpoint_plan
    plan = Plan.from_json(path.read_text())
    tensors = tuple(dataclasses.replace(t, bytes=t.bytes + 1) if t.name == DOWN0 else t for t in plan.tensors)
    with pytest.raises(PlanMismatchError, match=f"tensor {DOWN0}, field bytes"):
        mo.load(folder, device="cpu", plan=dataclasses.replace(plan, tensors=tensors))
