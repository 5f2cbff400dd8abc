"""The smoke model both engines' smoke checks run on: a make-tiny qwen3_moe (2 layers, 8 experts, top-2,
hidden 256) made in a scratch folder under the cache, and the token-id prompt they continue."""
from __future__ import annotations

import tempfile
from pathlib import Path

from engine_cache import REPO, EngineError, Log, root_dir

SMOKE_IDS = [1, 100, 200, 300, 400]


def make_tiny(work: Path, log: Log) -> Path:
    d = work / "tiny-qwen3_moe"
    if (d / "config.json").exists():
        return d
    cli = REPO / ".venv" / "bin" / "moe-offload"
    if not cli.exists():
        raise EngineError("making the smoke model", f"{cli} is missing: run `make setup` first")
    log.run("making the smoke model (moe-offload make-tiny)",
            [cli, "make-tiny", d, "--family", "qwen3_moe", "--layers", "2", "--experts", "8", "--top-k", "2",
             "--hidden", "256"], timeout=600)
    return d


def smoke_work() -> Path:
    w = root_dir() / "smoke"
    w.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="run-", dir=w))
