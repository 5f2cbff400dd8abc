"""run/dense_kernel.py: with the fused experts, the dense Linears' short calls run the CPU kernel on the weight as stored.

- every nn.Linear outside the routed experts is a KernelLinear (none with the eager experts);
- a KernelLinear's call of up to DENSE_MAX_ROWS rows is the kernel's arithmetic (bit for bit) and within bf16
  rounding of F.linear; a longer call is F.linear itself;
- FP8 Linear weights are read as stored (no dequantized copy is made for a decode step);
- the promise: with the attention, norms, embedding and LM head offloaded (uva, the prefetch ring, the disk tier)
  a fused model's logits equal, bit for bit, the same model's with nothing offloaded.

Models: make_tiny, 2 layers, hidden 64, 8 experts top-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_offload as mo
from fixtures_experts import folder_maker, generate_new, resident_maker
from fixtures_models import load
from moe_offload.kernels import expert_gemv
from moe_offload.planning.placement import GiB
from moe_offload.run.dense_kernel import DENSE_MAX_ROWS, KernelLinear
from moe_offload.run.experts import is_experts_module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_maker(tmp_path_factory.mktemp("dense-kernel"))


@pytest.fixture(scope="module")
def resident(folder):
    return resident_maker(folder, "fused")


def _linears(model):
    under_experts = {n for n, m in model.named_modules() if is_experts_module(m)}
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not any(n.startswith(e + ".") for e in under_experts)}


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss", "deepseek_v3"))
def test_dense_linears_are_kernel_linears_with_the_fused_experts_only(folder, family):
    model, _ = load(folder(family), offload_gb=0, experts="fused")
    linears = _linears(model)
    assert "lm_head" in linears and any("q_proj" in n or "q_a_proj" in n for n in linears)
    assert all(type(m) is KernelLinear for m in linears.values()), {n: type(m) for n, m in linears.items()}
    eager, _ = load(folder(family), offload_gb=0)
    assert not [n for n, m in eager.named_modules() if isinstance(m, KernelLinear)]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("bias", (False, True))
def test_short_calls_are_the_kernel_and_long_calls_are_linear(dtype, bias):
    g = torch.Generator().manual_seed(0)
    lin = KernelLinear(96, 40, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(40, generator=g))
    for shape in ((1, 1, 96), (1, DENSE_MAX_ROWS, 96), (DENSE_MAX_ROWS, 96)):
        x = torch.randn(*shape, generator=g).to(dtype)
        with torch.no_grad():
            got = lin(x)
            rows = x.reshape(-1, 96)
            want = expert_gemv(rows, lin.weight.unsqueeze(0), torch.zeros(rows.shape[0], dtype=torch.long))
            if bias:
                want = want + lin.bias.float()
            assert got.shape == (*shape[:-1], 40) and got.dtype == dtype
            assert torch.equal(got.reshape(-1, 40), want.to(dtype))
            ref = F.linear(x.double(), lin.weight.double(), lin.bias.double() if bias else None)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    for shape in ((DENSE_MAX_ROWS + 1, 96), (2, 3, 96)):
        x = torch.randn(*shape, generator=g).to(dtype)
        with torch.no_grad():
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_fp8_linears_are_read_as_stored(folder):
    path = folder("qwen3_moe", quant="fp8")
    model, _ = load(path, offload_gb=0, experts="fused")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is KernelLinear and q_proj.stored_fp8 is not None
    assert q_proj.weight.dtype == torch.float8_e4m3fn
    ids, (seq, logits) = resident_maker(folder, "fused")("qwen3_moe", quant="fp8")
    rt = model.moe_offload_runtime
    seq2, logits2 = generate_new(model, ids)
    assert not [k for k in rt.dequantizer._buffers if k[0] == "linear"]   # no decode step dequantized a Linear
    assert torch.equal(logits2, logits)
    eager, _ = load(path, offload_gb=0)   # the dequantize-at-use path: the same model within rounding
    _, want = generate_new(eager, ids)
    torch.testing.assert_close(logits[0], want[0], rtol=0, atol=0.05)


def _dense_way(way: str, plan0):
    total = plan0.total_bytes
    if way == "uva":
        return dict(offload_gb=total / GiB)
    if way == "prefetch":
        return dict(offload_gb=total / GiB, backend="prefetch")
    assert way == "disk"
    return dict(device_memory_gb=total / 64 / GiB, reserve_gb=0, host_memory_gb=total / 64 / GiB)


DENSE_CASES = [({}, "uva"), ({}, "prefetch"), ({}, "disk"), ({"quant": "fp8"}, "uva"), ({"quant": "fp8"}, "prefetch")]


@pytest.mark.exact   # (the disk tier reads quantized routed experts, not quantized dense weights)
@pytest.mark.parametrize("make, way", DENSE_CASES, ids=[f"{m.get('quant', 'fp32')}-{w}" for m, w in DENSE_CASES])
def test_offloaded_dense_linears_are_bitwise_the_resident(folder, resident, make, way):
    path = folder("qwen3_moe", **make)
    ids, (want_seq, want_logits) = resident("qwen3_moe", **make)
    model, plan = load(path, experts="fused", **_dense_way(way, mo.plan(path, offload_gb=0)))
    tiers = {t.tier for t in plan.tensors if t.role in ("attention", "lm_head")}
    assert tiers == ({"disk"} if way == "disk" else {"host"}), tiers
    seq, logits = generate_new(model, ids)
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits - want_logits).abs().max()}"
