"""The package's structure rules (CONTRIBUTING.md, docs/design.md), asserted.

The import rules are measured by ``tools/structure.py`` (loaded here from its path): no import
circle in ``pipetrain/`` or ``benchmarks/``, no import against the layer rule outside
``__main__`` entry points and at most two from them, at most 12 top-level modules in
``pipetrain/runtime/``, no read of another module's underscore names. This file adds what
the checker does not measure: no ``type: ignore[attr-defined]`` in ``pipetrain/``, no
module-global hand-over between ``run/`` and ``cli/``, no machine-specific path in any file,
every module path the documentation names exists. The last tests run the checkers on small
synthetic trees, to show that each of them can fail.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRUCTURE_PY = ROOT / "tools" / "structure.py"

#: The limits stated in CONTRIBUTING.md (fixed here, so loosening the checker's own does not pass).
MAX_ENTRY_UPWARD = 2
MAX_RUNTIME_TOP_MODULES = 12

#: Absolute paths of a particular machine, and the parent folder of a checkout.
MACHINE_PATH = re.compile(
    r"(?<![\w.{}-])/(?:work|tmp|root|home|Users|mnt)/"   # a work folder, temporary files, home folders
    r"|\.\./shared/"                                     # a folder beside the checkout
    r"|[A-Za-z]:\\Users\\"                               # a Windows home folder
)
#: Folders that hold no file of the project (environments, caches, build output).
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache",
             ".ruff_cache", "build", "out"}

#: A module path in prose, ending in ``.py``: with folders (``plan/cuts.py``) or bare (``comm.py``).
DOC_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w]*/)*[A-Za-z_]\w*\.py)\b")
#: A dotted name in the package (``pipetrain.plan.calibrated.predict_run``).
DOC_DOTTED = re.compile(r"\bpipetrain(?:\.[A-Za-z_]\w*)+")
#: Placeholders that stand for a family of files (``pipetrain/cli/NAME_cmd.py``).
PLACEHOLDERS = ("NAME", "test_X")
#: File names in examples that stand for the user's own files.
EXAMPLE_FILES = ("server.py",)
#: Where a bare module name (``gloo_probe.py``) may live.
SOURCE_DIRS = ("pipetrain", "benchmarks", "tests", "tools")


def load_structure() -> ModuleType:
    """``tools/structure.py`` as a module (it is a script, not part of the package)."""
    name = "pipetrain_tools_structure"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, STRUCTURE_PY)
    assert spec is not None and spec.loader is not None, f"cannot load {STRUCTURE_PY}"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def structure() -> ModuleType:
    return load_structure()


@pytest.fixture(scope="module")
def report(structure: ModuleType) -> Any:
    return structure.measure()


def listing(items: list) -> str:
    return "\n  " + "\n  ".join(str(i) for i in items)


# -- the import rules, measured by tools/structure.py ------------------------------------------

def test_no_import_circle(report: Any) -> None:
    circles = [" <-> ".join(c) for c in report.circles]
    assert not circles, f"{len(circles)} import circle(s) in pipetrain/ or benchmarks/:{listing(circles)}"


def test_no_import_against_the_layer_rule_outside_entry_points(report: Any) -> None:
    assert not report.upward, (f"{len(report.upward)} import(s) against the layer rule "
                               f"(CONTRIBUTING.md, 'The layer rule'):{listing(report.upward)}")


def test_entry_points_import_upwards_at_most_twice(report: Any) -> None:
    assert len(report.entry_upward) <= MAX_ENTRY_UPWARD, (
        f"{len(report.entry_upward)} upward imports from __main__ modules, at most "
        f"{MAX_ENTRY_UPWARD}:{listing(report.entry_upward)}")


def test_runtime_has_at_most_12_top_level_modules(report: Any) -> None:
    mods = report.runtime_top_modules
    assert len(mods) <= MAX_RUNTIME_TOP_MODULES, (
        f"pipetrain/runtime/ has {len(mods)} top-level modules, at most {MAX_RUNTIME_TOP_MODULES}:{listing(mods)}")


def test_no_read_of_another_modules_underscore_names(report: Any) -> None:
    assert not report.private_reads, (f"{len(report.private_reads)} read(s) of another module's underscore "
                                      f"names:{listing(report.private_reads)}")


def test_the_checker_agrees(report: Any) -> None:
    """``python tools/structure.py`` exits 1 exactly when ``Report.failures`` names a rule."""
    assert report.failures() == []


# -- what the checker does not measure --------------------------------------------------------

def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def attr_defined_ignores(files: list[Path]) -> list[str]:
    pattern = re.compile(r"type:\s*ignore\[[^\]]*\battr-defined\b")
    return [f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}:{n}"
            for p in files for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]


def test_no_attr_defined_ignore_in_the_package() -> None:
    found = attr_defined_ignores(python_files(ROOT / "pipetrain"))
    assert not found, ("`type: ignore[attr-defined]` hides an attribute that a typed interface should "
                       f"declare:{listing(found)}")


def test_no_module_global_hand_over_between_run_and_cli(structure: ModuleType) -> None:
    overrides = [f"{p.relative_to(ROOT)}:{n}" for p in python_files(ROOT / "pipetrain")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if "_TRAIN_OVERRIDE" in line]
    assert not overrides, f"the run/cli hand-over global _TRAIN_OVERRIDE is still used:{listing(overrides)}"
    known = {structure.module_name(p) for p in structure.source_files(["pipetrain", "benchmarks"])}
    upward = [f"{p.relative_to(ROOT)}:{line} imports {target}"
              for p in python_files(ROOT / "pipetrain" / "run")
              for target, line, _ in structure.imports_of(p, known)
              if target == "pipetrain.cli" or target.startswith("pipetrain.cli.")]
    assert not upward, f"pipetrain/run imports pipetrain.cli:{listing(upward)}"


def project_files(root: Path) -> list[Path]:
    """The files of the checkout: what git tracks or would track, else every file outside SKIP_DIRS."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True, timeout=60).stdout
        files = [root / f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in root.rglob("*") if not SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(p for p in files if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts)
                  and not p.name.endswith(".egg-info"))


def machine_paths(files: list[Path], root: Path) -> list[str]:
    found = []
    for p in files:
        data = p.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images)
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            m = MACHINE_PATH.search(line)
            if m:
                found.append(f"{p.relative_to(root)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_no_file_names_a_path_of_a_particular_machine() -> None:
    found = machine_paths(project_files(ROOT), ROOT)
    assert not found, f"paths of a particular machine (use paths relative to the checkout):{listing(found)}"


def test_the_helpers_notes_are_gone() -> None:
    assert not (ROOT / "docs" / "HELPERS.md").exists(), "docs/HELPERS.md is replaced by CONTRIBUTING.md"
    assert (ROOT / "CONTRIBUTING.md").is_file()


# -- the documentation names modules that exist ------------------------------------------------

def doc_files(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
            if p.is_file()]


def doc_references(text: str) -> Iterator[tuple[int, str]]:
    """(line, reference) of every module path and dotted package name in a text."""
    for n, line in enumerate(text.splitlines(), 1):
        for m in DOC_PATH.finditer(line):
            if not any(ph in m.group(1) for ph in PLACEHOLDERS) and m.group(1) not in EXAMPLE_FILES:
                yield n, m.group(1)
        for m in DOC_DOTTED.finditer(line):
            yield n, m.group(0)


def module_names_defined(path: Path) -> set[str]:
    """The names a module defines or imports at its top level (what ``module.NAME`` reads)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def string_literals(root: Path) -> set[str]:
    """Every string constant of the package (a logger's name, ``pipetrain.progress``, is not a module)."""
    out: set[str] = set()
    for p in python_files(root / "pipetrain"):
        out |= {n.value for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("pipetrain.")}
    return out


def reference_exists(ref: str, root: Path, literals: set[str]) -> bool:
    if ref.endswith(".py") and "/" in ref:
        # relative to the checkout (tests/..., benchmarks/...) or to the package (plan/cuts.py)
        return any((base / ref).is_file() for base in (root, root / "pipetrain"))
    if ref.endswith(".py"):
        # a bare name, in a listing of its folder or after its path: a file of that name somewhere
        return (root / ref).is_file() or any(any((root / d).rglob(ref)) for d in SOURCE_DIRS)
    if ref in literals:
        return True
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[i:]
            # the first name after the module must be defined there; deeper ones are its attributes
            return not rest or rest[0] in module_names_defined(module)
    return False


def missing_references(root: Path) -> list[str]:
    literals = string_literals(root)
    return [f"{p.relative_to(root)}:{n}: {ref}" for p in doc_files(root)
            for n, ref in doc_references(p.read_text()) if not reference_exists(ref, root, literals)]


def test_every_module_path_the_docs_name_exists() -> None:
    missing = missing_references(ROOT)
    assert not missing, f"the documentation names modules that do not exist:{listing(missing)}"


# -- the checkers can fail ---------------------------------------------------------------------

def write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def synthetic_tree(root: Path, broken: bool) -> None:
    """A small package in the layout; with ``broken``, one violation of every rule."""
    for pkg in ("pipetrain", "pipetrain/graph", "pipetrain/plan", "pipetrain/cli", "pipetrain/runtime",
                "pipetrain/runtime/engine", "pipetrain/runtime/process"):
        write(root, f"{pkg}/__init__.py")
    write(root, "pipetrain/errors.py", "class PipetrainError(ValueError):\n    pass\n")
    write(root, "pipetrain/graph/types.py", "from ..errors import PipetrainError\n")
    write(root, "pipetrain/plan/api.py", "from ..graph import types\n\n\ndef _helper():\n    return 1\n")
    write(root, "pipetrain/runtime/process/log.py", "import logging\n")
    write(root, "pipetrain/runtime/engine/executor.py", "from ..process import log\n")
    write(root, "pipetrain/cli/__main__.py", "from ..plan import api\n")
    write(root, "pipetrain/graph/__main__.py", "from ..plan import api\n")   # one upward import: allowed
    write(root, "benchmarks/run.py", "import timing\n")
    write(root, "benchmarks/timing.py", "")
    if not broken:
        return
    # a layer-1 module importing the planner (layer 3), inside a function: still counted
    write(root, "pipetrain/graph/capture.py", "def f():\n    from ..plan import api\n    return api\n")
    # inside runtime: process (0) importing engine (1)
    write(root, "pipetrain/runtime/process/peers.py", "from ..engine import executor\n")
    # a circle in benchmarks/
    write(root, "benchmarks/timing.py", "import run\n")
    # three upward imports from an entry point
    write(root, "pipetrain/graph/__main__.py",
          "from ..cli import __main__\nfrom ..plan import api\nimport pipetrain.runtime\n")
    # another module's underscore name
    write(root, "pipetrain/plan/cuts.py", "from .api import _helper\n")
    # thirteen top-level modules in runtime/ (with __init__.py)
    for i in range(12):
        write(root, f"pipetrain/runtime/m{i}.py")


def test_the_checker_reports_every_broken_rule(structure: ModuleType, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    synthetic_tree(tmp_path, broken=True)
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    rep = structure.measure()
    assert ["run", "timing"] in rep.circles
    assert any(u.startswith("pipetrain.graph.capture:2 -> pipetrain.plan") for u in rep.upward), rep.upward
    assert any(u.startswith("pipetrain.runtime.process.peers:1 -> pipetrain.runtime.engine") for u in rep.upward)
    assert len(rep.entry_upward) == 3 > MAX_ENTRY_UPWARD, rep.entry_upward
    assert any("pipetrain.plan.cuts" in r and "_helper" in r for r in rep.private_reads), rep.private_reads
    assert len(rep.runtime_top_modules) == 13
    assert len(rep.failures()) == 5, rep.failures()


def test_the_checker_passes_a_tree_that_keeps_the_rules(structure: ModuleType, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    synthetic_tree(tmp_path, broken=False)
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    rep = structure.measure()
    assert rep.failures() == []
    assert (rep.circles, rep.upward, rep.private_reads) == ([], [], [])
    assert rep.entry_upward == ["pipetrain.graph.__main__:1 -> pipetrain.plan.api"]
    assert len(rep.runtime_top_modules) == 1


def test_the_circle_finder_on_a_synthetic_graph(structure: ModuleType) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert structure.strongly_connected(graph) == [["a", "b", "c"]]
    assert structure.strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_other_checks_find_what_they_look_for(tmp_path: Path) -> None:
    home = "/" + "home" + "/someone/pipetrain"
    write(tmp_path, "pipetrain/x.py", "y = z.w  # type: ignore[attr-defined]\n")
    write(tmp_path, "notes.md", f"see {home}/docs\n")
    write(tmp_path, "ok.md", "the failure key is pipetrain/failure/{}/root; /proc/self/status; step_5.tmp/\n")
    assert len(attr_defined_ignores([tmp_path / "pipetrain" / "x.py"])) == 1
    found = machine_paths([tmp_path / "notes.md", tmp_path / "ok.md"], tmp_path)
    assert [f.split(":")[0] for f in found] == ["notes.md"], found

    write(tmp_path, "pipetrain/__init__.py", "from .plan import plan\n")
    write(tmp_path, "pipetrain/plan/__init__.py", "def plan():\n    pass\n")
    write(tmp_path, "pipetrain/plan/cuts.py", "def split_at_cuts():\n    pass\n")
    write(tmp_path, "README.md", "`plan/cuts.py`, `pipetrain.plan.cuts.split_at_cuts`, `pipetrain.plan`,\n"
                                 "`runtime/stage.py`, `pipetrain.plan.quick`, `pipetrain.plan.cuts.gone`,\n"
                                 "`pipetrain/cli/NAME_cmd.py`, cuts.py, quick.py, server.py\n")
    missing = [m.split(": ")[1] for m in missing_references(tmp_path)]
    assert missing == ["runtime/stage.py", "pipetrain.plan.quick", "pipetrain.plan.cuts.gone", "quick.py"], missing
