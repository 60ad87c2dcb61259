"""``--precision bf16``: autocast compute, float32 masters, bfloat16 wires.

A flush on 2 stages in bf16 equals bf16 on one worker (the same autocast forward; the only
difference is the rounding of the cut's activations and gradients to bf16), to 1e-2 relative
on every weight after 6 SGD steps of a small GPT; its final loss is within 2% of fp32's; the
activation and gradient bytes per sample it sends are half of fp32's (within 5%) and equal to
the prediction; the weights stay float32. Bad precisions are refused in one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipetrain.errors import RuntimeConfigError
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local, train_one_process

pytestmark = pytest.mark.timeout(180)

GPT = {"vocab": 64, "d_model": 32, "layers": 2, "heads": 4, "seq_len": 16}
TIMEOUT = 60


def cfg(workers: int, precision: str, **kw: Any) -> TrainConfig:
    pipe: dict[str, Any] = dict(config="1-1", schedule="flush", microbatches=2) if workers > 1 else {}
    base: dict[str, Any] = dict(model="gpt", model_options=GPT, workers=workers, batch_size=8, steps=6, seed=0,
                                precision=precision, return_state=True, timeout=TIMEOUT, quiet=True, threads=1,
                                optimizer=OptimizerConfig("sgd", lr=0.1))
    return TrainConfig.of(**{**base, **pipe, **kw})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12))


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    resolved = {p: resolve_run(cfg(2, p)) for p in ("fp32", "bf16")}
    out = dict(zip(resolved, launch_local(list(resolved.values()), timeout=TIMEOUT * 2)))
    out["bf16_one"] = train_one_process(resolve_run(cfg(1, "bf16")))
    return out


def test_bf16_pipeline_equals_bf16_one_worker(runs: dict[str, Any]) -> None:
    pipe, one = runs["bf16"].state, runs["bf16_one"].state
    assert set(pipe) == set(one)
    for n, t in one.items():
        assert pipe[n].dtype == t.dtype, f"{n}: {pipe[n].dtype} (masters keep their dtype), one worker {t.dtype}"
        if t.is_floating_point():
            assert t.dtype == torch.float32, n
        # every weight matrix to 1e-2 of its own largest magnitude; the biases (zero at init,
        # about 1e-4 after 6 steps, the attention key's gradient exactly zero) against the model's
        if t.dim() >= 2:
            err = rel_err(pipe[n], t)
            assert err <= 1e-2, f"{n}: relative error {err:.2e} > 1e-2"
    floats = [n for n, t in one.items() if t.is_floating_point()]
    diff = max(float((pipe[n] - one[n]).abs().max()) for n in floats)
    scale = max(float(one[n].abs().max()) for n in floats)
    assert diff <= 1e-2 * scale, (diff, scale)
    assert runs["bf16"].losses == pytest.approx(runs["bf16_one"].losses, rel=1e-3)
    # bf16 really changes the numbers: it is not the fp32 run
    fp32 = runs["fp32"].state
    assert max(rel_err(pipe[n], fp32[n]) for n in fp32) > 1e-6


def test_bf16_final_loss_within_2_percent_of_fp32(runs: dict[str, Any]) -> None:
    a, b = runs["bf16"].final_loss, runs["fp32"].final_loss
    assert abs(a - b) <= 0.02 * abs(b), (a, b)


def test_bf16_wire_bytes_half_and_predicted(runs: dict[str, Any]) -> None:
    def wire(r: Any, which: str) -> float:
        d = getattr(r, which)
        return float(d["activation"] + d["gradient"])

    bf, fp = runs["bf16"], runs["fp32"]
    assert wire(bf, "bytes_per_sample") == pytest.approx(0.5 * wire(fp, "bytes_per_sample"), rel=0.05)
    for r in (bf, fp):
        assert wire(r, "bytes_per_sample") == wire(r, "predicted_bytes_per_sample") > 0


def test_fp16_refused_in_one_line() -> None:
    with pytest.raises(RuntimeConfigError, match=r"^--precision fp16 is not built .*pass --precision bf16"):
        TrainConfig.of(precision="fp16")
    with pytest.raises(RuntimeConfigError, match=r"unknown precision 'fp8'; valid: fp32, bf16"):
        TrainConfig.of(precision="fp8")


def test_bf16_checkpoint_keeps_fp32_masters_and_resumes_equal(runs: dict[str, Any], tmp_path: Path) -> None:
    """3 bf16 steps saved (``--save``, float32 masters) and resumed for 3 more equal the 6
    steps straight: the same losses and weights (to 1e-6)."""
    from pipetrain.run import train
    from pipetrain.runtime.checkpoints.export import load_checkpoint

    path = tmp_path / "bf16.pt"
    first = train(cfg(2, "bf16", steps=3, save=str(path)))
    assert first is not None
    state, trainer = load_checkpoint(path)
    assert trainer.step == 3 and all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    resumed = train(cfg(2, "bf16", steps=3, resume=str(path)))
    straight = runs["bf16"]
    assert resumed is not None and resumed.start_step == 3
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=1e-6)
    for n, t in straight.state.items():
        assert rel_err(resumed.state[n], t) <= 1e-6, n


def test_bf16_evaluation_runs_under_autocast_on_every_path() -> None:
    """With real data, evaluations run their forwards under bf16 autocast as training does: the
    last evaluation of a 2-stage bf16 run (at its final step) is the bf16 evaluation of its
    final weights in one process (within 1% of the bf16-fp32 gap), not their fp32 evaluation;
    one worker's likewise."""
    from pipetrain.job.model import load_bundle
    from pipetrain.runtime.single import evaluate_model

    def c(workers: int) -> TrainConfig:
        pipe: dict[str, Any] = dict(config="1-1", schedule="flush", microbatches=2) if workers > 1 else {}
        return TrainConfig.of(model="mlp", model_options={"depth": 4, "width": 64}, data="digits", loader_workers=0,
                              eval_every=3, batch_size=16, steps=6, seed=0, precision="bf16", workers=workers,
                              return_state=True, timeout=TIMEOUT, quiet=True, threads=1,
                              optimizer=OptimizerConfig("sgd", lr=0.1), **pipe)

    two = resolve_run(c(2))
    results = {"two": launch_local([two], timeout=TIMEOUT * 2)[0], "one": train_one_process(resolve_run(c(1)))}
    source = two.data.load()
    for name, res in results.items():
        model = load_bundle(two.config, 8).model
        model.load_state_dict(res.state)
        got = res.eval_history[-1]
        assert got["step"] == 6
        ev = {p: evaluate_model(model, source.eval, two.data.eval_batch_size, "classification", None,
                                torch.device("cpu"), p).result(6, 0.0, 0, 0.0).loss for p in ("bf16", "fp32")}
        gap = abs(ev["bf16"] - ev["fp32"])  # bf16 and fp32 evaluations of these weights differ
        assert gap > 0 and abs(got["loss"] - ev["bf16"]) <= 0.01 * gap, (name, got["loss"], ev)
