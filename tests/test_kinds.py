"""One record per draft kind (`dflash.kinds.registry`): the records agree with what they describe (the model a draft
config of the kind builds, its objective, its metric layout, its config section), and nothing in the package outside
`dflash/kinds/` branches on a kind (`kind_branches`: a fitness test over the package's source, naming file:line)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import KIND_HEADS, make_tiny_target, tiny_config

import dflash.kinds.registry as registry
from dflash.kinds.registry import DFLASH, KIND_NAMES, KINDS, kind_named, kind_of

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash"

# What names a kind, all read off the records (a fifth kind is covered without touching this file).
ALLOWED_KIND_MODULES = {"dflash.kinds.registry", "dflash.kinds.record"}
SECTIONS = {kind.section for kind in KINDS if kind.section is not None}  # config sections: domino, dflash2, dspark
OTHER_KINDS = [kind for kind in KINDS if kind is not DFLASH]
RECOGNISERS = {kind.recognises.__name__ for kind in OTHER_KINDS}  # is_domino, is_dflash2, is_dspark
KIND_CLASSES = {cls.__name__ for kind in OTHER_KINDS for cls in (kind.model, kind.objective)}
RECORD_NAMES = {name for name, value in vars(registry).items() if any(value is kind for kind in KINDS)}  # DFLASH, ...
SETTINGS_CLASSES = {kind.settings_type.__name__ for kind in KINDS if kind.settings_type is not None}
# The one place a kind's section is named: its field of `TrainConfig` (and the import of its settings class there)
CONFIG_PATH, CONFIG_CLASS = "dflash/config.py", "TrainConfig"


def _module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_module(node: ast.ImportFrom, path: str) -> str:
    """The absolute module of a `from ... import` (relative ones resolved against `path`)."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _kind_specific(module: str) -> bool:
    return module.startswith("dflash.kinds.") and module not in ALLOWED_KIND_MODULES


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a kind name (`DOMINO = "domino"`, `DFLASH, DSPARK = "dflash", "dspark"`)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                pairs = (zip(target.elts, node.value.elts, strict=False) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                for name, value in pairs:
                    if isinstance(name, ast.Name) and isinstance(value, ast.Constant) and value.value in KIND_NAMES:
                        found[name.id] = value.value
    return found


def _name_of(node: ast.AST) -> str | None:
    """`X` of `X` or `a.b.X`."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _kinds_in(node: ast.AST, aliases: dict[str, str]) -> list[str]:
    """How `node` names a kind, alone or in a tuple / list / set display: a kind name ('domino'), a module name
    bound to one (DOMINO = 'domino'), or a record of the registry (DOMINO; also any name spelt like one)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KIND_NAMES:
        return [repr(node.value)]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [name for elt in node.elts for name in _kinds_in(elt, aliases)]
    name = _name_of(node)
    if isinstance(node, ast.Name) and name in aliases:
        return [f"{name} (= {aliases[name]!r})"]
    return [f"{name} (a kind record's name)"] if name in RECORD_NAMES else []


def _kind_classes_in(node: ast.AST) -> list[str]:
    """The kind classes (draft model / objective) `node` names, alone or in a tuple (isinstance's second argument)."""
    if isinstance(node, ast.Tuple | ast.List):
        return [name for elt in node.elts for name in _kind_classes_in(elt)]
    name = _name_of(node)
    return [name] if name in KIND_CLASSES else []


def _pattern_kinds(pattern: ast.pattern, aliases: dict[str, str]) -> list[str]:
    """What a `match` case pattern names of the kinds: a kind as a value or mapping key, or a kind class."""
    found: list[str] = []
    for node in ast.walk(pattern):
        if isinstance(node, ast.MatchValue):
            found += _kinds_in(node.value, aliases)
        elif isinstance(node, ast.MatchMapping):
            found += [name for key in node.keys for name in _kinds_in(key, aliases)]
        elif isinstance(node, ast.MatchClass):
            found += _kind_classes_in(node.cls)
    return found


def kind_branches(source: str, path: str) -> list[str]:
    """Every kind branch in the module `source` (at `path`, relative to the repository root, e.g.
    "dflash/config.py"), as "path:line: what". A kind branch is code that names one kind where its record should
    be asked: an import of a kind's own module; a kind (its name, a constant bound to it, a record) compared, a key
    of a dict literal or a match case; a kind's config section read (`.domino`, also through getattr) or declared
    outside `TrainConfig`; a kind's recogniser called (`is_domino`); a kind's draft model or objective class tested
    (isinstance / issubclass, `type(x) is`, a class pattern); a kind's record looked up by its name
    (`kind_named("dspark")`). A kind name in a docstring or a message is none, and
    a dict literal whose only kind key is "dflash" (the project's name too: a report's `"dflash": ...` figures)."""
    tree = ast.parse(source, filename=path)
    aliases = _aliases(tree)
    found: list[tuple[int, str]] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append((node.lineno, what))

    def visit(node: ast.AST, klass: str | None) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _kind_specific(alias.name):
                    hit(node, f"import of the kind module {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = _imported_module(node, path)
            names = [alias.name for alias in node.names]
            if _kind_specific(module):
                if not (path == CONFIG_PATH and set(names) <= SETTINGS_CLASSES):  # the sections' types
                    hit(node, f"import from the kind module {module} ({', '.join(names)})")
            elif module == "dflash.kinds":  # `from dflash.kinds import domino`
                for name in names:
                    if _kind_specific(f"{module}.{name}"):
                        hit(node, f"import of the kind module {module}.{name}")
        elif isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                for name in _kinds_in(operand, aliases):
                    hit(node, f"kind {name} compared")
                for name in _kind_classes_in(operand):
                    hit(node, f"kind class {name} compared")
        elif isinstance(node, ast.Dict):
            keys = [(key, name) for key in node.keys if key is not None for name in _kinds_in(key, aliases)]
            if any(name != repr(DFLASH.name) for _, name in keys):
                for key, name in keys:
                    hit(key, f"kind {name} as a dict key")
        elif isinstance(node, ast.match_case):
            for name in _pattern_kinds(node.pattern, aliases):
                hit(node.pattern, f"kind {name} as a match case")
        elif isinstance(node, ast.Attribute) and node.attr in SECTIONS:
            hit(node, f"kind section .{node.attr}")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in SECTIONS:
            if klass is not None and not (path == CONFIG_PATH and klass == CONFIG_CLASS):
                hit(node, f"kind section {node.target.id} declared in {klass} (only {CONFIG_CLASS} holds the sections)")
        elif isinstance(node, ast.Call):
            func = _name_of(node.func)
            if func in RECOGNISERS:
                hit(node, f"kind recogniser {func}()")
            elif func in ("isinstance", "issubclass") and len(node.args) == 2:
                for name in _kind_classes_in(node.args[1]):
                    hit(node, f"{func}(..., {name})")
            elif func in ("getattr", "hasattr", "setattr") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and arg.value in SECTIONS:
                    hit(node, f"kind section {arg.value!r} through {func}")
            elif func == "kind_named" and node.args:  # `kind_named("dspark").unsupported`: one kind, by name
                for name in _kinds_in(node.args[0], aliases):
                    hit(node, f"kind {name} looked up by name")
            elif func in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _kind_specific(arg.value):
                    hit(node, f"import of the kind module {arg.value}")
        inner = node.name if isinstance(node, ast.ClassDef) else None if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef) else klass  # class bodies only, not their methods
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, None)
    return [f"{path}:{line}: {what}" for line, what in sorted(found)]


# ---- the detector on planted sources: each rule finds its branch, a message or docstring is none -----------------

# (source, what the one finding says, its line); None: no finding
PLANTED = [
    ("import dflash.kinds.domino", "import of the kind module dflash.kinds.domino", 1),
    ("from dflash.kinds.dspark import DSparkHeadConfig", "import from the kind module dflash.kinds.dspark", 1),
    ("from dflash.kinds import dflash2_objective", "import of the kind module dflash.kinds.dflash2_objective", 1),
    ("from ..kinds.domino import DominoObjective", "import from the kind module dflash.kinds.domino", 1),
    ("from .domino import X", None, 0),  # dflash/evaluation/domino.py: not a kind module
    ("import importlib\nimportlib.import_module('dflash.kinds.dspark')", "import of the kind module dflash.kinds.dspark", 2),
    ("from dflash.kinds.registry import kind_named\nfrom dflash.kinds.record import DraftKind", None, 0),
    ("x = 1\nif kind == 'domino':\n    pass", "kind 'domino' compared", 2),
    ("ok = 'dspark' != config.draft.kind", "kind 'dspark' compared", 1),
    ("ok = kind in ('dflash', 'x')", "kind 'dflash' compared", 1),
    ("ok = kind not in ['x', 'dflash2']", "kind 'dflash2' compared", 1),
    ("ok = kind in {'dspark'}", "kind 'dspark' compared", 1),
    ("extras = {'other': 2,\n          'domino': 1}", "kind 'domino' as a dict key", 2),
    ("match kind:\n    case 'dflash2':\n        pass", "kind 'dflash2' as a match case", 2),
    ("match kind:\n    case 'x' | 'dspark':\n        pass", "kind 'dspark' as a match case", 2),
    ("match d:\n    case DominoDraftModel():\n        pass", "kind DominoDraftModel as a match case", 2),
    ("rank = config.dspark.markov_rank", "kind section .dspark", 1),
    ("gru = cfg.domino.gru_hidden_dim", "kind section .domino", 1),
    ("top_k = getattr(config, 'dflash2').selector_top_k", "kind section 'dflash2' through getattr", 1),
    ("class Other:\n    domino: int = 0", "kind section domino declared in Other", 2),
    ("ok = is_domino(draft.config)", "kind recogniser is_domino()", 1),
    ("ok = heads.is_dspark(cfg)", "kind recogniser is_dspark()", 1),
    ("ok = isinstance(draft, DFlash2DraftModel)", "isinstance(..., DFlash2DraftModel)", 1),
    ("ok = isinstance(obj, (DFlashObjective, kinds.DSparkObjective))", "isinstance(..., DSparkObjective)", 1),
    ("ok = type(obj) is DominoObjective", "kind class DominoObjective compared", 1),
    ("ok = kind_named(name) is DSPARK", "kind DSPARK (a kind record's name) compared", 1),
    ("why = kind_named('dspark').unsupported.dpace", "kind 'dspark' looked up by name", 1),
    ("DOMINO = 'domino'\nok = kind == DOMINO", "kind DOMINO (= 'domino') compared", 2),
    ("A, B = 'dflash', 'dspark'\nnotes = {B: 'every slot proposes'}", "kind B (= 'dspark') as a dict key", 2),
    ("from dflash.evaluation.serving import DOMINO\nif kind != serving.DOMINO: pass", "kind DOMINO (a kind", 2),
    # none of these is a branch
    ('"""Trains a domino, dflash2 or dspark draft."""\ndef f():\n    """The dspark way."""', None, 0),
    ("name = 'domino'\nraise ValueError(f'{name}: domino drafts need {kind.title}')", None, 0),
    ("log.info('dflash2 runs'); x = kind == other; y = {kind.name: 1}; z = d['dspark_loss']", None, 0),
    ("ok = isinstance(draft, DFlashDraftModel) and draft.kind is kind", None, 0),
    ("report = {'engine': 'vllm', 'dflash': own}", None, 0),  # dflash's own figures, not a table of kinds
    ("section = getattr(config, kind.section)\nclass Settings:\n    kind: str = 'domino'", None, 0),
]


@pytest.mark.parametrize("source, expected, line", PLANTED, ids=[f"planted-{i}" for i in range(len(PLANTED))])
def test_the_detector_finds_each_planted_kind_branch_and_nothing_else(source, expected, line):
    found = kind_branches(source, "dflash/evaluation/planted.py")
    if expected is None:
        assert found == [], found
    else:
        assert len(found) == 1 and found[0].startswith(f"dflash/evaluation/planted.py:{line}: {expected}"), found


def test_the_detectors_vocabulary_is_read_off_every_record():
    """A record whose recogniser is a lambda, or two kinds sharing a class, would leave a kind's branches unseen."""
    assert len(RECOGNISERS) == len(OTHER_KINDS) and all(name.isidentifier() for name in RECOGNISERS), RECOGNISERS
    assert len(KIND_CLASSES) == 2 * len(OTHER_KINDS) and len(RECORD_NAMES) == len(KINDS), (KIND_CLASSES, RECORD_NAMES)
    assert SECTIONS and SECTIONS <= set(KIND_NAMES) and len(SETTINGS_CLASSES) == len(SECTIONS)


def test_a_table_of_kinds_is_found_at_every_key_dflash_included():
    found = kind_branches("TITLES = {\n    'dflash': 'DFlash',\n    'dspark': 'DSpark',\n}", "dflash/x.py")
    assert found == ["dflash/x.py:2: kind 'dflash' as a dict key", "dflash/x.py:3: kind 'dspark' as a dict key"]


def test_only_train_config_in_config_py_declares_the_sections_and_imports_their_settings():
    declared = "from dflash.kinds.domino import DominoSettings\nclass TrainConfig:\n    domino: DominoSettings = None\n"
    assert kind_branches(declared, CONFIG_PATH) == []
    assert len(kind_branches(declared, "dflash/other.py")) == 2  # the import and the declaration
    assert len(kind_branches(declared.replace("TrainConfig", "DraftSettings"), CONFIG_PATH)) == 1
    # config.py may import the settings classes, nothing else of a kind, and may not read a section
    assert len(kind_branches("from dflash.kinds.domino import DominoSettings, DominoDraftModel", CONFIG_PATH)) == 1
    assert len(kind_branches("class TrainConfig:\n    def f(self):\n        return self.dspark", CONFIG_PATH)) == 1


def package_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if PACKAGE / "kinds" not in p.parents)


def test_the_package_outside_dflash_kinds_has_no_kind_branch():
    """Every kind difference lives in the kind's record (`dflash/kinds/registry.py`) and the kind's own modules: a
    branch elsewhere is a place a fifth kind would have to be added by hand."""
    modules = package_modules()
    assert len(modules) > 40 and PACKAGE / "config.py" in modules  # the walk found the package
    found = [line for p in modules for line in kind_branches(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not found, f"{len(found)} kind branches outside dflash/kinds/:\n" + "\n".join(found)


# ---- the records -----------------------------------------------------------------------------------------------


def test_kind_names_are_unique_and_each_finds_its_record():
    assert len(set(KIND_NAMES)) == len(KIND_NAMES) == len(KINDS) and KINDS[0] is DFLASH
    for kind in KINDS:
        assert kind_named(kind.name) is kind
    with pytest.raises(ValueError, match="not a draft kind") as refused:
        kind_named("medusa")
    assert all(name in str(refused.value) for name in KIND_NAMES), refused.value


def test_each_section_is_a_train_config_field_of_the_kinds_settings():
    from dflash.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig()
    for kind in KINDS:
        if kind.settings_type is None:
            assert kind.section is None and kind.name not in fields
        else:
            assert kind.section == kind.name and type(getattr(config, kind.section)) is kind.settings_type


def test_kind_heads_cover_every_kind():
    assert list(KIND_HEADS) == list(KIND_NAMES)
    for name, overrides in KIND_HEADS.items():
        assert tiny_config(**overrides).draft.kind == name


@pytest.mark.parametrize("name", KIND_NAMES)
def test_kind_of_a_draft_built_for_each_kind_is_that_kind(name):
    """`kind_of` reads a kind off a draft config (the keys its head adds): exactly the kind the draft was built for,
    recognised by its own record alone (the plain record, asked last, recognises every config)."""
    from dflash.factory import build_draft

    kind = kind_named(name)
    draft = build_draft(tiny_config(**KIND_HEADS[name]), make_tiny_target(), None)
    assert type(draft) is kind.model
    assert kind_of(draft.config) is kind
    assert [k for k in OTHER_KINDS if k.recognises(draft.config)] == ([] if kind is DFLASH else [kind])


# The proposals a block of bs slots makes: bs - 1 (slot 0 holds the anchor), DSpark's bs (slot k predicts a + k + 1)
PROPOSALS = {"dflash": -1, "domino": -1, "dflash2": -1, "dspark": 0}


@pytest.mark.parametrize("block_size", [4, 6])
@pytest.mark.parametrize("name", KIND_NAMES)
def test_each_records_model_objective_and_metric_layout_agree(name, block_size):
    """The objective built for a kind is the record's objective around the record's model, and the metrics it fills
    are as wide as the proposals its draft makes per block (DSpark's slot 0 proposes too)."""
    from dflash.factory import build_objective

    kind = kind_named(name)
    config = tiny_config(**KIND_HEADS[name], draft__block_size=block_size)
    objective = build_objective(config, make_tiny_target(), None, device=torch.device("cpu"), dtype=torch.float32)
    assert type(objective) is kind.objective and type(objective.draft) is kind.model
    assert objective.block_size == block_size
    proposals = objective.draft.proposals_per_block(block_size)
    assert objective.metric_layout().proposals == proposals
    assert proposals == block_size + PROPOSALS[name]
