"""The documentation runs as written: every shell command of README.md and docs/*.md, in the
fast mode (docs_commands.py says which commands and how), and the figures the text states
where they are deterministic.

Every document runs once per session (the module fixture, two units at a time); a failing
command fails its document's test with the command, where it is and the end of its output.
The seconds and CPU seconds of every command are printed (``-s`` shows them).
"""
from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest
from docs_commands import REPO, DocRun, Options, describe, extract, markdown_table, run_document, run_documents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the budget: CONTRIBUTING.md, "Docs that run"

DOCUMENTS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]

#: Commands not run, with the reason (keep this list short: a command belongs here only when it
#: needs what CI lacks or takes minutes even in the fast mode).
EXCLUDED = [
    (r"^make (demo|test|install)\b", "make installs .venv first; `make test` is the suite itself, and `make demo`'s "
                                     "recipe is the README command after it (test_make_demo_is_the_readme_command)"),
    (r"^torchrun --nnodes 2", "needs two machines"),
    (r"^pipetrain (cluster|calibrate --hosts)", "needs root: network namespaces (tests/cluster/ runs them as root)"),
    (r"benchmarks/(cluster|run)\.py", "a benchmark: 5 to 35 minutes (tests/benchmarks/ checks its presets)"),
    (r"benchmarks/time_to_accuracy\.py", "needs root (the emulated cluster) and minutes (tests/benchmarks/ checks its "
                                         "tables and plots)"),
    (r"--data fashion-mnist", "needs Debian's dataset-fashion-mnist files, and evaluates 10,000 images a row"),
]
#: Commands run without the fast mode, because the figures stated for them are checked.
FULL = [r"--option width=256 --data digits --workers 3 --config 1-1-1"]  # the demo: 10 epochs, about 20 s
#: The Python blocks that run (rule 3), by a line each contains.
PYTHON = ["import pipetrain as pt", 'load_profile("tests/data/profiles/vgg16.txt")']


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DocRun]:
    """Every document's run, made once, two units at a time; each command's line is printed as
    it ends and a summary at the end (``-s`` shows them)."""
    t0 = time.perf_counter()
    done = run_documents([REPO / d for d in DOCUMENTS], tmp_path_factory.mktemp("docs"),
                         Options(excluded=EXCLUDED, full=FULL, python=PYTHON),
                         log=lambda r: print(f"\n  {describe(r)}", end="", flush=True))
    once = {id(r): r for d in done.values() for r in d.runs}  # a repeat shares its first run's result
    print(f"\ndocumentation commands: {time.perf_counter() - t0:.0f} s wall, "
          f"{sum(r.cpu for r in once.values()):.0f} s CPU (each command: wall s, CPU s)")
    for d in done.values():
        for r in d.runs:
            print(f"  {describe(r)}")
    return {str(path.relative_to(REPO)): run for path, run in done.items()}


def text(doc: str) -> str:
    return (REPO / doc).read_text()


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_command_runs(doc: str, runs: dict[str, DocRun]) -> None:
    done = runs[doc]
    assert not done.failures, "\n\n".join(done.failures)


def test_every_exclusion_and_full_run_names_a_documented_command() -> None:
    """No stale entry: each pattern of EXCLUDED, FULL and PYTHON matches a command."""
    every = [c for doc in DOCUMENTS for c in extract(REPO / doc, python=PYTHON)]
    assert len(every) >= 20
    for pattern in [p for p, _ in EXCLUDED] + FULL + [re.escape(p) for p in PYTHON]:
        assert any(re.search(pattern, c.text) for c in every), pattern


def test_make_demo_is_the_readme_command() -> None:
    recipe = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert recipe is not None
    readme = [c.text for c in extract(REPO / "README.md") if c.text.startswith("pipetrain train") and c.block == 1]
    assert readme == [recipe.group(1).replace("$(BIN)/", "")]


# -- figures the text states -----------------------------------------------------------------

def _printed_table(output: str, first: str) -> dict[str, dict[str, str]]:
    """``pipetrain compare``'s table (columns two or more spaces apart), by its first column."""
    lines = output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(first))
    names = re.split(r"\s{2,}", lines[head].strip())
    rows: dict[str, dict[str, str]] = {}
    for line in lines[head + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(names):
            break
        rows[cells[0]] = dict(zip(names, cells))
    return rows


def test_readme_demo_accuracies(runs: dict[str, DocRun]) -> None:
    stated = re.search(r"final accuracy \(([\d.]+); best ([\d.]+) at epoch (\d+)\)", text("README.md"))
    assert stated is not None
    out = runs["README.md"].output_of(FULL[0])
    got = re.search(r"accuracy ([\d.]+), loss [\d.]+ after 10 epochs \(best ([\d.]+) at epoch (\d+)\)", out)
    assert got is not None, out[-2000:]
    assert f"{float(got.group(1)):.3f}" == stated.group(1)
    assert (f"{float(got.group(2)):.3f}", got.group(3)) == (stated.group(2), stated.group(3))


def test_readme_plan_of_the_published_vgg16_profile(runs: dict[str, DocRun]) -> None:
    stated = re.search(r"`([\d-]+)` for PipeDream's published VGG-16 profile on 16 workers", text("README.md"))
    assert stated is not None and stated.group(1) == "15-1"
    out = runs["README.md"].output_of(r"^pipetrain plan tests/data/profiles/vgg16.txt --workers 16")
    assert re.search(r"^config: (\S+)$", out, re.M).group(1) == stated.group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize("command", [r"--option width=128 --data digits --workers 3",
                                     r"--model gpt --option d_model=64"], ids=["digits", "shakespeare"])
def test_readme_compare_bytes_per_sample(command: str, runs: dict[str, DocRun]) -> None:
    """Bytes per sample follow from the plan and the batch, not from the run's length or the
    machine: the fast run's equal the table's under the command."""
    table = markdown_table(text("README.md"), command)
    printed = _printed_table(runs["README.md"].output_of(command), "schedule ")
    assert [r["schedule"] for r in table] == list(printed)
    assert [r["bytes/sample"] for r in table] == [p["bytes/sample"] for p in printed.values()]


def test_readme_compare_example_output_bytes_per_sample(runs: dict[str, DocRun]) -> None:
    """The example output printed under the table's compare command: its bytes per sample."""
    command = "pipetrain compare --model mlp --data digits --workers 2 --schedules dp,pipedream,flush"
    readme = text("README.md")
    after = readme[readme.index(f"```bash\n{command}"):]
    shown = _printed_table("\n".join(line[4:] for line in after.splitlines() if line.startswith("    ")),
                           "schedule ")
    printed = _printed_table(runs["README.md"].output_of("^" + re.escape(command)), "schedule ")
    assert list(shown) == list(printed) == ["dp", "pipedream", "flush"]
    assert [r["bytes/sample"] for r in shown.values()] == [r["bytes/sample"] for r in printed.values()]


def test_readme_train_names_the_planners_choice(runs: dict[str, DocRun]) -> None:
    out = runs["README.md"].output_of(r"^pipetrain train --model mlp --data digits --workers 2 --schedule pipedream")
    line = next(x for x in out.splitlines() if x.startswith("plan: planner ("))
    config = re.match(r"plan: planner \(([\d-]+)\)", line).group(1)  # type: ignore[union-attr]
    if "-" in config:
        assert "stages are predicted" in line and "data parallelism" in line, line
    else:
        assert re.search(r"data parallelism\) is predicted [\d.]+ ms per minibatch under pipedream, the fastest "
                         r"pipeline \((1-1)\) [\d.]+ ms; pass --config \1 to train that pipeline$", line), line


def test_readme_python_example_prints_a_plan(runs: dict[str, DocRun]) -> None:
    out = runs["README.md"].output_of(r"import pipetrain as pt").splitlines()
    assert re.fullmatch(r"\d+(-\d+)* \d+\.\d+", out[0]), out[:3]
    assert out[1].startswith("rank  0 |")


def test_planner_md_example_figures(runs: dict[str, DocRun]) -> None:
    stated = re.search(r"speedup_over_data_parallel\s+# (\(.*\))", text("docs/planner.md"))
    assert stated is not None
    want = ast.literal_eval(stated.group(1))
    out = runs["docs/planner.md"].output_of(r"load_profile").splitlines()
    got = ast.literal_eval(out[0])
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:]):  # to the digits the text gives
        digits = len(str(w).split(".")[1])
        assert round(g, digits) == w
    assert out[1] == "True"


# -- the checker itself ----------------------------------------------------------------------

SAMPLE = """# Sample

```bash
# a comment line
pipetrain plan p.json --workers 4 \\
    --bandwidth 10Gbit   # trailing comment
T=$(python -c "print('x y')")/f.txt
echo "$T # not a comment"
```

| a | b |
| --- | --- |
| plan | `pipetrain plan PROFILE --workers N` and `pipetrain simulate --stages 2 --json` |
| error | `pipetrain train: error: unrecognized` |

    pipetrain train --model mlp   (indented: a synopsis, not run)

```python
print("not named, not run")
```

```text
pipetrain train --model mlp
```
"""


def test_extraction_rule(tmp_path: Path) -> None:
    cmds = extract(tmp_path / "s.md", SAMPLE)
    assert [(c.line, c.text, c.prelude) for c in cmds] == [
        (5, "pipetrain plan p.json --workers 4 --bandwidth 10Gbit", ()),
        (8, 'echo "$T # not a comment"', ("T=$(python -c \"print('x y')\")/f.txt",)),
        (13, "pipetrain simulate --stages 2 --json", ()),
    ]
    assert [c.language for c in extract(tmp_path / "s.md", SAMPLE, python=['print("not named'])][-1] == "python"


def test_a_broken_command_fails_its_document(tmp_path: Path) -> None:
    doc = tmp_path / "broken.md"
    doc.write_text("```bash\ntrue\npipetrain plan nosuch.json --workers 2\nexit 0\n```\n\n"
                   "| x |\n| --- |\n| `pipetrain simulate --stages 2 --no-such-flag` |\n")
    done = run_document(doc, tmp_path / "work")
    assert [r.returncode for r in done.runs] == [0, 2, 0, 2]
    failures = done.failures
    assert len(failures) == 2
    assert failures[0].startswith("broken.md:3: `pipetrain plan nosuch.json --workers 2` exited 2:")
    assert "does not exist" in failures[0]
    assert failures[1].startswith("broken.md:9: `pipetrain simulate --stages 2 --no-such-flag` exited 2:")
    assert "usage: pipetrain simulate" in failures[1]
    excluded = run_document(doc, tmp_path / "work", [(r"nosuch|no-such", "left out")])
    assert not excluded.failures and [r.reason for r in excluded.runs] == ["", "left out", "", "left out"]
