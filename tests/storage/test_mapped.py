"""moe_offload.storage.mapped: disk-tier reads through a memory map of the checkpoint (`load(disk_read="mmap")`).

Files come from make_tiny: qwen3_moe (one checkpoint tensor per expert and matrix) and gpt-oss (fused [E, ...]
experts), float32, hidden 32, 2 layers, E=6, top-2. Every read is compared with SafetensorsReader's
(buffered, page cache released) read of the same file, and with safetensors' own load.

What is checked: the same bytes for whole tensors, per-expert tensors and expert subsets of a fused tensor;
bytes_read and read_calls count exactly the runs asked; a file truncated after open, or cut short under the
reader (the identity check passed), is a CheckpointError and never garbage or a crash; a model loaded with
disk_read="mmap" gives bitwise the logits and disk bytes of disk_read="direct"; an unknown mode is refused.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moe_offload as mo
from fixtures_models import BACKENDS, load, prompt_ids
from moe_offload.errors import CheckpointError, MoeOffloadError
from moe_offload.planning.placement import Tier
from moe_offload.storage.disk import SafetensorsReader
from moe_offload.storage.mapped import MappedReader
from moe_offload.tiny.make import make_tiny

SMALL = dict(layers=2, experts=6, top_k=2, hidden=32)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mapped")


@pytest.fixture(scope="module")
def qwen(root) -> Path:
    return make_tiny(root / "qwen", family="qwen3_moe", **SMALL)


@pytest.fixture(scope="module")
def gpt_oss(root) -> Path:
    return make_tiny(root / "gpt", family="gpt_oss", **SMALL)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_whole_tensors_are_the_buffered_readers_bytes(qwen):
    path = qwen / "model.safetensors"
    with MappedReader(path) as m, SafetensorsReader(path, direct=False) as b, safe_open(str(path), "pt") as f:
        assert set(m.tensors) == set(b.tensors)
        total = 0
        for name, span in m.tensors.items():
            got = m.read(name)
            assert torch.equal(_raw(got), _raw(b.read(name))) and torch.equal(got, f.get_tensor(name)), name
            total += span.nbytes
        assert (m.bytes_read, m.read_calls) == (total, len(m.tensors))
        assert m.bytes_read == b.bytes_read


def test_per_expert_tensors_coalesce_into_runs(qwen):
    path = qwen / "model.safetensors"
    picked = (1, 2, 5)
    names = [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in picked for p in ("gate_proj", "up_proj",
                                                                                     "down_proj")]
    with MappedReader(path) as m, SafetensorsReader(path, direct=False) as b:
        got, want = m.read_tensors(names), b.read_tensors(names)
        assert all(torch.equal(_raw(g), _raw(w)) for g, w in zip(got, want))
        spans = sorted((m.tensors[n].start, m.tensors[n].end) for n in names)
        runs = 1 + sum(1 for (_, end), (start, _) in zip(spans, spans[1:]) if start != end)
        assert (m.bytes_read, m.read_calls) == (sum(e - s for s, e in spans), runs) == (b.bytes_read, b.read_calls)


@pytest.mark.parametrize("picked", [[4, 0, 3], [1, 2, 3], [5]])
def test_expert_subsets_of_a_fused_tensor(gpt_oss, picked):
    path = gpt_oss / "model.safetensors"
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with MappedReader(path) as m, SafetensorsReader(path, direct=False) as b, safe_open(str(path), "pt") as f:
        full = f.get_tensor(name)
        got = m.read_experts(name, picked)
        assert torch.equal(got, full[picked]) and torch.equal(_raw(got), _raw(b.read_experts(name, picked)))
        out = torch.empty(len(picked), *full.shape[1:], dtype=full.dtype)
        assert m.read_experts(name, picked, out=out) is out and torch.equal(out, full[picked])
        row = m.tensors[name].nbytes // full.shape[0]
        runs = len(m.expert_ranges(name, picked))
        assert (m.bytes_read, m.read_calls) == (2 * len(picked) * row, 2 * runs)


def _copy(src: Path, dest: Path) -> Path:
    dest.write_bytes(src.read_bytes())
    os.utime(dest, ns=(10**18, 10**18))     # any later change moves the mtime
    return dest


def test_a_file_truncated_after_open_is_an_error_at_the_read(qwen, tmp_path):
    path = _copy(qwen / "model.safetensors", tmp_path / "copy.safetensors")
    with MappedReader(path) as m:
        m.read("lm_head.weight")
        os.truncate(path, path.stat().st_size // 2)
        for name in ("lm_head.weight", "model.embed_tokens.weight"):    # read before, and not yet
            with pytest.raises(CheckpointError, match="changed after it was opened.*size"):
                m.read(name)


# A map of a file cut short under it: its pages past the new end raise SIGBUS when touched, and those in the last
# page read as zeros. Run in a child process so that a crash fails this test rather than the session.
_SHORT = textwrap.dedent("""
    import os, sys
    from moe_offload.errors import CheckpointError
    from moe_offload.storage.mapped import MappedReader

    path, which = sys.argv[1], sys.argv[2]
    r = MappedReader(path)
    spans = sorted(r.tensors.values(), key=lambda s: s.start)
    span = max(spans, key=lambda s: s.nbytes) if which == "large" else spans[-1]
    os.truncate(path, span.start + 4)
    r._identity = type(r._identity).of(os.stat(path))   # the shrink lands after the identity check
    try:
        r.read(span.name)
    except CheckpointError as exc:
        print("CheckpointError:", exc)
        sys.exit(0)
    print(f"no error: {span.name} ({span.nbytes} B at {span.start}) read from a file of {os.path.getsize(path)} B")
    sys.exit(1)
""")


@pytest.mark.parametrize("which", ["large", "last"])
def test_a_file_cut_short_under_the_reader_is_an_error_never_a_crash(qwen, tmp_path, which):
    """As SafetensorsReader's short reads: bytes past the end are refused, never read as zeros or a SIGBUS."""
    path = _copy(qwen / "model.safetensors", tmp_path / "short.safetensors")
    out = subprocess.run([sys.executable, "-c", _SHORT, str(path), which], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "truncated" in out.stdout, (
        f"MappedReader read past the end of a file cut short (exit {out.returncode}, -7/135 = SIGBUS): "
        f"{out.stdout.strip()} {out.stderr.strip()[-500:]}; mapped.py checks against len(self._map), the size "
        "at open, not the file's size now")


def test_the_mechanism_says_mmap(qwen):
    with MappedReader(qwen / "model.safetensors") as m:
        assert m.mechanism.startswith("mmap") and not m.direct and m.bounce_bytes == 0


def _disk_plan(folder):
    """Zero-budget plan with every routed expert and the embedding on disk (the embedding: a dense disk read)."""
    p0 = mo.plan(folder, offload_gb=0)
    return dataclasses.replace(p0, tensors=tuple(
        dataclasses.replace(t, tier=Tier.DISK.value) if t.role in ("routed_expert", "embedding") else t
        for t in p0.tensors))


def _generate(model, ids):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=[], pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.cat(out.logits)


@pytest.mark.exact
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_model_read_through_mmap_equals_direct(qwen, gpt_oss, family, backend):
    folder = qwen if family == "qwen3_moe" else gpt_oss
    plan = _disk_plan(folder)
    ids = prompt_ids(folder, 8)
    seen = {}
    for mode in ("direct", "mmap"):
        model, _ = load(folder, plan=plan, backend=backend, disk_read=mode)
        rt = model.moe_offload_runtime
        seen[mode] = (_generate(model, ids), list(rt.disk_counter.calls), rt.disk.mechanism, rt.disk)
    (tokens, logits), calls, mechanism, disk = seen["mmap"]
    (tokens0, logits0), calls0, mechanism0, disk0 = seen["direct"]
    assert torch.equal(tokens, tokens0) and torch.equal(logits, logits0)
    assert calls == calls0 and sum(b for _, b in calls) > 0
    assert "mmap" in mechanism and "mmap" not in mechanism0
    assert all(isinstance(r, MappedReader) for r in disk.readers)
    assert not any(isinstance(r, MappedReader) for r in disk0.readers)


def test_an_unknown_disk_read_mode_is_refused(qwen):
    with pytest.raises(MoeOffloadError, match="disk_read='bogus'"):
        load(qwen, plan=_disk_plan(qwen), disk_read="bogus")
