"""A CPU-only decode step whose checkpoint reads overlap its compute (run/streamed.py).

- the streamed steps are taken (disk-tier decode, CPU kernels, a cpu device) and the generation equals the same
  model with nothing offloaded, fused, bit for bit: alone, with the host cache (hits copied and admissions stored
  by the reader threads), with a look-ahead, for a family with biases (gpt-oss), one and two threads;
- the first expert is computed while a later expert's rows are still being read; host-cache hits in one run
  of pages, resident rows of split tensors and wholly resident tensors are read in place (not copied), a miss
  the host cache admits is read straight into its pages, and the experts in place are one kernel call per
  projection whatever stacks their rows lie in (and the generation stays bitwise the resident fused one with
  tensors split or wholly resident);
- `Deferred` issues its jobs in row order, waits only for the rows asked and says which have landed;
- a checkpoint changed after load is a CheckpointError out of a streamed step, with every read finished.

Models: make_tiny, 2 layers, hidden 64, 8 experts top-2 (top-4 where a step needs several chunks), float32.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fixtures_experts import SIZES, experts_on_disk, generate_new, resident_and_on_disk, resident_maker
from fixtures_models import load, prompt_ids
from moe_offload.errors import CheckpointError
from moe_offload.run import experts as experts_py
from moe_offload.run import streamed
from moe_offload.run.host_cache import HostCache
from moe_offload.run.read_executor import Deferred
from moe_offload.run.runtime import runtime_of
from moe_offload.tiny.make import make_tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("streamed"), {}

    def get(family, **kw):
        key = (family, *sorted(kw.items()))
        if key not in made:
            made[key] = make_tiny(root / "-".join([family, *map(str, kw.values())]), family=family,
                                  **{**SIZES, **kw})
        return made[key]
    return get


@pytest.fixture(scope="module")
def resident(folder):
    """threads -> the references made at that thread count (torch's dense kernels block by the thread count)."""
    return {t: resident_maker(folder, "fused") for t in (1, 2)}


@pytest.fixture
def steps(monkeypatch):
    """Counts the streamed steps taken (the experts function calls streamed_step through its module's name)."""
    taken = []
    real = experts_py.streamed_step

    def counted(*a, **k):
        taken.append(1)
        return real(*a, **k)

    monkeypatch.setattr(experts_py, "streamed_step", counted)
    return taken


WAYS = {"disk": {}, "host cache": {"host_cache_gb": 0.001}, "look-ahead": {"lookahead": 1},
        "host cache + look-ahead": {"host_cache_gb": 0.001, "lookahead": 1}}
CASES = [("qwen3_moe", {}, w, 1) for w in WAYS] + [("gpt_oss", {}, "host cache", 1), ("qwen3_moe", {"top_k": 4}, "disk", 2)]


@pytest.mark.exact
@pytest.mark.parametrize("family, make, way, threads", CASES,
                         ids=[f"{f}-{'-'.join(map(str, m.values())) or 'top2'}-{w}-{t}t" for f, m, w, t in CASES])
def test_a_streamed_generation_is_bitwise_the_resident_fused(folder, resident, steps, family, make, way, threads):
    path = folder(family, **make)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids, (want_seq, want_logits) = resident[threads](family, **make)
        with load(path, plan=experts_on_disk(path), experts="fused", **WAYS[way]) as loaded:
            seq, logits = generate_new(loaded.model, ids)
            rt = runtime_of(loaded.model)
            assert rt.disk_counter.decode_bytes_per_token() > 0
            if "host cache" in way:
                stats = rt.host_cache.stats()
                assert stats["host_cache_hits"] > 0 and stats["host_cache_misses"] > 0, stats
    finally:
        torch.set_num_threads(before)
    layers = loaded.model.config.num_hidden_layers
    assert len(steps) == (seq.shape[1] - ids.shape[1] - 1) * layers    # every decode step's MoE layers streamed
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits.float() - want_logits.float()).abs().max()}"


@pytest.mark.exact
@pytest.mark.parametrize("whole_gate_up", [False, True], ids=["both split", "gate_up resident"])
def test_resident_experts_and_admitted_misses_are_read_where_they_lie(folder, resident, steps, monkeypatch,
                                                                      whole_gate_up):
    """A streamed step reads resident rows (a split tensor's resident stack, a wholly resident parameter) where
    they lie, reads a miss the host cache admits straight into its pages (no store after the read), and computes
    the experts whose rows are all in place in one kernel call per projection, over every stack they lie in; the
    generation stays bitwise the resident fused one."""
    placed, stores, calls = [], [], []
    real_place, real_store, real_gemv = Deferred.place, HostCache.store, streamed.expert_gemv
    monkeypatch.setattr(Deferred, "place", lambda self, p, name, stack, row: placed.append(stack)
                        or real_place(self, p, name, stack, row))
    box = {}    # the decode steps' stores (a prefill stores the experts it keeps after reading them: gathered)
    monkeypatch.setattr(HostCache, "store", lambda self, pages, row: (box["rt"].decode_step and stores.append(pages))
                        or real_store(self, pages, row))

    def counted(x, stack, ids, **kw):    # the streamed step's kernel calls: (pairs, stacks read) of each
        calls.append((len(ids), len(stack) if isinstance(stack, tuple) else 1))
        return real_gemv(x, stack, ids, **kw)

    monkeypatch.setattr(streamed, "expert_gemv", counted)
    path = folder("qwen3_moe")
    ids, (want_seq, want_logits) = resident[1]("qwen3_moe")
    with load(path, plan=resident_and_on_disk(path, whole_gate_up), experts="fused", host_cache_gb=0.001) as loaded:
        rt = box["rt"] = runtime_of(loaded.model)
        seq, logits = generate_new(loaded.model, ids)
        splits = [s.resident for s in rt.splits.values()]
        stats = rt.host_cache.stats()
    assert steps and stats["host_cache_misses"] > 0 and stats["host_cache_hits"] > 0, stats
    assert any(any(stack is r for r in splits) for stack in placed), "no resident row was read in place"
    assert len(stores) < stats["host_cache_misses"], (len(stores), stats)   # admitted misses read into their pages
    assert max(n for n, _ in calls) > 1, "the experts in place were computed one call each"
    assert max(k for _, k in calls) > 1, "no call read rows lying in two stacks"
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits.float() - want_logits.float()).abs().max()}"


LANDINGS = {"all at once": {}, "one at a time": {}, "every row in place": {"host_cache_gb": 1.0}}


@pytest.mark.exact
@pytest.mark.parametrize("landing", LANDINGS)
def test_how_the_rows_land_changes_no_bit(folder, resident, steps, monkeypatch, landing):
    """Every read landed before the first is waited for (the whole step then one call per projection), each only
    once waited for (one call per expert), or nothing queued at all (a warm host cache: every pair at once, none
    picked out or scattered): the same bits as the resident fused step."""
    queued = []
    real_start = Deferred.start
    monkeypatch.setattr(Deferred, "start", lambda self, submit: queued.append(len(self.pending))
                        or real_start(self, submit))
    if landing != "every row in place":
        def landed(self, positions):
            positions = list(positions)
            if landing == "one at a time":
                return []
            self.wait(positions)
            return positions
        monkeypatch.setattr(Deferred, "landed", landed)
    path = folder("qwen3_moe")
    ids, (want_seq, want_logits) = resident[1]("qwen3_moe")
    with load(path, plan=experts_on_disk(path), experts="fused", **LANDINGS[landing]) as loaded:
        seq, logits = generate_new(loaded.model, ids)
    decode = queued[-len(steps):]
    if landing == "every row in place":
        assert 0 in decode, "no decode step found every row in place"
    else:
        assert min(decode) > 1, decode
    assert torch.equal(seq, want_seq)
    assert torch.equal(logits, want_logits), f"max |diff| {(logits.float() - want_logits.float()).abs().max()}"


def test_the_first_experts_are_computed_while_later_rows_are_read(folder, monkeypatch):
    """Rows after the first chunk are held back until the step has started computing: a step that waited for every
    read before computing would time out here."""
    computing = threading.Event()
    held, real_pairs = [], streamed.pair_outputs

    def pairs(*a, **k):
        computing.set()
        return real_pairs(*a, **k)

    monkeypatch.setattr(streamed, "pair_outputs", pairs)
    path = folder("qwen3_moe", top_k=4)
    with load(path, plan=experts_on_disk(path), experts="fused") as loaded:
        rt = runtime_of(loaded.model)
        submit = rt.disk.submit
        positions = []

        def held_back(job):
            position = len(positions)
            positions.append(position)

            def run():
                if position >= 2:          # the first expert's rows (two tensors) land at once; the rest wait
                    held.append(computing.wait(timeout=10))
                return job()
            return submit(run)

        ids = prompt_ids(path, 6)
        with torch.no_grad():
            out = loaded.model(input_ids=ids, use_cache=True)
            computing.clear()
            rt.disk.submit = held_back
            loaded.model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
            rt.disk.submit = submit
    assert held and all(held), "later rows were released by the compute, not by the timeout"


def test_host_cache_hits_in_one_run_of_pages_are_read_in_place(folder, monkeypatch):
    copies, real = [], HostCache.read
    monkeypatch.setattr(HostCache, "read", lambda self, pages, row: copies.append(pages) or real(self, pages, row))
    path = folder("qwen3_moe")
    ids = prompt_ids(path, 10)
    with load(path, plan=experts_on_disk(path), experts="fused", host_cache_gb=0.001) as loaded:
        generate_new(loaded.model, ids)
        hits = runtime_of(loaded.model).host_cache.stats()["host_cache_hits"]
    # each hit has two rows (gate_up: two pages, down_proj: one); copied, they would be 2 * hits copies
    assert hits > 0 and len(copies) < hits, (hits, copies)


def test_deferred_issues_in_row_order_and_waits_only_for_the_rows_asked():
    d, order, gate = Deferred(), [], threading.Event()
    for position in (2, 0, 1):
        d.read(position, lambda p=position: order.append(p) or (gate.wait(10) if p == 2 else None))
    with ThreadPoolExecutor(1) as pool:
        d.start(pool.submit)
        start = time.perf_counter()
        d.wait([0, 1])                      # position 2 is still blocked on the gate
        assert time.perf_counter() - start < 5 and order[:2] == [0, 1]
        assert d.landed([2, 1, 0]) == [1, 0]
        gate.set()
        d.wait([2])
    assert order == [0, 1, 2] and d.landed([0, 1, 2]) == [0, 1, 2]
    queued = Deferred()
    queued.read(0, lambda: None)
    assert queued.landed([0, 1]) == [1]     # queued, not started: not landed; nothing asked of 1: nothing to wait

    failing = Deferred()
    failing.read(0, lambda: (_ for _ in ()).throw(CheckpointError("changed")))
    with ThreadPoolExecutor(1) as pool:
        failing.start(pool.submit)
        with pytest.raises(CheckpointError, match="changed"):
            failing.wait([0])


def test_a_checkpoint_changed_after_load_is_an_error_out_of_a_streamed_step(folder, steps):
    """The step raises the reader's CheckpointError, and leaves nothing broken: with the file as it was, the same
    step gives the same logits as before the failure."""
    path = folder("qwen3_moe", top_k=4)
    shard = sorted(path.glob("*.safetensors"))[0]
    with load(path, plan=experts_on_disk(path), experts="fused") as loaded:
        ids = prompt_ids(path, 6)

        def step():
            out = loaded.model(input_ids=ids[:, :-1], use_cache=True)
            return loaded.model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits

        with torch.no_grad():
            want = step()
            stat = shard.stat()
            os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
            try:
                with pytest.raises(CheckpointError, match="changed after it was opened"):
                    step()
            finally:
                os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            assert torch.equal(step(), want)
    assert steps, "the steps were streamed ones"
