"""Every code block of README.md and of the documents in docs/ runs exactly as written, so they stay true.

Blocks are found by their fence's language, so a section added later is picked up by itself:

- ```python: the block is a script, run by the venv's python in a subprocess;
- ```console: every `$ ` line (with the lines its trailing backslashes continue) is a command, run by
  bash; the other lines are the output a reader sees, not compared (paths and timings differ);
- ```bash, ```sh, ```shell: the whole block is a bash script, run with `set -e`;
- ```text, ```json, ```jsonl: output shown to the reader, never run.

A fence of any other language (or none) fails `test_every_block_has_a_known_language`: a new block
cannot escape the test unnoticed. To keep a runnable block out of the test (it needs a GPU, it is the
test suite itself), write `<!-- not-run: the reason -->` on the line right before its fence; the reason
is required. Use it sparingly: a block that is not run is a block that can rot.

Each document's runnable blocks run in its order in a fresh working directory of its own (later blocks use
what earlier ones wrote there, e.g. the `tiny-moe` folder that docs/cli.md's make-tiny example writes), with
the venv's bin first on PATH and nothing fetched from a hub. Running one block's test alone first runs the
blocks of its document before it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + [ROOT / "docs" / n for n in ("cli.md", "python-api.md", "results.md", "limits.md",
                                                 "architecture.md", "design.md")]
BIN = Path(sys.executable).parent        # the venv's bin: its python and its moe-offload
RUN = {"python", "console", "bash", "sh", "shell"}
OUTPUT = {"text", "json", "jsonl"}
TIMEOUT_S = 300                          # per command: the slowest (bench) takes ~10 s on 2 cores
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NOT_RUN = re.compile(r"<!--\s*not-run:((?:(?!-->).)*)-->\s*\Z", re.S)   # only blank space up to the fence


@dataclass(frozen=True)
class Block:
    line: int            # the document's line of the opening fence (1-based)
    lang: str
    code: str
    not_run: str | None  # the reason given by a `<!-- not-run: ... -->` marker, None without one
    doc: str = "README.md"

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.not_run is None


def extract_blocks(text: str, doc: str = "README.md") -> list[Block]:
    """The fenced code blocks of a markdown text, in order, with their language and not-run marker."""
    blocks = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()]
        marker = _NOT_RUN.search(before[-500:])
        blocks.append(Block(before.count("\n") + 1, m.group(1).lower(), m.group(2),
                            marker.group(1).strip() if marker else None, doc))
    return blocks


def console_commands(code: str) -> list[str]:
    """The `$ ` commands of a console block, continuation lines joined as the shell reads them."""
    commands: list[str] = []
    continued = False
    for line in code.splitlines():
        if continued:
            commands[-1] += "\n" + line
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            continue                           # output
        continued = line.endswith("\\")
    return commands


def _id(block: Block) -> str:
    return f"{block.doc}-line{block.line}-{block.lang}"


BLOCKS = [b for path in DOCS for b in extract_blocks(path.read_text(), path.relative_to(ROOT).as_posix())]
RUNNABLE = [b for b in BLOCKS if b.runs]


class Session:
    """The working directory one document's blocks share, and which of them have run there."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.done: set[int] = set()
        self.env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1",
                        TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg",
                        # the suite's one-thread rule (conftest): tiny models on a small shared CPU
                        OMP_NUM_THREADS="1")

    def run_through(self, block: Block) -> None:
        for b in RUNNABLE[:RUNNABLE.index(block) + 1]:
            if b.doc == block.doc and b.line not in self.done:
                self.done.add(b.line)          # a failed block is reported once, by its own test
                self._run(b)

    def _run(self, block: Block) -> None:
        if block.lang == "python":
            self._check(block, "the python block", [str(BIN / "python"), "-c", block.code])
        elif block.lang == "console":
            commands = console_commands(block.code)
            assert commands, f"{block.doc} line {block.line}: a console block without a `$ ` command"
            for cmd in commands:
                self._check(block, f"`$ {cmd}`", ["bash", "-c", cmd])
        else:
            self._check(block, "the bash block", ["bash", "-e", "-c", block.code])

    def _check(self, block: Block, what: str, argv: list[str]) -> None:
        done = subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, (
            f"{block.doc} line {block.line}: {what} exited {done.returncode} (run in a fresh folder where the blocks "
            f"before it ran)\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict:
    """One working directory per document, made when its first block runs."""
    assert (BIN / "moe-offload").is_file(), f"no {BIN / 'moe-offload'}: run the tests with the venv's python"
    made: dict[str, Session] = {}

    def of(doc: str) -> Session:
        if doc not in made:
            made[doc] = Session(tmp_path_factory.mktemp(Path(doc).stem))
        return made[doc]
    return of


@pytest.mark.parametrize("block", RUNNABLE, ids=_id)
def test_readme_block_runs_as_written(sessions, block):
    sessions(block.doc).run_through(block)


def test_every_block_has_a_known_language():
    unknown = [(b.doc, b.line, b.lang or "(none)") for b in BLOCKS if b.lang not in RUN | OUTPUT]
    assert not unknown, (f"blocks of unknown language {unknown}: fence each as one of {sorted(RUN)} (run) "
                         f"or {sorted(OUTPUT)} (output)")


def test_not_run_blocks_say_why_and_are_few():
    skipped = [b for b in BLOCKS if b.not_run is not None]
    assert all(b.not_run for b in skipped), "a `<!-- not-run: ... -->` marker needs its reason"
    assert all(b.lang in RUN for b in skipped), "only a runnable block needs a not-run marker"
    # Sparingly: most of what a user pastes must stay tested.
    assert len(skipped) <= len(RUNNABLE) // 2
    # The README's own examples are run: the ones a new user pastes first.
    langs = {b.lang for b in RUNNABLE if b.doc == "README.md"}
    assert {"python", "console"} <= langs and len(RUNNABLE) >= 5


def test_every_document_in_docs_is_run_or_listed_as_a_benchmark_page():
    # a new document cannot escape the test: it is in DOCS, or it is a page a benchmark writes
    docs = {p.name for p in (ROOT / "docs").glob("*.md")}
    run = {p.name for p in DOCS}
    written = {p.name for p in (ROOT / "docs").glob("*_bench.md")}
    assert docs - run - written == set()


def test_the_readme_links_only_to_files_that_exist():
    links = re.findall(r"\]\(((?!https?:|#)[^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert links and all((ROOT / link).exists() for link in links), [l for l in links if not (ROOT / l).exists()]


def test_extraction_rules():
    text = "\n".join([
        "intro",
        "```console",
        "$ moe-offload plan m \\",
        "      --offload-gb 1",
        "output line",
        "$ echo 'two'",
        "```",
        "<!-- not-run: needs a GPU -->",
        "```bash",
        "nvidia-smi",
        "```",
        "",
        "```text",
        "$ not a command: output",
        "```",
        "```python",
        "print(1)",
        "```",
    ])
    blocks = extract_blocks(text)
    assert [(b.line, b.lang, b.not_run, b.runs) for b in blocks] == [
        (2, "console", None, True), (9, "bash", "needs a GPU", False), (13, "text", None, False),
        (16, "python", None, True)]
    assert console_commands(blocks[0].code) == ["moe-offload plan m \\\n      --offload-gb 1", "echo 'two'"]
    # A marker applies only to the block right after it.
    assert extract_blocks("<!-- not-run: x -->\n\nprose\n```bash\nls\n```\n")[0].not_run is None
    two = extract_blocks("<!-- not-run: a -->\n```bash\nls\n```\n<!-- not-run: b -->\n```sh\nls\n```\n")
    assert [b.not_run for b in two] == ["a", "b"]
