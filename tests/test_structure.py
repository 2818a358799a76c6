"""The package's shape: no import circle among dflash modules, dflash imports at the top of each file,
and modules small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash"
MAX_LINES = 450
# The CLI dispatches to one subcommand and the package root resolves names on first use: importing
# everything up front would make `dflash plot` load torch and `import dflash` load transformers.
LAZY_IMPORTS_ALLOWED = {"dflash.cli.main", "dflash.__init__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only, never executed)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(n) for n in ast.walk(node))
    return hidden


def _imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported dflash module, imported at module level?) for every import statement in `path`."""
    tree = ast.parse(path.read_text())
    hidden = _type_checking_nodes(tree)
    top = {id(n) for n in tree.body}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                out.append((name, id(node) in top))
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the dflash modules it imports anywhere in its file (top level or inside functions)."""
    mods = _modules()
    known = set(mods)
    return {m: {t for t, _ in _imports(p, known) if t != m} for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_sees_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert find_cycle(graph) is None


def test_no_import_circle_among_dflash_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_dflash_imports_are_at_the_top_of_each_file():
    mods = _modules()
    known = set(mods)
    lazy = [f"{m}: {t}" for m, p in mods.items() if m not in LAZY_IMPORTS_ALLOWED
            for t, at_top in _imports(p, known) if not at_top]
    assert not lazy, "dflash imports inside functions (move them to the top of the file): " + ", ".join(lazy)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_module_is_small_enough_to_read(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (limit {MAX_LINES}): split it by concern"


# The layers as folders: what each subpackage (and the trainer / factory hubs) may not import. A folder
# low in the stack importing one above it is an upward arrow.
LAYERS = ("kinds", "target_model", "data", "run", "evaluation", "report", "hf", "cli")
FORBIDDEN = {
    "kinds": {"data", "run", "evaluation", "report", "hf", "cli", "dflash.trainer", "dflash.factory"},
    "target_model": {"data", "run", "evaluation", "report", "hf", "cli", "dflash.trainer", "dflash.factory"},
    "data": {"run", "evaluation", "hf", "cli", "dflash.trainer", "dflash.factory"},
    "run": {"data", "evaluation", "hf", "cli", "dflash.trainer", "dflash.factory"},
    "report": {"target_model", "data", "run", "evaluation", "hf", "cli", "dflash.trainer", "dflash.factory"},
    "evaluation": {"hf", "cli", "dflash.trainer", "dflash.factory"},
    "dflash.trainer": {"hf", "cli"},
    "dflash.factory": {"run", "evaluation", "hf", "cli", "dflash.trainer"},
}


def _place(module: str) -> str:
    """A module's folder (`target_model`, `data`, ...), or the module itself when it sits at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else module


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if _place(t) in FORBIDDEN.get(_place(m), set()))


def test_the_layer_check_sees_a_planted_upward_import():
    graph = {"dflash.target_model.frozen": {"dflash.modeling"}, "dflash.run.checkpoint": {"dflash.kinds.registry"}}
    assert layer_violations(graph) == []
    graph["dflash.target_model.frozen"].add("dflash.data.corpus")
    graph["dflash.run.checkpoint"].add("dflash.factory")
    assert layer_violations(graph) == ["dflash.run.checkpoint -> dflash.factory",
                                       "dflash.target_model.frozen -> dflash.data.corpus"]


def test_each_layer_imports_only_what_is_below_it():
    assert not (found := layer_violations(import_graph())), "imports against the layers: " + ", ".join(found)


def _imports_conftest(source: str) -> bool:
    """Whether a test module's source imports `conftest` as a module (pytest loads it by itself; helpers belong in
    `tests/helpers.py`)."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "conftest":
            return True
        if isinstance(node, ast.Import) and any(alias.name == "conftest" for alias in node.names):
            return True
    return False


def test_no_test_module_imports_conftest():
    assert _imports_conftest("def f():\n    from conftest import tiny_config\n")  # a planted one is seen
    assert _imports_conftest("import conftest as fixtures\n") and not _imports_conftest("from helpers import x\n")
    tests = Path(__file__).resolve().parent
    offenders = [p.name for p in sorted(tests.glob("*.py")) if p.name != "conftest.py" and _imports_conftest(p.read_text())]
    assert offenders == []
