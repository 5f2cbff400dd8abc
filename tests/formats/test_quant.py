"""Quantized checkpoints: FP8 e4m3 block-scaled and MXFP4 (moe_offload.formats.quant, make-tiny --quant).

The reference is transformers itself: it loads the tiny quantized checkpoints with FineGrainedFP8Config /
Mxfp4Config(dequantize=True) and generates, and our dequantization of the files' tensors equals its
dequantized weights bit for bit, name by name. Sizes (hidden 64, 2 layers, 8 experts, top-k 2): experts
[8, 192, 64] gate_up / [8, 64, 96] down, FP8 blocks 32x32 (qwen3_moe) and 8x32 (deepseek_v3, whose
kv_a_proj_with_mqa has 40 rows), MXFP4 groups of 32.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_offload.cli.main import main
from moe_offload.errors import CheckpointError
from moe_offload.model.checkpoint import read_headers
from moe_offload.model.config import read_config
from moe_offload.model.inventory import from_checkpoint, from_config
from moe_offload.formats.layouts import map_keys
from moe_offload.formats.quant import QuantFormat, QuantSpec, QuantTensor, check_headers, spec_from_config
from moe_offload.formats.quant_codecs import (FP4_VALUES, FP8_MAX, check_fp8, check_mxfp4, dequantize_fp8,
                                              dequantize_mxfp4, fp8_scale_shape, quantize_fp8, quantize_mxfp4)
from moe_offload.tiny.families import QUANT_FAMILIES
from moe_offload.tiny.make import make_tiny

CASES = {"qwen3_moe": "fp8", "deepseek_v3": "fp8", "gpt_oss": "mxfp4"}
OTHER_FP8 = tuple(f for f in QUANT_FAMILIES["fp8"] if f not in CASES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (quantized folder, the same model unquantized in bf16: the weights that were quantized)."""
    root = tmp_path_factory.mktemp("quant")
    return {f: (make_tiny(root / f"{f}-{q}", family=f, quant=q), make_tiny(root / f, family=f, dtype="bf16"))
            for f, q in CASES.items()}


def _transformers(folder, quant: str, dtype=None):
    import transformers

    config = (transformers.FineGrainedFP8Config if quant == "fp8" else transformers.Mxfp4Config)(dequantize=True)
    kw = {} if dtype is None else {"dtype": dtype}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config, output_loading_info=True, local_files_only=True, **kw)
    assert not any(info.values()), info  # every tensor came from the file: nothing missing, unexpected or resized
    return model.eval()


def _files(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _quantized(folder, model) -> dict[str, QuantTensor]:
    """In-memory name -> its stored tensors assembled as the loader holds them: per-expert FP8 matrices
    written into the fused [E, ...] tensor (gate and up as 2 parts) with their scale rows beside them."""
    sd, spec = _files(folder), spec_from_config(json.loads((folder / "config.json").read_text()))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = {}
    if spec.format is QuantFormat.MXFP4:
        for key in sd:
            if key.endswith("_blocks"):
                name = key.removesuffix("_blocks")
                out[name] = QuantTensor(QuantFormat.MXFP4, sd[key], sd[name + "_scales"])
                assert out[name].shape == shapes[name]
        return out
    weights = [k for k in sd if k + "_scale_inv" in sd]
    slots = map_keys(model, weights, known=set(shapes))
    for key in weights:
        slot = slots[key]
        if slot.is_whole:
            out[slot.target] = QuantTensor(QuantFormat.FP8, sd[key], sd[key + "_scale_inv"], spec.block)
            continue
        if slot.target not in out:
            shape = shapes[slot.target]
            out[slot.target] = QuantTensor(QuantFormat.FP8, torch.zeros(shape, dtype=torch.float8_e4m3fn),
                                           torch.zeros(fp8_scale_shape(shape, spec.block, slot.parts)),
                                           spec.block, slot.parts)
        qt, w, s = out[slot.target], sd[key], sd[key + "_scale_inv"]
        assert slot.part_dim == 0 and slot.transpose is None
        qt.data[slot.expert][slot.part * w.shape[0]:(slot.part + 1) * w.shape[0]] = w
        qt.scale[slot.expert][slot.part * s.shape[0]:(slot.part + 1) * s.shape[0]] = s
    return out


# ---------------------------------------------------------------------------------------
# The tiny checkpoints and transformers


@pytest.mark.parametrize("family", CASES)
def test_tiny_checkpoint_is_in_the_released_format(tiny, family):
    folder, _ = tiny[family]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    floats = {d for k, d in dtypes.items() if d not in ("F8_E4M3", "U8") and not k.endswith("_scale_inv")}
    if CASES[family] == "fp8":
        assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
        assert qc["weight_block_size"] == ([32, 32] if family == "qwen3_moe" else [8, 32])
        fp8 = {k for k, d in dtypes.items() if d == "F8_E4M3"}
        assert fp8 == {k.removesuffix("_scale_inv") for k in dtypes if k.endswith("_scale_inv")}
        assert {dtypes[k + "_scale_inv"] for k in fp8} == {"F32"}
        # Every Linear and expert matrix, not the head, the embedding, norms or routers.
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in fp8
        assert "model.layers.0.self_attn.o_proj.weight" in fp8
        assert not {k for k in fp8 if "lm_head" in k or "embed" in k or "norm" in k or ".gate.weight" in k}
        assert ("modules_to_not_convert" in qc) == (family == "qwen3_moe")  # DeepSeek-V3 ships none
        # DeepSeek keeps its router in float32 (transformers' _keep_in_fp32_modules_strict), the rest bf16.
        assert floats == ({"BF16", "F32"} if family == "deepseek_v3" else {"BF16"})
    else:
        assert qc == {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        u8 = {k for k, d in dtypes.items() if d == "U8"}
        assert u8 == {f"model.layers.{i}.mlp.experts.{p}_{s}" for i in range(2)
                      for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")}
        assert floats == {"BF16"}  # biases included
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        if family == "gpt_oss":
            assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks").get_shape() == [8, 192, 2, 16]
            assert f.get_slice("model.layers.0.mlp.experts.down_proj_scales").get_shape() == [8, 64, 3]
        else:
            assert f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv").get_shape() == (
                [3, 2] if family == "qwen3_moe" else [12, 2])


@pytest.mark.parametrize("family", CASES)
def test_transformers_loads_and_generates(tiny, family):
    folder, _ = tiny[family]
    model = _transformers(folder, CASES[family])
    ids = torch.tensor([[1, 40, 77, 300, 12, 9]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10) and torch.equal(out[:, :6], ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", CASES)
def test_dequantize_equals_transformers_bit_for_bit(tiny, family, dtype):
    folder, _ = tiny[family]
    model = _transformers(folder, CASES[family], dtype)
    params = dict(model.named_parameters())
    quantized = _quantized(folder, model)
    # Exactly the tensors the inventory plans as quantized.
    assert set(quantized) == {r.name for r in from_checkpoint(folder).records
                              if r.dtype in ("float8_e4m3fn", "mxfp4")}
    for name, qt in quantized.items():
        assert torch.equal(qt.dequantize(dtype=dtype), params[name].data), name
    # The unquantized rest is the file's tensors in the model's dtype, so every parameter is accounted for.
    sd = _files(folder)
    for name, p in params.items():
        if name not in quantized:
            assert torch.equal(sd[name].to(p.dtype), p.data), name


@pytest.mark.parametrize("family", CASES)
def test_selected_experts_into_a_reused_buffer(tiny, family):
    """The runtime's call: a subset of experts, in routing order, into one buffer reused across steps."""
    folder, _ = tiny[family]
    model = _transformers(folder, CASES[family])
    params = dict(model.named_parameters())
    quantized = _quantized(folder, model)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    qt, full = quantized[name], params[name].data
    buf = torch.empty((3, *qt.shape[1:]), dtype=torch.bfloat16)
    for ids in ([5, 0, 3], torch.tensor([7, 7, 1])):
        got = qt.dequantize(dtype=torch.bfloat16, out=buf, experts=ids)
        assert got is buf and torch.equal(buf, full[torch.as_tensor(ids)])
    with pytest.raises(ValueError, match="output buffer"):
        qt.dequantize(dtype=torch.float32, out=buf, experts=[0, 1, 2])


@pytest.mark.parametrize("family", CASES)
def test_dequantized_checkpoint_is_the_quantized_model_within_rounding(tiny, family):
    """The format round trip on real tensors: every dequantized tensor is the bf16 original it was made from,
    within the rounding of its format; orientation and gate/up order included."""
    folder, plain = tiny[family]
    model = _transformers(folder, CASES[family])
    quantized = _quantized(folder, model)
    original = dict(_transformers_plain(plain).named_parameters())
    for name, qt in quantized.items():
        w, deq = original[name].data.float(), qt.dequantize(dtype=torch.float32)
        if qt.format is QuantFormat.FP8:
            s = _expand(qt.scale, qt.block, qt.parts, w.shape)
            assert (deq - w).abs().le(w.abs() * 2 ** -4 + s * 2 ** -10).all(), name
        else:
            scale = torch.exp2(qt.scale.float() - 127)        # [E, rows, G]
            x = scale.repeat_interleave(32, dim=-1).transpose(1, 2)                   # [E, cols, rows]
            assert (deq - w).abs().le(x * _fp4_half_step(w.abs() / x)).all(), name
        assert not torch.equal(deq, w)  # it really was quantized


def _transformers_plain(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("family", OTHER_FP8)
def test_other_fp8_families_load_in_transformers_and_match(tmp_path, family):
    folder = make_tiny(tmp_path / family, family=family, quant="fp8", layers=1, experts=4)
    model = _transformers(folder, "fp8")
    params = dict(model.named_parameters())
    quantized = _quantized(folder, model)
    assert any("experts" in n for n in quantized)
    for name, qt in quantized.items():
        assert torch.equal(qt.dequantize(dtype=torch.bfloat16), params[name].data), name


# ---------------------------------------------------------------------------------------
# Arithmetic on random tensors


def _expand(scale, block, parts, shape):
    """Per-element scale by the block definition: element (r, c) of part p reads scale[p*R + r//bm, c//bn]."""
    *_, rows, cols = shape
    pr, sr = rows // parts, scale.shape[-2] // parts
    r = torch.arange(rows)
    srow = (r // pr) * sr + (r % pr) // block[0]
    scol = torch.arange(cols) // block[1]
    return scale.float()[..., srow, :][..., scol]


def _fp4_half_step(v):
    """Half the distance between neighbouring e2m1 values around magnitude v (0.5 apart below 2, 1 below 4,
    2 up to 6)."""
    return torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))


@pytest.mark.parametrize("shape,block,parts", [((3, 100, 70), (32, 32), 1), ((2, 64, 96), (128, 128), 1),
                                               ((4, 2 * 40, 48), (16, 32), 2), ((576, 160), (128, 128), 1)])
def test_fp8_round_trip_within_e4m3_rounding_partial_blocks_included(shape, block, parts):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])  # blocks of very different scales
    halves = w.chunk(parts, dim=-2)
    pairs = [quantize_fp8(h, block) for h in halves]
    q, s = torch.cat([p[0] for p in pairs], dim=-2), torch.cat([p[1] for p in pairs], dim=-2)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == fp8_scale_shape(shape, block, parts)
    check_fp8("w", q.shape, q.dtype, s.shape, s.dtype, block, parts)
    scale = _expand(s, block, parts, shape)
    # By definition: value = q * scale of its block, computed in float32 (then rounded once to the dtype).
    assert torch.equal(dequantize_fp8(q, s, block, dtype=torch.float32, parts=parts), q.float() * scale)
    assert torch.equal(dequantize_fp8(q, s, block, parts=parts), (q.float() * scale).to(torch.bfloat16))
    deq = dequantize_fp8(q, s, block, dtype=torch.float32, parts=parts)
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative), subnormal steps of 2^-9 (half: 2^-10) of the scale.
    assert (deq - w).abs().le(w.abs() * 2 ** -4 + scale * 2 ** -10).all()
    # Each block's largest magnitude lands on 448, e4m3's largest value.
    assert q.float().abs().amax() == FP8_MAX


def test_fp8_zero_block_and_subset():
    w = torch.zeros(3, 64, 64)
    w[1, :32, :32] = torch.linspace(-1, 1, 32 * 32).reshape(32, 32)
    q, s = quantize_fp8(w, (32, 32))
    assert torch.equal(s[0], torch.ones(2, 2)) and s[1, 0, 0] == 1 / FP8_MAX
    deq = dequantize_fp8(q, s, (32, 32), dtype=torch.float32, experts=[1, 0])
    assert torch.equal(deq[1], torch.zeros(64, 64)) and torch.equal(deq[0, 32:], torch.zeros(32, 64))


@pytest.mark.parametrize("shape", [(4, 48, 64), (2, 8, 32 * 5)])
def test_mxfp4_round_trip_within_e2m1_rounding(shape):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 3, shape[-1] // 32).repeat_interleave(32)
    blocks, scales = quantize_mxfp4(w)
    e, rows, cols = shape
    assert blocks.shape == (e, rows, cols // 32, 16) and scales.shape == (e, rows, cols // 32)
    assert blocks.dtype == scales.dtype == torch.uint8
    check_mxfp4("w", blocks.shape, blocks.dtype, scales.shape, scales.dtype, memory_shape=(e, cols, rows))
    deq = dequantize_mxfp4(blocks, scales, dtype=torch.float32)                # [E, cols, rows]
    assert deq.shape == (e, cols, rows)
    x = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)   # [E, rows, cols]
    back = deq.transpose(1, 2)
    assert (back - w).abs().le(x * _fp4_half_step(w.abs() / x)).all()
    # The scale is the smallest power of two that fits each group's largest magnitude into [-6, 6].
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1)
    unit = torch.exp2(scales.float() - 127)
    assert (amax <= 6 * unit).all() and (amax > 3 * unit).all()
    # By definition: each byte holds codes (2j, 2j+1) as (low, high) nibbles of the e2m1 table.
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()   # [E, rows, G, 32]
    by_hand = (lut[codes] * unit[..., None]).flatten(-2)
    assert torch.equal(back, by_hand)
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=torch.float32, experts=[1, 0]), deq[[1, 0]])


def test_mxfp4_rounds_to_nearest_ties_to_even_code():
    # One group scaled by 1 (its largest magnitude is 6); ties between neighbours go to the even code.
    values = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, 2.6, -6.0, 0.0, 4.9, 1.0]
                          + [0.0] * 16)
    blocks, scales = quantize_mxfp4(values.reshape(1, 1, 32))
    assert scales.item() == 127
    deq = dequantize_mxfp4(blocks, scales, dtype=torch.float32).flatten()
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 3.0, -6.0, 0.0, 4.0, 1.0]
    assert deq[:16].tolist() == want


def test_mxfp4_matches_transformers_converter():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 40, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=dtype), want), dtype


def test_transformers_reads_a_partial_fp8_block_differently():
    """Why the block comes from the config: transformers' loader derives it from the scale grid, so 192
    rows in blocks of 128 (2 scale rows) would be read as two blocks of 96. Ours follows the definition."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(192, 128)
    q, s = quantize_fp8(w, (128, 128))
    ours = dequantize_fp8(q, s, (128, 128), dtype=torch.float32)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(ours, q.float() * _expand(s, (128, 128), 1, q.shape))
    assert not torch.equal(theirs, ours)


# ---------------------------------------------------------------------------------------
# Malformed input


def _fp8_headers():
    return {"a.weight": (None, "F8_E4M3", (96, 64)), "a.weight_scale_inv": (None, "F32", (3, 2)),
            "b.weight": (None, "BF16", (8, 64))}


def _mx_headers():
    return {"e.gate_up_proj_blocks": (None, "U8", (8, 192, 2, 16)), "e.gate_up_proj_scales": (None, "U8", (8, 192, 2)),
            "e.gate_up_proj_bias": (None, "BF16", (8, 192))}


FP8 = QuantSpec(QuantFormat.FP8, (32, 32))
MX = QuantSpec(QuantFormat.MXFP4)


@pytest.mark.parametrize("spec,edit,names,says", [
    (FP8, lambda h: h.update({"a.weight_scale_inv": (None, "F32", (2, 2))}), "a.weight_scale_inv", "needs [3, 2]"),
    (FP8, lambda h: h.pop("a.weight_scale_inv"), "a.weight", "no a.weight_scale_inv"),
    (FP8, lambda h: h.update({"c.weight_scale_inv": (None, "F32", (1, 1))}), "c.weight_scale_inv", "has no weight"),
    (FP8, lambda h: h.update({"a.weight": (None, "F8_E5M2", (96, 64))}), "a.weight", "fmt is e4m3"),
    (FP8, lambda h: h.update({"a.weight_scale_inv": (None, "U8", (3, 2))}), "a.weight_scale_inv", "uint8"),
    (FP8, lambda h: h.update({"a.weight": (None, "F8_E4M3", (96,))}), "a.weight", "1-d FP8"),
    (MX, lambda h: h.update({"e.gate_up_proj_blocks": (None, "U8", (8, 192, 4, 8))}), "e.gate_up_proj_blocks",
     "groups, 16"),
    (MX, lambda h: h.pop("e.gate_up_proj_scales"), "e.gate_up_proj_blocks", "no e.gate_up_proj_scales"),
    (MX, lambda h: h.update({"e.gate_up_proj_scales": (None, "U8", (8, 192, 3))}), "e.gate_up_proj_scales",
     "one scale per group"),
    (MX, lambda h: h.update({"e.gate_up_proj_blocks": (None, "BF16", (8, 192, 2, 16))}), "e.gate_up_proj_blocks",
     "uint8"),
    (MX, lambda h: h.update({"e.down_proj_scales": (None, "U8", (8, 64, 3))}), "e.down_proj_scales",
     "no e.down_proj_blocks"),
], ids=["scale-shape", "missing-scale", "orphan-scale", "e5m2", "scale-dtype", "1d", "block-width",
        "missing-scales", "scales-shape", "blocks-dtype", "orphan-scales"])
def test_malformed_tensors_are_named(spec, edit, names, says):
    headers = _fp8_headers() if spec.format is QuantFormat.FP8 else _mx_headers()
    check_headers(spec, headers)  # well-formed as given
    edit(headers)
    with pytest.raises(CheckpointError) as exc:
        check_headers(spec, headers)
    assert str(exc.value).startswith(names + " ") and says in str(exc.value)


def test_mxfp4_blocks_for_another_model_are_named():
    with pytest.raises(CheckpointError, match=r"e\.down_proj_blocks .* model's e\.down_proj is \[8, 96, 64\]"):
        check_mxfp4("e.down_proj", (8, 64, 2, 16), torch.uint8, (8, 64, 2), torch.uint8, memory_shape=(8, 96, 64))


@pytest.mark.parametrize("qc,says", [
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": None}, "per-tensor"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
])
def test_unsupported_quantization_configs(qc, says):
    with pytest.raises(CheckpointError, match=says):
        spec_from_config({"model_type": "deepseek_v3", "quantization_config": qc})


def test_spec_round_trips_through_config():
    assert spec_from_config({"model_type": "llama"}) is None
    for spec in (QuantSpec(QuantFormat.FP8, (128, 128), ("lm_head",)), QuantSpec(QuantFormat.MXFP4, None, None)):
        assert spec_from_config({"quantization_config": spec.to_config()}) == spec
    # DeepSeek-V3's config names no block list and no skips: transformers' defaults.
    assert spec_from_config({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}) == QuantSpec(
        QuantFormat.FP8, (128, 128), None)


@pytest.mark.parametrize("family,key", [("qwen3_moe", "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"),
                                        ("gpt_oss", "model.layers.1.mlp.experts.down_proj_scales")])
def test_broken_tiny_checkpoint_is_refused_from_its_headers(tiny, tmp_path, family, key):
    """A scale tensor cut short: the inventory (so plan, and the loader that builds on it) names it."""
    folder, _ = tiny[family]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    sd = _files(folder)
    sd[key] = (sd[key][:2] if family == "qwen3_moe" else sd[key][:, :, :2]).contiguous()
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    spec = spec_from_config(read_config(folder))
    check_headers(spec, read_headers([folder / "model.safetensors"]))
    with pytest.raises(CheckpointError, match=re.escape(key)):
        from_checkpoint(broken)


# ---------------------------------------------------------------------------------------
# Inventory and CLI


def _file_tensor_bytes(path) -> int:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize("family", CASES)
def test_inventory_bytes_are_the_files_bytes(tiny, family):
    folder, _ = tiny[family]
    on_disk = _file_tensor_bytes(folder / "model.safetensors")
    ckpt, planned = from_checkpoint(folder), from_config(folder / "config.json")
    assert sum(r.bytes for r in ckpt.records) == on_disk
    assert ckpt.records == planned.records  # the config's rule plans exactly what the headers hold
    # A scale is counted with its weight: one record per in-memory tensor, no `_scale_inv` / `_scales` records.
    assert not any(r.name.endswith(("_scale_inv", "_scales", "_blocks")) for r in ckpt.records)
    rec = ckpt.by_name()["model.layers.1.mlp.experts.gate_up_proj"]
    if family == "gpt_oss":
        assert (rec.dtype, rec.bytes) == ("mxfp4", 8 * 192 * 64 // 2 + 8 * 192 * 2)
    else:
        block = (32, 32) if family == "qwen3_moe" else (8, 32)
        scales = 8 * 2 * math.ceil(96 / block[0]) * math.ceil(64 / block[1])
        assert (rec.dtype, rec.bytes) == ("float8_e4m3fn", 8 * 192 * 64 + 4 * scales)


def test_cli_make_tiny_quant(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "m"), "--family", "gpt_oss", "--quant", "mxfp4", "--layers", "1"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4" and cfg["dtype"] == "bfloat16"
    capsys.readouterr()
    for argv, says in ((["--family", "gpt_oss", "--quant", "fp8"], "not available for gpt_oss"),
                       (["--family", "gpt_oss", "--quant", "mxfp4", "--hidden", "32"], "multiple of 64")):
        assert main(["make-tiny", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and says in err and err.count("\n") == 1
        assert not (tmp_path / "x").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dequantize_on_the_device_equals_the_cpu():
    """Device-agnostic: the same ops on the accelerator give the same bits (expert ids as a device tensor,
    into a device buffer)."""
    g = torch.Generator().manual_seed(3)
    q, s = quantize_fp8(torch.randn(6, 2 * 48, 64, generator=g), (16, 32))
    blocks, scales = quantize_mxfp4(torch.randn(6, 96, 64, generator=g))
    ids = torch.tensor([4, 1, 1])
    for qt in (QuantTensor(QuantFormat.FP8, q, s, (16, 32), 2), QuantTensor(QuantFormat.MXFP4, blocks, scales)):
        dev = QuantTensor(qt.format, qt.data.cuda(), qt.scale.cuda(), qt.block, qt.parts)
        buf = torch.empty((3, *qt.shape[1:]), dtype=torch.bfloat16, device="cuda")
        got = dev.dequantize(out=buf, experts=ids.cuda())
        assert got is buf and torch.equal(buf.cpu(), qt.dequantize(experts=ids))
