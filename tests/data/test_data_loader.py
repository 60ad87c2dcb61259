"""Sampling for pipelines: epochs reshuffle, units partition minibatches, replicas read disjoint
shards, loaders give each rank only its part and do not depend on num_workers; background
workers only where they pay off, kept across segments; the seconds a loader blocks; eval batches."""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from pipetrain.data import (
    ArrayDataset,
    EpochSampler,
    EvalBatches,
    UnitLoader,
    UnitWorkers,
    WaitMeter,
    correct_count,
    kept_workers,
    loss_sum,
)
from pipetrain.data.loader import SLOW_ITEM_S, WORKER_START_S, gather, item_seconds, suggested_workers
from pipetrain.errors import DataError

torch.set_num_threads(1)
N, B = 103, 12     # 103 samples, minibatches of 12: 8 per epoch, 7 samples dropped


def dataset(n: int = N) -> ArrayDataset:
    """Sample i has input row [i, -i] (float) and target i (int64), so indices are visible."""
    i = torch.arange(n)
    return ArrayDataset((torch.stack([i, -i], 1).float(),), i.clone())


def test_epochs_cover_once_drop_the_tail_and_reshuffle() -> None:
    s = EpochSampler(N, B, seed=5)
    assert s.steps_per_epoch == N // B == 8
    orders = []
    for epoch in range(3):
        batches = [s.minibatch(epoch * 8 + k) for k in range(8)]
        assert all(b.shape == (B,) for b in batches)
        seen = torch.cat(batches)
        assert len(set(seen.tolist())) == 8 * B                        # no sample twice in an epoch
        assert torch.equal(s.order(epoch)[:8 * B], seen)
        orders.append(s.order(epoch))
        assert sorted(s.order(epoch).tolist()) == list(range(N))      # a permutation
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
    assert s.epoch_of(7) == 0 and s.epoch_of(8) == 1


def test_sampler_is_a_function_of_seed_and_epoch() -> None:
    a, b, c = EpochSampler(N, B, seed=1), EpochSampler(N, B, seed=1), EpochSampler(N, B, seed=2)
    # b visits epochs in another order: the same minibatches still come out.
    for t in (17, 3, 9, 0):
        b.minibatch(t)
    assert all(torch.equal(a.minibatch(t), b.minibatch(t)) for t in range(30))
    assert not torch.equal(a.minibatch(0), c.minibatch(0))
    plain = EpochSampler(N, B, shuffle=False)
    assert plain.minibatch(9).tolist() == list(range(12, 24))


@pytest.mark.parametrize("m", [1, 2, 4])
def test_units_partition_each_minibatch(m: int) -> None:
    s = EpochSampler(N, B, seed=0)
    for t in range(10):
        chunks = [s.indices_of_unit(t * m + j, m) for j in range(m)]
        assert all(c.numel() == B // m for c in chunks)
        assert torch.equal(torch.cat(chunks), s.minibatch(t))      # chunk j of minibatch u // m, in order
    assert torch.equal(s.indices_of_unit(5, m, step_offset=3), s.indices_of_unit(5 + 3 * m, m))


@pytest.mark.parametrize("m,r", [(4, 2), (3, 3), (1, 2), (2, 3)])
def test_replicas_read_disjoint_shards_that_cover_each_minibatch(m: int, r: int) -> None:
    """Unit u runs on replica u mod r; over the run, each minibatch is split among replicas
    with no sample read twice and none missed (pipedream m=1: whole minibatches alternate)."""
    ds, s = dataset(), EpochSampler(N, B, seed=7)
    steps = 2 * s.steps_per_epoch
    total = steps * m
    read: dict[int, list[int]] = {}
    for i in range(r):
        units = range(i, total, r)
        loader = UnitLoader(ds, s, m, units, part="targets")
        for u in units:
            inputs, target = loader.unit(u)
            assert inputs == () and target is not None
            read.setdefault(loader.step_of(u), []).extend(target.tolist())
    for t in range(steps):
        assert sorted(read[t]) == sorted(s.minibatch(t).tolist())      # disjoint and covering
    if r > 1 and m % r == 0:
        shard0 = set(UnitLoader(ds, s, m, range(0, m, r)).unit(0)[1].tolist())
        shard1 = set(UnitLoader(ds, s, m, range(1, m, r)).unit(1)[1].tolist())
        assert not shard0 & shard1


def test_parts_hold_only_what_the_stage_needs() -> None:
    ds, s = dataset(), EpochSampler(N, B, seed=0)
    first = UnitLoader(ds, s, 2, range(6), part="inputs").unit(3)
    last = UnitLoader(ds, s, 2, range(6), part="targets").unit(3)
    both = UnitLoader(ds, s, 2, range(6), part="both").unit(3)
    assert first[1] is None and len(first[0]) == 1 and last[0] == () and last[1] is not None
    assert torch.equal(first[0][0], both[0][0]) and torch.equal(last[1], both[1])
    assert torch.equal(both[0][0][:, 0].long(), both[1])                # inputs and targets of the same samples
    with pytest.raises(DataError, match=r"part must be one of inputs, targets, both, got 'input'"):
        UnitLoader(ds, s, 2, range(6), part="input")  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"batch size 12 is not divisible by microbatches 5"):
        UnitLoader(ds, s, 5, range(6))


def test_results_do_not_depend_on_workers_order_or_cache() -> None:
    ds, s = dataset(), EpochSampler(N, B, seed=3)
    units = list(range(1, 40, 2))
    ref = {u: gather(ds, s.indices_of_unit(u, 4), "both") for u in units}
    with UnitLoader(ds, s, 4, units, num_workers=2) as bg:
        got = {u: bg.unit(u) for u in units}
    # Out of order, repeated, evicted (cache=2) and unlisted units are still right.
    odd = UnitLoader(ds, s, 4, units, cache=2)
    order = [7, 1, 1, 39, 3, 7, 0, 2]
    got_odd = {u: odd.unit(u) for u in order}
    for u in units:
        assert torch.equal(got[u][0][0], ref[u][0][0]) and torch.equal(got[u][1], ref[u][1])
    for u in order:
        want = gather(ds, s.indices_of_unit(u, 4), "both")
        assert torch.equal(got_odd[u][0][0], want[0][0]) and torch.equal(got_odd[u][1], want[1])


def test_generic_datasets_stack_items_like_array_datasets() -> None:
    ds, s = dataset(), EpochSampler(N, B, seed=0)
    plain = TensorDataset(ds.inputs[0], ds.target)                      # no take(): items are stacked
    a = UnitLoader(ds, s, 3, range(9)).unit(8)
    b = UnitLoader(plain, s, 3, range(9)).unit(8)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1], b[1])


class Slow(Dataset):  # type: ignore[type-arg]
    """``n`` samples, each taking ``delay`` seconds to load (a file read, a decode)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay, self.calls = n, delay, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        time.sleep(self.delay)
        return torch.tensor([float(i), -float(i)]), torch.tensor(i)


class Pids(Dataset):  # type: ignore[type-arg]
    """Sample i is ([i, pid of the process that loaded it], i): who gathered a unit is visible."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i), float(os.getpid())]), torch.tensor(i)


@dataclass
class Owner:
    """What keeps background workers (a run's DataSource, here a stand-in that equals by value)."""

    name: str


def in_memory() -> tuple[TensorDataset, TensorDataset]:
    """A user factory (--data test_data_loader:in_memory): 48 + 16 samples of 5 features, 3 classes."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.arange(64) % 3
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])


def slow_items() -> tuple[Slow, Slow]:
    """A user factory whose items take 5 ms each."""
    return Slow(48, 0.005), Slow(16, 0.005)


def test_suggested_workers() -> None:
    """In-memory data loads in the calling process; background workers only for slow items in
    a run that reads enough of them to repay starting the workers."""
    assert suggested_workers(dataset()) == 0                                  # take(): one indexing op
    assert suggested_workers(TensorDataset(torch.zeros(300, 3), torch.zeros(300))) == 0
    slow = Slow(300, 3 * SLOW_ITEM_S)
    assert suggested_workers(slow) == 2
    assert suggested_workers(slow, samples=int(2 * WORKER_START_S / slow.delay)) == 2
    assert suggested_workers(slow, samples=100) == 0                         # 0.3 s of loading: not worth it
    assert item_seconds(slow) >= slow.delay
    very = Slow(300, 0.2)
    item_seconds(very, probe=8, budget_s=0.5)
    assert very.calls == 3                                                    # stops past the budget


def test_the_run_decides_the_workers_once() -> None:
    """The resolved run carries the decision: 0 for an in-memory TensorDataset by default, the
    user's --loader-workers when given, 2 for slow items over a long run."""
    from pipetrain.job import TrainConfig
    from pipetrain.run import resolve_run

    def workers(data: str, **kw: object) -> int:
        cfg = TrainConfig.of(model="mlp", model_options={"depth": 2, "width": 8}, data=data, batch_size=8,
                             workers=1, quiet=True, **kw)
        run = resolve_run(cfg)
        assert run.data is not None
        return run.data.loader_workers

    assert workers("test_data_loader:in_memory", steps=4) == 0
    assert workers("test_data_loader:in_memory", steps=4, loader_workers=2) == 2
    assert workers("test_data_loader:slow_items", steps=4) == 0               # 32 items: 0.16 s here
    assert workers("test_data_loader:slow_items", steps=1000) == 2           # 8000 items: 40 s here


def test_kept_workers_serve_every_segment() -> None:
    """--loader-workers 2: the same two processes gather the units of every segment (persistent
    workers, started once), results equal the in-process ones, and the workers stop when their
    owner goes."""
    ds, s = Pids(), EpochSampler(N, B, seed=4)
    owner = Owner("run")                                                      # unhashable: held by identity
    pool = kept_workers(owner, ds, s, 2, "both", 2)
    assert pool is not None and kept_workers(owner, ds, s, 2, "both", 2) is pool
    assert kept_workers(owner, ds, s, 2, "both", 0) is None
    pids: list[set[int]] = []
    for offset in (0, 8, 16):                                                 # three segments (epochs) of 8 steps
        loader = UnitLoader(ds, s, 2, range(16), step_offset=offset, workers=pool)
        assert loader.num_workers == 2
        assert loader.prefetch(8) == 8
        got = [loader.unit(u) for u in range(16)]
        for u, (inputs, target) in enumerate(got):
            idx = s.indices_of_unit(u, 2, offset)
            assert torch.equal(target, idx) and torch.equal(inputs[0][:, 0].long(), idx)
        pids.append({int(p) for _, (inputs, _) in enumerate(got) for p in inputs[0][:, 1].tolist()})
        loader.close()                                                        # leaves the kept workers running
    assert len(pids[0]) == 2 and pids[1] == pids[2] == pids[0] and os.getpid() not in pids[0]
    other = kept_workers(owner, ds, s, 2, "targets", 2)                       # another part: new workers
    assert other is not None and other is not pool
    with pytest.raises(DataError, match=r"the background workers given serve another dataset"):
        UnitLoader(ds, s, 2, range(4), part="both", workers=other)
    del pool, other, loader, owner
    gc.collect()
    for pid in pids[0]:
        with pytest.raises(ProcessLookupError):                               # stopped and reaped
            os.kill(pid, 0)


def test_a_superseded_stream_loads_its_units_itself() -> None:
    ds, s = dataset(), EpochSampler(N, B, seed=2)
    pool = UnitWorkers(ds, s, 1, "targets", 1)
    try:
        old = UnitLoader(ds, s, 1, range(6), part="targets", workers=pool)
        assert torch.equal(old.unit(0)[1], ds.target[s.minibatch(0)])
        new = UnitLoader(ds, s, 1, range(6), part="targets", step_offset=6, workers=pool)
        assert torch.equal(new.unit(0)[1], ds.target[s.minibatch(6)])      # the stream is new's now
        assert all(torch.equal(old.unit(u)[1], ds.target[s.minibatch(u)]) for u in range(1, 6))
    finally:
        pool.close()
    with pytest.raises(DataError, match=r"these background workers were closed"):
        pool.stream(range(2), 0)
    with pytest.raises(DataError, match=r"UnitWorkers needs num_workers >= 1, got 0"):
        UnitWorkers(ds, s, 1, "targets", 0)


def test_loaders_count_the_seconds_they_block() -> None:
    """Every unit not yet cached and every prefetch add the time they took to the meter; a
    cached unit adds nothing."""
    ds, s = Slow(N, 0.002), EpochSampler(N, B, seed=0)
    meter = WaitMeter()
    loader = UnitLoader(ds, s, 3, range(9), meter=meter)                      # 4 samples per unit
    loader.unit(0)
    loader.unit(1)
    assert meter.seconds == loader.waited >= 2 * 4 * 0.002
    before = meter.seconds
    loader.unit(1)                                                            # cached
    assert meter.seconds == before
    t0 = time.perf_counter()
    loader.prefetch(3)
    spent = time.perf_counter() - t0
    assert 7 * 4 * 0.002 <= meter.seconds - before <= spent and meter.seconds == loader.waited


def test_prefetch_and_step_of() -> None:
    ds, s = dataset(), EpochSampler(N, B, seed=0)
    loader = UnitLoader(ds, s, 2, range(0, 20), step_offset=5)
    assert loader.step_of(3) == 6 and loader.epoch_of(0) == 0 and loader.epoch_of(6) == 1
    assert loader.prefetch(4) == 4
    assert torch.equal(loader.unit(0)[1], ds.target[s.minibatch(5)[:6]])


def test_small_splits_are_rejected() -> None:
    with pytest.raises(DataError, match=r"the train split has 5 samples, fewer than one minibatch of 8"):
        EpochSampler(5, 8)


@pytest.mark.parametrize("pad", [False, True])
def test_eval_batches_count_every_sample_once(pad: bool) -> None:
    ds = dataset(10)
    ev = EvalBatches(ds, 4, pad=pad)
    batches = list(ev)
    assert len(ev) == 3 and [b.count for b in batches] == [4, 4, 2]
    assert [b.rows for b in batches] == ([4, 4, 4] if pad else [4, 4, 2])
    real = torch.cat([b.target[:b.count] for b in batches])
    assert real.tolist() == list(range(10))                             # fixed order, each once
    if pad:
        assert batches[-1].target.tolist() == [8, 9, 9, 9]              # padding repeats the last sample
    # Accuracy over the batches equals accuracy over the whole split.
    logits_of = lambda x: torch.nn.functional.one_hot((x[:, 0].long() * 3) % 4, 10).float()  # noqa: E731
    correct = sum(correct_count(logits_of(b.inputs[0]), b.target, b.count) for b in batches)
    sums = [loss_sum(logits_of(b.inputs[0]), b.target, b.count) for b in batches]
    assert sum(n for _, n in sums) == 10
    assert correct == correct_count(logits_of(ds.inputs[0]), ds.target)
    assert sum(t for t, _ in sums) == pytest.approx(loss_sum(logits_of(ds.inputs[0]), ds.target)[0], rel=1e-12)


def test_eval_batch_split_and_parts() -> None:
    ev = EvalBatches(dataset(10), 4, pad=True)
    micro = ev.batch(2).split(2)
    assert [(b.rows, b.count) for b in micro] == [(2, 2), (2, 0)]
    first, last = ev.batch(1, "inputs"), ev.batch(1, "targets")
    assert first.target is None and last.inputs == () and first.count == last.count == 4
    with pytest.raises(DataError, match=r"eval batch of 4 rows is not divisible into 3 microbatches"):
        ev.batch(0).split(3)
    with pytest.raises(DataError, match=r"the eval split is empty"):
        EvalBatches(dataset(0), 4)


def test_units_accumulate_to_the_minibatch_gradient_and_digits_train() -> None:
    """Each unit's loss is a mean over its samples; the mean of the m unit gradients equals the
    minibatch's gradient (what every synchronous schedule computes), and plain SGD over the
    loader's units learns digits to over 90% eval accuracy in a few epochs."""
    pytest.importorskip("sklearn")
    from pipetrain.data import check_fits, load_data, loss_for_bundle, model_options_for
    from pipetrain.models import get_model

    src = load_data("digits", seed=0)
    torch.manual_seed(0)
    bundle = get_model("mlp", batch_size=32, depth=2, width=64, **model_options_for("mlp", src))
    check_fits(bundle, src)
    model, loss_fn, m = bundle.model, loss_for_bundle(bundle, src), 4
    sampler = EpochSampler(src.num_train, 32, seed=0)
    epochs = 6
    loader = UnitLoader(src.train, sampler, m, range(epochs * sampler.steps_per_epoch * m))
    # Gradient identity on minibatch 0.
    model.zero_grad()
    for u in range(m):
        inputs, target = loader.unit(u)
        (loss_fn(model(*inputs), target) / m).backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x, y = gather(src.train, sampler.minibatch(0))
    loss_fn(model(*x), y).backward()
    for a, p in zip(accumulated, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)
    # Training.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(epochs * sampler.steps_per_epoch):
        opt.zero_grad()
        for u in range(t * m, (t + 1) * m):
            inputs, target = loader.unit(u)
            (loss_fn(model(*inputs), target) / m).backward()
        opt.step()
    correct = 0
    with torch.no_grad():
        for b in EvalBatches(src.eval, 64, pad=True):
            correct += correct_count(model(*b.inputs), b.target, b.count)
    assert correct / src.num_eval > 0.9
