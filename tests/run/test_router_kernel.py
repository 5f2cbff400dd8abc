"""run/router_kernel.py: with the fused experts, the routers' short calls take the kernel's logits.

- each router class it knows chooses, from F.linear's logits, exactly what the class's own forward chooses (the
  family's arithmetic after the logits is copied, so a transformers release that changes it fails here);
- a short call's logits are the kernel's (bit for bit) and within bf16 rounding of F.linear; a long call is the
  class's own forward;
- loaded with the fused experts, those routers are KernelRouters with their parameters' names (none with the
  eager experts), and the model's greedy tokens are the plain routers' tokens;
- the promise: a fused model with its routers offloaded (the disk tier) gives, bit for bit, the resident logits.

Models: make_tiny, 2 layers, hidden 64, 8 experts top-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_offload as mo
from fixtures_experts import folder_maker, generate_new, resident_maker
from fixtures_models import load, prompt_ids
from moe_offload.kernels import expert_gemv
from moe_offload.model.config import read_config
from moe_offload.planning.placement import GiB
from moe_offload.run.dense_kernel import DENSE_MAX_ROWS
from moe_offload.run.router_kernel import _FINISH, KernelRouter, kernel_router_class

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_vl_moe", "qwen3_next")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return folder_maker(tmp_path_factory.mktemp("router-kernel"))


@pytest.fixture(scope="module")
def resident(folder):
    return resident_maker(folder, "fused")


def _routers(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__ in _FINISH or isinstance(m, KernelRouter)}


def _plain_router(folder, family, dtype):
    """The family's own router class, built from its tiny config, random weights in `dtype`."""
    model, _ = load(folder(family), offload_gb=0)
    (name, router), *_ = _routers(model).items()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return router.to(dtype)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_the_family_arithmetic_after_the_logits_is_the_class_own(folder, family, dtype):
    router = _plain_router(folder, family, dtype)
    finish = _FINISH[type(router).__name__]
    x = torch.randn(5, router.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        own = router(x)
        ours = finish(router, F.linear(x, router.weight, getattr(router, "bias", None)))
    assert len(own) == len(ours) == 3
    for a, b in zip(own, ours):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral", "gpt_oss"))
def test_short_calls_take_the_kernel_logits_and_long_calls_the_class_forward(folder, family):
    plain = _plain_router(folder, family, torch.bfloat16)
    cls = kernel_router_class(type(plain))
    config = read_config(folder(family)).get_text_config()
    router = cls(config).to(torch.bfloat16)
    router.load_state_dict(plain.state_dict())
    router._kernel_setup(_FINISH[type(plain).__name__])
    hidden = plain.weight.shape[1]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rows in range(1, DENSE_MAX_ROWS + 1):
            x = torch.randn(1, rows, hidden, generator=g).to(torch.bfloat16)
            logits, scores, ids = router(x)
            kernel = expert_gemv(x.reshape(rows, hidden), plain.weight.unsqueeze(0), torch.zeros(rows, dtype=torch.long))
            bias = getattr(plain, "bias", None)
            kernel = (kernel + bias.float() if bias is not None else kernel).to(torch.bfloat16)
            assert torch.equal(logits, kernel)
            torch.testing.assert_close(logits, F.linear(x.reshape(rows, hidden), plain.weight, bias),
                                       rtol=1.6e-2, atol=1e-2)
            for a, b in zip((logits, scores, ids), _FINISH[type(plain).__name__](plain, kernel)):
                assert torch.equal(a, b)
        long = torch.randn(DENSE_MAX_ROWS + 3, hidden, generator=g).to(torch.bfloat16)
        for a, b in zip(router(long), plain(long)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss", "mixtral"))
def test_fused_models_have_kernel_routers_and_the_plain_tokens(folder, family):
    fused, _ = load(folder(family), offload_gb=0, experts="fused")
    routers = _routers(fused)
    assert routers and all(isinstance(m, KernelRouter) for m in routers.values()), routers
    names = {n for n, _ in fused.named_parameters()}
    assert all(f"{n}.weight" in names for n in routers)
    eager, _ = load(folder(family), offload_gb=0)
    assert _routers(eager) and not any(isinstance(m, KernelRouter) for m in _routers(eager).values())
    ids = prompt_ids(folder(family), 10)
    assert torch.equal(generate_new(fused, ids)[0], generate_new(eager, ids)[0])


@pytest.mark.exact
@pytest.mark.parametrize("family", ("qwen3_moe", "gpt_oss"))
@pytest.mark.parametrize("way", ("uva", "disk"))
def test_offloaded_routers_give_the_resident_logits(folder, resident, family, way):
    path = folder(family)
    ids, (want_seq, want_logits) = resident(family)
    total = mo.plan(path, offload_gb=0).total_bytes
    budget = (dict(offload_gb=total / GiB) if way == "uva" else
              dict(device_memory_gb=total / 64 / GiB, reserve_gb=0, host_memory_gb=total / 64 / GiB))
    model, plan = load(path, experts="fused", **budget)
    assert {t.tier for t in plan.tensors if t.role == "router"} == {"host" if way == "uva" else "disk"}
    seq, logits = generate_new(model, ids)
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits - want_logits).abs().max()}"
