"""EvalAccumulator: exact sums, independent of batching, mergeable over ranks."""
from __future__ import annotations

import math
import multiprocessing as mp
import queue as queue_mod
import socket
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pipetrain.errors import ModelError, RuntimeConfigError
from pipetrain.metrics import EvalAccumulator, EvalResult, task_kind_of
from pipetrain.metrics.accumulate import PACKED_SIZE


def _accumulate(logits: torch.Tensor, target: torch.Tensor, batch: int, **kw: object) -> EvalAccumulator:
    acc = EvalAccumulator()
    for i in range(0, target.shape[0], batch):
        acc.update(logits[i:i + batch], target[i:i + batch], **kw)  # type: ignore[arg-type]
    return acc


def _classification(n: int = 37, classes: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, classes, generator=g), torch.randint(0, classes, (n,), generator=g)


def test_classification_equals_full_batch_and_ignores_batching() -> None:
    logits, target = _classification()
    want_loss = float(F.cross_entropy(logits.double(), target))
    want_acc = float((logits.argmax(-1) == target).double().mean())
    results = [_accumulate(logits, target, b) for b in (1, 4, 7, 37, 100)]
    for acc in results:
        assert acc.kind == "classification"
        assert acc.targets == 37 and acc.samples == 37
        assert acc.loss == pytest.approx(want_loss, abs=1e-12)
        assert acc.accuracy == want_acc
        assert acc.perplexity is None
    assert len({acc.correct for acc in results}) == 1
    assert results[0].batches == 37 and results[2].batches == 6


def test_language_counts_per_token_and_skips_ignored() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 6, 11, generator=g)
    target = torch.randint(0, 11, (9, 6), generator=g)
    target[0, :3] = -100
    target[5, 5] = -100
    keep = target != -100
    want_loss = float(F.cross_entropy(logits.reshape(-1, 11).double(), target.reshape(-1)))  # mean over kept
    want_acc = float(((logits.argmax(-1) == target) & keep).sum()) / int(keep.sum())
    for b in (1, 2, 9):
        acc = _accumulate(logits, target, b)
        assert acc.kind == "language"
        assert acc.targets == int(keep.sum()) == 9 * 6 - 4
        assert acc.loss == pytest.approx(want_loss, abs=1e-12)
        assert acc.accuracy == pytest.approx(want_acc, abs=1e-15)
        assert acc.perplexity == pytest.approx(math.exp(want_loss), rel=1e-12)
        r = acc.result(step=10, epoch=0.5, samples=320, wall_time=3.0)
        assert r.task == "language" and r.perplexity == pytest.approx(math.exp(want_loss), rel=1e-12)
        assert r.eval_samples == 9 and r.eval_targets == 50


def test_regression_is_mean_squared_error_over_values() -> None:
    g = torch.Generator().manual_seed(2)
    out, target = torch.randn(13, 3, generator=g), torch.randn(13, 3, generator=g)
    want = float(F.mse_loss(out.double(), target.double()))
    for b in (1, 5, 13):
        acc = _accumulate(out, target, b)
        assert acc.kind == "regression"
        assert acc.loss == pytest.approx(want, abs=1e-12)
        assert acc.accuracy is None and acc.perplexity is None
    assert _accumulate(out, target, 4).result(1, 1.0, 13, 0.0).accuracy is None


def test_a_mean_loss_fn_is_weighted_to_the_full_mean() -> None:
    logits, target = _classification(n=23)
    want = float(F.cross_entropy(logits, target))
    for b in (2, 5, 23):  # uneven last batches
        acc = _accumulate(logits, target, b, loss_fn=F.cross_entropy)
        assert acc.loss == pytest.approx(want, rel=1e-6)


def test_merge_equals_one_big_accumulation() -> None:
    logits, target = _classification(n=40, seed=3)
    whole = _accumulate(logits, target, 40)
    # two "replicas" reading disjoint shards (round-robin batches) with different batch sizes
    a, b = EvalAccumulator(), EvalAccumulator()
    a.update(logits[:8], target[:8])
    b.update(logits[8:11], target[8:11])
    a.update(logits[11:30], target[11:30])
    b.update(logits[30:], target[30:])
    merged = a.merge(b)
    assert (merged.correct, merged.targets, merged.samples, merged.batches) == (whole.correct, 40, 40, 4)
    assert merged.loss == pytest.approx(whole.loss, abs=1e-12)
    assert merged.accuracy == whole.accuracy
    # merge does not change its operands
    assert a.targets == 27 and b.targets == 13


def test_packed_sum_over_ranks_unpacks_to_the_merge() -> None:
    logits, target = _classification(n=30, seed=4)
    ranks = [EvalAccumulator(), EvalAccumulator(), EvalAccumulator()]  # the third saw nothing
    ranks[0].update(logits[:12], target[:12])
    ranks[1].update(logits[12:], target[12:])
    packed = [r.to_tensor() for r in ranks]
    assert all(p.shape == (PACKED_SIZE,) and p.dtype == torch.float64 for p in packed)
    summed = torch.stack(packed).sum(0)  # what dist.all_reduce(SUM) computes
    acc = EvalAccumulator.from_tensor(summed)
    whole = _accumulate(logits, target, 30)
    assert acc.kind == "classification"
    assert (acc.correct, acc.targets, acc.samples) == (whole.correct, whole.targets, whole.samples)
    assert acc.loss == pytest.approx(whole.loss, abs=1e-12)
    again = EvalAccumulator.from_dict(ranks[0].merge(ranks[1]).to_dict())
    assert again.to_dict() == acc.to_dict()


def test_language_kind_wins_over_classification_in_merges() -> None:
    logits, target = _classification(n=6)
    lm = EvalAccumulator(kind="language")
    lm.update(logits, target)  # one-token targets declared a language model: perplexity reported
    assert lm.kind == "language" and lm.perplexity == pytest.approx(math.exp(lm.loss))
    cls = _accumulate(logits, target, 6)
    assert cls.merge(lm).kind == lm.merge(cls).kind == "language"
    assert EvalAccumulator.from_tensor(cls.to_tensor() + lm.to_tensor()).kind == "language"


def test_mixed_tasks_are_refused() -> None:
    acc = EvalAccumulator()
    acc.update(torch.randn(4, 2), torch.randn(4, 2))
    with pytest.raises(RuntimeConfigError, match="eval batches disagree on the task: regression then classification"):
        acc.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    reg = EvalAccumulator(kind="regression")
    with pytest.raises(RuntimeConfigError, match="different tasks were merged"):
        EvalAccumulator.from_tensor(reg.to_tensor() + _accumulate(*_classification(4), 4).to_tensor())


def test_bad_shapes_and_empty_splits_are_one_line_errors() -> None:
    with pytest.raises(RuntimeConfigError, match=r"outputs of shape target.shape \+ \(classes,\), got output \(4, 3\) "
                                                 r"for target \(4, 2\)"):
        EvalAccumulator().update(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(RuntimeConfigError, match="one output value per target value"):
        EvalAccumulator().update(torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(RuntimeConfigError, match="gave no targets"):
        EvalAccumulator().result(0, 0.0, 0, 0.0)
    with pytest.raises(ModelError, match="cannot find the logits in the model's output"):
        EvalAccumulator().update({"x": 1}, torch.zeros(2, dtype=torch.long))
    with pytest.raises(RuntimeConfigError, match="unknown evaluation task 'vision'"):
        EvalAccumulator(kind="vision")  # type: ignore[arg-type]


def test_model_outputs_with_logits_attribute_and_tuples() -> None:
    logits, target = _classification(n=8)
    plain = _accumulate(logits, target, 8)
    hf = EvalAccumulator()
    hf.update(SimpleNamespace(logits=logits, loss=None), target)  # a Hugging Face ModelOutput
    tup = EvalAccumulator()
    tup.update((logits, torch.zeros(1)), target)
    mapping = EvalAccumulator()
    mapping.update({"logits": logits}, target)
    assert hf.to_dict() == plain.to_dict() == tup.to_dict() == mapping.to_dict()


@pytest.mark.parametrize("with_loss_fn", [False, True])
def test_padded_batches_count_only_their_real_rows(with_loss_fn: bool) -> None:
    logits, target = _classification(n=10, seed=6)
    loss_fn = F.cross_entropy if with_loss_fn else None
    whole = _accumulate(logits, target, 10, loss_fn=loss_fn)
    padded = EvalAccumulator()
    for i in range(0, 10, 4):  # batches of 4, the last padded with copies of its last row
        lg, tg = logits[i:i + 4], target[i:i + 4]
        real = tg.shape[0]
        pad = 4 - real
        lg = torch.cat([lg, lg[-1:].expand(pad, -1)]) if pad else lg
        tg = torch.cat([tg, tg[-1:].expand(pad)]) if pad else tg
        padded.update(lg, tg, loss_fn=loss_fn, count=real)
    assert (padded.targets, padded.samples, padded.correct) == (10, 10, whole.correct)
    assert padded.loss == pytest.approx(whole.loss, rel=1e-6)


def test_kind_from_a_data_source_task() -> None:
    assert EvalAccumulator(kind="synthetic").kind is None  # type: ignore[arg-type]
    lm = EvalAccumulator(kind="language")
    logits, target = _classification(n=5)
    lm.update(logits, target)
    assert lm.perplexity is not None


def test_task_kind_of() -> None:
    assert task_kind_of(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)) == "classification"
    assert task_kind_of(torch.zeros(2, 4, 3), torch.zeros(2, 4, dtype=torch.long)) == "language"
    assert task_kind_of(torch.zeros(2, 1), torch.zeros(2, 1)) == "regression"


def test_eval_result_json_round_trip_and_non_finite_values() -> None:
    r = EvalResult(step=5, epoch=0.25, samples=160, loss=float("inf"), accuracy=0.5, perplexity=float("inf"),
                   wall_time=1.5, task="language", eval_samples=10, eval_targets=40)
    d = r.to_dict()
    assert d["loss"] is None and d["perplexity"] is None and d["accuracy"] == 0.5
    back = EvalResult.from_dict({**d, "loss": 2.0, "kind": "eval"})
    assert back.step == 5 and back.epoch == 0.25 and back.loss == 2.0 and back.task == "language"


def _all_reduce_rank(rank: int, world: int, port: int, queue: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        logits, target = _classification(n=30, seed=5)
        acc = EvalAccumulator()
        if rank < 2:  # rank 2 holds no last stage: an empty accumulator
            shard = slice(rank * 11, 30 if rank == 1 else 11)
            acc.update(logits[shard], target[shard])
        queue.put((rank, acc.all_reduce().to_dict()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduce_over_gloo_ranks_equals_one_accumulation() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, 3, port, queue)) for r in range(3)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 240  # spawning 3 interpreters is slow on a loaded machine
    try:
        while len(got) < len(procs):
            try:
                rank, d = queue.get(timeout=1.0)
                got[rank] = d
            except queue_mod.Empty:
                crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not crashed, f"a rank failed with exit code {crashed[0]}"
                assert time.monotonic() < deadline, f"ranks {sorted(set(range(3)) - set(got))} gave no result"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    whole = _accumulate(*_classification(n=30, seed=5), 30).to_dict()
    assert len(got) == 3
    for d in got.values():
        assert {k: v for k, v in d.items() if k != "loss_sum"} == {**{k: v for k, v in whole.items()
                                                                     if k != "loss_sum"}, "batches": 2}
        assert d["loss_sum"] == pytest.approx(whole["loss_sum"], abs=1e-9)
