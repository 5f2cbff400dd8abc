"""The text benchmarks/train_tiny.py trains and evaluates on, and the rules that choose it.

* training text: the source of the Python standard library, files in sorted order; one file in ten
  (chosen by a hash of its relative path) is held out as unseen code of the training kind;
* held-out prose: English paragraphs from /usr/share/doc (README, NEWS, changelog and copyright files,
  deduplicated), or, when fewer than MIN_PROSE exist, the docstrings of the held-out stdlib modules;
* prompt pieces for eval_texts.json: code cut at line ends, chosen by content hash.

DATA_RULES is part of the settings hash (training_settings.Settings.digest): bump it when these rules change.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import os
import re
import sysconfig
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc")
MIN_PROSE = 64          # fewer held-out prose paragraphs than this and the evaluation would be noise
# Bump when the text-selection rules in this module change: the cached model then no longer matches them.
DATA_RULES = 1


def stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's own .py files, in sorted order.

    Tests, third-party packages and the build-specific sysconfig data are left out: they are
    not the library's prose-and-code, and the last differs from machine to machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip_dirs & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        try:
            out.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def is_heldout(rel: str, every: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % every == 0


_DOC_NAME = re.compile(r"^(readme|news|changelog|changes|copyright|authors|thanks)", re.IGNORECASE)
_CHANGELOG_NOISE = re.compile(r"^\s*(-- .*<.*>|\S+ \(.*\) .*; urgency=\S+)\s*$")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs that read as English prose, whitespace collapsed."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.splitlines() if not _CHANGELOG_NOISE.match(ln)]
        para = " ".join(" ".join(lines).split())
        words = para.split()
        if len(words) < 25 or len(para) > 4000:
            continue
        letters = sum(c.isalpha() or c == " " for c in para)
        # Prose is nearly all letters and spaces; licences' field lists, code and file lists are not.
        if letters / len(para) >= 0.9:
            out.append(para)
    return out


def doc_prose() -> tuple[list[str], int]:
    """Distinct English paragraphs from /usr/share/doc and the number of files they came from."""
    seen: set[str] = set()
    paras: list[str] = []
    files = 0
    if not DOC_ROOT.is_dir():
        return [], 0
    for dirpath, dirnames, filenames in os.walk(DOC_ROOT):   # symlinked package folders are not followed
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not _DOC_NAME.match(name) or path.stat().st_size > 2_000_000:
                continue
            try:
                raw = gzip.open(path).read() if name.endswith(".gz") else path.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            found = [p for p in _paragraphs(text) if p not in seen]
            seen.update(found)
            paras.extend(found)
            files += bool(found)
    return paras, files


def docstring_prose(files: list[tuple[str, str]]) -> list[str]:
    """The fallback held-out prose: docstring paragraphs of the given modules."""
    out = []
    for _, src in files:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out.extend(_paragraphs(doc))
    return out


def code_chunks(files: list[tuple[str, str]], chars: int) -> list[str]:
    """Consecutive pieces of about `chars` characters, cut at line ends."""
    out = []
    for _, src in files:
        piece = ""
        for line in src.splitlines(keepends=True):
            piece += line
            if len(piece) >= chars:
                if piece.strip():
                    out.append(piece)
                piece = ""
    return out


def spread(items: list[str], n: int) -> list[str]:
    """n items chosen by content hash: deterministic, and spread over every source file."""
    return sorted(items, key=lambda s: hashlib.sha1(s.encode()).hexdigest())[:n]
