"""kernels.expert_gemv: the selected experts' products read from the stored format (kernels/csrc/expert_gemv.cpp).

- one arithmetic on every CPU: each instruction-set path this CPU runs (AVX-512, AVX2) gives the portable path's
  bits, for every stored format, tails of rows and columns, transposed stacks, shared experts;
- the bits do not depend on the thread count, on where the stack lies (alignment), on which other pairs share the
  call, or on whether the stack is the whole parameter, the selected experts gathered with renumbered ids, or
  experts lying at pages of a larger arena (a stack whose experts are stride(0) apart, rows overlapping), or on
  whether the experts of a call lie in one stack or several (each pair naming its stack);
- the values are the products of the stored weights, within float32 rounding of a float64 reference (FP8 and
  MXFP4 against formats/quant_codecs' dequantization);
- the prefetch distances (this CPU's default or a call's own) change no bit, and the default follows the vendor;
- bad arguments are refused with what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_offload.formats.quant_codecs import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from moe_offload.kernels import (Fp8Stack, Isa, Mxfp4Stack, Prefetch, best_isa, expert_gemv, fp8_row_blocks,
                                prefetch_distances)

pytestmark = pytest.mark.exact

RUNS = [i for i in Isa if i <= best_isa()]   # the paths this CPU (and ATEN_CPU_CAPABILITY) allows
# (experts, rows, cols): tails of 16 and 64; more outputs than a transposed work item's 4096 columns, K not / 4
SHAPES = [(5, 37, 70), (4, 64, 128), (3, 33, 16), (2, 130, 200), (2, 4096 + 37, 23)]
IDS = [0, 2, 2, 1, 0, 1]


def _ids(E):
    return torch.tensor([i % E for i in IDS])


def _reference(x, w, ids, transposed=False):
    w = w.double().transpose(1, 2) if transposed else w.double()
    return torch.einsum("sok,sk->so", w[ids], x.double())


def _all_paths(x, stack, ids, **kw):
    outs = [expert_gemv(x, stack, ids, isa=i, **kw) for i in RUNS]
    for isa, out in zip(RUNS, outs):
        assert torch.equal(out, outs[0]), f"{isa.name} differs from {RUNS[0].name}"
    return outs[0]


def test_this_cpu_runs_a_vector_path():
    # every x86-64 CPU of the last decade has AVX2; the suite's second kernel path caps it at the portable one
    assert Isa.PORTABLE in RUNS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_float_stacks_every_path_one_result(dtype, transposed, shape):
    E, O, K = shape
    g = torch.Generator().manual_seed(O * K)
    w = torch.randn(E, O, K, generator=g).to(dtype)
    x = torch.randn(len(IDS), K, generator=g)
    ids = _ids(E)
    stack = w.transpose(1, 2).contiguous() if transposed else w
    out = _all_paths(x, stack, ids, transposed=transposed)
    assert out.shape == (len(IDS), O) and out.dtype == torch.float32
    want = _reference(x, w, ids)
    assert want.abs().max() > 1
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5 * K ** 0.5)


def test_fp8_block_scales_with_stacked_parts_and_partial_blocks():
    E, I, K = 3, 200, 300                       # gate and up of 200 rows each: 2 x 2 row blocks; 3 column blocks
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(E, I, K, generator=g), torch.randn(E, I, K, generator=g) * 3
    qg, sg = quantize_fp8(gate, (128, 128))
    qu, su = quantize_fp8(up, (128, 128))
    values, scales = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
    rows = fp8_row_blocks(2 * I, 128, parts=2)
    assert rows[:I].max() == 1 and rows[I] == 2 and rows[-1] == 3
    x = torch.randn(len(IDS), K, generator=g)
    ids = _ids(E)
    out = _all_paths(x, Fp8Stack(values, scales, rows, 128), ids)
    deq = dequantize_fp8(values, scales, (128, 128), dtype=torch.float32, parts=2)
    torch.testing.assert_close(out.double(), _reference(x, deq, ids), rtol=0, atol=1e-4)
    # the values as float8 or as their bytes: one result
    assert torch.equal(expert_gemv(x, Fp8Stack(values.view(torch.uint8), scales, rows, 128), ids), out)


def test_mxfp4_blocks_as_gpt_oss_stores_them():
    E, O, K = 3, 50, 96
    g = torch.Generator().manual_seed(2)
    blocks, scales = quantize_mxfp4(torch.randn(E, O, K, generator=g) * 4)
    x = torch.randn(len(IDS), K, generator=g)
    ids = _ids(E)
    out = _all_paths(x, Mxfp4Stack(blocks, scales), ids)
    deq = dequantize_mxfp4(blocks, scales, dtype=torch.float32)   # [E, K, O], transformers' orientation
    torch.testing.assert_close(out.double(), _reference(x, deq, ids, transposed=True), rtol=0, atol=1e-4)


def test_bits_do_not_depend_on_threads_alignment_or_company():
    E, O, K = 6, 130, 200
    g = torch.Generator().manual_seed(3)
    w = torch.randn(E, O, K, generator=g).to(torch.bfloat16)
    x = torch.randn(8, K, generator=g)
    ids = torch.tensor([5, 1, 1, 3, 0, 5, 2, 4])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = expert_gemv(x, w, ids)
        torch.set_num_threads(2)
        two = expert_gemv(x, w, ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    # the same stack two bytes off its allocation's alignment
    buf = torch.empty(w.numel() + 1, dtype=w.dtype)
    shifted = buf[1:].view(w.shape)
    shifted.copy_(w)
    assert shifted.data_ptr() % 64 != w.data_ptr() % 64 or shifted.data_ptr() % 4
    assert torch.equal(expert_gemv(x, shifted, ids), one)
    # each pair alone: the same bits as in company
    for s in range(len(ids)):
        assert torch.equal(expert_gemv(x[s:s + 1], w, ids[s:s + 1]), one[s:s + 1])
    # the selected experts gathered, ids renumbered (what the gathering path hands the kernel)
    selected = torch.unique(ids)
    local = torch.searchsorted(selected, ids)
    assert torch.equal(expert_gemv(x, w.index_select(0, selected), local), one)
    # the experts inside a larger arena, each starting at a page (a host cache's arena seen as a stack of rows
    # starting at every page: overlapping rows, stride(0) one page, not one expert)
    page = O * K // 2
    arena = torch.zeros((2 * E + 3) * page, dtype=w.dtype)
    starts = [3 + 2 * e for e in range(E)]
    for e, at in enumerate(starts):
        arena[at * page:at * page + O * K].copy_(w[e].reshape(-1))
    pages = arena.as_strided(((arena.numel() - O * K) // page + 1, O, K), (page, K, 1))
    assert torch.equal(expert_gemv(x, pages, torch.tensor([starts[e] for e in ids.tolist()])), one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_experts_in_several_stacks_one_call_the_same_bits(dtype, transposed):
    """A call over several stacks (the module's parameter, a split tensor's resident stack, a cache arena's pages)
    gives each pair the bits of that pair computed from its own stack alone, on every path; an expert index that
    appears in two stacks is two experts."""
    E, O, K = 5, 70, 130
    g = torch.Generator().manual_seed(5)
    full = torch.randn(E, O, K, generator=g).to(dtype)
    part = torch.randn(3, O, K, generator=g).to(dtype)
    page = O * K // 2                               # the third stack: experts at pages of an arena
    arena = torch.zeros(9 * page, dtype=dtype)
    for e, at in enumerate((1, 4)):
        arena[at * page:at * page + O * K].copy_(part[e].reshape(-1))
    pages = arena.as_strided(((arena.numel() - O * K) // page + 1, O, K), (page, K, 1))
    if transposed:      # (the arena's pages hold untransposed rows)
        stacks = (full.transpose(1, 2).contiguous(), part.transpose(1, 2).contiguous())
        which, ids = torch.tensor([0, 1, 0, 1, 1, 0]), torch.tensor([3, 0, 3, 1, 2, 4])
    else:               # the arena's experts start at pages 1 and 4: part's experts 0 and 1
        stacks = (full, part, pages)
        which, ids = torch.tensor([0, 1, 0, 2, 1, 2, 0, 1]), torch.tensor([3, 0, 3, 1, 2, 4, 0, 0])
    x = torch.randn(len(ids), K, generator=g)
    x[3] = x[1]
    out = _all_paths(x, stacks, ids, which=which, transposed=transposed)
    for s in range(len(ids)):
        alone = expert_gemv(x[s:s + 1], stacks[which[s]], ids[s:s + 1], transposed=transposed)
        assert torch.equal(out[s:s + 1], alone), f"pair {s} (stack {int(which[s])}, expert {int(ids[s])})"
    if not transposed:  # part's expert 0 read from its stack and from the arena
        assert torch.equal(out[1], out[3])


def test_prefetch_distances_change_no_bit():
    # a row of 4133 bf16 (8 KiB, past the default distances) and short rows; every stored format, every path
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(IDS), 4133, generator=g)
    ids = _ids(4)
    w = torch.randn(4, 40, 4133, generator=g)
    fp8 = Fp8Stack(*quantize_fp8(w[:, :, :4096], (128, 128)), fp8_row_blocks(40, 128), 128)
    mx = Mxfp4Stack(*quantize_mxfp4(w[:, :, :4096]))
    cases = [(w.to(torch.bfloat16), x), (w, x), (w[:, :, :70].to(torch.float16), x[:, :70]),
             (fp8, x[:, :4096]), (mx, x[:, :4096])]
    for stack, xs in cases:
        default = _all_paths(xs, stack, ids)
        for pf in (Prefetch(0, 0), Prefetch(512, 0), Prefetch(0, 2048), Prefetch(512, 2048), Prefetch(4096, 65536),
                   Prefetch(0, 0, 2), Prefetch(256, 0, 4), Prefetch(1024, 4096, 8)):
            assert torch.equal(_all_paths(xs, stack, ids, prefetch=pf), default), pf


def test_prefetch_default_follows_the_vendor():
    vendor = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), "")
    amd = vendor == "AuthenticAMD"
    assert prefetch_distances() == (Prefetch(512, 2048, 1) if amd else Prefetch(256, 0, 8))


def test_bad_prefetch_distances_are_refused():
    for l1, l2 in ((-1, 0), (0, 65537), (512.0, 0)):
        with pytest.raises(ValueError, match="a distance is 0 \\(none\\) to 65536 bytes ahead"):
            Prefetch(l1, l2)
    w, x, ids = torch.randn(2, 8, 32), torch.randn(1, 32), torch.tensor([1])
    with pytest.raises(RuntimeError, match="prefetch distances are -1 .* or 0..65536 bytes, not 70000 and 0"):
        torch.ops.moe_offload.expert_gemv(x, w, ids, 0, None, None, 0, False, int(best_isa()), 70000, 0)
    for rows in (0, 3, 16, 2.0):
        with pytest.raises(ValueError, match="the kernel reads 1, 2, 4, 8 rows together"):
            Prefetch(0, 0, rows)
    with pytest.raises(RuntimeError, match="rows in flight are -1 .*, 1, 2, 4 or 8, not 3"):
        torch.ops.moe_offload.expert_gemv(x, w, ids, 0, None, None, 0, False, int(best_isa()), 0, 0, 3)


def test_second_kernel_path_setting_caps_the_instruction_set(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert best_isa() is Isa.PORTABLE


def test_bad_arguments_are_refused():
    w = torch.randn(4, 8, 32)
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="expert id 4 out of range 0..3"):
        expert_gemv(x, w, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="x has 16 columns, the experts take 32"):
        expert_gemv(torch.randn(2, 16), w, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="each expert of the stack must be contiguous"):
        expert_gemv(x, w.transpose(1, 2), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="each expert of the stack must be contiguous"):
        expert_gemv(x, torch.randn(4, 8, 64)[:, :, ::2], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="unsupported weight dtype"):
        expert_gemv(x, w.to(torch.float64), torch.tensor([0, 1]))
    two = torch.tensor([0, 1])      # several stacks: each pair's stack named, one dtype and matrix shape
    with pytest.raises(ValueError, match="needs `which`"):
        expert_gemv(x, (w, w), two)
    with pytest.raises(ValueError, match="one stack was given"):
        expert_gemv(x, w, two, which=two)
    with pytest.raises(RuntimeError, match="expert id 2 out of range 0..1"):
        expert_gemv(x, (w, w[:2]), torch.tensor([3, 2]), which=two)
    with pytest.raises(RuntimeError, match="stack 2 out of range 0..1"):
        expert_gemv(x, (w, w), two, which=torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="the first's dtype and matrix shape"):
        expert_gemv(x, (w, w.half()), two, which=two)
    with pytest.raises(RuntimeError, match="the first's dtype and matrix shape"):
        expert_gemv(x, (w, torch.randn(4, 9, 32)), two, which=two)
    with pytest.raises(RuntimeError, match="each expert of the stack must be contiguous"):
        expert_gemv(x, (w, torch.randn(4, 8, 64)[:, :, ::2]), two, which=two)
    q = Mxfp4Stack(torch.zeros(4, 8, 1, 16, dtype=torch.uint8), torch.zeros(4, 8, 1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="only float stacks are read from several stacks"):
        torch.ops.moe_offload.expert_gemv(x, q.blocks, two, 2, q.scales, None, 0, False, 0, -1, -1, -1, [q.blocks],
                                          two)
