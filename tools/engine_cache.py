"""The engines' cache and the plumbing every install shares (see tools/engines.py for the cache's layout).

Where the cache is (``$MOE_OFFLOAD_ENGINES_DIR``, default ``${XDG_CACHE_HOME:-~/.cache}/moe-offload/engines``),
one log per engine that each command and its output are appended to (each command in its own process
group, so a timeout or an interrupt ends all of it), the ``stamp.json`` that marks a folder as a finished
engine (written last), the ``logs/<name>.failed`` line that ``where`` reports, the per-engine lock, and the
build-in-a-``.tmp-*``-folder-then-rename step.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

STAMP_SCHEMA = 1
REPO = Path(__file__).resolve().parent.parent


class EngineError(Exception):
    """One engine could not be had: `step` failed because of `why`."""

    def __init__(self, step: str, why: str):
        super().__init__(f"{step} failed: {why}")
        self.step, self.why = step, why


def root_dir() -> Path:
    env = os.environ.get("MOE_OFFLOAD_ENGINES_DIR")
    if env:
        return Path(env).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(cache).expanduser() / "moe-offload" / "engines").resolve()


def threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def repo_python() -> Path:
    env = os.environ.get("MOE_OFFLOAD_CONVERTER_PYTHON")
    return Path(env) if env else REPO / ".venv" / "bin" / "python"


# --------------------------------------------------------------------------------------------- running


class Log:
    """Appends each command and its output to one log file per engine."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", encoding="utf-8", errors="replace")

    def note(self, text: str) -> None:
        self.f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")
        self.f.flush()

    def run(self, step: str, cmd: list, *, timeout: float | None = None, env: dict | None = None,
            cwd: Path | None = None) -> str:
        """Run `cmd`, its output into the log; return that output; EngineError when it fails."""
        self.note(f"$ {' '.join(str(c) for c in cmd)}")
        start = self.f.tell()
        full_env = dict(os.environ, **(env or {}))
        try:
            # its own process group, so that a timeout or an interrupt ends the compilers under make too
            p = subprocess.Popen([str(c) for c in cmd], stdout=self.f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=full_env, cwd=str(cwd) if cwd else None,
                                 start_new_session=True)
        except FileNotFoundError:
            raise EngineError(step, f"{cmd[0]} not found") from None
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(p)
            self.f.flush()
            raise EngineError(step, f"no result after {timeout:.0f} s") from None
        except BaseException:
            kill_group(p)
            raise
        self.f.flush()
        with open(self.path, encoding="utf-8", errors="replace") as r:
            r.seek(start)
            out = r.read()
        if p.returncode != 0:
            raise EngineError(step, f"exit {p.returncode}: {last_error_line(out)}")
        return out

    def close(self) -> None:
        self.f.close()


def kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error_line(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for pat in (r"^(ERROR|error|Error|fatal|FAILED|CMake Error|RuntimeError|ValueError|"
                r"NotImplementedError|ModuleNotFoundError|ImportError|AssertionError)\b.*",
                r".*(error:|Error:|ERROR:|No matching distribution|Could not find).*"):
        hits = [ln for ln in lines if re.match(pat, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


def pip_python() -> list:
    """A python whose `-m pip` works: this one, or the project's venv."""
    for py in (sys.executable, str(repo_python())):
        if py and Path(py).exists() and subprocess.run(
                [py, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [py, "-m", "pip"]
    raise EngineError("finding pip", f"neither {sys.executable} nor {repo_python()} has pip")


def read_stamp(d: Path) -> dict | None:
    try:
        return json.loads((d / "stamp.json").read_text())
    except (OSError, ValueError):
        return None


def write_stamp(d: Path, stamp: dict) -> None:
    tmp = d / "stamp.json.tmp"
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    tmp.replace(d / "stamp.json")


def failure_file(name: str) -> Path:
    return root_dir() / "logs" / f"{name}.failed"


def put_in_place(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` (an old copy is moved aside first, then removed)."""
    tmp.chmod(0o755)  # mkdtemp made it 0700
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_stale(root: Path, name: str) -> None:
    for p in root.glob(f".tmp-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(f".old-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)


class Lock:
    """One install of an engine at a time (another waits, then finds it cached)."""

    def __init__(self, root: Path, name: str):
        root.mkdir(parents=True, exist_ok=True)
        self.f = open(root / f".lock-{name}", "w")

    def __enter__(self):
        try:
            import fcntl
            fcntl.flock(self.f, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc):
        self.f.close()
