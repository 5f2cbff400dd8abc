"""The dense Linears of a decode step computed by moe-offload's CPU kernels, on their weights as stored.

With the fused experts (`--experts fused`, the CLI's default on a CPU) the routed experts are not the only
weights a decode step reads: the attention projections, shared experts, dense MLPs and the LM head are read too
(at Qwen3-30B-A3B's dimensions the LM head alone is 0.6 GB a token), and torch's bf16 matrix-vector product on a
CPU reads them at half the speed of the kernels (measured at two threads on the 2-core EPYC: LM head 21.9 ms by
`F.linear`, 13.2 ms by the kernel). So every `nn.Linear` outside the routed experts is built as a
`KernelLinear`: an `nn.Linear` whose calls of up to DENSE_MAX_ROWS rows run `kernels.expert_gemv` on its weight
as the one expert of a one-expert stack: bf16, fp16 or fp32 as loaded, FP8 (e4m3 with block scales, `StoredFp8`)
read in place with nothing dequantized. Longer calls (prefill, batched decode) take `F.linear` (an FP8 weight
dequantized for that call, as quant_weights' hooks do on the other paths): the kernel is a matrix-vector product,
each row's arithmetic repeated per token, and torch's GEMM overtakes it from 3 rows on (measured on the 2-core
EPYC, [4096 x 2048] bf16 at one thread: 1 row 0.50 ms against 0.82, 2 rows 0.74 against 0.58 (two threads 0.34
against 0.44), 4 rows 1.05 against 0.58; the LM head [151936 x 2048]: 2 rows 31 ms against 36, 3 rows 43 against 35).

The swap is made on the meta skeleton, before any weight is placed or hook attached (`kernel_linears`): the
loader, the runtime and its hooks see the KernelLinear modules from the start, nothing is patched afterwards, and
a call reads whatever weight its module holds then (the prefetch ring's staged copy, the disk tier's read).
The arithmetic is the kernel's, the same on every path of `make test`: resident and offloaded runs of one model
agree bit for bit, as they do for the experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..formats.quant import QuantFormat
from ..formats.quant_codecs import dequantize_fp8
from ..kernels import FLOAT_DTYPES, Fp8Stack, Isa, best_isa, expert_gemv, fp8_row_blocks

DENSE_MAX_ROWS = 2   # rows (tokens x sequences) of a call up to which the kernel computes a dense Linear


@dataclass(frozen=True)
class StoredFp8:
    """An FP8 Linear weight held as stored: e4m3 values (the parameter) and float32 block scales (the buffer
    `scale_local`), `block` (rows, cols), dequantizing to `compute_dtype` for calls the kernel does not take."""
    scale_local: str
    block: tuple[int, int]
    parts: int
    compute_dtype: torch.dtype
    row_block: torch.Tensor


class KernelLinear(nn.Linear):
    """nn.Linear whose short calls (decode steps, small batches) run the CPU kernel on the weight as stored."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 isa: Isa | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.stored_fp8: StoredFp8 | None = None
        self.isa = best_isa() if isa is None else Isa(isa)
        self._ids = torch.zeros(DENSE_MAX_ROWS, dtype=torch.long)   # expert 0 of the one-expert stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        fp8 = self.stored_fp8
        if 0 < rows <= DENSE_MAX_ROWS and w.device.type == "cpu" and (fp8 is not None or w.dtype in FLOAT_DTYPES):
            if fp8 is not None:
                stack = Fp8Stack(w.unsqueeze(0), self._buffers[fp8.scale_local].unsqueeze(0), fp8.row_block,
                                 fp8.block[1])
            else:
                stack = w.unsqueeze(0)
            out = expert_gemv(x.reshape(rows, x.shape[-1]), stack, self._ids[:rows], isa=self.isa)
            dtype = fp8.compute_dtype if fp8 is not None else w.dtype
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype if x.dtype in FLOAT_DTYPES else dtype).view(*x.shape[:-1], self.out_features)
        if fp8 is not None:
            w = dequantize_fp8(w, self._buffers[fp8.scale_local], fp8.block, dtype=fp8.compute_dtype,
                               parts=fp8.parts)
        # As one contiguous [rows, in] matrix: a strided batch (the LM head's last position of a prompt batch,
        # hidden[:, -1:]) sends torch's bf16 CPU matmul down a batched path that copies the weight per sequence
        # (Qwen3-30B-A3B's LM head, 4 prompts: 7.9 s and 2.3 GB more, against 0.02 s).
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return F.linear(flat, w, self.bias).view(*x.shape[:-1], self.out_features)


def kernel_linears(model: nn.Module, skip: Callable[[str, nn.Module], bool]) -> list[str]:
    """Replace, on the meta skeleton, every plain nn.Linear not under a module `skip` names by a KernelLinear of
    the same shape and dtype (on meta: the loader fills it as it would the Linear). Returns the names replaced."""
    skipped: list[str] = []
    targets = []
    isa = best_isa()
    for name, module in model.named_modules():
        if any(name.startswith(s + ".") for s in skipped):
            continue
        if skip(name, module):
            skipped.append(name)
            continue
        if type(module) is nn.Linear:
            targets.append(name)
    for name in targets:
        old = model.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = KernelLinear(old.in_features, old.out_features, bias=old.bias is not None, device="meta",
                           dtype=old.weight.dtype, isa=isa)
        new.train(old.training)
        setattr(parent, child, new)
    return targets


def attach_fp8(model: nn.Module, layouts: Mapping) -> set[str]:
    """Give each KernelLinear whose weight is held as FP8 its StoredFp8: the kernel reads it in place. Returns the
    layouts' names so served (quant_weights' per-call dequantizing hooks are for the others)."""
    served = set()
    for name, q in layouts.items():
        module_name, _, local = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not isinstance(module, KernelLinear) or local != "weight" or q.format is not QuantFormat.FP8 or q.block is None:
            continue
        rows = q.data_shape[0]
        module.stored_fp8 = StoredFp8(q.scale_local, tuple(q.block), q.parts, q.compute_dtype,
                                      fp8_row_blocks(rows, q.block[0], q.parts))
        served.add(name)
    return served
