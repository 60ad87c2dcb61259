"""Zero-bubble's split backward (runtime/engine/split_backward.py): I and W together do the work of one
backward, no more: the forward is never re-run, I computes no weight gradient and writes no
accumulator, W starts where I stopped; and the zerobubble schedule trains like one process.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.graph import capture
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import TINY_OPTIONS, get_model
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local, single_config
from pipetrain.runtime.engine.fused import GradSink, install
from pipetrain.runtime.engine.split_backward import backward_input, backward_weight
from pipetrain.stages.partition import boundary_codecs, build_stage_modules, partition_graph

pytestmark = pytest.mark.timeout(180)

# The operations that do a backward's real work (GEMMs, embedding gradients).
HEAVY = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "embedding_dense_backward"}


class OpCount(TorchDispatchMode):
    """Counts the aten operations run inside it (``forward`` ops would show up here too)."""

    def __init__(self) -> None:
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        k = func.overloadpacket.__name__
        self.n[k] = self.n.get(k, 0) + 1
        return func(*args, **(kwargs or {}))

    def heavy(self) -> int:
        return sum(v for k, v in self.n.items() if k in HEAVY)


class Knotty(nn.Module):
    """Linear chain with LayerNorm, a skip, a weight used twice (once inside the input path,
    once on a weights-only output) and a parameter added late."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln, self.b, self.c = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.pos = nn.Parameter(torch.randn(8))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.relu(self.ln(self.a(x)))
        h = self.b(h) + x
        return self.c(h) + self.pos, self.b(self.pos)


def _setup(fuse: bool) -> tuple[torch.fx.GraphModule, list[str], dict[str, Tensor], GradSink, set[str]]:
    torch.manual_seed(0)
    m = torch.fx.symbolic_trace(Knotty())
    names = [n for n, _ in m.named_parameters()]
    params = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    sink = GradSink()
    fused = set(install(m, set(names), sink)) if fuse else set()
    for n in fused:
        sink.buffers[n] = torch.zeros_like(params[n])
    return m, names, params, sink, fused


@pytest.mark.parametrize("fuse", [False, True])
def test_split_backward_equals_backward_and_does_its_work_once(fuse: bool) -> None:
    m, names, params, sink, fused = _setup(fuse)
    x = torch.randn(4, 8, requires_grad=True)
    gouts = [torch.randn(4, 8), torch.randn(8)]
    weights = [params[n] for n in names]
    out = functional_call(m, params, (x,))
    with OpCount() as whole:  # the plain backward B
        ref = torch.autograd.grad(list(out), [x, *weights], gouts, allow_unused=True)
    ref_w = {n: (sink.buffers[n].clone() if n in fused else r) for n, r in zip(names, ref[1:])}
    for n in fused:
        sink.buffers[n].zero_()
    sink.touched.clear()

    out = functional_call(m, params, (x,))
    with OpCount() as i_ops:
        gin, work = backward_input(list(out), gouts, [x], weights, sink)
    # I computed no weight gradient: no accumulator written, no .grad, GEMMs only for dx
    assert not sink.touched and all(p.grad is None for p in weights)
    assert i_ops.n.get("addmm_", 0) == 0
    with OpCount() as w_ops:
        gw = backward_weight(work, sink)
    torch.testing.assert_close(gin[0], ref[0], rtol=1e-6, atol=1e-6)
    for n, g in zip(names, gw):
        got = sink.buffers[n] if n in fused else g
        assert got is not None, n
        torch.testing.assert_close(got, ref_w[n], rtol=1e-6, atol=1e-6, msg=n)
    # Together exactly the GEMMs of one backward; neither pass ran an operation the plain
    # backward does not (a forward recomputation would: relu, native_layer_norm, ...).
    assert i_ops.heavy() + w_ops.heavy() == whole.heavy(), (i_ops.n, w_ops.n, whole.n)
    assert i_ops.heavy() >= 3 and w_ops.heavy() >= 3  # the work really is split
    assert not (set(i_ops.n) | set(w_ops.n)) - set(whole.n), (i_ops.n, w_ops.n, whole.n)
    with pytest.raises(RuntimeError, match="twice"):
        backward_weight(work, sink)


def test_first_stage_has_no_input_pass() -> None:
    m, names, params, sink, _ = _setup(True)
    x = torch.randn(4, 8)  # a first stage's input needs no gradient
    weights = [params[n] for n in names]
    out = functional_call(m, params, (x,))
    gouts = [torch.randn(4, 8), torch.randn(8)]
    with OpCount() as i_ops:
        gin, work = backward_input(list(out), gouts, [], weights, sink)
    assert gin == [] and i_ops.heavy() == 0 and not sink.touched
    gw = backward_weight(work, sink)
    assert gw[names.index("ln.weight")] is not None and sink.touched == {n for n in names if n[0] in "abc"}


def _gpt_second_stage() -> tuple[Any, list[Tensor], dict[str, Tensor], Any]:
    """Stage 1 of a 2-stage cut of the tiny GPT, with received inputs that require grad."""
    torch.manual_seed(0)
    b = get_model("gpt", batch_size=2, **TINY_OPTIONS["gpt"])
    cap = capture(b.model, b.example_inputs)
    values = ("placeholder", "call_module", "call_function", "call_method")
    names = [n.name for n in cap.gm.graph.nodes if n.op in values]
    cut = len(names) // 2
    part = partition_graph(cap.gm, [names[:cut], names[cut:]])
    codecs = boundary_codecs(cap.gm, part, b.example_inputs)
    st = build_stage_modules(cap, part, codecs, [0, 1])
    with torch.no_grad():
        wires = codecs[0].encode(st[0].module(*b.example_inputs), torch.device("cpu"))
    leaves = [w.detach().clone().requires_grad_(i in codecs[0].grad_indices) for i, w in enumerate(wires)]
    mod = st[1]
    params = {n: p.detach().clone().requires_grad_() for n, p in mod.module.named_parameters()}
    _, target = b.make_batch(2, torch.Generator().manual_seed(1))

    def loss_of() -> Tensor:
        out = functional_call(mod.module, params, tuple(codecs[0].decode(leaves)))
        return b.loss_fn(mod.finish_output(out), target)

    return loss_of, [leaves[i] for i in codecs[0].grad_indices], params, mod


def test_gpt_stage_split_equals_backward() -> None:
    loss_of, leaves, params, _ = _gpt_second_stage()
    weights = list(params.values())
    assert leaves, "the cut must carry a value that needs a gradient"
    loss = loss_of()
    with OpCount() as whole:
        ref = torch.autograd.grad(loss, leaves + weights, allow_unused=True)
    loss = loss_of()
    with OpCount() as i_ops:
        gin, work = backward_input([loss], None, leaves, weights)
    with OpCount() as w_ops:
        gw = backward_weight(work)
    for a, b in zip(gin + gw, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert i_ops.heavy() + w_ops.heavy() == whole.heavy(), (i_ops.n, w_ops.n, whole.n)
    assert i_ops.heavy() > 0 and w_ops.heavy() > 0


# --------------------------------------------------------------------------- training
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)


def _cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="mlp", model_options=dict(TINY_OPTIONS["mlp"], depth=6), batch_size=8,
                                steps=3, optimizer=SGD, return_state=True, timeout=30, quiet=True,
                                schedule="zerobubble", workers=2, config="1-1", microbatches=4)
    base.update(kw)
    return TrainConfig.of(**base)


def test_zerobubble_trains_like_one_process() -> None:
    cfgs = {
        "mlp_unfused": _cfg(fused_grads=False),
        "gpt": _cfg(model="gpt", model_options=TINY_OPTIONS["gpt"], batch_size=4, microbatches=2, steps=2),
    }
    runs = {k: resolve_run(c) for k, c in cfgs.items()}
    results = launch_local(list(runs.values()), timeout=60)  # one launch for both
    for (k, run), res in zip(runs.items(), results):
        ref = single_config(run)
        for n, t in ref.state.items():
            err = float((res.state[n].float() - t.float()).abs().max() / (t.float().abs().max() + 1e-6))
            assert err <= 1e-5, (k, n, err)
        assert res.losses == pytest.approx(ref.losses, rel=1e-5), k


def test_the_sink_layers_weight_passes_share_one_autograd_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """W runs the groups of fused layers (their backward skips the input gradient in W) in one
    autograd call and every other group in its own: fewer calls, the same gradients."""
    import pipetrain.runtime.engine.split_backward as sb

    m, names, params, sink, fused = _setup(True)
    x = torch.randn(4, 8, requires_grad=True)
    gouts = [torch.randn(4, 8), torch.randn(8)]
    weights = [params[n] for n in names]
    _, work = backward_input(list(functional_call(m, params, (x,))), gouts, [x], weights, sink)
    aware = [all(sb.phase_aware(n) for n in g.frontier) for g in work.groups]
    assert sum(aware) >= 2 and not all(aware)  # fused linears, and the LayerNorm's own group
    calls: list[int] = []
    real = torch.autograd.grad

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sb.torch.autograd, "grad", counted)
    backward_weight(work, sink)
    assert len(calls) == 1 + aware.count(False)
