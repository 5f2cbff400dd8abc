"""The selected experts computed by moe-offload's CPU kernels, straight from their stored bytes (experts="fused").

The kernels (kernels/csrc/expert_gemv.cpp) read an expert stack where it lies (the module's resident parameter,
a uva view of host memory, the buffer a gather staged rows into, a cache page) in its stored format, bf16 / fp16 /
fp32, FP8 e4m3 with its block scales, MXFP4 e2m1 blocks with their e8m0 scales, decode 16 values at a time in
registers and accumulate in float32: a call reads the selected experts' stored bytes once and writes no
dequantized copy. Pairs that picked the same expert share each row's read.

The arithmetic around the two projections is grouped.py's (`experts_math`: the class's gate convention,
transposed storage, biases, post-expert norm, the routing weights, the same roundings to the model's dtype), so
a model run fused equals, bit for bit, the same model with nothing offloaded run fused: its same-arithmetic
reference, whatever tier or buffer each expert's bytes came from, and on every CPU (the kernel's AVX-512, AVX2
and portable paths compute one definition). Against the class's eager loop it agrees within rounding.

Only calls of up to `FUSED_MAX_ROWS` rows per sequence step are computed here (decode steps, small batches); a
prefill keeps the eager loop over GEMMs, where each expert serves many tokens (benchmarks/step_bench.py measures
the crossover).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import torch
import torch.nn as nn

from ..formats.quant import QuantFormat
from ..kernels import FLOAT_DTYPES, Fp8Stack, Isa, Mxfp4Stack, expert_gemv, fp8_row_blocks
from .grouped import experts_math

FUSED_MAX_ROWS = 16   # rows (tokens x sequences) of a call up to which the kernels compute it


@lru_cache(maxsize=64)
def _row_blocks(rows: int, block_rows: int, parts: int) -> torch.Tensor:
    return fp8_row_blocks(rows, block_rows, parts)


def supports(module: nn.Module, quant: Mapping) -> str | None:
    """None when the kernels can compute this experts module; else why not (said in the runtime's report)."""
    for local, q in quant.items():
        if q.format is QuantFormat.FP8 and getattr(module, "is_transposed", False):
            return f"{local}: FP8 experts held transposed"
    for name, p in module.named_parameters(recurse=False):
        if name in quant or p.dim() != 3:
            continue
        if p.dtype not in FLOAT_DTYPES:
            return f"{name}: {p.dtype} experts"
    return None


def stack(module: nn.Module, tensors: Mapping[str, torch.Tensor], quant: Mapping, name: str):
    """The stack the kernel reads for projection `name`: a float tensor, or the stored values with their scales."""
    def get(n):
        return tensors[n] if n in tensors else getattr(module, n)

    q = quant.get(name)
    if q is None:
        return get(name)
    if q.format is QuantFormat.MXFP4:
        return Mxfp4Stack(get(name), get(q.scale_local))
    values = get(name)
    return Fp8Stack(values, get(q.scale_local), _row_blocks(values.shape[1], q.block[0], q.parts), q.block[1])


def fused_experts(module: nn.Module, tensors: Mapping[str, torch.Tensor], quant: Mapping,
                  hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  isa: Isa | None = None) -> torch.Tensor:
    """The experts module's output for [T, H] hidden states routed to top_k_index [T, k] (ids into the stacks of
    `tensors`, default the module's own), every projection by the kernels (`isa`: the path, resolved once by the
    caller; default the best here)."""
    return experts_math(module, tensors, kernel_project(module, tensors, quant, isa), hidden_states, top_k_index,
                        top_k_weights)


def kernel_project(module: nn.Module, tensors: Mapping[str, torch.Tensor], quant: Mapping, isa: Isa | None,
                   rows: Mapping[str, torch.Tensor] | None = None):
    """grouped.experts_math's `project` by the kernels over the stacks of `tensors` (default the module's own).
    `rows`: local name -> int64 [E] the row of each expert id in that stack (the ids of a pair are then expert ids:
    host compute reads host stacks and resident stacks in place this way); without it the ids index the stacks."""
    transposed = bool(getattr(module, "is_transposed", False))

    def project(name: str, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s = stack(module, tensors, quant, name)
        if rows is not None and name in rows:
            ids = rows[name][ids]
        # x: [S, K] -> [S, O] float32, rounded to the model's dtype as grouped.py's kernels round
        return expert_gemv(x, s, ids, transposed=transposed and not isinstance(s, (Fp8Stack, Mxfp4Stack)),
                           isa=isa).to(x.dtype)

    return project
