"""Measure the package structure from its imports: circles, imports against the layer rule,
reads of another module's underscore names, the runtime's top level, the longest functions.

    python tools/structure.py            # the report; exit 1 when a rule is broken
    python tools/structure.py --json     # the same as JSON

The layer rule (docs/design.md): a module may import only from its own layer or below.

    errors < graph, schedule, models, checkpoint, cluster < profile, data, metrics, stages
           < plan < simulate < job, auto < runtime < run < cli

and inside ``runtime``: process < engine < guards < checkpoints < worker, single, reference, rehearsal
< launch (the package ``__init__`` re-exports, so it sits on top). Every import counts,
also those inside functions and under ``TYPE_CHECKING``: a circle hidden from the
interpreter is still a circle for the reader. ``__main__`` modules are entry points and may
import upwards (at most ``MAX_ENTRY_UPWARD`` of them).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS: dict[str, int] = {
    "errors": 0,
    "graph": 1, "schedule": 1, "models": 1, "checkpoint": 1, "cluster": 1,
    "profile": 2, "data": 2, "metrics": 2, "stages": 2,
    "plan": 3,
    "simulate": 4,
    "job": 5, "auto": 5,
    "runtime": 6,
    "run": 7,
    "cli": 8,
    "__main__": 9, "__init__": 9,
}
RUNTIME_LAYERS: dict[str, int] = {
    "process": 0, "engine": 1, "guards": 2, "checkpoints": 3,
    "worker": 4, "single": 4, "reference": 4, "rehearsal": 4, "launch": 5, "__init__": 6,
}
MAX_RUNTIME_TOP_MODULES = 12
MAX_ENTRY_UPWARD = 2
LONG_FUNCTION = 80


@dataclass
class Report:
    circles: list[list[str]] = field(default_factory=list)
    upward: list[str] = field(default_factory=list)
    entry_upward: list[str] = field(default_factory=list)
    private_reads: list[str] = field(default_factory=list)
    runtime_top_modules: list[str] = field(default_factory=list)
    long_functions: list[tuple[str, int]] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = []
        if self.circles:
            out.append(f"{len(self.circles)} import circle(s)")
        if self.upward:
            out.append(f"{len(self.upward)} import(s) against the layer rule outside entry points")
        if len(self.entry_upward) > MAX_ENTRY_UPWARD:
            out.append(f"{len(self.entry_upward)} upward imports from entry points (at most {MAX_ENTRY_UPWARD})")
        if self.private_reads:
            out.append(f"{len(self.private_reads)} read(s) of another module's underscore names")
        if len(self.runtime_top_modules) > MAX_RUNTIME_TOP_MODULES:
            out.append(f"pipetrain/runtime has {len(self.runtime_top_modules)} top-level modules "
                       f"(at most {MAX_RUNTIME_TOP_MODULES})")
        return out


def module_name(path: Path) -> str:
    """The dotted name a file is imported by (benchmarks put ``benchmarks/`` on ``sys.path``)."""
    rel = path.relative_to(ROOT).with_suffix("")
    if rel.parts[0] == "benchmarks":
        rel = rel.relative_to("benchmarks")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def resolve(current: str, package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = current.split(".")
    if not package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(path: Path, known: set[str]) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names) for every import in the file, resolved to known modules."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    out: list[tuple[str, int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                mod = alias.name
                while mod and mod not in known:
                    mod = mod.rpartition(".")[0]
                if mod:
                    out.append((mod, node.lineno, []))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(me, is_package(path), node.level, node.module)
            names = [a.name for a in node.names]
            for name in names:
                # ``from . import module`` imports the submodule itself
                sub = f"{base}.{name}" if base else name
                if sub in known:
                    out.append((sub, node.lineno, []))
                    continue
                mod = base
                while mod and mod not in known:
                    mod = mod.rpartition(".")[0]
                if mod:
                    out.append((mod, node.lineno, [name]))
    return out


def layer_of(mod: str) -> tuple[int, int] | None:
    parts = mod.split(".")
    if parts[0] != "pipetrain":
        return None
    if len(parts) == 1:
        return (LAYERS["__init__"], 0)
    top = parts[1]
    if top not in LAYERS:
        return None
    inner = 0
    if top == "runtime":
        inner = RUNTIME_LAYERS.get(parts[2] if len(parts) > 2 else "__init__", RUNTIME_LAYERS["__init__"])
    return (LAYERS[top], inner)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def defined_privates(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and node.id.startswith("_") and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.arg) and node.arg.startswith("_"):
            names.add(node.arg)
    return names


def is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def private_reads(files: dict[str, Path], trees: dict[str, ast.AST], own: dict[str, set[str]],
                  imports: dict[str, list[tuple[str, int, list[str]]]]) -> list[str]:
    """Reads of an underscore name that another pipetrain module defines and this one does not."""
    everywhere: dict[str, set[str]] = defaultdict(set)
    for mod, names in own.items():
        for n in names:
            everywhere[n].add(mod)
    out = []
    for mod, tree in trees.items():
        for target, line, names in imports[mod]:
            for n in names:
                if n.startswith("_") and not is_dunder(n):
                    out.append(f"{mod}:{line} imports {target}.{n}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name = node.args[1].value
                if (name.startswith("_") and not is_dunder(name) and name not in own[mod]
                        and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
                        and everywhere.get(name, set()) - {mod}):
                    out.append(f"{mod}:{node.lineno} reads {name!r} by {node.func.id} "
                               f"(defined in {', '.join(sorted(everywhere[name] - {mod}))})")
                continue
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
                continue
            name = node.attr
            if not name.startswith("_") or is_dunder(name) or name in own[mod]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            others = everywhere.get(name, set()) - {mod}
            if others:
                out.append(f"{mod}:{node.lineno} reads .{name} (defined in {', '.join(sorted(others))})")
    return out


def long_functions(trees: dict[str, ast.AST], limit: int) -> list[tuple[str, int]]:
    out = []
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    body = body[1:]
                if not body:
                    continue
                n = (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1
                if n > limit:
                    out.append((f"{mod}.{node.name}", n))
    return sorted(out, key=lambda t: -t[1])


def source_files(roots: Iterable[str]) -> list[Path]:
    files = []
    for r in roots:
        files += sorted((ROOT / r).rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def measure(long_limit: int = LONG_FUNCTION) -> Report:
    files = {module_name(p): p for p in source_files(["pipetrain", "benchmarks"])}
    known = set(files)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in files.items()}
    imports = {m: imports_of(p, known) for m, p in files.items()}
    graph: dict[str, set[str]] = defaultdict(set)
    rep = Report()
    for mod, imps in imports.items():
        mine = layer_of(mod)
        for target, line, _ in imps:
            if target == mod:
                continue
            graph[mod].add(target)
            if mod.startswith(target + "."):  # its own ancestor package: above it by nesting, not by layer
                continue
            theirs = layer_of(target)
            if mine is None or theirs is None:
                continue
            if theirs > mine:
                msg = f"{mod}:{line} -> {target}"
                (rep.entry_upward if mod.endswith("__main__") else rep.upward).append(msg)
    rep.circles = strongly_connected(graph)
    own = {m: defined_privates(t) for m, t in trees.items()}
    pkg_trees = {m: t for m, t in trees.items() if m.startswith("pipetrain")}
    rep.private_reads = private_reads(files, pkg_trees, own, imports)
    rep.runtime_top_modules = sorted(p.name for p in (ROOT / "pipetrain" / "runtime").glob("*.py"))
    rep.long_functions = long_functions(pkg_trees, long_limit)
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--long", type=int, default=LONG_FUNCTION, help="report functions with a longer body")
    args = ap.parse_args(argv)
    rep = measure(args.long)
    if args.json:
        print(json.dumps(asdict(rep) | {"failures": rep.failures()}, indent=1))
    else:
        for title, items in (("import circles", [" <-> ".join(c) for c in rep.circles]),
                             ("imports against the layer rule", rep.upward),
                             ("upward imports from entry points", rep.entry_upward),
                             ("reads of another module's underscore names", rep.private_reads),
                             (f"functions longer than {args.long} lines",
                              [f"{n}: {k}" for n, k in rep.long_functions])):
            print(f"{title}: {len(items)}")
            for it in items:
                print(f"  {it}")
        print(f"pipetrain/runtime top-level modules: {len(rep.runtime_top_modules)}")
        for f in rep.failures():
            print(f"FAIL: {f}")
    return 1 if rep.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
