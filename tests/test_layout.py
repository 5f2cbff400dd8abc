"""The house keeps its walls: stages import only the stages below them, no import circle, no private name
imported across modules, no module past 400 lines. Read from the source's own import statements (every
import, including those inside functions and under TYPE_CHECKING), so a new arrow that breaks a wall fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moe_offload"
MAX_LINES = 400

# Each room (a sub-package, or a module at the package root) and its floor: a room may import rooms on lower
# floors only (and itself). Rooms on one floor stand side by side and do not import each other.
FLOORS = {
    "errors": 0, "prompts": 0,
    "formats": 1, "kernels": 1,
    "model": 2,
    "tiny": 3, "planning": 3,
    "routing": 4, "storage": 4, "engines": 4,
    "run": 5,
    "loading": 6,
    "api": 7,
    "measure": 8, "serve": 8,
    "cli": 9,
    "__init__": 10,
}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of moe_offload code in one module."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                out.append((target, [a.name for a in node.names], node.lineno))
            else:   # `from . import module`
                out += [((f"{target}." if target else "") + a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_offload"):
            target = node.module.removeprefix("moe_offload").lstrip(".")
            out.append((target, [a.name for a in node.names], node.lineno))
    return out


def _room(module: str) -> str:
    return module.split(".")[0] if module else "__init__"


MODULES = _modules()


def _resolve(target: str) -> str:
    """A target that names a package resolves to its __init__; a module stays itself."""
    if target in MODULES:
        return target
    return f"{target}.__init__" if f"{target}.__init__" in MODULES else target


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in MODULES}
    assert rooms <= set(FLOORS), f"rooms without a floor in this test (add them): {sorted(rooms - set(FLOORS))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down(module):
    here = _room(module)
    for target, _, line in _imports(module, MODULES[module]):
        there = _room(target)
        if there == here:
            continue
        assert FLOORS[there] < FLOORS[here], (
            f"{module} (floor {FLOORS[here]}, {here}/) imports {target} at line {line}, on floor {FLOORS[there]} "
            f"({there}/): a stage imports only the stages below it")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_modules(module):
    for target, names, line in _imports(module, MODULES[module]):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{module} line {line} imports private {private} from {target}: make it public or move it"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it on its second job"


def test_no_import_circle():
    graph = {m: {_resolve(t) for t, _, _ in _imports(m, p)} & set(MODULES) - {m} for m, p in MODULES.items()}
    # Tarjan's strongly connected components: any component of two or more modules is a circle.
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_reader_resolves_what_a_module_imports(tmp_path):
    """The reader is real: relative levels, `from . import module`, absolute imports, imports inside functions."""
    src = tmp_path / "bench.py"
    src.write_text("from ..run.runtime import Runtime, _Private\nfrom . import timing\n"
                   "def f():\n    from moe_offload.cli.main import main\n")
    found = {(t, tuple(n)) for t, n, _ in _imports("measure.bench", src)}
    assert found == {("run.runtime", ("Runtime", "_Private")), ("measure.timing", ()), ("cli.main", ("main",))}
    assert _room("run.runtime") == "run" and FLOORS["run"] > FLOORS["measure"] - 4


def test_the_architecture_tree_is_the_package():
    """docs/architecture.md lists every module once, in the folder it is in, and nothing that is not there."""
    text = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    tree = text.split("```text\n", 1)[1].split("```", 1)[0].splitlines()[1:]   # below `src/moe_offload/`
    listed, folder = [], None
    for line in filter(str.strip, tree):
        entry = line.strip().split()[0]
        depth = (len(line) - len(line.lstrip())) // 2
        if entry.endswith("/"):
            folder = entry.rstrip("/")
        elif entry.endswith(".py"):
            stem = entry[:-3]
            listed.append(stem if depth == 1 else f"{folder}.{stem}")
    assert len(listed) == len(set(listed)), "a module is listed twice"
    actual = {m.removesuffix(".__init__") if m != "__init__" else m for m in MODULES
              if not m.endswith(".__init__")}
    assert set(listed) == actual, (f"not in docs/architecture.md: {sorted(actual - set(listed))}; "
                                   f"listed but not in the package: {sorted(set(listed) - actual)}")


def test_the_tests_mirror_the_rooms():
    """tests/<room>/ for every sub-package, and no test folder that is not a room."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == rooms, (f"sub-packages without tests/<room>/: {sorted(rooms - folders)}; "
                              f"test folders that are not rooms: {sorted(folders - rooms)}")


def test_only_the_runtime_accessor_reads_the_runtime_off_a_model():
    """`model.moe_offload_runtime` is the public attribute (docs/python-api.md); inside the package it is read and
    set only through run/runtime.py's runtime_of / set_runtime: no other module names it in code."""
    named = []
    for module, path in MODULES.items():
        if module == "run.runtime":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "moe_offload_runtime") or \
                    (isinstance(node, ast.Constant) and node.value == "moe_offload_runtime"):
                named.append(f"{module}:{node.lineno}")
    assert not named, f"read the runtime through run.runtime.runtime_of, not the attribute: {named}"


TRANSFORMERS_INTERNALS = ("_compile_all_devices", "output_router", "result_handlers", "logit_processor",
                          "tensors_required", "cb_logits_processors")


def test_transformers_internals_are_touched_in_one_module_only():
    """What the package uses of transformers beyond its public API lives in run/transformers_compat.py, which
    checks the version range; no other module names those internals."""
    named = []
    for module, path in MODULES.items():
        if module == "run.transformers_compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.module if isinstance(node, ast.ImportFrom) \
                else None
            if name and any(part in TRANSFORMERS_INTERNALS for part in name.split(".")):
                named.append(f"{module}:{node.lineno} {name}")
    assert not named, f"reach transformers' internals through run/transformers_compat.py: {named}"


def test_the_read_strategy_is_an_object_not_a_string():
    """uva and prefetch are strategy objects (run/read_backend.py and one module each); no module compares a
    backend's name to choose what to do."""
    compared = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ("uva", "prefetch")
                                                     for c in [node.left, *node.comparators]):
                compared.append(f"{module}:{node.lineno}")
    assert not compared, f"ask the runtime's read strategy (rt.reads) instead: {compared}"


def test_the_read_plan_is_the_only_place_that_charges_a_counter():
    """Bytes are charged from plans (run/read_plan.py: a layer step's StepPlan, WholeRead, LookupRead, InPlaceRead);
    no other module adds to the link or disk counter, whatever it names it."""
    charged = []
    for module, path in MODULES.items():
        if module == "run.read_plan":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add"):
                continue
            target = node.func.value
            name = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) \
                else target.func.attr if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) \
                else None
            if name in ("counter", "disk_counter", "of"):
                charged.append(f"{module}:{node.lineno}")
    assert not charged, f"charge through a plan of run/read_plan.py: {charged}"
