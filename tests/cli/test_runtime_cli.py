"""``pipetrain train``: one-line errors, --workers 1, JSON output, traces and checkpoints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipetrain.cli import main
from pipetrain.models import get_model

pytestmark = pytest.mark.timeout(120)

TINY = ["--model", "mlp", "--option", "depth=4", "--option", "width=16", "--option", "in_features=8",
        "--option", "num_classes=5"]
CLI = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "pipetrain")


@pytest.mark.parametrize("args, message", [
    (["--workers", "1", "--schedule", "flush", "--batch-size", "10", "--microbatches", "4"],
     r"batch size 10 is not divisible by microbatches 4: .*use --microbatches 2 or --batch-size 12"),
    (["--schedule", "bogus"], r"unknown schedule 'bogus'; valid schedules: 2bw, dp, flush"),
    (["--workers", "3", "--config", "2-1-1"],
     r"--workers 3 does not match --config 2-1-1, which needs 4 workers; pass --workers 4"),
    (["--workers", "2", "--config", "2-x"], r"--config must list replicas per stage joined by '-'"),
    (["--workers", "2", "--schedule", "interleaved", "--config", "1-1-1", "--virtual-stages", "2"],
     r"--workers 2 does not match --config 1-1-1, which needs 3 workers \(2 stages per rank\)"),
    (["--schedule", "flush", "--vertical-sync"], r"--vertical-sync applies to the pipedream schedule only"),
    (["--schedule", "pipedream", "--microbatches", "2"],
     r"pipedream moves whole minibatches, so --microbatches must be 1"),
    (["--clip-grad-norm", "-1"], r"--clip-grad-norm must be > 0"),
    (["--lr-schedule", "triangle"], r"unknown learning-rate schedule 'triangle'"),
    (["--steps", "0"], r"--steps must be an integer >= 1, got 0"),
    (["--workers", "1", "--resume", "/nonexistent/ckpt.pt"], r"checkpoint '/nonexistent/ckpt.pt' does not exist"),
    (["--workers", "1", "--option", "depth=-2"], r"mlp option 'depth' must be an integer >= 1, got -2"),
])
def test_bad_configuration_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    rc = main(["train", *TINY, "--batch-size", "8", *args] if "--batch-size" not in args else ["train", *TINY, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith("error: ")
    import re

    assert re.search(message, err), err


def test_one_worker_trains_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "one.pt"
    # seed 1: initial weights whose three steps at lr 0.1 descend (seed 0's first loss is low and overshoots)
    rc = main(["train", *TINY, "--workers", "1", "--batch-size", "8", "--steps", "3", "--json", "--lr", "0.1",
               "--seed", "1", "--save", str(ckpt)])
    out = capsys.readouterr().out.strip()
    assert rc == 0
    res = json.loads(out)
    for key in ("steps", "samples_per_second", "final_loss", "losses", "config", "schedule", "workers"):
        assert key in res
    assert res["workers"] == 1 and res["steps"] == 3 and len(res["losses"]) == 3
    assert res["losses"][-1] < res["losses"][0]
    b = get_model("mlp", depth=4, width=16, in_features=8, num_classes=5)
    b.model.load_state_dict(torch.load(ckpt, weights_only=True))


def _cli(args: list[str], timeout: float = 100) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "train", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_two_workers_json_trace_and_checkpoint(tmp_path: Path) -> None:
    trace, ckpt = tmp_path / "trace", tmp_path / "ck.pt"
    p = _cli([*TINY, "--workers", "2", "--config", "1-1", "--schedule", "flush", "--microbatches", "2",
              "--batch-size", "8", "--steps", "3", "--json", "--trace", str(trace), "--save", str(ckpt),
              "--log-every", "1", "--timeout", "30"])
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)  # the whole stdout is one JSON object
    assert res["schedule"] == "flush" and res["workers"] == 2 and res["config"] == "1-1"
    assert len(res["losses"]) == 3 and res["final_loss"] == res["losses"][-1] and res["samples_per_second"] > 0
    assert "step 3: loss" in p.stderr  # progress goes to stderr with --json
    merged = json.loads((trace / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in merged if e.get("ph") == "X"}
    assert {"0F0", "1F0", "1B3", "0B0", "0STEP0", "1STEP2", "0SEND_F1", "1RECV_F1"} <= names
    assert {e["pid"] for e in merged if e.get("ph") == "X"} == {0, 1}
    for r in (0, 1):
        per_rank = json.loads((trace / f"rank{r}.json").read_text())["traceEvents"]
        assert all(e["pid"] == r for e in per_rank)
    state = torch.load(ckpt, weights_only=True)
    b = get_model("mlp", depth=4, width=16, in_features=8, num_classes=5)
    b.model.load_state_dict(state)
    assert Path(str(ckpt) + ".trainer").exists()


def test_failing_rank_is_named_on_the_command_line() -> None:
    p = _cli([*TINY, "--workers", "2", "--config", "1-1", "--schedule", "pipedream", "--batch-size", "8",
              "--steps", "4", "--timeout", "30", "--debug-fail", "1:2"])
    assert p.returncode == 1
    err = p.stderr.strip().splitlines()
    assert err[-1] == "error: rank 1 failed: RuntimeError: debug failure injected on rank 1 at step 2 (--debug-fail)"
    assert "Traceback" not in p.stderr


def test_runs_as_workers_under_torchrun_on_two_nodes() -> None:
    """Two torchrun agents (two 'machines' of one process each) meet at one rendezvous; the
    same command runs as one worker in each; only global rank 0 prints the JSON."""
    from pipetrain.runtime.launch import free_port

    torchrun = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "torchrun")
    def run_once() -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]] | str:
        endpoint = f"127.0.0.1:{free_port()}"

        def cmd(is_host: int) -> list[str]:
            # Both "machines" share this host's address, so say which one hosts the rendezvous
            # store instead of letting them race to bind the port.
            return [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", endpoint, "--rdzv-conf", f"is_host={is_host}", "-m", "pipetrain", "train",
                    *TINY, "--config", "1-1", "--schedule", "2bw", "--microbatches", "2", "--batch-size", "8",
                    "--steps", "3", "--json", "--timeout", "30"]

        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(cmd(is_host), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for is_host in (1, 0)]
        try:
            return procs, [p.communicate(timeout=60) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return "\n----\n".join(p.communicate()[1][-1500:] for p in procs)

    # stdin is /dev/null: with descriptor 0 closed (as in some CI jobs) the agents' sockets took
    # it and were inherited by the workers, and the rendezvous stalled (pipetrain's own CLI now
    # reopens closed standard descriptors; torchrun's does not).
    result = run_once()
    if isinstance(result, str):
        pytest.fail("two torchrun agents did not finish in 60 s:\n" + result)
    procs, outs = result
    assert [p.returncode for p in procs] == [0, 0], [o[1][-500:] for o in outs]
    printed = [json.loads(o[0]) for o in outs if o[0].strip()]
    assert len(printed) == 1
    res = printed[0]
    assert res["workers"] == 2 and res["schedule"] == "2bw" and len(res["losses"]) == 3


# --------------------------------------------------------------------------- checks before launch
# Factories for --model test_runtime_cli:NAME (pytest puts tests/ on sys.path).

def _tiny_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def int_batch(batch_size: int = 4):  # make_batch disagrees with the example batch (int64 vs float32)
    from pipetrain.models import ModelBundle, mse_loss

    def make(n: int, g: torch.Generator):
        return (torch.randint(0, 3, (n, 4), generator=g),), torch.randn(n, 3, generator=g)

    return ModelBundle(model=_tiny_mlp(), example_inputs=(torch.randn(batch_size, 4),), loss_fn=mse_loss,
                       make_batch=make, name="int_batch")


def bad_target(batch_size: int = 4):  # the loss cannot take make_batch's target
    from pipetrain.models import ModelBundle, mse_loss

    def make(n: int, g: torch.Generator):
        return (torch.randn(n, 4, generator=g),), torch.randn(n, 7, generator=g)

    return ModelBundle(model=_tiny_mlp(), example_inputs=(torch.randn(batch_size, 4),), loss_fn=mse_loss,
                       make_batch=make, name="bad_target")


def frozen(batch_size: int = 4):  # nothing to train
    m = _tiny_mlp()
    for p in m.parameters():
        p.requires_grad_(False)
    return m, torch.randn(batch_size, 4)


SMALL = ["--model", "mlp", "--option", "depth=2", "--option", "width=8", "--option", "in_features=4",
         "--option", "num_classes=3", "--batch-size", "4", "--steps", "2"]


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a worker process would be started: these errors are found before."""
    import pipetrain.runtime.launch as launch

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("workers were launched for an error the launcher can find itself")

    monkeypatch.setattr(launch, "launch_local", refuse)
    monkeypatch.setattr("pipetrain.runtime.single.train_one_process", refuse)


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> str:
    import re

    rc = main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and re.search(message, err), err
    return err


@pytest.mark.parametrize("extra, message", [
    # more stages than layers: the most workers, and replication as the alternative
    (["--workers", "64"], r"--workers 64 needs 64 pipeline stages .* model mlp has only 5 layers; use at most "
                          r"--workers 5, or replicate stages with --config \(e\.g\. --config 60-1-1-1-1\)"),
    (["--workers", "2", "--schedule", "interleaved", "--virtual-stages", "3"],
     r"needs 6 stages but model mlp has only 5 layers; use at most --workers 1"),
    (["--config", "3", "--workers", "3"],
     r"--steps must be a multiple of every replica count of --config 3: got --steps 2; use --steps 3"),
    (["--workers", "2", "--cut", "nosuch"], r"--cut 'nosuch' names no node or module of the captured model"),
    (["--workers", "2", "--schedule", "flush", "--microbatches", "3"],
     r"batch size 4 is not divisible by microbatches 3: .*use --microbatches 2 or --batch-size 6"),
    (["--workers", "2", "--schedule", "pipedream", "--virtual-stages", "2"],
     r"--virtual-stages applies to the interleaved schedule only \(got --schedule pipedream\)"),
])
def test_pipeline_errors_are_found_before_launch(capsys: pytest.CaptureFixture[str], no_launch: None,
                                                 extra: list[str], message: str) -> None:
    _one_line_error(capsys, [*SMALL, *extra], message)


@pytest.mark.parametrize("factory, message", [
    ("int_batch", r"make_batch of model 'test_runtime_cli:int_batch' gives inputs \[2, 4\] int64 .* example batch "
                  r"is \[2, 4\] float32"),
    ("bad_target", r"model 'test_runtime_cli:bad_target' fails on a batch from its make_batch .*target \[2, 7\]"),
    ("frozen", r"model 'test_runtime_cli:frozen' has no trainable parameters"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_model_errors_are_found_before_launch(capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest,
                                              factory: str, message: str, workers: str) -> None:
    argv = ["--model", f"test_runtime_cli:{factory}", "--batch-size", "4", "--steps", "2", "--workers", workers,
            "--schedule", "flush"]
    if workers == "2":
        request.getfixturevalue("no_launch")
    else:  # one worker trains in this process: the check runs there, before training
        argv = argv + ["--microbatches", "2"]  # same unit size (2) in both parametrizations' messages
        message = message.replace(r"\[2, 4\]", r"\[4, 4\]").replace(r"\[2, 7\]", r"\[4, 7\]")
    _one_line_error(capsys, argv, message)


@pytest.mark.parametrize("extra, message", [
    (["--save", "{dir}"], r"--save .*: '.*' is a directory, but --save writes the checkpoint file"),
    (["--trace", "{file}"], r"--trace .*: '.*' is an existing file, but --trace takes a directory"),
    (["--save", "{file}/ck.pt"], r"--save .*/ck\.pt: cannot write into '.*'"),
    (["--trace", "{file}/tr"], r"--trace .*/tr: cannot write into '.*'"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_output_paths_are_rejected_before_training(capsys: pytest.CaptureFixture[str], no_launch: None,
                                                       tmp_path: Path, extra: list[str], message: str,
                                                       workers: str) -> None:
    (tmp_path / "afile.json").write_text("{}")
    extra = [x.format(dir=tmp_path, file=tmp_path / "afile.json") for x in extra]
    _one_line_error(capsys, [*SMALL, "--workers", workers, *extra], message)


def test_missing_save_directories_are_created(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "new" / "dir" / "ck.pt"
    assert main(["train", *SMALL, "--workers", "1", "--save", str(ckpt)]) == 0
    assert ckpt.exists() and Path(str(ckpt) + ".trainer").exists()


@pytest.mark.parametrize("extra, message", [
    (["--optimizer", "adam", "--eps", "-1"],
     r"Adam eps must be a finite number > 0, got -1\.0; pass e\.g\. --eps 1e-8"),
    (["--optimizer", "adam", "--betas", "2,3"], r"Adam betas must be two numbers in \[0, 1\), got \(2\.0, 3\.0\)"),
    (["--betas", "0.9"], r"--betas takes two numbers like 0\.9,0\.999, got '0\.9'"),
    (["--lr", "inf"], r"learning rate must be a finite number in \(0, 1e6\], got inf; pass e\.g\. --lr 0\.01"),
    (["--lr", "nan"], r"learning rate must be a finite number in \(0, 1e6\], got nan"),
    (["--lr", "1e300"], r"learning rate must be a finite number in \(0, 1e6\], got 1e\+300"),
    (["--lr", "0"], r"learning rate must be a finite number in \(0, 1e6\], got 0\.0"),
    (["--momentum", "1"], r"momentum must be in \[0, 1\), got 1\.0"),
    (["--momentum", "-0.5"], r"momentum must be in \[0, 1\), got -0\.5"),
    (["--weight-decay", "-1"], r"weight decay must be a finite number >= 0, got -1\.0"),
    (["--weight-decay", "inf"], r"weight decay must be a finite number >= 0, got inf"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_optimizer_values_are_one_line(capsys: pytest.CaptureFixture[str], no_launch: None, extra: list[str],
                                           message: str, workers: str) -> None:
    _one_line_error(capsys, [*SMALL, "--workers", workers, *extra], message)


def test_optimizer_config_validates_ranges() -> None:
    from pipetrain.errors import RuntimeConfigError
    from pipetrain.job.config import OptimizerConfig

    for bad in (dict(lr=float("inf")), dict(lr=-1.0), dict(momentum=1.0), dict(betas=(0.9, 1.0)),
                dict(betas=(-0.1, 0.9)), dict(eps=0.0), dict(weight_decay=float("nan"))):
        with pytest.raises(RuntimeConfigError, match="must be"):
            OptimizerConfig("adam", **bad)
    OptimizerConfig("adam", lr=1e-3, betas=(0.0, 0.99), eps=1e-12, weight_decay=0.0)  # edges that are valid


def test_failure_records_name_the_originating_rank() -> None:
    """Records travel as JSON through a store; the first root failure wins, caused ones name it."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.errors import ModelError
    from pipetrain.runtime.process.failures import FailureBoard, FailureRecord, WorkerFailure

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    board = FailureBoard(store)
    assert board.root() is None
    board.post(FailureRecord.of(2, RuntimeError("boom\nsecond line")))
    board.post(FailureRecord.of(0, ConnectionError("peer closed"), caused_by=2))  # brought down by rank 2
    board.post(FailureRecord.of(1, RuntimeError("later root")))                   # not the first root
    root = board.root()
    assert root == FailureRecord(2, "RuntimeError", False, "boom", None)
    assert board.of_rank(0) == FailureRecord(0, "ConnectionError", False, "peer closed", 2)
    e = WorkerFailure.of(root)
    assert (e.rank, e.message, e.user_error, str(e)) == (2, "RuntimeError: boom", False,
                                                         "rank 2 failed: RuntimeError: boom")
    user = WorkerFailure.of(FailureRecord.of(1, ModelError("bad option")))
    assert (user.message, user.user_error) == ("bad option", True)
    assert FailureRecord.from_json(root.to_json()) == root


def test_user_error_in_a_worker_is_reported_as_the_message_alone() -> None:
    """A PipetrainError raised inside the workers (here: the resolved run's model options
    broken after the launcher's checks) exits 2 with just its message, like the same error
    found before launch."""
    code = ("import sys, dataclasses, pipetrain.run.checks as pf\n"
            "good = pf.preflight\n"
            "def broken(cfg, world=None):\n"
            "    run = good(cfg, world)\n"
            "    opts = dict(run.config.model.options, depth=0)\n"
            "    return dataclasses.replace(run, config=run.config.replace(model_options=opts))\n"
            "pf.preflight = broken\n"
            "from pipetrain.cli import main\n"
            f"sys.exit(main(['train', *{SMALL!r}, '--workers', '2', '--timeout', '30']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert err[-1].startswith("error: mlp option 'depth' must be an integer >= 1"), p.stderr
    assert "Traceback" not in p.stderr and "rank" not in err[-1]


def test_the_resource_trackers_leak_warning_is_silenced_and_only_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that fails can leave semaphores registered; Python's resource tracker then
    warns after the CLI's error line (seen once in a full-suite run). The CLI silences that
    warning only, keeping the user's own PYTHONWARNINGS filters."""
    from pipetrain.cli import QUIET_RESOURCE_TRACKER, quiet_resource_tracker

    leak = "import multiprocessing as mp, os\ns = mp.get_context('spawn').Semaphore()\nos._exit(0)"

    def warned(env: dict[str, str]) -> bool:
        p = subprocess.run([sys.executable, "-c", leak], env=env, capture_output=True, text=True, timeout=60)
        return "leaked semaphore" in p.stderr

    base = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    assert warned(base)  # the warning this guards against exists
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    quiet_resource_tracker()
    quiet_resource_tracker()  # idempotent
    assert os.environ["PYTHONWARNINGS"] == f"error::DeprecationWarning,{QUIET_RESOURCE_TRACKER}"
    assert not warned(dict(base, PYTHONWARNINGS=os.environ["PYTHONWARNINGS"]))
