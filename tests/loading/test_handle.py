"""What `mo.load` returns (loading/handle.py): still the (model, plan) pair scripts unpack, and a handle whose
close() leaves nothing behind: no worker thread, no open file, no memory (RSS back within a bound after ten
loads and closes), the model emptied, closing twice harmless.

Model: make_tiny qwen3_moe, bf16, hidden 256, 4 layers, 16 experts top-2 (76 MiB; 71 MiB of routed experts).
The disk case plans a third of the model's bytes in RAM (cpu_only), the rest of the experts on the disk tier,
with a host cache and a look-ahead of one layer: every worker the runtime has is running."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

import moe_offload as mo
from moe_offload.planning.placement import GiB
from moe_offload.tiny.make import make_tiny

from fixtures_models import prompt_ids


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("handle") / "m", family="qwen3_moe", layers=4, experts=16, top_k=2,
                     hidden=256)


@pytest.fixture(scope="module")
def disk_plan(folder):
    total = mo.plan(folder, offload_gb=0).total_bytes
    return mo.plan(folder, device_memory_gb=total // 3 / GiB + 1, reserve_gb=1, cpu_only=True)


def decode(model, folder, n: int = 4):
    ids = prompt_ids(folder, 6)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=[], pad_token_id=0)


def threads() -> set[int]:
    return set(int(t) for t in os.listdir("/proc/self/task"))


def files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:   # the listing's own descriptor, gone by now
            pass
    return out


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_load_still_returns_the_pair_and_names_its_parts(folder):
    model, plan = mo.load(folder, offload_gb=0.02)
    assert isinstance(plan, mo.Plan) and plan.offloaded_bytes > 0
    loaded = mo.load(folder, offload_gb=0.02)
    assert isinstance(loaded, mo.Loaded) and isinstance(loaded, tuple) and len(loaded) == 2
    assert loaded[0] is loaded.model and loaded[1] is loaded.plan
    assert loaded.runtime is loaded.model.moe_offload_runtime and not loaded.closed
    assert torch.equal(decode(loaded.model, folder), decode(model, folder))
    loaded.close()
    model.moe_offload_runtime.close()   # a script that unpacked the pair closes through the runtime
    assert model.moe_offload_runtime.closed and not model.moe_offload_runtime.handles


def test_closing_stops_every_worker_and_closes_every_file(folder, disk_plan):
    before_threads, before_files = threads(), files()
    before_names = {t.name for t in threading.enumerate()}
    with mo.load(folder, plan=disk_plan, host_cache_gb=0.002, lookahead=1) as loaded:
        rt = loaded.runtime
        assert rt.disk is not None and rt.lookahead is not None and rt.host_cache is not None
        decode(loaded.model, folder)
        assert rt.disk_counter.decode_bytes_per_token() > 0          # the disk tier was read
        opened = {f for f in files() - before_files if str(folder) in f}
        assert opened, "the disk tier holds its checkpoint files open while the model runs"
        assert threads() - before_threads, "the look-ahead and the disk reads run on worker threads"
    assert loaded.closed
    assert not {f for f in files() - before_files if str(folder) in f}, files() - before_files
    assert {t.name for t in threading.enumerate()} == before_names   # the Python workers were joined
    deadline = time.monotonic() + 5
    while threads() - before_threads and time.monotonic() < deadline:   # native threads (OpenMP's) wind down
        time.sleep(0.05)
    assert not threads() - before_threads, [open(f"/proc/self/task/{t}/comm").read() for t in threads() - before_threads]


def test_a_closed_model_is_emptied_and_closing_again_does_nothing(folder, disk_plan):
    loaded = mo.load(folder, plan=disk_plan)
    model = loaded.model
    loaded.close()
    assert not hasattr(model, "moe_offload_runtime") and loaded.runtime is None
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    assert not model._forward_hooks and not model._forward_pre_hooks   # the runtime's hooks are gone
    loaded.close()
    assert "closed" in repr(loaded)


def test_ten_loads_and_closes_give_the_memory_back(folder, disk_plan):
    weights = mo.plan(folder, offload_gb=0).total_bytes
    for plan in (mo.plan(folder, offload_gb=0.03), disk_plan):
        with mo.load(folder, plan=plan):   # the first load: imports, kernels, allocator pools warm
            pass
        gc.collect()
        base = rss()
        kept = []   # a long-running program may keep its models: closing empties them all the same
        for _ in range(10):
            with mo.load(folder, plan=plan, host_cache_gb=0.002) as loaded:
                decode(loaded.model, folder, 2)
            kept.append(loaded.model)
            gc.collect()
        grown = rss() - base
        # a leak of one load is the weights it holds in RAM (at least a third of 76 MiB); ten would be ten times
        # that. The bound: a quarter of the model's bytes for all ten together (allocator and interpreter slack).
        assert grown < weights // 4, f"RSS grew {grown / 2**20:.1f} MiB over ten loads of {weights / 2**20:.1f} MiB"
