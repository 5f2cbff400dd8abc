"""Tests for moe_offload.tiny.make.make_tiny: tiny random MoE checkpoints that transformers loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from moe_offload.prompts import CORPUS, PROMPTS
from moe_offload.tiny.families import AUTO_CLASSES, FAMILIES, RELEASED_TRANSPOSED
from moe_offload.tiny.make import make_tiny
from moe_offload.tiny.released import transpose_in_place
from fixtures_cli import unwritable_dir

REQUIRED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_vl_moe")

# Non-default sizes, so a test cannot pass by reading transformers' defaults back.
EXPERTS = 6


def _top_k(family: str) -> int:
    return 2 if family == "phimoe" else 3  # PhiMoE's router always picks exactly two


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Everything must load from the folder alone; nothing may come from a hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _load(path: Path, family: str):
    auto = getattr(transformers, AUTO_CLASSES[family])
    model = auto.from_pretrained(path, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tok


def _weights(path: Path) -> dict[str, tuple[list[int], str]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}


def _expert_count_field(cfg) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    raise AssertionError(f"no routed-expert count field in {type(cfg).__name__}")


def _experts_on_disk(weights: dict[str, tuple[list[int], str]]) -> set[int]:
    """Routed experts per MoE layer as stored: per-expert keys or fused [E, ...] tensors."""
    per_expert: dict[str, set[int]] = {}
    fused: set[int] = set()
    for key, (shape, _) in weights.items():
        m = re.search(r"^(.*\.layers\.\d+)\..*\.experts\.(\d+)\.", key)
        if m:
            per_expert.setdefault(m.group(1), set()).add(int(m.group(2)))
        elif re.search(r"\.experts\.(gate_up_proj|down_proj)$|\.(input|output)_linear\.weight$", key):
            fused.add(shape[0])
    counts = {len(ix) for ix in per_expert.values()} | fused
    assert counts, "no routed-expert tensors found on disk"
    return counts


def test_required_families_present():
    assert set(REQUIRED_FAMILIES) <= set(FAMILIES)
    assert set(AUTO_CLASSES) == set(FAMILIES)


def test_prompts_and_corpus():
    assert len(PROMPTS) >= 16 and len(set(PROMPTS)) == len(PROMPTS)
    assert all(isinstance(p, str) and 20 < len(p) < 400 for p in PROMPTS)
    assert len(CORPUS) > 3000


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates(tmp_path, family):
    top_k = _top_k(family)
    out = make_tiny(tmp_path / "m", family=family, experts=EXPERTS, top_k=top_k, seed=1)
    assert out == (tmp_path / "m").absolute()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "temporary folder left behind"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "moe_offload_tiny.json"):
        assert (out / name).is_file(), name

    record = json.loads((out / "moe_offload_tiny.json").read_text())
    assert {k: record[k] for k in ("family", "layers", "experts", "top_k", "hidden", "seed", "dtype")} == {
        "family": family, "layers": 2, "experts": EXPERTS, "top_k": top_k, "hidden": 64, "seed": 1,
        "dtype": "float32",
    }

    model, tok = _load(out, family)
    cfg = model.config.get_text_config()
    assert _expert_count_field(cfg) == EXPERTS
    assert cfg.num_experts_per_tok == top_k
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 64
    assert not model.config.tie_word_embeddings
    assert _experts_on_disk(_weights(out)) == {EXPERTS}

    # Tokenizer and model agree on the vocabulary and the special tokens.
    assert len(tok) == cfg.vocab_size == model.get_input_embeddings().weight.shape[0]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    text = PROMPTS[0]
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text

    enc = tok(PROMPTS[1], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
        gen = model.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert logits.float().std() > 0.1, "random init too small: outputs are all but constant"
    assert gen.shape[-1] == enc["input_ids"].shape[-1] + 5


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic(tmp_path, family):
    a = make_tiny(tmp_path / "a", family=family, seed=7)
    b = make_tiny(tmp_path / "b", family=family, seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_seed_changes_weights_and_leaves_caller_rng_alone(tmp_path):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = make_tiny(tmp_path / "a", family="mixtral", seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    b = make_tiny(tmp_path / "b", family="mixtral", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(tmp_path, dtype):
    out = make_tiny(tmp_path / "m", family="qwen3_moe", dtype=dtype)
    stored = {"bfloat16": "BF16", "float16": "F16"}[dtype]
    assert {d for _, d in _weights(out).values()} == {stored}
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    model, _ = _load(out, "qwen3_moe")
    assert model.dtype == getattr(torch, dtype)


def test_other_sizes(tmp_path):
    out = make_tiny(tmp_path / "m", family="deepseek_v3", layers=3, experts=4, top_k=1, hidden=32,
                    vocab_size=300)
    model, tok = _load(out, "deepseek_v3")
    assert len(tok) == model.config.vocab_size == 300
    assert model.config.first_k_dense_replace == 1 and model.config.n_group == 1
    assert len(model.model.layers) == 3


def test_empty_existing_dir_is_used(tmp_path):
    (tmp_path / "m").mkdir()
    out = make_tiny(tmp_path / "m", family="olmoe")
    assert (out / "model.safetensors").is_file()


def test_unknown_family_lists_supported(tmp_path):
    with pytest.raises(ValueError) as err:
        make_tiny(tmp_path / "m", family="llama")
    for family in FAMILIES:
        assert family in str(err.value)
    assert not (tmp_path / "m").exists()


def test_non_empty_out_dir_refused_and_untouched(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny(target, family="qwen3_moe")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert (target / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["m"], "temporary folder left behind"


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(experts=4, top_k=5), "top_k=5"),
        (dict(layers=0), "layers=0"),
        (dict(experts=0, top_k=0), "experts=0"),
        (dict(hidden=50), "hidden=50"),
        (dict(dtype="int8"), "dtype"),
        (dict(vocab_size=100), "vocab_size"),
    ],
)
def test_bad_numbers_raise(tmp_path, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        make_tiny(tmp_path / "m", family="qwen3_moe", **kwargs)
    assert "Fix:" in str(err.value)
    assert not (tmp_path / "m").exists()


def test_family_specific_limits(tmp_path):
    with pytest.raises(ValueError, match="phimoe"):
        make_tiny(tmp_path / "m", family="phimoe", top_k=3)
    with pytest.raises(ValueError, match="deepseek_v3"):
        make_tiny(tmp_path / "m", family="deepseek_v3", experts=1, top_k=1)


@pytest.fixture
def never_built(monkeypatch):
    """make_tiny must refuse its target before building anything (the tokenizer is trained first)."""
    from moe_offload.tiny import make as tiny

    def built(*args, **kwargs):
        raise AssertionError("make_tiny started building before refusing its target")

    monkeypatch.setattr(tiny, "build_tokenizer", built)


@pytest.mark.parametrize("where", ["unwritable", "unwritable-nested", "through-a-file"])
def test_target_that_cannot_be_written_is_refused_first(tmp_path, never_built, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    target = {"unwritable": unwritable_dir(tmp_path) / "m", "unwritable-nested": unwritable_dir(tmp_path) / "a" / "m",
              "through-a-file": blocker / "sub" / "m"}[where]
    expected = NotADirectoryError if where == "through-a-file" else PermissionError
    with pytest.raises(expected, match="cannot write a tiny model to .*Fix:") as err:
        make_tiny(target, family="qwen3_moe")
    assert err.value.errno is None                  # our message, not a raw OSError
    assert ("is a file" if where == "through-a-file" else "nothing can be created") in str(err.value)
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "read-only") == ["a-file"]


@pytest.mark.parametrize("where", ["unwritable", "through-a-file", "a-file"])
def test_make_tiny_cli_unwritable_path_is_one_error_line(tmp_path, capsys, never_built, where):
    from moe_offload.cli.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = {"unwritable": unwritable_dir(tmp_path) / "x", "through-a-file": blocker / "x", "a-file": blocker}[where]
    assert main(["make-tiny", str(target), "--family", "qwen3_moe"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: cannot write a tiny model to") and captured.err.count("\n") == 1
    assert "Errno" not in captured.err and "Fix:" in captured.err


# --- streamed writing: save_pretrained's layout, a few tensors' worth of memory ---------------------------------

SMALL = dict(hidden=32, experts=4, top_k=2)


def _headers(folder: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """key -> (shape, safetensors dtype, file name), over every safetensors file of the folder."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                out[k] = (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype(), path.name)
    return out


def _save_pretrained_reference(made: Path, dest: Path, dtype: str, **save_kwargs) -> Path:
    """The folder save_pretrained writes for the config `made` holds, at `dtype` the way users get it: float32
    from from_config, half precision through from_pretrained(dtype=...), which applies the keep-in-fp32 rules.
    Then make-tiny's one departure: the fused experts released checkpoints store transposed (Qwen3-VL-MoE)."""
    import tempfile

    config = transformers.AutoConfig.from_pretrained(made)
    auto = getattr(transformers, AUTO_CLASSES[config.model_type])
    model = auto.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig.from_pretrained(made)
    if dtype == "float32":
        model.save_pretrained(dest, **save_kwargs)
    else:
        with tempfile.TemporaryDirectory(dir=dest.parent) as scratch:
            model.save_pretrained(scratch)
            half = auto.from_pretrained(scratch, dtype=getattr(torch, dtype))
            half.generation_config = model.generation_config
            half.save_pretrained(dest, **save_kwargs)
    if config.model_type in RELEASED_TRANSPOSED:
        assert transpose_in_place(dest, RELEASED_TRANSPOSED[config.model_type])
    return dest


def _json(path: Path):
    return json.loads(path.read_text())


# float16 keeps both _keep_in_fp32_modules and the _strict ones in float32 (and shows any explicitly typed
# tensor), bfloat16 only the strict ones: it is checked where a family has such lists (gpt-oss: norms, not
# strict; DeepSeek/GLM: routers, strict).
_LAYOUT_CASES = [(f, d) for f in FAMILIES for d in ("float32", "float16")] + [
    (f, "bfloat16") for f in ("gpt_oss", "deepseek_v3", "deepseek_v2", "glm4_moe")]


@pytest.mark.parametrize("family, dtype", _LAYOUT_CASES)
def test_streamed_layout_is_save_pretrained_s(tmp_path, family, dtype):
    # Names, shapes, dtypes, config.json and generation_config.json: what save_pretrained writes for the same
    # config, at that dtype.
    made = make_tiny(tmp_path / "m", family=family, dtype=dtype, **SMALL)
    ref = _save_pretrained_reference(made, tmp_path / "ref", dtype)
    assert _headers(made) == _headers(ref)
    assert _json(made / "config.json") == _json(ref / "config.json")
    assert _json(made / "generation_config.json") == _json(ref / "generation_config.json")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_sharded_layout_and_index_are_save_pretrained_s(tmp_path, family):
    # Per-expert checkpoint tensors are views of one fused tensor: save_pretrained keeps them in one shard and
    # counts that storage once; the streamed writer must split exactly alike.
    made = make_tiny(tmp_path / "m", family=family, max_shard_size=60_000, **SMALL)
    ref = _save_pretrained_reference(made, tmp_path / "ref", "float32", max_shard_size=60_000)
    assert not (made / "model.safetensors").exists()
    assert len(list(made.glob("model-*-of-*.safetensors"))) > 2
    assert sorted(p.name for p in made.glob("*.safetensors")) == sorted(p.name for p in ref.glob("*.safetensors"))
    assert _json(made / "model.safetensors.index.json") == _json(ref / "model.safetensors.index.json")
    assert _headers(made) == _headers(ref)
    # transformers loads the sharded folder to the very tensors the files hold
    from safetensors.torch import load_file
    from transformers.core_model_loading import revert_weight_conversion

    model, _ = _load(made, family)
    stored = {k: v for p in made.glob("*.safetensors") for k, v in load_file(p).items()}
    loaded = revert_weight_conversion(model, model.state_dict())
    assert set(loaded) == set(stored) and all(torch.equal(loaded[k], stored[k]) for k in stored)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_values_follow_the_family_s_init(tmp_path, family):
    # Every tensor the family's init makes deterministic (norm weights, biases, Mamba's A_log, ...) equals it;
    # random ones have its spread. Two reference draws tell which is which.
    from safetensors.torch import load_file
    from transformers.core_model_loading import revert_weight_conversion

    made = make_tiny(tmp_path / "m", family=family, **SMALL)
    ours = load_file(made / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(made)
    auto = getattr(transformers, AUTO_CLASSES[family])
    refs = []
    for seed in (0, 1):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            ref = auto.from_config(config, dtype=torch.float32)
        state = revert_weight_conversion(ref, ref.state_dict())
        for key in [k for k in state if k.endswith(RELEASED_TRANSPOSED.get(family, ()))]:
            state[key] = state[key].transpose(1, 2)   # stored as the released checkpoints store it
        refs.append(state)
    assert set(ours) == set(refs[0])
    checked = 0
    for key, value in ours.items():
        a, b = refs[0][key], refs[1][key]
        if torch.equal(a, b):
            assert torch.equal(value, a), key
        elif value.numel() >= 1000:
            ratio = float(value.std() / a.std())
            assert 0.85 < ratio < 1.18, (key, ratio)
            checked += 1
    assert checked >= 4


def test_shard_bytes_are_what_safetensors_writes(tmp_path):
    from safetensors.torch import load_file, save_file

    made = make_tiny(tmp_path / "m", family="deepseek_v3", dtype="bfloat16", **SMALL)  # bf16 + fp32 routers
    again = tmp_path / "again.safetensors"
    save_file(load_file(made / "model.safetensors"), str(again), metadata={"format": "pt"})
    assert (made / "model.safetensors").read_bytes() == again.read_bytes()


def test_half_precision_is_the_rounded_float32_draw(tmp_path):
    from safetensors.torch import load_file

    full = load_file(make_tiny(tmp_path / "f", family="qwen3_moe", **SMALL) / "model.safetensors")
    half = load_file(make_tiny(tmp_path / "h", family="qwen3_moe", dtype="bf16", **SMALL) / "model.safetensors")
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)


def test_no_progress_bar_off_a_terminal_and_one_on_request(tmp_path, capfd):
    make_tiny(tmp_path / "a", family="olmoe", **SMALL)
    assert capfd.readouterr().err == ""
    out = make_tiny(tmp_path / "b", family="olmoe", progress=True, **SMALL)
    assert (out / "model.safetensors").is_file()


_RSS_SCRIPT = r"""
import json, math, resource, sys
from pathlib import Path
from safetensors import safe_open
from moe_offload.tiny.make import make_tiny

root = Path(sys.argv[1])
# Warm-up: imports, tokenizer training and every code path, so the baseline holds all but the weights.
make_tiny(root / "warm", family="qwen3_moe", layers=1, hidden=64, experts=4, dtype="bf16")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = make_tiny(root / "big", family="qwen3_moe", layers=2, hidden=768, experts=16, dtype="bf16")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with safe_open(str(out / "model.safetensors"), "pt") as f:
    sizes = {k: math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys()}
print(json.dumps({"base": base, "peak": peak, "total": sum(sizes.values()),
                  "layer": sum(v for k, v in sizes.items() if k.startswith("model.layers.0."))}))
"""


def test_peak_memory_is_a_small_multiple_of_one_layer(tmp_path):
    # bf16, hidden 768, 16 experts: 2 layers of 88 MB (the fused gate_up_proj alone 57 MB) + 1.5 MB of tables.
    # Writing it through save_pretrained held the whole model several times over; streamed, the peak is one
    # tensor drawn in float32 plus its bf16 rounding (about 2x a layer).
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["total"] > 170e6 and m["layer"] > 85e6
    assert m["peak"] - m["base"] < 2.5 * m["layer"], m
