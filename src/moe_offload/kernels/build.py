"""Building and loading the CPU kernels (csrc/expert_gemv.cpp) as a torch operator library, once per machine.

The source is compiled at first use by torch's own extension builder (ninja and the C++ compiler on PATH, the
headers of the torch that is installed), into a folder of the user's cache keyed by the source's hash and torch's
version: `~/.cache/moe-offload/kernels/<torch>-<hash>/` (`MOE_OFFLOAD_KERNELS_DIR` moves it). A second process
loads the built library in milliseconds. Built without `-march`: the instruction sets are chosen at run time
(function-level targets in the source), so one build serves AVX-512, AVX2 and older CPUs alike.

`-fopenmp` lets ATen's `parallel_for` (inline in its headers) run on torch's own OpenMP threads: the library
needs `libgomp.so.1`, which the dynamic linker finds already loaded with torch, so both share one pool.

What a failed build means is said, never swallowed: `kernels()` raises KernelUnavailable with the compiler's
last lines and the fix; callers that can compute another way say which way in their report.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import MoeOffloadError

SOURCE = Path(__file__).resolve().parent / "csrc" / "expert_gemv.cpp"
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-unused-function"]
LDFLAGS = ["-fopenmp"]


class KernelUnavailable(MoeOffloadError):
    """The CPU kernels cannot be built or loaded here."""


@lru_cache(maxsize=4)
def _digest(flags: str) -> str:   # the source is the installed package's own: read once per process
    return hashlib.sha256(SOURCE.read_bytes() + flags.encode()).hexdigest()[:16]


def build_dir() -> Path:
    return _build_dir(os.environ.get("MOE_OFFLOAD_KERNELS_DIR"), os.environ.get("HOME"))


@lru_cache(maxsize=8)
def _build_dir(given: str | None, home: str | None) -> Path:   # made once per setting
    root = given or Path.home() / ".cache" / "moe-offload" / "kernels"
    return Path(root) / f"torch-{torch.__version__.replace('+', '_')}-{_digest(' '.join(CFLAGS))}"


@contextmanager
def _ninja_on_path():
    """torch's builder runs `ninja` from PATH; the venv's ninja (the `ninja` package) is not on it when the venv
    was not activated. Added for the build only."""
    try:
        import ninja
        extra = str(Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        extra = None
    old = os.environ.get("PATH", "")
    if extra and shutil.which("ninja") is None:
        os.environ["PATH"] = extra + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _problem() -> str | None:
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler (c++, g++ or clang++) is on PATH; install one (e.g. apt install g++)"
    return None


_LOADED: dict[Path, str] = {}   # build folder -> library path: torch's operator registry is per process anyway


def kernels(*, progress=None) -> str:
    """Build (once per machine) and load the kernels; returns the library's path. `progress`: a callable taking
    one line, told when a build starts (it takes 30-60 s on two cores). Raises KernelUnavailable."""
    # Loaded in this process: asked of the operator registry before the build folder's path is made from the
    # environment, as this runs before every kernel call (0.25 us a call against 1.05 on a Xeon SPR).
    if hasattr(torch.ops.moe_offload, "expert_gemv"):
        return next(iter(_LOADED.values()), "already loaded")
    folder = build_dir()
    problem = _problem()
    if problem:
        raise KernelUnavailable(f"moe-offload's CPU kernels cannot be built: {problem}")
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    name = "moe_offload_kernels"
    built = folder / f"{name}.so"
    if not built.is_file() and progress is not None:
        progress(f"building moe-offload's CPU kernels into {folder} (once; about a minute)")
    try:
        with _ninja_on_path():
            path = cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(folder),
                                      extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, is_python_module=False,
                                      verbose=False)
    except Exception as err:   # the compiler's own message, shortened, with the fix
        tail = " ".join(str(err).strip().splitlines()[-3:])[:600]
        raise KernelUnavailable(f"building moe-offload's CPU kernels in {folder} failed ({tail}); check the C++ "
                                "compiler and `pip install ninja`, or compute experts another way "
                                "(--experts eager)") from None
    _LOADED[folder] = str(path or built)
    _register_fake()
    return _LOADED[folder]


def _register_fake() -> None:
    """Shapes for torch.compile: the operator is opaque to inductor, called as is from a compiled step."""
    @torch.library.register_fake("moe_offload::expert_gemv")
    def _(x, w, ids, fmt, scales, row_block, block_k, transposed, isa, pf_l1=-1, pf_l2=-1, pf_rows=-1, more=None,
          which=None):
        if fmt == 2:
            rows = w.shape[1]
        else:
            rows = w.shape[2] if transposed else w.shape[1]
        return x.new_empty((x.shape[0], rows))
