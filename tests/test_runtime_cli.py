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
    (["--schedule", "pipedream", "--microbatches", "2"], r"pipedream moves whole minibatches, so --microbatches must be 1"),
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
    rc = main(["train", *TINY, "--workers", "1", "--batch-size", "8", "--steps", "3", "--json", "--lr", "0.1",
               "--save", str(ckpt)])
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
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "-m", "pipetrain", "train", *TINY, "--config", "1-1", "--schedule", "2bw",
           "--microbatches", "2", "--batch-size", "8", "--steps", "3", "--json", "--timeout", "30"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-500:] for o in outs]
    printed = [json.loads(o[0]) for o in outs if o[0].strip()]
    assert len(printed) == 1
    res = printed[0]
    assert res["workers"] == 2 and res["schedule"] == "2bw" and len(res["losses"]) == 3
