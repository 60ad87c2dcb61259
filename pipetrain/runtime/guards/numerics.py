"""Stop (or skip) a step at the first non-finite loss, activation, gradient or weight, naming
the step, stage, rank and graph node where it first appeared.

:class:`NumericsGuard` is one of the executor's hooks (:mod:`pipetrain.runtime.engine.hooks`),
called at four points of every stage:

1. after each forward (``after_forward``): the stage's outputs (the last stage: the unit's
   loss) must be finite. When they are not and the stage's *inputs* were finite, the value
   first appeared in this stage: the unit's forward is re-run node by node on the same input
   and weights (:func:`locate_forward`, an fx :class:`~torch.fx.Interpreter` over the stage's
   GraphModule) to name the first node whose output is non-finite (or the loss function, when
   every node is finite). A non-finite input came from an upstream stage, which found it first.
   Infinities by design are not findings: a node given an infinite constant (an attention
   mask's ``masked_fill(mask, -inf)``) and what its infinities flow into, while no NaN
   appears; a stage whose output carries them (a cut right after the mask) is then checked
   for NaN only.
2. after each backward (``after_backward``): when the received output gradients were finite,
   the forward was finite, but a gradient (an input's or a weight's) is not, the unit's
   forward and backward are re-run recording every node output's gradient
   (:func:`locate_backward`) to name the node whose backward first turned it non-finite.
3. at every STEP (``check_step``), before the update: every loss since the last check (last
   stage) and every mean gradient must be finite (names the minibatch, unit or parameter).
4. after every update (``after_update``): every weight must be finite (a huge learning rate
   can overflow finite gradients).

What happens then:

- default: :class:`NonFiniteError` is raised on the rank that found it, before the step is
  applied (point 4: right after). No checkpoint is written after it (checkpoints are written
  only at drained boundaries the run reaches), so the latest complete checkpoint in
  ``--checkpoint-dir`` is the last good one, and the message names it. The other ranks stop
  when their waits on this rank break (:mod:`pipetrain.runtime.process.peers`).
- ``--skip-nonfinite`` (synchronous schedules only): the step is dropped on every stage. At
  the rank's last STEP of a minibatch every rank all-reduces a flag (its stages' findings),
  so all ranks agree; when any is set, no stage applies the step (its gradients are
  discarded, its weights stay, its optimizer state and step count stay, and the weight
  version advances with the same tensors so that the schedule's version numbers still hold).
  Rank 0 logs one warning line with the origin's details (gathered from every rank), and the
  run's result counts the skipped steps (``RunResult.skipped_steps``). Asynchronous schedules
  step their stages at different times, so no agreement point exists: refused.

Cost when nothing is wrong: one fused norm (:func:`_all_finite`) over each forward's
outputs, each backward's returned gradients, and each step's gradients and weights; on
BERT's 74 weights (2.3 M elements) 0.4 ms where one sum per tensor took 1.0 ms. Re-running
is only done when a check fires.

Minibatch numbering: ``step`` is minibatches done before the offending minibatch, counted
from the run's start (``UnitData.step_of``).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ...errors import RuntimeConfigError
from ...schedule.action import Action, Op
from ..engine.hooks import EngineHooks, EngineView
from ..engine.stage_runtime import StageRuntime
from ..engine.unit_state import UnitState

__all__ = ["NonFiniteError", "NumericsGuard", "Finding", "first_nonfinite", "locate_forward", "locate_backward"]

log = logging.getLogger("pipetrain.numerics")


class NonFiniteError(RuntimeError):
    """A loss, activation, gradient or weight became NaN or Inf (module docstring); ``step``,
    ``stage`` and ``where`` (a node, a unit's loss or a parameter name) say where it first appeared."""

    def __init__(self, message: str, step: int, stage: int, where: str) -> None:
        super().__init__(message)
        self.step, self.stage, self.where = step, stage, where


@dataclass(frozen=True)
class Finding:
    """Where a non-finite value first appeared: ``what`` (output, gradient, loss, weight),
    the minibatch ``step``, ``stage``, ``rank`` and ``where`` (the node or parameter)."""

    what: str
    step: int
    stage: int
    rank: int
    where: str

    def line(self) -> str:
        return f"non-finite {self.what} at minibatch {self.step} on stage {self.stage} (rank {self.rank}): {self.where}"


def _finite(t: Any) -> bool:
    """Whether every element of ``t`` is finite, at the cost of one reduction.

    The sum of a tensor is non-finite iff an element is NaN or Inf, or (rarely) when finite
    elements overflow the sum; only then is the exact element-wise test run. This keeps the
    check to one read of each tensor and no allocation (``isfinite(t).all()`` writes a mask
    of the tensor's size and reads it again: checking every gradient and weight that way cost
    a third of a step on the MLP).
    """
    if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
        return True
    if t.numel() == 0:
        return True
    with torch.no_grad():
        total = t.detach().sum()
    if bool(torch.isfinite(total)):
        return True
    return bool(torch.isfinite(t).all())


def _all_finite(values: Iterable[Any]) -> bool:
    """Whether every element of every tensor in ``values`` is finite: one fused 2-norm per
    dtype and device (``torch.nn.utils.get_total_norm``, foreach kernels), which is non-finite
    iff an element is NaN or Inf or the norm overflows; only then each tensor is tested
    (:func:`_finite`). A stage's dozens of gradients and weights cost one call, not one
    reduction and a Python round trip each."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for v in values:
        if isinstance(v, Tensor) and v.is_floating_point() and v.numel():
            groups.setdefault((v.dtype, v.device), []).append(v.detach())
        elif not _finite(v):  # complex and other values, one at a time
            return False
    for ts in groups.values():
        if len(ts) == 1:
            if not _finite(ts[0]):
                return False
            continue
        with torch.no_grad():
            total = torch.nn.utils.get_total_norm(ts, foreach=True)
        if not bool(torch.isfinite(total)) and not all(_finite(t) for t in ts):
            return False
    return True


def _first_bad(t: Tensor) -> float:
    bad = t[~torch.isfinite(t)].flatten()[0]
    return float(bad.real if bad.is_complex() else bad)


def first_nonfinite(tensors: Mapping[str, Tensor | None]) -> tuple[str, float] | None:
    """The first ``(name, a bad value)`` among ``tensors`` holding a NaN or Inf, else ``None``."""
    if _all_finite(tensors.values()):
        return None
    for name, t in tensors.items():
        if t is not None and not _finite(t):
            return name, _first_bad(t)
    return None


def _describe(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """``node 'net_4' (call_module net.4: Div)`` or ``node 'truediv' (call_function truediv in
    module div)``: the node's name, op and target, and the model's module it was traced in."""
    from ...plan.cuts import node_modules

    if node.op == "call_module":
        what = f"{node.target}: {type(gm.get_submodule(str(node.target))).__name__}"
    elif node.op in ("call_function", "call_method"):
        what = getattr(node.target, "__name__", str(node.target))
        inside = [m for m in node_modules(node) if m]
        if inside:
            what += f" in module {inside[-1]}"
    else:
        what = str(node.target)
    return f"node {node.name!r} ({node.op} {what})"


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


class _Found(Exception):
    def __init__(self, node: torch.fx.Node, value: float) -> None:
        self.node, self.value = node, value


def _has_nan(values: Iterable[Any]) -> bool:
    return any(isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())
               for t in values)


def _writes_infinity(n: torch.fx.Node) -> bool:
    """Whether the node is given an infinite constant: an attention mask's
    ``masked_fill(mask, -inf)``, ``full(..., -inf)``, ``where(c, x, -inf)``."""
    return any(isinstance(a, float) and math.isinf(a) for a in pytree.tree_leaves((n.args, n.kwargs)))


class _Stepper(torch.fx.Interpreter):
    """Runs a GraphModule node by node; stops at the first node whose output is non-finite
    (``stop``), or records every node's output (``keep``).

    Infinities by design are not findings: a node given an infinite constant
    (:func:`_writes_infinity`, an attention mask) and the nodes its infinities flow into, as
    long as their outputs hold no NaN (a softmax over the mask is finite again). They are
    listed in ``by_design``."""

    def __init__(self, gm: torch.fx.GraphModule, stop: bool) -> None:
        super().__init__(gm, garbage_collect_values=stop)
        self.stop = stop
        self.outputs: dict[torch.fx.Node, Any] = {}
        self.by_design: set[torch.fx.Node] = set()

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output":
            if not self.stop:
                self.outputs[n] = out
            else:
                leaves = _leaves(out)
                if not _all_finite(leaves):
                    if not _has_nan(leaves) and (_writes_infinity(n) or any(a in self.by_design
                                                                            for a in n.all_input_nodes)):
                        self.by_design.add(n)
                        return out
                    bad = next(t for t in leaves if not _finite(t))
                    raise _Found(n, _first_bad(bad))
        return out


@torch.no_grad()
def locate_forward(gm: torch.fx.GraphModule, params: Mapping[str, Tensor], inputs: Sequence[Any]) -> str | None:
    """The first node of ``gm`` whose output is non-finite when run on ``inputs`` with
    ``params`` (bound by name, as ``functional_call`` does), described, with a bad value;
    ``None`` when every node is finite, infinities by design apart (an attention mask's,
    :class:`_Stepper`)."""
    with _reparametrize_module(gm, dict(params)):
        try:
            _Stepper(gm, stop=True).run(*inputs)
        except _Found as f:
            return f"{_describe(gm, f.node)} is the first node whose output is non-finite (value {f.value})"
    return None


def locate_backward(gm: torch.fx.GraphModule, params: Mapping[str, Tensor], inputs: Sequence[Any],
                    head: Any, grad_outputs: Sequence[Tensor] | None) -> str | None:
    """The node whose backward first produces a non-finite gradient (module docstring, 2).

    Re-runs ``gm`` on ``inputs``/``params`` keeping every node's output, then
    ``head(module output) -> tensors`` (the loss, or the stage's differentiable output
    wires) and differentiates them (with ``grad_outputs``) with respect to every node output
    and parameter. Walking the nodes backwards (the order the gradient flows), the first node
    whose own output gradient is finite but whose inputs' or parameters' gradients are not
    is the one named. ``None`` when every gradient is finite.
    """
    ps = {n: p.detach().requires_grad_(p.is_floating_point()) for n, p in params.items()}
    ins = [x.detach().requires_grad_(True) if isinstance(x, Tensor) and x.is_floating_point() else x for x in inputs]
    with torch.enable_grad(), _reparametrize_module(gm, ps):
        stepper = _Stepper(gm, stop=False)
        out = stepper.run(*ins)
        outs = [t for t in head(out) if isinstance(t, Tensor) and t.requires_grad]
        if not outs:
            return None
        nodes = [n for n, v in stepper.outputs.items() if isinstance(v, Tensor) and v.requires_grad]
        pnames = [n for n, p in ps.items() if p.requires_grad]
        grads = torch.autograd.grad(outs, [stepper.outputs[n] for n in nodes] + [ps[n] for n in pnames],
                                    grad_outputs=list(grad_outputs) if grad_outputs is not None else None,
                                    allow_unused=True)
    gnode = dict(zip(nodes, grads[:len(nodes)]))
    gparam = dict(zip(pnames, grads[len(nodes):]))

    def bad(g: Tensor | None) -> bool:
        return g is not None and not _finite(g)

    for n in reversed(list(gm.graph.nodes)):
        if n.op in ("output", "placeholder") or bad(gnode.get(n)):
            continue
        own = [f"{n.target}." if n.op == "call_module" else ""]
        mine = [p for p in pnames if n.op == "call_module" and p.startswith(own[0])]
        culprits = [f"input {a.name!r}" for a in n.all_input_nodes if bad(gnode.get(a))]
        culprits += [f"parameter {p!r}" for p in mine if bad(gparam.get(p))]
        if culprits:
            return (f"{_describe(gm, n)} is the first node whose backward produces a non-finite gradient (at its "
                    f"{culprits[0]}; its output's gradient is finite)")
    first = next((p for p in pnames if bad(gparam.get(p))), None)
    if first is not None:
        return f"parameter {first!r} has a non-finite gradient (no node's output gradient is non-finite)"
    return None


class NumericsGuard(EngineHooks):
    """Checks losses, activations, gradients and weights (module docstring).

    Args:
        rank: this worker's rank (for messages).
        checkpoint_dir: ``--checkpoint-dir`` (to name the last good checkpoint), or ``None``.
        skip: ``--skip-nonfinite``: drop the step on every rank instead of raising.
        synchronous: whether the schedule is synchronous (``skip`` needs it).
        schedule: the schedule's name (for the refusal's message).
        loss_fn: ``loss_fn(output, target)`` (to re-run the last stage's loss; default: the executor's).
        timeout: seconds for the agreement's process group (``skip`` under torch.distributed).
        tied: whether some stage of this rank sums its gradients with other stages' (tied
            parameters): its mean gradient is then not only its own units'.

    With ``skip`` under torch.distributed the constructor creates a process group: every rank
    must construct its guard at the same point.
    """

    def __init__(self, rank: int, checkpoint_dir: str | None = None, skip: bool = False, synchronous: bool = True,
                 schedule: str = "", loss_fn: Any = None, timeout: float = 300.0, tied: bool = False) -> None:
        if skip and not synchronous:
            raise RuntimeConfigError(
                f"--skip-nonfinite drops a step on every stage at once, which the asynchronous schedule {schedule!r} "
                f"cannot (its stages step at different times); use a synchronous schedule (flush, gpipe) or drop "
                f"--skip-nonfinite")
        self.rank = rank
        self.checkpoint_dir = checkpoint_dir
        self.skip = skip
        self.loss_fn = loss_fn
        self.tied = tied
        self.skipped: list[int] = []          # minibatches skipped (--skip-nonfinite), in order
        self.findings: list[Finding] = []     # origins found on this rank since the last agreement
        self._bad_units: set[tuple[int, int]] = set()  # (stage, unit) whose forward was already non-finite
        self._masks: set[int] = set()  # stages whose outputs carry infinities by design (an attention mask)
        self._inputs: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._checked: set[int] = set()
        self._passed: dict[int, int] = {}  # stage -> units of its open group whose gradients passed (2.)
        self._losses_id = 0
        self._local_bad = False
        self._group: Any = None
        if skip and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from datetime import timedelta

            self._group = dist.new_group(timeout=timedelta(seconds=timeout))

    @property
    def drops_steps(self) -> bool:
        """``--skip-nonfinite``: a non-finite value drops the step on every rank (:meth:`agree`)."""
        return self.skip

    # -- messages -------------------------------------------------------------------------
    def _last_good(self) -> str:
        if self.checkpoint_dir is None:
            return "no --checkpoint-dir was given, so no checkpoint was kept"
        from ...checkpoint import latest_checkpoint

        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return f"{self.checkpoint_dir} holds no complete checkpoint yet"
        return f"the last good checkpoint is {Path(path)}"

    def _found(self, f: Finding, applied: bool = False) -> None:
        """Record ``f``; without ``--skip-nonfinite`` raise it."""
        self._local_bad = True
        if not any(g.what == f.what and g.stage == f.stage and g.step == f.step for g in self.findings):
            self.findings.append(f)
        if self.skip and not applied:
            return
        done = "the step was applied (the weights are lost)" if applied else "the step was not applied"
        hint = "lower --lr" if applied else "lower --lr, clip with --clip-grad-norm, pass --skip-nonfinite"
        raise NonFiniteError(f"{f.line()}; {done} and {self._last_good()}; {hint}, or check the data",
                             f.step, f.stage, f.where)

    # -- 1. forward ------------------------------------------------------------------------
    def after_forward(self, executor: EngineView, a: Action, inputs: Sequence[Any], params: Mapping[str, Tensor],
                      outputs: Sequence[Tensor]) -> None:
        """After the forward of unit ``a.mb`` at stage ``a.stage`` (module docstring, 1)."""
        key = (a.stage, a.mb)
        self._inputs[key] = tuple(inputs)
        st = executor.stages[a.stage]
        if st.sink.probe is None and st.fused:
            st.sink.probe = torch.zeros((), device=executor.comm.device)
        if _all_finite(outputs):
            return
        if a.stage in self._masks and not _has_nan(outputs):
            return  # the stage's outputs carry a mask's infinities (found below)
        self._bad_units.add(key)
        if not _all_finite(_leaves(list(inputs))):
            return  # it came from upstream, which found it first
        sm = st.stage
        step = executor.data.step_of(a.mb)
        where = locate_forward(sm.module, params, inputs)
        if where is None and not sm.is_last and not _has_nan(outputs):
            # every infinity is by design: a cut after an attention mask sends it on
            self._bad_units.discard(key)
            self._masks.add(a.stage)
            return
        if where is None and sm.is_last:
            where = "the loss function gives a non-finite loss although every node's output is finite"
            what = "loss"
        else:
            what = "output"
        self._found(Finding(what, step, a.stage, self.rank, f"unit {a.mb}: {where or 'an output is non-finite'}"))

    # -- 2. backward -----------------------------------------------------------------------
    def after_backward(self, executor: EngineView, a: Action, unit: UnitState, grad_outputs: Sequence[Tensor] | None,
                       grads: Sequence[Tensor | None]) -> None:
        """After the backward of unit ``a.mb`` at stage ``a.stage`` (module docstring, 2)."""
        key = (a.stage, a.mb)
        inputs = self._inputs.pop(key, None)
        if key in self._bad_units:
            self._bad_units.discard(key)
            return
        st = executor.stages[a.stage]
        # fused Linear layers wrote their weight gradients into the sink during the backward;
        # their probe (fused.GradSink.probe) says whether any output gradient they saw was
        # non-finite, checked here per unit so that the node search below still has the
        # unit's input, without reading the weight-sized accumulators once per unit
        probe = st.sink.probe
        fused_ok = probe is None or _finite(probe) or _all_finite(  # a finite sum that overflowed: read them
            st.sink.buffers[n] for n in st.fused if n in st.sink.buffers)
        if probe is not None:
            probe.zero_()
        if _all_finite(g for g in grads if g is not None) and fused_ok:
            self._passed[a.stage] = self._passed.get(a.stage, 0) + 1
            return
        if grad_outputs is not None and not _all_finite(grad_outputs):
            return  # the gradient arrived non-finite: a downstream stage found it first
        sm = st.stage
        where = None
        if inputs is not None:
            if sm.is_last:
                target = executor.data.unit(a.mb)[1]
                loss_fn = self.loss_fn or executor.loss_fn

                def head(out: Any) -> list[Tensor]:
                    return [loss_fn(sm.finish_output(out), target)]
            else:
                codec = sm.out_codec

                assert codec is not None  # a stage before the last has one

                def head(out: Any) -> list[Tensor]:
                    wires = codec.encode(out, executor.comm.device)
                    return [wires[i] for i in codec.grad_indices]
            try:
                where = locate_backward(sm.module, unit.params, inputs, head, grad_outputs)
            except Exception as e:  # noqa: BLE001 - the search is a diagnosis: never hide the finding itself
                where = f"(the node could not be found: {type(e).__name__}: {e})"
        if where is None:
            bad = first_nonfinite(dict(zip(st.trainable, grads[-len(st.trainable):])) if st.trainable else {})
            where = (f"parameter {bad[0]!r} has gradient value {bad[1]}" if bad is not None
                     else "an input gradient is non-finite")
        self._found(Finding("gradient", executor.data.step_of(a.mb), a.stage, self.rank, f"unit {a.mb}: {where}"))

    # -- 3. step ---------------------------------------------------------------------------
    def check_step(self, executor: EngineView, st: StageRuntime, action: Action,
                   grads: Mapping[str, Tensor | None]) -> None:
        """Called at a STEP of stage ``st`` with its mean gradients, before the update."""
        data = executor.data
        if st.stage.is_last:
            losses: Mapping[int, Tensor] = executor.losses
            if id(losses) != self._losses_id:  # a new segment: a new dict
                self._losses_id, self._checked = id(losses), set()
            for unit in sorted(u for u in losses if u not in self._checked):
                self._checked.add(unit)
                value = float(losses[unit])
                if not math.isfinite(value):
                    self._found(Finding("loss", data.step_of(unit), st.index, self.rank,
                                        f"the loss of unit {unit} is {value}"))
        # Every unit of the group passed the per-unit check (2.), which covered each weight
        # gradient it added: their mean is finite (up to an overflow of the sum, which the
        # check after the update still catches), so the weight-sized read is skipped. Units
        # whose weight pass ran without that check (zero-bubble's W) leave the count short;
        # replicated stages (other ranks' gradients) and tied weights are read in full.
        passed = self._passed.pop(st.index, 0)
        if passed > 0 and passed >= st.acc_count > 0 and st.replicas == 1 and not self.tied:
            return
        bad = first_nonfinite(grads)
        if bad is not None:
            name, value = bad
            module = name.rpartition(".")[0] or name
            self._found(Finding("gradient", data.step_offset + int(action.mb), st.index, self.rank,
                                f"parameter {name!r} (node {module!r}) has gradient value {value}"))

    # -- 4. after the update ---------------------------------------------------------------
    def after_update(self, executor: EngineView, st: StageRuntime, action: Action) -> None:
        """Every weight of stage ``st`` is finite after its update (module docstring, 4)."""
        bad = first_nonfinite(dict(st.versions.latest))
        if bad is not None:
            self._found(Finding("weight", executor.data.step_offset + int(action.mb), st.index, self.rank,
                                f"parameter {bad[0]!r} has value {bad[1]} after the update"), applied=True)

    # -- --skip-nonfinite: the agreement ----------------------------------------------------
    def agree(self, executor: EngineView, action: Action) -> bool:
        """At this rank's last STEP of a minibatch: whether any rank found a non-finite value
        since the last agreement (a collective over every rank). When so, rank 0 logs one
        warning line with the origin and the step is counted as skipped."""
        local = 1.0 if self._local_bad else 0.0
        distributed = self._group is not None
        total = local
        if distributed:
            t = torch.tensor([local], dtype=torch.float64, device=executor.comm.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
            total = float(t.item())
        if total <= 0:
            return False
        findings = list(self.findings)
        if distributed:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, findings, group=self._group)
            findings = [f for g in gathered for f in (g or [])]
        step = executor.data.step_offset + int(action.mb)
        self.skipped.append(step)
        if self.rank == 0:
            origin = _origin(findings)
            log.warning("skipped step %d (--skip-nonfinite; %d skipped so far): %s", step, len(self.skipped),
                        origin.line() if origin is not None else "a non-finite value")
        self.findings, self._local_bad = [], False
        self._bad_units.clear()
        return True

    def after_action(self, executor: EngineView, a: Action) -> None:
        """A unit whose backward ended in W (zero-bubble) had no B check: forget its input."""
        if a.op is Op.W:
            self._inputs.pop((a.stage, a.mb), None)


def _origin(findings: Sequence[Finding]) -> Finding | None:
    """The finding nearest the origin: a forward one at the lowest stage, else a gradient one
    at the highest stage (gradients flow backwards), else any."""
    fwd = [f for f in findings if f.what in ("output", "loss") and "unit" in f.where and "loss of unit" not in f.where]
    if fwd:
        return min(fwd, key=lambda f: (f.step, f.stage))
    grad = [f for f in findings if f.what == "gradient" and "node" in f.where and "is the first node" in f.where]
    if grad:
        return max(grad, key=lambda f: (-f.step, f.stage))
    return findings[0] if findings else None
