"""Weights in 2 MiB pages (storage/huge_pages.py): the advised span lies inside the tensor, the kernel's setting is
read as it is written, the advice reaches the mapping (VmFlags `hg`) where the kernel takes it and is a no-op where
it does not, and the loader, the host slabs and the host cache's pages ask for it before their first write."""

from __future__ import annotations

import torch

from moe_offload.run.pages import PagedArena
from moe_offload.storage import huge_pages
from moe_offload.storage.host import HostArena
from moe_offload.storage.huge_pages import HUGE_PAGE, advise_huge, huge_span, thp_mode
from moe_offload.tiny.make import make_tiny

MiB = 1 << 20


def test_the_span_is_the_whole_huge_pages_inside():
    assert huge_span(0, 4 * HUGE_PAGE) == (0, 4 * HUGE_PAGE)
    assert huge_span(1, 4 * HUGE_PAGE) == (HUGE_PAGE, 3 * HUGE_PAGE)          # ends cut back to whole pages
    assert huge_span(HUGE_PAGE - 64, HUGE_PAGE + 64) == (HUGE_PAGE, HUGE_PAGE)
    assert huge_span(64, HUGE_PAGE) == (HUGE_PAGE, 0)                          # none inside: nothing advised
    start, length = huge_span(12345, 10 * HUGE_PAGE)
    assert start >= 12345 and start + length <= 12345 + 10 * HUGE_PAGE and start % HUGE_PAGE == 0


def test_the_setting_is_read_as_the_kernel_writes_it(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "SETTING", f)
    assert thp_mode() is None                                   # no file: no transparent huge pages
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never")):
        f.write_text(text)
        assert thp_mode() == mode


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[0] == "VmFlags:":
            return head[1:]
    return []


def test_the_advice_reaches_the_mapping_where_the_kernel_takes_it():
    t = torch.empty(16 * MiB, dtype=torch.uint8)
    advised = advise_huge(t)
    start, length = huge_span(t.data_ptr(), t.numel())
    if thp_mode() in ("always", "madvise"):
        assert advised == length >= 14 * MiB
        assert "hg" in _vm_flags(start)
    else:                                                        # never, or no THP: nothing asked, nothing changed
        assert advised == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * 16 * MiB                          # the bytes are the tensor's, as ever


def test_no_advice_where_it_cannot_apply(monkeypatch):
    assert advise_huge(torch.empty(MiB, dtype=torch.uint8)) == 0                    # smaller than one huge page
    assert advise_huge(torch.empty(16 * MiB, dtype=torch.uint8, device="meta")) == 0
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert advise_huge(torch.empty(16 * MiB, dtype=torch.uint8)) == 0


def _recording(monkeypatch, module) -> list[torch.Tensor]:
    seen = []

    def record(t):
        seen.append(t)
        return 0
    monkeypatch.setattr(module, "advise_huge", record)
    return seen


def test_loaded_weights_slabs_and_cache_pages_are_advised_before_they_are_written(tmp_path, monkeypatch):
    from moe_offload.loading import allocate
    from moe_offload.run import pages
    from moe_offload.storage import host
    import moe_offload as mo

    folder = make_tiny(tmp_path / "m", family="qwen3_moe", layers=2, experts=4, top_k=2, hidden=32)
    resident = _recording(monkeypatch, allocate)
    with mo.load(folder, device="cpu", offload_gb=0) as loaded:
        held = {p.data_ptr() for p in loaded.model.parameters()}
    assert resident and {t.data_ptr() for t in resident} <= held   # each advised tensor is one the model holds

    slabs = _recording(monkeypatch, host)
    arena = HostArena(torch.device("cpu"), want_uva=False)
    out = arena.allocate("layer 0", [("w", (4, 8), torch.bfloat16)])
    assert len(slabs) == 1 and slabs[0].data_ptr() == out["w"][0].data_ptr()

    pool_seen = _recording(monkeypatch, pages)
    pool = PagedArena()
    pool.carve([4096], [4096 * 3], 4096 * 2)
    assert len(pool_seen) == 1 and pool_seen[0] is pool.arena and not bool(pool.arena.any())   # zeros, as before
