"""`--device-memory X` on a CPU-only machine keeps the whole process within X, at a released model's dimensions: a
model with Qwen3-30B-A3B's exact layer (make-tiny --like, one layer: 2.4 GiB in bf16) decodes inside a memory cgroup
(v1) of exactly X, page cache included, and the cgroup's peak is read back.

Needs root and the cgroup v1 memory controller (this project's machines have both); elsewhere the test says why it
cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moe_offload.tiny.make_like import make_like

CGROUPS = Path("/sys/fs/cgroup/memory")
GiB = 1 << 30
LIMIT_GB = 2


def _cgroup_or_skip() -> Path:
    if os.geteuid() != 0 or not (CGROUPS / "cgroup.procs").is_file():
        pytest.skip("a memory cgroup (v1) needs root and /sys/fs/cgroup/memory: not available on this machine")
    path = CGROUPS / f"moe-offload-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return make_like(tmp_path_factory.mktemp("released") / "qwen3-30b-a3b-1L", "qwen3-30b-a3b", layers=1)


def test_generate_stays_inside_a_cgroup_of_the_device_memory_it_was_told(released, tmp_path):
    cg = _cgroup_or_skip()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT_GB * GiB))
        cli = Path(sys.executable).parent / "moe-offload"
        cmd = (f'echo $$ > {cg}/cgroup.procs && exec "{cli}" generate "{released}" --device cpu '
               f"--device-memory {LIMIT_GB} --reserve-gb 1 --prompt 'The harbour master counted the boats' "
               "--max-new-tokens 4 --ignore-eos --json")
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=900)
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
        killed = "oom_kill 1" in (cg / "memory.oom_control").read_text()
    finally:
        cg.rmdir()
    assert out.returncode == 0 and not killed, (out.returncode, out.stderr[-2000:])
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 4 and result["disk_read_bytes_per_token"] > 0   # experts read from disk
    assert peak <= LIMIT_GB * GiB, peak
    print(f"cgroup peak {peak / GiB:.2f} GiB of {LIMIT_GB} GiB")
