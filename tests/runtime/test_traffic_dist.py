"""Communication accounting, measured: gloo on 127.0.0.1 against the prediction, byte for byte.

Two runs of a small MLP, cut by the runtime's own resolver: a 2-worker straight pipeline
(flush, ``1-1``) and 3-worker plans with a replicated stage (``2-1``: flush with global
gradient clipping, and pipedream). The prediction is :func:`predict_traffic` of every
segment's schedule with the exact cut sizes of the runtime's codecs (:func:`cut_bytes`) and
the stages' all-reduce buffers (:func:`reduce_buffers`).

- ``test_comm_counts_every_kind_as_predicted``: real ``Comm`` objects on a real gloo group
  execute every action list the way the executor does (receives posted ahead, sends of the
  codecs' wire tensors, all-reduces of the flat gradient buffers with their count element,
  the clipping norm once per step index); every rank's per-kind counts equal the prediction.
- ``test_training_run_sends_the_predicted_bytes``: the real runtime (``launch_local``) trains
  the same runs; every rank's ``bytes_sent`` (all kinds) equals the prediction, and the
  planner's prediction from a profile (:func:`plan_traffic`) equals the codecs' for this MLP.
- ``test_training_run_reports_traffic_by_kind``: the runtime's result reports ``traffic`` per
  rank (timed segments only), and its per-kind counts equal the prediction exactly, as do
  ``bytes_per_sample`` and ``predicted_bytes_per_sample``; the merged trace carries the same.
- ``test_tied_all_reduces_are_predicted``: a language model whose head reads the embedding's
  weight, cut across two stages, with a warm-up: the tied gradient's all-reduce at every STEP
  is in the prediction (``predict_traffic(..., tied=...)``), and the warm-up is not counted.
- ``test_pipedream_refuses_a_tie_across_stages_before_launch``: ``pipetrain train`` exits 2
  with the one-line rule, from the resolver, before any worker starts.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import launch

from pipetrain.errors import RuntimeConfigError
from pipetrain.graph import capture
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.job.model import load_bundle
from pipetrain.models import TINY_OPTIONS
from pipetrain.plan.traffic import plan_traffic, predict_traffic
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local
from pipetrain.runtime.engine.comm import Comm, cut_bytes, reduce_buffers
from pipetrain.schedule.action import Op, Schedule
from pipetrain.schedule.traffic import KINDS, CutBytes, TiedBuffer, Traffic, bytes_per_sample, ring_allreduce_bytes
from pipetrain.stages.partition import boundary_codecs, partition_graph
from pipetrain.stages.tied import stage_parameters, tied_buffers

pytestmark = pytest.mark.timeout(240)

MLP = dict(TINY_OPTIONS["mlp"], depth=4)


def _cfg(schedule: str, workers: int, config: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {"model": "mlp", "model_options": MLP, "batch_size": 8, "steps": 4, "timeout": 60,
                            "quiet": True, "optimizer": OptimizerConfig("sgd", lr=0.1)}
    base.update(kw)
    return TrainConfig.of(schedule=schedule, workers=workers, config=config, **base)


CONFIGS: dict[str, TrainConfig] = {
    "flush 1-1": _cfg("flush", 2, "1-1", microbatches=2),
    "flush 2-1 clip": _cfg("flush", 3, "2-1", microbatches=4, clip_grad_norm=1.0),
    "pipedream 2-1": _cfg("pipedream", 3, "2-1"),
}
#: the tied language model of tests/runtime/test_tied.py (head reads the embedding's weight), cut
#: between the stages so both hold a copy; a warm-up step that the report must leave out
TIED_CUT = "tanh"   # stage 1 starts at tanh: stage 0 tokens, emb, l1; stage 1 tanh, l2, tanh_1, head


def _tied_cfg(schedule: str = "flush", **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="test_tied:tied_lm", batch_size=8, microbatches=2, steps=3, warmup_steps=1,
                                timeout=60, quiet=True, optimizer=OptimizerConfig("sgd", lr=0.1))
    base.update(kw)
    return TrainConfig.of(schedule=schedule, workers=2, cut=TIED_CUT, **base)


class _Job:
    """What a run's traffic depends on: schedules, codecs, all-reduce buffers, clipping."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.run = resolve_run(cfg)
        bundle = load_bundle(cfg, self.run.unit_batch)
        self.captured = capture(bundle.model, bundle.example_inputs)
        part = partition_graph(self.captured.gm, self.run.stage_nodes)
        self.codecs = boundary_codecs(self.captured.gm, part, bundle.example_inputs)
        params = dict(bundle.model.named_parameters())
        S = self.run.plan.num_stages  # type: ignore[union-attr]
        # a tie across stages is held (and replica-reduced) by every stage that reads it
        trainable = stage_parameters(params, part.param_stage, part.tied, S)
        if not part.tied:  # without ties: exactly the owner's parameters
            assert [[id(p) for p in ps] for ps in trainable] == [
                [id(p) for n, p in params.items() if part.param_stage.get(n) == k and p.requires_grad]
                for k in range(S)]
        self.buffers = [reduce_buffers(ps) for ps in trainable]
        self.ties = tied_buffers(params, part.tied)
        self.numels = [[(p.dtype, p.numel()) for p in ps] for ps in trainable]
        self.clip = cfg.synchronous and cfg.training.clip_grad_norm is not None
        self.schedules = self.run.schedules
        self.world = self.run.world_size

    def predicted(self, timed_only: bool = False) -> dict[int, Traffic]:
        """Every segment's prediction summed (``timed_only``: the timed segments')."""
        scheds = [s.schedule for s in self.run.timed_segments] if timed_only else self.schedules
        out = {r: Traffic() for r in range(self.world)}
        for s in scheds:
            for r, t in predict_traffic(s, cut_bytes(self.codecs), self.buffers, global_clip=self.clip,
                                        tied=self.ties).items():
                out[r] = out[r] + t
        return out

    def payload(self) -> dict[str, Any]:
        return {"schedules": self.schedules, "codecs": self.codecs, "numels": self.numels, "clip": self.clip}


@pytest.fixture(scope="module")
def jobs() -> dict[str, _Job]:
    return {name: _Job(c) for name, c in CONFIGS.items()}


# --------------------------------------------------------------------------- ties, literally


def test_ties_add_one_allreduce_per_step_of_each_holder() -> None:
    """A tie over stages 0 and 2 of a [2, 1, 1] flush: its group is stage 0's two replicas
    and stage 2's rank (3 ranks); each holder rank sums it once per STEP, stage 1's rank never."""
    from pipetrain.errors import PlanError
    from pipetrain.schedule.registry import build_schedule

    s = build_schedule("flush", [2, 1, 1], 2, steps=3)
    cuts = [CutBytes(0, 0), CutBytes(0, 0)]
    got = predict_traffic(s, cuts, [0, 0, 0], tied=[TiedBuffer(300, (0, 2)), TiedBuffer(99, (1,))])
    ring = ring_allreduce_bytes(300, 3)   # floor(2 * 2 * 300 / 3) = 400
    assert ring == 400
    holders = set(s.stage_ranks[0]) | set(s.stage_ranks[2])
    assert {r: (t.sent["allreduce"], t.messages_sent["allreduce"], t.reduced["allreduce"]) for r, t in got.items()} \
        == {r: ((3 * ring, 3, 900) if r in holders else (0, 0, 0)) for r in range(s.num_workers)}
    assert all(t.sent["control"] == 0 for t in got.values())   # no count element rides with a tie
    with pytest.raises(PlanError, match=r"a tied buffer needs bytes >= 0 and stages in 0\.\.2"):
        predict_traffic(s, cuts, [0, 0, 0], tied=[TiedBuffer(8, (0, 3))])


# --------------------------------------------------------------------------- the Comm harness


def _execute(comm: Comm, actions: list[Any], numels: list[list[tuple[torch.dtype, int]]], clip: bool) -> None:
    """One rank's actions through ``comm``, as the executor issues them (data is irrelevant)."""
    last_step = {a.mb: i for i, a in enumerate(actions) if a.op is Op.STEP}
    pending: dict[int, list[Any]] = {}
    post = 0
    for i, a in enumerate(actions):
        while post < min(len(actions), i + 9):  # receives posted 8 actions ahead
            if actions[post].op in (Op.RECV_F, Op.RECV_B):
                comm.post(actions[post])
            post += 1
        if a.op in (Op.SEND_F, Op.SEND_B):
            comm.send(a, [torch.zeros(s.shape, dtype=s.dtype) for s in comm.specs(a)])
        elif a.op in (Op.RECV_F, Op.RECV_B):
            comm.release(comm.wait(a), a)
        elif a.op is Op.ALLREDUCE:
            by_dtype: dict[torch.dtype, int] = {}
            for dt, n in numels[a.stage]:
                by_dtype[dt] = by_dtype.get(dt, 0) + n
            for dt, n in by_dtype.items():
                flat = torch.zeros(n + 1, dtype=dt)
                flat[-1] = 1.0
                work = comm.allreduce_start(a.stage, flat)
                if work is not None:
                    pending.setdefault(a.stage, []).append(work)
        elif a.op is Op.STEP:
            for w in pending.pop(a.stage, []):
                w.wait()
            if clip and last_step[a.mb] == i:
                comm.sum_over_ranks(1.0)


def _comm_worker(rank: int, world: int, out: Path, payloads: list[dict[str, Any]]) -> None:
    """Every job in turn on one gloo group, each through a fresh ``Comm`` (its own subgroups)."""
    for j, payload in enumerate(payloads):
        scheds: list[Schedule] = payload["schedules"]
        comm = Comm(rank, scheds[0], payload["codecs"], torch.device("cpu"), 60.0, global_clip=payload["clip"])
        for s in scheds:
            _execute(comm, s.workers[rank], payload["numels"], payload["clip"])
            comm.finish(60.0)
        (out / f"traffic_{j}_{rank}.json").write_text(json.dumps(comm.traffic.to_json()))


def _launch(jobs: list[_Job], out: Path) -> list[dict[int, Traffic]]:
    """Run the harness for ``jobs`` (one world size) on gloo ranks; fail (never hang) on error."""
    out.mkdir()
    world = jobs[0].world
    launch(_comm_worker, world, out, [j.payload() for j in jobs], preload=["pipetrain.runtime.engine.comm"])
    return [{r: Traffic.from_json(json.loads((out / f"traffic_{j}_{r}.json").read_text())) for r in range(world)}
            for j in range(len(jobs))]


def test_comm_counts_every_kind_as_predicted(jobs: dict[str, _Job], tmp_path: Path) -> None:
    measured_all: dict[str, dict[int, Traffic]] = {}
    for world in (2, 3):
        names = [n for n, j in jobs.items() if j.world == world]
        measured_all.update(zip(names, _launch([jobs[n] for n in names], tmp_path / f"world{world}")))
    for name, job in jobs.items():
        measured = measured_all[name]
        predicted = job.predicted()
        for r in range(job.world):
            assert measured[r] == predicted[r], (name, r, measured[r], predicted[r])
        kinds = {k for t in measured.values() for k in KINDS if t.sent[k] > 0}
        want = {"activation", "gradient"} | ({"allreduce", "control"} if job.world == 3 else set())
        assert kinds == want, (name, kinds)


# --------------------------------------------------------------------------- the real runtime


@pytest.fixture(scope="module")
def tied_job() -> _Job:
    return _Job(_tied_cfg())


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traffic_trace")


TRACED = "flush 2-1 clip"   # the configuration run with --trace


@pytest.fixture(scope="module")
def results(jobs: dict[str, _Job], tied_job: _Job, trace_dir: Path) -> dict[str, Any]:
    """Every configuration trained by the runtime (one launch per world size; the tied model
    with the 2-worker runs, under the name ``"tied"``)."""
    out: dict[str, Any] = {}
    for world in (2, 3):
        names = [n for n, j in jobs.items() if j.world == world]
        runs = [jobs[n].run for n in names]
        runs = [dataclasses.replace(r, config=r.config.replace(trace=str(trace_dir))) if n == TRACED else r
                for n, r in zip(names, runs)]
        if world == 2:
            names, runs = names + ["tied"], runs + [tied_job.run]
        for n, res in zip(names, launch_local(runs, timeout=60)):
            out[n] = res
    return out


def test_training_run_sends_the_predicted_bytes(jobs: dict[str, _Job], results: dict[str, Any]) -> None:
    from pipetrain.profile.profiler import profile_captured

    for name, job in jobs.items():
        predicted = job.predicted()
        assert results[name].bytes_sent == [predicted[r].total_sent for r in range(job.world)], name
        # the planner's prediction from a profile equals the codecs' for this MLP (float32
        # activations proportional to the batch, every parameter trainable)
        run = job.run
        # profiled on the unit batch the graph was captured with (activation sizes are the capture's)
        prof = profile_captured(job.captured, load_bundle(CONFIGS[name], run.unit_batch).example_inputs,
                                warmup=0, repeats=1)
        planned = {r: Traffic() for r in range(job.world)}
        for s in job.schedules:
            for r, t in plan_traffic(run.plan, prof, s, unit_samples=run.unit_batch,  # type: ignore[arg-type]
                                     global_clip=job.clip).items():
                planned[r] = planned[r] + t
        assert planned == predicted, name
        samples = run.batch_size * run.total_steps
        per = bytes_per_sample(predicted, samples)
        assert per["total"] * samples == sum(results[name].bytes_sent)


def test_training_run_reports_traffic_by_kind(jobs: dict[str, _Job], results: dict[str, Any],
                                             trace_dir: Path) -> None:
    for name, job in jobs.items():
        predicted = job.predicted()   # no warm-up: the timed steps are all the steps
        res = results[name]
        measured = [Traffic.from_json(t) for t in res.traffic]
        for r in range(job.world):  # per rank, per kind (activations and gradients included), exactly
            assert measured[r] == predicted[r], (name, r, measured[r], predicted[r])
        assert sum(t.sent["activation"] for t in measured) > 0 and sum(t.sent["gradient"] for t in measured) > 0
        assert [Traffic.from_json(t) for t in res.predicted_traffic] == measured, name
        assert res.bytes_sent == [t.total_sent for t in measured], name   # bytes_sent is the timed traffic
        samples = job.run.batch_size * job.run.total_steps
        assert res.bytes_per_sample == res.predicted_bytes_per_sample == bytes_per_sample(predicted, samples), name
        assert res.eval_traffic == []   # no evaluation ran
        out = res.to_json()   # what --json prints
        assert out["traffic"] == res.traffic and out["predicted_bytes_per_sample"] == res.bytes_per_sample
        json.dumps(out)
    # the merged trace carries the same report; each rank's trace its own traffic
    res = results[TRACED]
    other = json.loads((trace_dir / "trace.json").read_text())["otherData"]
    assert other["traffic"] == res.traffic and other["bytes_per_sample"] == res.bytes_per_sample
    assert other["predicted_bytes_per_sample"] == res.predicted_bytes_per_sample
    for r in range(jobs[TRACED].world):
        mine = json.loads((trace_dir / f"rank{r}.json").read_text())["otherData"]["traffic"]
        assert mine == res.traffic[r]


def test_tied_all_reduces_are_predicted(tied_job: _Job, results: dict[str, Any]) -> None:
    from test_tied import VOCAB, WIDTH

    res = results["tied"]
    run = tied_job.run
    assert [s.kind for s in run.segments] == ["warmup", "timed"] and run.plan.num_stages == 2  # type: ignore[union-attr]
    emb = VOCAB * WIDTH * 4
    assert tied_job.ties == [TiedBuffer(emb, (0, 1))]
    # both stages hold (and would replica-reduce) the tied weight: stage 1's buffer has the head
    assert [b[0].gradient_bytes for b in tied_job.buffers] == [emb + (WIDTH * WIDTH + WIDTH) * 4,
                                                              emb + (WIDTH * WIDTH + WIDTH) * 4]
    measured = [Traffic.from_json(t) for t in res.traffic]
    timed = tied_job.predicted(timed_only=True)
    assert measured == [timed[r] for r in range(2)]
    # the tie's all-reduce, once per timed step on each rank (the warm-up's is not counted)
    steps = run.config.training.steps
    assert [t.sent["allreduce"] for t in measured] == [steps * ring_allreduce_bytes(emb, 2)] * 2
    assert [t.messages_sent["allreduce"] for t in measured] == [steps, steps]
    assert res.bytes_sent == [t.total_sent for t in measured]
    assert res.bytes_per_sample == res.predicted_bytes_per_sample
    # without the ties the prediction would miss exactly those bytes
    bare = predict_traffic(run.schedule, cut_bytes(tied_job.codecs), tied_job.buffers)
    assert [measured[r].sent["allreduce"] - bare[r].sent["allreduce"] for r in range(2)] == \
        [steps * ring_allreduce_bytes(emb, 2)] * 2


def test_pipedream_refuses_a_tie_across_stages_before_launch() -> None:
    rule = (r"parameter 'emb.weight' \(also 'head.weight'\) is tied across stages 0 and 1, which the asynchronous "
            r"schedule 'pipedream' cannot keep equal")
    with pytest.raises(RuntimeConfigError, match=rule):   # the resolver refuses it: no worker is started
        resolve_run(_tied_cfg("pipedream", microbatches=None, warmup_steps=0))
    resolve_run(_tied_cfg("gpipe", warmup_steps=0))      # synchronous schedules keep the copies equal
    cli = Path(sys.executable).with_name("pipetrain")
    args = [str(cli), "train", "--model", "test_tied:tied_lm", "--workers", "2", "--cut", TIED_CUT,
            "--schedule", "pipedream", "--batch-size", "8", "--steps", "2", "--timeout", "30"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # PYTHONPATH: every test folder (conftest.py)
    p = subprocess.run(args, capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert err == [err[-1]] and err[-1].startswith(
        "error: parameter 'emb.weight' (also 'head.weight') is tied across stages 0 and 1, which the asynchronous "
        "schedule 'pipedream' cannot keep equal"), p.stderr
    assert "Traceback" not in p.stderr and "rank" not in p.stderr
