"""The shell commands of the documentation, extracted and run (CONTRIBUTING.md, "Docs that run").

A command is

1. every logical line (``\\`` continuations joined) of a fenced code block whose info
   string is ``bash``, ``sh`` or ``shell``, without blank lines, comment lines and trailing
   ``  # comments``; a line ``NAME=VALUE`` alone is an assignment, prefixed to the commands
   after it in the same block;
2. every inline code span in a Markdown table row that starts with ``pipetrain SUBCOMMAND``
   and has no placeholder: no ``...`` and no word in capitals (``PROFILE``, ``N``,
   ``PLAN.json``, ``KEY=VALUE``);
3. a fenced ``python`` block that the caller names by a line it contains, run as a REPL would
   (each expression statement's value printed).

Indented code blocks, fenced blocks of other languages and inline code in prose are not run
(synopses, output, diagrams).

A *unit* is one fenced block, or all the table cells of a document: its commands run in
order in one scratch directory of its own (what one writes, a later one of the unit reads;
a block that needs another block's files fails), laid out like the repository: links to
its ``tests``, ``benchmarks``, ``tools`` and ``pipetrain`` and an empty ``docs/img``. Two
units run at once (on 2 cores, one multi-process run leaves about a core idle). Every command
runs with the interpreter's ``bin`` first on ``PATH``, ``PIPETRAIN_DOCS_FAST=1``
(pipetrain.job.config.DOCS_FAST_ENV: at most 12 steps and 1 epoch a run, one timed run in
profiles) and ``PIPETRAIN_CACHE`` in its directory. A command repeated in a document, or a
table cell repeated in another, runs once.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAST_ENV = {"PIPETRAIN_DOCS_FAST": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SHELLS = ("bash", "sh", "shell")
#: What the scratch directory links to in the repository.
LINKED = ("tests", "benchmarks", "tools", "pipetrain", "pyproject.toml", "Makefile")

_FENCE = re.compile(r"^(\s*)```\s*([\w-]*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S+$")
_TABLE_COMMAND = re.compile(r"^pipetrain [a-z]+( |$)")
_SPAN = re.compile(r"`([^`]+)`")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$")


@dataclass(frozen=True)
class DocCommand:
    """One command of a document: where it is, its text and the assignments before it."""

    path: Path
    line: int                      # 1-based line of its first line in the document
    text: str                      # the command, continuations joined
    prelude: tuple[str, ...] = ()  # NAME=VALUE lines before it in its block
    block: int | None = None       # index of its fenced block; None: a table cell
    language: str = "bash"         # or "python" (rule 3)

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def script(self) -> str:
        return "\n".join([*self.prelude, self.text])


def _strip_comment(line: str) -> str:
    """The line without a trailing ``  # comment`` outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _block_commands(path: Path, start: int, lines: Sequence[str], block: int) -> list[DocCommand]:
    out: list[DocCommand] = []
    prelude: list[str] = []
    i = 0
    while i < len(lines):
        first = i
        text = _strip_comment(lines[i])
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + _strip_comment(lines[i]).strip()
        i += 1
        text = text.strip()
        if not text:
            continue
        if is_assignment(text):
            prelude.append(text)
            continue
        out.append(DocCommand(path, start + first + 1, text, tuple(prelude), block))
    return out


def is_assignment(line: str) -> bool:
    """``NAME=VALUE`` alone (its value may be quoted or a ``$(...)`` substitution)."""
    bare = re.sub(r"\"[^\"]*\"|'[^']*'", "", line)
    while re.search(r"\$\([^()]*\)", bare):
        bare = re.sub(r"\$\([^()]*\)", "", bare)
    return bool(_ASSIGNMENT.match(bare))


def has_placeholder(command: str) -> bool:
    """Whether ``command`` is a synopsis: ``...`` or a word in capitals (module docstring)."""
    if "..." in command:
        return True
    words = (w for tok in command.split() for w in re.split(r"[=,|\[\]]", tok.strip("()[]<>")) if w)
    return any(_PLACEHOLDER.match(w) for w in words)


def extract(path: Path, text: str | None = None, python: Sequence[str] = ()) -> list[DocCommand]:
    """Every command of the document at ``path`` (``text``: its contents, if already read);
    ``python``: lines that name the Python blocks to run (rule 3)."""
    lines = (path.read_text() if text is None else text).splitlines()
    out: list[DocCommand] = []
    i = block = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            body = lines[i + 1:end]
            if fence.group(2) in SHELLS:
                out += _block_commands(path, i + 1, body, block)
            elif fence.group(2) == "python" and any(m in line for m in python for line in body):
                out.append(DocCommand(path, i + 2, "\n".join(body), (), block, "python"))
            block += 1
            i = end + 1
            continue
        if lines[i].lstrip().startswith("|"):
            for span in _SPAN.findall(lines[i]):
                if _TABLE_COMMAND.match(span) and not has_placeholder(span):
                    out.append(DocCommand(path, i + 1, span))
        i += 1
    return out


@dataclass
class Ran:
    """A command's run: exit status, output (stdout then stderr) and seconds."""

    command: DocCommand
    returncode: int | None         # None: excluded, not run
    output: str = ""
    seconds: float = 0.0
    reason: str = ""               # why it was not run
    cpu: float = 0.0               # CPU seconds of the command and the processes it waited for


@dataclass
class DocRun:
    """Every command of one document, run or excluded, in order."""

    path: Path
    runs: list[Ran] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        return [f"{r.command.where}: `{r.command.text}` exited {r.returncode}:\n{r.output[-3000:]}"
                for r in self.runs if r.returncode not in (None, 0)]

    def output_of(self, pattern: str) -> str:
        """The output of the one command run whose text matches ``pattern`` (a regex)."""
        found = list({id(r): r for r in self.runs
                      if r.returncode is not None and re.search(pattern, r.command.text)}.values())
        assert len(found) == 1, f"{len(found)} commands of {self.path.name} match {pattern!r}"
        return found[0].output


def scratch_dir(root: Path) -> Path:
    """A directory laid out as the repository for the documented relative paths (module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = root / name
        if not link.exists():
            link.symlink_to(REPO / name)
    (root / "docs" / "img").mkdir(parents=True, exist_ok=True)
    return root


def environment(workdir: Path) -> dict[str, str]:
    """The commands' environment: this interpreter's ``bin`` first on ``PATH`` (``pipetrain``
    and ``python`` are this installation's), the fast mode, and a profile cache of
    ``workdir``'s own."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(FAST_ENV)
    env["PIPETRAIN_CACHE"] = str(workdir / ".cache")
    return env


#: Runs a Python block as a REPL would: statements in order, each expression's value printed.
REPL = """import ast, sys
env = {"__name__": "__main__"}
for node in ast.parse(sys.stdin.read()).body:
    if isinstance(node, ast.Expr):
        value = eval(compile(ast.Expression(node.value), "<doc>", "eval"), env)
        if value is not None:
            print(repr(value))
    else:
        exec(compile(ast.Module([node], []), "<doc>", "exec"), env)
"""


def run_one(cmd: DocCommand, workdir: Path, env: dict[str, str], timeout: float) -> Ran:
    """Run one command in ``workdir`` in its own process group (killed whole after ``timeout``):
    its exit status, output, seconds and CPU seconds (its own and its descendants')."""
    if cmd.language == "python":
        argv, stdin = [sys.executable, "-c", REPL], cmd.text
    else:
        argv, stdin = ["bash", "-o", "pipefail", "-c", cmd.script], ""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()))  # type: ignore[union-attr]
    reader.start()
    proc.stdin.write(stdin)  # type: ignore[union-attr]
    proc.stdin.close()  # type: ignore[union-attr]
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    code, out = proc.returncode, "".join(chunks)
    if expired.is_set():
        code, out = 124, out + f"\n(timed out after {timeout:.0f} s)"
    return Ran(cmd, code, out, time.perf_counter() - t0, cpu=usage.ru_utime + usage.ru_stime)


@dataclass(frozen=True)
class Options:
    """How documents are run (:func:`run_documents`)."""

    excluded: Sequence[tuple[str, str]] = ()  # (regex, reason): not run
    full: Sequence[str] = ()                  # regexes: run without the fast mode
    python: Sequence[str] = ()                # lines naming the Python blocks to run (rule 3)
    timeout: float = 600.0                    # seconds a command
    parallel: int = 2                         # units run at once


def units(commands: Sequence[DocCommand]) -> list[list[DocCommand]]:
    """The commands grouped into units, in order: each fenced block is one, and all the table
    cells of the document are one."""
    groups: dict[object, list[DocCommand]] = {}
    for c in commands:
        groups.setdefault(c.block if c.block is not None else "tables", []).append(c)
    return list(groups.values())


class _Runner:
    """Runs commands once each (module docstring): a repeat waits for the first run's result."""

    def __init__(self, options: Options, log: Callable[[Ran], None] | None) -> None:
        self.rules = [(re.compile(p), why) for p, why in options.excluded]
        self.whole = [re.compile(p) for p in options.full]
        self.options, self.log = options, log
        self.started: dict[tuple[object, str], Future[Ran]] = {}
        self.lock = threading.Lock()

    def one(self, cmd: DocCommand, workdir: Path) -> Ran:
        why = next((w for p, w in self.rules if p.search(cmd.text)), None)
        if why is not None:
            return Ran(cmd, None, reason=why)
        keys = [(cmd.path, cmd.script)] + ([("table", cmd.text)] if cmd.block is None else [])
        mine: Future[Ran] = Future()
        with self.lock:
            earlier = next((self.started[k] for k in keys if k in self.started), None)
            if earlier is None:
                self.started.update((k, mine) for k in keys)
        if earlier is not None:
            return earlier.result()
        env = environment(workdir)
        if any(p.search(cmd.text) for p in self.whole):
            env.pop("PIPETRAIN_DOCS_FAST")
        ran = run_one(cmd, workdir, env, self.options.timeout)
        mine.set_result(ran)
        if self.log is not None:
            self.log(ran)
        return ran

    def unit(self, commands: list[DocCommand], workdir: Path) -> list[Ran]:
        scratch_dir(workdir)
        return [self.one(c, workdir) for c in commands]


def run_documents(paths: Sequence[Path], root: Path, options: Options = Options(),
                  texts: dict[Path, str] | None = None,
                  log: Callable[[Ran], None] | None = None) -> dict[Path, DocRun]:
    """Run the commands of every document: each unit (:func:`units`) in its order, in its own
    scratch directory under ``root`` (:func:`scratch_dir`), ``options.parallel`` units at once
    (submitted in document order). A command matching an ``excluded`` regex is recorded with
    the reason, not run. A command already run in the same document, or a table cell already
    run in any, is not run again: the earlier result stands for it. ``log`` gets each result
    as it ends."""
    runner = _Runner(options, log)
    jobs = []
    with ThreadPoolExecutor(max_workers=max(1, options.parallel)) as pool:
        for path in paths:
            text = (texts or {}).get(path)
            for k, group in enumerate(units(extract(path, text, options.python))):
                jobs.append((path, pool.submit(runner.unit, group, root / f"{path.stem}_{k}")))
    done = {path: DocRun(path) for path in paths}
    for path, job in jobs:
        done[path].runs += job.result()
    for d in done.values():
        d.runs.sort(key=lambda r: r.command.line)
    return done


def run_document(path: Path, workdir: Path, excluded: Sequence[tuple[str, str]] = (),
                 text: str | None = None) -> DocRun:
    """:func:`run_documents` for one document, one unit at a time, under ``workdir``."""
    texts = {path: text} if text is not None else None
    return run_documents([path], workdir, Options(excluded=excluded, parallel=1), texts)[path]


def describe(ran: Ran) -> str:
    """One line: wall and CPU seconds, where, the command, and how it ended."""
    state = f"not run: {ran.reason}" if ran.returncode is None else f"rc {ran.returncode}"
    return f"{ran.seconds:6.1f} {ran.cpu:6.1f}  {ran.command.where}  {ran.command.text[:90]}  ({state})"


def markdown_table(text: str, after: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table after the first line matching ``after`` (a regex), as
    ``{header: cell}``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.search(after, line))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, body = rows[0], [r for r in rows[2:]]
    return [dict(zip(header, r)) for r in body]
