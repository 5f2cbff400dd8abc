"""What a moe-offload process takes beside its weights (storage/process_memory.py): measured in a fresh process
once per installation, cached, measured over when the cache is damaged; the note a CPU-only plan makes of it, and
the refusal of a CPU-only reserve the process itself does not fit in."""

from __future__ import annotations

import json

import pytest

from moe_offload.errors import BudgetError
from moe_offload.model.inventory import inventory
from moe_offload.planning import planner
from moe_offload.planning.placement import GiB, format_bytes
from moe_offload.storage import process_memory
from moe_offload.tiny.make import make_tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "process-memory.json"
    monkeypatch.setenv("MOE_OFFLOAD_PROCESS_MEMORY", str(path))
    return path


def test_measured_once_then_cached(cache):
    said = []
    first = process_memory.runtime_bytes(progress=said.append)
    # torch alone is well over 100 MiB resident; a process of this package stays far below 4 GiB
    assert 100 << 20 < first < 4 << 30 and len(said) == 1
    assert json.loads(cache.read_text()) == {process_memory._key(): first}
    assert process_memory.runtime_bytes(progress=said.append) == first and len(said) == 1


def test_a_damaged_cache_is_measured_over(cache):
    cache.write_text("[not a mapping")
    assert process_memory.runtime_bytes() > 100 << 20
    assert isinstance(json.loads(cache.read_text()), dict)


def test_a_cpu_only_plan_says_what_is_left_of_the_reserve(tmp_path):
    inv = inventory(make_tiny(tmp_path / "m", family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64))
    runtime, reserve = 300 << 20, 1.0
    p = planner.plan(inv, device_memory_gb=reserve + 0.001, reserve_gb=reserve, cpu_only=True,
                     runtime_bytes=runtime)
    note = next(n for n in p.notes if "the process itself takes" in n)
    assert f"{format_bytes(int(reserve * GiB) - runtime)} remain" in note
    without = planner.plan(inv, device_memory_gb=reserve + 0.001, reserve_gb=reserve, cpu_only=True)
    assert not any("the process itself" in n for n in without.notes)
    assert [t.tier for t in without.tensors] == [t.tier for t in p.tensors]   # a note: the placement is the same


def test_a_cpu_only_reserve_smaller_than_the_process_is_refused(tmp_path):
    """--device-memory on a CPU-only machine bounds the whole process: a reserve the process itself does not fit in
    is a budget it cannot keep, refused with the numbers and the fix (on an accelerator the reserve is device
    memory, not the process's: nothing is refused there)."""
    inv = inventory(make_tiny(tmp_path / "m", family="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64))
    with pytest.raises(BudgetError, match=r"the process itself takes 300.00 MiB .*, more than the 0.25 GiB reserve .*"
                                          r"reserve_gb of at least 0.55 \(device_memory_gb as much more, 0.551"):
        planner.plan(inv, device_memory_gb=0.251, reserve_gb=0.25, cpu_only=True, runtime_bytes=300 << 20)
    planner.plan(inv, device_memory_gb=0.251, reserve_gb=0.25, runtime_bytes=300 << 20)      # not CPU-only
    planner.plan(inv, device_memory_gb=0.551, reserve_gb=0.55, cpu_only=True, runtime_bytes=300 << 20)
