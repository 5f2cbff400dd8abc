"""The C library's memmove for the disk tier's reader threads (storage/clib.py copy_bytes): bytes copied exactly,
wrong arguments refused, and, called on a thread of its own, no thread started (torch's copy_ of a large tensor
there starts an OpenMP team whose threads spin on the decode step's cores)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from moe_offload.storage import clib
from moe_offload.storage.clib import copy_bytes

MiB = 1 << 20


def test_bytes_are_copied_exactly_whatever_the_dtypes():
    src = torch.randn(3, 257, dtype=torch.bfloat16)
    dst = torch.empty(3 * 257 * 2, dtype=torch.uint8)
    copy_bytes(dst, src)
    assert torch.equal(dst.view(torch.bfloat16).view(3, 257), src)
    row = torch.zeros(5, 64, dtype=torch.uint8)
    copy_bytes(row[1:3], torch.arange(128, dtype=torch.uint8).view(2, 64))       # a contiguous slice of pages
    assert row[0].eq(0).all() and row[3:].eq(0).all() and row[1:3].flatten().tolist() == list(range(128))
    copy_bytes(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.float32))   # nothing: no call


def test_without_a_c_library_torch_copies_the_same_bytes(monkeypatch):
    monkeypatch.setattr(clib, "_memmove", lambda: None)        # a platform with no C library found
    src = torch.randn(4, 33, dtype=torch.float16)
    dst = torch.zeros(4 * 33, dtype=torch.int16)
    copy_bytes(dst, src)
    assert torch.equal(dst.view(torch.float16).view(4, 33), src)


def test_sizes_layouts_and_devices_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="8 contiguous bytes into, 4 from"):
        copy_bytes(torch.empty(8, dtype=torch.uint8), torch.empty(1, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous: True, False"):
        copy_bytes(torch.empty(8, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.uint8)[:, :2])
    with pytest.raises(ValueError, match="cpu tensors only"):
        copy_bytes(torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8, device="meta"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc (Linux)")
def test_a_copy_on_a_worker_thread_starts_no_other_thread():
    src, dst = torch.ones(64 * MiB, dtype=torch.uint8), torch.empty(64 * MiB, dtype=torch.uint8)
    seen = {}

    def work():
        before = set(os.listdir("/proc/self/task"))
        copy_bytes(dst, src)
        seen["new"] = set(os.listdir("/proc/self/task")) - before

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["new"] == set() and bool(dst.eq(1).all())
