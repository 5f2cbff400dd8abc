"""`experts="fused"` (run/fused.py): a call's selected experts computed by the CPU kernels on their stored format.

- fused_experts on a real experts module equals the class's eager forward within fp32 rounding, for the
  conventions of transformers' families;
- the promise: a fused model with anything offloaded (uva in place, prefetch, a split tensor, the disk tier, a
  device cache; bf16; FP8 and MXFP4 experts read as stored) gives logits bitwise equal to the same model loaded
  with nothing offloaded, fused; quantized experts are never dequantized into memory;
- `auto` resolves to fused on a CPU and says why not elsewhere; an explicit fused that cannot run is refused.

Models: make_tiny, 2 layers, hidden 64, 8 experts top-2, float32 unless said.
"""

from __future__ import annotations

import pytest
import torch

from fixtures_experts import SIZES, experts_module, folder_maker, offloaded_equals_resident, resident_maker
from fixtures_models import load
from moe_offload.errors import DeviceError
from moe_offload.run.compute import ExpertsMode, resolve_experts
from moe_offload.run.fused import FUSED_MAX_ROWS, fused_experts
from moe_offload.run.grouped import original_forward



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_maker(tmp_path_factory.mktemp("fused"))


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss", "mixtral", "deepseek_v3", "olmoe"))
def test_fused_experts_equals_the_class_forward(folder, family):
    model, _ = load(folder(family), offload_gb=0)
    module = experts_module(model)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, FUSED_MAX_ROWS):
        hidden = torch.randn(rows, model.config.hidden_size, generator=g)
        weights, index = torch.randn(rows, SIZES["experts"], generator=g).softmax(-1).topk(
            model.config.num_experts_per_tok, -1)
        with torch.no_grad():
            want = original_forward(module)(module, hidden, index, weights)
            got = fused_experts(module, {}, {}, hidden, index, weights)
        assert want.abs().max() > 0.1
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def resident(folder):
    return resident_maker(folder, "fused")


CASES = [(f, {}, way) for f in ("qwen3_moe", "gpt_oss") for way in ("uva", "prefetch", "split", "disk", "cache")]
CASES += [("qwen3_moe", {"dtype": "bfloat16"}, way) for way in ("uva", "split")]
CASES += [("qwen3_moe", {"quant": "fp8"}, way) for way in ("uva", "prefetch", "split")]
CASES += [("gpt_oss", {"quant": "mxfp4"}, way) for way in ("uva", "split")]


@pytest.mark.exact
@pytest.mark.parametrize("family, make, way", CASES,
                         ids=[f"{f}-{'-'.join(map(str, m.values())) or 'fp32'}-{w}" for f, m, w in CASES])
def test_offloaded_fused_is_bitwise_the_resident_fused(folder, resident, family, make, way):
    def check(model, rt):
        assert rt.compute.mode is ExpertsMode.FUSED and "CPU kernels" in rt.mechanism
        assert rt.compute._unsupported and not any(rt.compute._unsupported.values())   # every module ran fused
        if rt.dequantizer is not None:   # quantized experts were read as stored: no dequantized copy was made
            assert not [key for key in rt.dequantizer._buffers if key[0] == "experts"]

    offloaded_equals_resident(folder, resident, family, make, way, "fused", check)


def test_long_prefills_run_the_class_forward(folder):
    model, _ = load(folder("qwen3_moe"), offload_gb=0, experts="fused")
    module = experts_module(model)
    rt = model.moe_offload_runtime
    hidden = torch.randn(FUSED_MAX_ROWS + 1, model.config.hidden_size)
    weights, index = torch.randn(FUSED_MAX_ROWS + 1, SIZES["experts"]).softmax(-1).topk(2, -1)
    assert not rt.compute.fused_for(module, hidden)
    with torch.no_grad():
        assert torch.equal(rt.compute(module, {}, hidden, index, weights, decode=False),
                           original_forward(module)(module, hidden, index, weights))


def test_auto_is_fused_on_the_cpu_and_says_why_not_elsewhere(folder):
    model, _ = load(folder("qwen3_moe"), offload_gb=0, experts="auto")
    assert model.moe_offload_runtime.compute.mode is ExpertsMode.FUSED
    mode, why = resolve_experts("auto", torch.device("cuda"))
    assert mode is ExpertsMode.EAGER and "cuda" in why
    with pytest.raises(DeviceError, match="--experts grouped or eager"):
        resolve_experts("fused", torch.device("cuda"))
    model, _ = load(folder("qwen3_moe"), offload_gb=0)   # the Python API's default stays the class's loop
    assert model.moe_offload_runtime.compute.mode is ExpertsMode.EAGER
