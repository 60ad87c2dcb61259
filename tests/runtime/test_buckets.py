"""A replicated stage's all-reduce in buckets (stage_runtime.py, as DDP's): during the group's
last backward each bucket starts as soon as the fused layers have written all of its
parameters; ALLREDUCE starts the rest; every element is summed exactly once; a parameter also
read by an unfused layer (a tie) waits for ALLREDUCE. Equality of whole runs with and without
buckets is in test_buckets_equal_one_allreduce."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipetrain.graph import capture
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.runtime import launch_local
from pipetrain.runtime.engine.fused import exclusive_writes
from pipetrain.runtime.engine.optim import FunctionalOptimizer
from pipetrain.runtime.engine.stage_runtime import StageRuntime
from pipetrain.stages.partition import build_stage_modules, partition_graph

pytestmark = pytest.mark.timeout(180)


class Recorder:
    """A Comm's all-reduce half that records what starts when (no process group)."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, int, int]] = []  # (when, first element, elements)
        self.counted = 0
        self.when = "backward"
        self.base = 0

    def allreduce_count(self, stage: int, flat: torch.Tensor) -> None:
        self.counted += 1

    def allreduce_launch(self, stage: int, part: torch.Tensor) -> None:
        self.launches.append((self.when, (part.data_ptr() - self.base) // part.element_size(), part.numel()))


def _stage(model: nn.Module, x: torch.Tensor, bucket_bytes: int) -> StageRuntime:
    cm = capture(model, (x,))
    part = partition_graph(cm.gm, [[n.name for n in cm.graph.nodes]])
    sm = build_stage_modules(cm, part, [], [0])[0]
    return StageRuntime(sm, FunctionalOptimizer(OptimizerConfig("sgd")), 2, torch.device("cpu"), fuse_linear=True,
                        bucket_bytes=bucket_bytes)


def _unit(st: StageRuntime, x: torch.Tensor, last: bool, comm: Any) -> None:
    params = {n: p.detach().requires_grad_(True) for n, p in st.versions.latest.items()}
    out = functional_call(st.stage.module, params, (x,))
    out = out[0] if isinstance(out, (tuple, list)) else out
    if last:
        st.arm_last_backward(comm)
    grads = torch.autograd.grad(out.pow(2).mean(), [params[n] for n in st.trainable], allow_unused=True)
    st.accumulate(list(grads))


def test_buckets_start_in_the_last_backward_and_cover_the_buffer_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(6)])
    x = torch.randn(4, 64)
    st = _stage(model, x, bucket_bytes=2 * 64 * 65 * 4)  # two layers' weights and biases a bucket
    [flat] = st.flats.values()
    comm = Recorder()
    comm.base = flat.data_ptr()
    _unit(st, x, last=False, comm=comm)
    assert comm.launches == []  # not the group's last unit: nothing starts
    _unit(st, x, last=True, comm=comm)
    early = list(comm.launches)
    comm.when = "allreduce"
    st.start_allreduce(comm)  # type: ignore[arg-type]
    assert comm.counted == 1  # one collective counted for the whole buffer
    assert len(early) == 3  # six layers, two a bucket
    assert [s for _, s, _ in early] == sorted(s for _, s, _ in early)  # the last layers' buckets first
    covered = sorted((s, s + k) for _, s, k in comm.launches)
    assert covered[0][0] == 0 and covered[-1][1] == flat.numel()
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, no overlap: each element once
    ln = st.views["5.1.weight"].data_ptr()  # a LayerNorm weight: autograd's gradient, added after the backward
    assert any(w == "allreduce" and s <= (ln - flat.data_ptr()) // 4 < s + k for w, s, k in comm.launches)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def test_a_tied_weight_read_by_an_unfused_layer_is_not_bucketed() -> None:
    x = torch.randint(0, 40, (2, 5))
    st = _stage(TiedLM(), x, bucket_bytes=1)
    written = exclusive_writes(st.stage.module, st.fused)
    assert "emb.weight" in st.fused and "emb.weight" not in written  # the head reads it unfused
    assert written == {"mid.weight": (1, written["mid.weight"][1]), "mid.bias": (1, written["mid.bias"][1])}


GPT = {"vocab": 64, "d_model": 32, "layers": 4, "heads": 4, "seq_len": 16}


@pytest.mark.parametrize(("schedule", "config", "workers", "m"), [
    ("dp", "2", 2, 4), ("pipedream", "2-1", 3, 1), ("zerobubble", "2-1", 3, 4)])
def test_buckets_equal_one_allreduce(schedule: str, config: str, workers: int, m: int) -> None:
    """Tiny buckets (every parameter its own) and none give the same weights, bit for bit."""
    def cfg(bucket_mb: float) -> TrainConfig:
        return TrainConfig.of(model="gpt", model_options=GPT, schedule=schedule, workers=workers, config=config,
                              microbatches=m, batch_size=8, steps=4, seed=0, return_state=True, timeout=60,
                              quiet=True, threads=1, bucket_mb=bucket_mb,
                              optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))
    from pipetrain.run import resolve_run

    one, tiny = launch_local([resolve_run(cfg(0.0)), resolve_run(cfg(1e-6))], timeout=120)
    assert one.state.keys() == tiny.state.keys()
    for n, t in one.state.items():
        assert torch.equal(t, tiny.state[n]), n
