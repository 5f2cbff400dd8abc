"""The real peer engines (llama.cpp, vLLM CPU) as the tests see them: where they are, and small helpers.

Imported explicitly (not a conftest). Everything here reads ``python3 tools/engines.py where --json``
(``make engines`` installs and caches the engines outside the repository); a test that needs an engine calls
``require(name)``, which *fails* the test (never skips it) with the engine's ``missing`` line when the engine
is not installed. Tests that use an engine carry ``@pytest.mark.engines``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINES_PY = REPO / "tools" / "engines.py"
_KEYS = {"llama.cpp": "llama_cpp", "llama_cpp": "llama_cpp", "vllm": "vllm"}


@functools.lru_cache(maxsize=1)
def engines() -> dict:
    """The parsed ``tools/engines.py where --json`` (schema 1), read once per session."""
    out = subprocess.run([sys.executable, str(ENGINES_PY), "where", "--json"], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        pytest.fail(f"`tools/engines.py where --json` exited {out.returncode}: {out.stderr.strip()}", pytrace=False)
    return json.loads(out.stdout)


def require(name: str) -> dict:
    """The ``where --json`` entry of engine `name` ("llama.cpp" / "llama_cpp" or "vllm"); fails the test when
    that engine is not ok, with its ``missing`` line and how to get it."""
    key = _KEYS.get(name, name)
    entry = engines().get(key)
    if not entry or not entry.get("ok"):
        missing = (entry or {}).get("missing") or f"engine {name!r} not in `tools/engines.py where --json`"
        pytest.fail(f"engine {name} is not installed: {missing}; run `make engines`", pytrace=False)
    return entry
