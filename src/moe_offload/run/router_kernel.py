"""A decode step's router logits by moe-offload's CPU kernels, the routing that follows them as transformers has it.

The routers of Qwen2/3-MoE, Qwen3-Next, Qwen3-VL-MoE, OLMoE, Mixtral and GPT-OSS are not `nn.Linear`s (a module
holding a `weight` [experts, hidden] that calls `F.linear` itself), so dense_kernel's swap does not reach them, and
torch's bf16 matrix-vector product on a CPU is slow at their size: at Qwen3-30B-A3B's router ([128 x 2048] bf16,
0.5 MB) 0.26 ms a layer at one thread on the 2-core EPYC, 2 GB/s, where the kernel reads at RAM speed.

So, with the fused experts, each such router is rebuilt on the meta skeleton as a subclass of its own class
(`kernel_routers`): its calls of up to DENSE_MAX_ROWS rows on a CPU compute the logits as KernelLinear does (the
weight as the one expert of a one-expert stack, float32 sums rounded once to the dtype F.linear would return) and
then choose the experts with the family's own arithmetic (`_FINISH`: softmax, top-k, normalization and casts as
transformers writes them, checked against the class's own forward in tests/run/test_router_kernel.py); every
other call is the class's own forward. The parameters keep their names, so the loader and the plan see the same
tensors; resident and offloaded runs of one model take the same router and agree bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import FLOAT_DTYPES, best_isa, expert_gemv
from .dense_kernel import DENSE_MAX_ROWS


def _softmax_top_k(router: nn.Module, logits: torch.Tensor, *, normalize: bool, cast: bool):
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, router.top_k, dim=-1)
    if normalize:
        top /= top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype) if cast else top, ids


def _qwen(router, logits):            # Qwen2/3-MoE, Qwen3-Next, OLMoE: normalized if the config says so
    return _softmax_top_k(router, logits, normalize=router.norm_topk_prob, cast=True)


def _qwen_vl(router, logits):         # Qwen3-VL-MoE's text router: always normalized
    return _softmax_top_k(router, logits, normalize=True, cast=True)


def _mixtral(router, logits):         # normalized, the weights left in float32
    return _softmax_top_k(router, logits, normalize=True, cast=False)


def _gpt_oss(router, logits):         # top-k of the logits, then a softmax over those k in their dtype
    top, ids = torch.topk(logits, router.top_k, dim=-1)
    return logits, F.softmax(top, dim=1, dtype=top.dtype), ids


# Router class name -> what its forward does after `router_logits = F.linear(hidden, weight[, bias])`.
_FINISH: dict[str, Callable] = {
    "Qwen2MoeTopKRouter": _qwen,
    "Qwen3MoeTopKRouter": _qwen,
    "Qwen3NextTopKRouter": _qwen,
    "OlmoeTopKRouter": _qwen,
    "Qwen3VLMoeTextTopKRouter": _qwen_vl,
    "MixtralTopKRouter": _mixtral,
    "GptOssTopKRouter": _gpt_oss,
}


class KernelRouter(nn.Module):
    """Mixed in before a router class of _FINISH: short CPU calls take the kernel's logits, the rest the class's
    own forward."""

    def _kernel_setup(self, finish: Callable) -> None:
        self._finish = finish
        self._isa = best_isa()
        self._ids = torch.zeros(DENSE_MAX_ROWS, dtype=torch.long)   # expert 0 of the one-expert stack

    def forward(self, hidden_states: torch.Tensor):
        w = self.weight
        rows = hidden_states.numel() // w.shape[1] if hidden_states.numel() else 0
        if 0 < rows <= DENSE_MAX_ROWS and w.device.type == "cpu" and w.dtype in FLOAT_DTYPES \
                and hidden_states.dtype == w.dtype:     # (F.linear refuses mixed dtypes: the class's forward says so)
            logits = expert_gemv(hidden_states.reshape(rows, w.shape[1]), w.unsqueeze(0), self._ids[:rows],
                                 isa=self._isa)
            bias = getattr(self, "bias", None)
            if bias is not None:
                logits = logits + bias.float()
            return self._finish(self, logits.to(w.dtype))
        return super().forward(hidden_states)


def kernel_router_class(cls: type) -> type | None:
    """The KernelRouter subclass of router class `cls`, or None when _FINISH does not know it."""
    if cls.__name__ not in _FINISH:
        return None
    return type(f"Kernel{cls.__name__}", (KernelRouter, cls), {"__module__": __name__})


def kernel_routers(model: nn.Module) -> list[str]:
    """Replace, on the meta skeleton, every router module _FINISH knows by its KernelRouter subclass, built from
    the model's (text) config as transformers builds it, the old module's meta parameters assigned to it (names,
    shapes and dtypes unchanged). Returns the names replaced."""
    config = model.config.get_text_config()
    made: dict[type, type | None] = {}
    names = []
    for name, module in list(model.named_modules()):
        cls = type(module)
        if cls not in made:
            made[cls] = kernel_router_class(cls)
        if made[cls] is None:
            continue
        with torch.device("meta"):
            new = made[cls](config)
        new.load_state_dict(module.state_dict(), assign=True)
        new.train(module.training)
        new._kernel_setup(_FINISH[cls.__name__])
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        names.append(name)
    return names
