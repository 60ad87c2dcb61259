"""Exceptions raised by the user's model or loss while training: where they happened.

An exception from inside a stage's forward or the loss (an index out of range, a shape that
does not broadcast) is the model's own error, not pipetrain's. It is reported as a
:class:`UserCodeError`, one line that names where it happened::

    step 3, stage 1 (rank 1), unit 6, node 'embedding' (model.py:42): IndexError: index out of range in self

- ``step``: the minibatch (counted from the run's start), ``unit`` the executor's unit index
  in the segment (as the numerics guard counts it);
- ``node``: the graph node whose run raised, found *after* the failure by re-running the
  failing forward node by node (:func:`failing_node`, an fx ``Interpreter``), so the normal
  path runs no interpreter; ``the loss function`` when every node ran and the loss raised;
- the code line: the node's recorded stack trace (``torch.export`` records one), else the
  innermost frame of the user's own code in the exception's traceback.

The re-run also decides what is a user error: the exception is the model's when re-running
the same forward raises an exception of the same type at a node, or in the loss. One that
does not recur (an injected failure, a crash outside the model's code) and running out of
memory are not user errors; they are reported as they are.
"""
from __future__ import annotations

import os
import re
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ...errors import ModelError

__all__ = ["UserCodeError", "FailureSite", "failing_node", "code_location", "rerun_failure", "model_failure"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODELS_DIR = os.path.join(_PACKAGE_DIR, "models")  # the built-in models are user code like any other
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"])
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')

#: What the re-run reports when every node ran and the loss raised.
LOSS = "the loss function"


@dataclass(frozen=True)
class FailureSite:
    """Where a user's exception happened: the minibatch ``step``, the ``stage`` and ``rank``,
    the ``unit``, the ``node`` (``node 'embedding'`` or :data:`LOSS`) and the code line
    (``model.py:42``), the last two when known."""

    step: int
    stage: int
    rank: int
    unit: int
    node: str | None = None
    code: str | None = None

    def line(self) -> str:
        """``step 3, stage 1 (rank 1), unit 6, node 'embedding' (model.py:42)``."""
        text = f"step {self.step}, stage {self.stage} (rank {self.rank}), unit {self.unit}"
        if self.node is not None:
            text += f", {self.node}"
        if self.code is not None:
            text += f" ({self.code})"
        return text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class UserCodeError(ModelError):
    """The model's forward or its loss raised (module docstring); ``site`` says where, the
    original exception is the ``__cause__``."""

    def __init__(self, site: FailureSite, exc: BaseException) -> None:
        super().__init__(f"{site.line()}: {_first_line(exc)}; the model's own code raised this (--debug prints "
                         f"the traceback)")
        self.site = site


class _NodeRunner(torch.fx.Interpreter):
    """Runs a GraphModule node by node and remembers the node whose run raised."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # the exception stays as the node raised it
        self.failed: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            self.failed = n
            raise


class _Interpreted(nn.Module):
    """``gm`` run by a :class:`_NodeRunner`, as a module (so that ``functional_call`` binds
    the weights under ``gm.NAME``)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.runner = _NodeRunner(gm)

    def forward(self, *inputs: Any) -> Any:
        return self.runner.run(*inputs)


def failing_node(gm: torch.fx.GraphModule, inputs: Sequence[Any], params: Mapping[str, Tensor] | None = None,
                 ) -> tuple[torch.fx.Node | None, BaseException | None, Any]:
    """Re-run ``gm`` on ``inputs`` node by node (with ``params`` bound by name, as
    ``functional_call`` does; ``None``: its own): ``(node, exception, None)`` for the node
    whose run raised, else ``(None, None, output)``."""
    wrapper = _Interpreted(gm)
    bound = {f"gm.{k}": v for k, v in (params or {}).items()}
    try:
        with torch.enable_grad():
            out = functional_call(wrapper, bound, tuple(inputs)) if bound else wrapper(*inputs)
    except Exception as e:  # noqa: BLE001 - the model's exception is what is looked for
        return wrapper.runner.failed, e, None
    return None, None, out


def _user_frame(exc: BaseException) -> str | None:
    """``file.py:LINE`` of the innermost frame of ``exc``'s traceback in the user's code (not
    torch, not the standard library, not pipetrain outside its models, not generated code)."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith((_TORCH_DIR, _STDLIB_DIR)):
            continue
        if path.startswith(_PACKAGE_DIR + os.sep) and not path.startswith(_MODELS_DIR + os.sep):
            continue
        found = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return found


def code_location(node: torch.fx.Node | None, exc: BaseException) -> str | None:
    """The code line of a failure: the node's recorded stack trace (innermost frame), else
    the innermost user frame of ``exc``'s traceback (``model.py:42``)."""
    trace = None
    if node is not None:
        trace = node.stack_trace or node.meta.get("stack_trace")
    if trace:
        frames = _FRAME.findall(str(trace))
        if frames:
            path, line = frames[-1]
            return f"{os.path.basename(path)}:{line}"
    return _user_frame(exc)


def _same_failure(original: BaseException, again: BaseException | None) -> bool:
    """Whether the re-run's exception is the original's (a user error), not memory running out."""
    if again is None or type(again) is not type(original):
        return False
    return not isinstance(original, (MemoryError, torch.OutOfMemoryError))


def rerun_failure(exc: BaseException, gm: torch.fx.GraphModule, inputs: Sequence[Any],
                  params: Mapping[str, Tensor] | None = None,
                  loss: Callable[[Any], Any] | None = None) -> tuple[str, str | None] | None:
    """Re-run the forward that raised ``exc`` (:func:`failing_node`), then ``loss(output)``
    when given: ``(what, code line)`` (``node 'NAME'`` or :data:`LOSS`) when the re-run raises
    the same way (a user error), else ``None``. A re-run that cannot be made is ``None`` too."""
    try:
        node, again, out = failing_node(gm, inputs, params)
        if node is not None:
            return (f"node {node.name!r}", code_location(node, exc)) if _same_failure(exc, again) else None
        if again is not None or loss is None:
            return None
        try:
            with torch.enable_grad():
                loss(out)
        except Exception as e:  # noqa: BLE001 - the loss's exception is what is looked for
            return (LOSS, _user_frame(exc)) if _same_failure(exc, e) else None
    except Exception:  # noqa: BLE001 - the search is a diagnosis: the original error is reported as it is
        return None
    return None


def model_failure(exc: BaseException, model: nn.Module, loss_fn: Callable[[Any, Any], Any],
                  example_inputs: Sequence[Any], batch: tuple[Sequence[Any], Any], step: int,
                  unit: int) -> UserCodeError | None:
    """One process (``--workers 1``): the :class:`UserCodeError` of ``exc``, raised by
    ``loss_fn(model(*inputs), target)`` on ``batch`` at ``step``, or ``None`` when it is not
    the model's (module docstring). The model is captured (on ``example_inputs``) to name the
    node as a pipeline run would; the code line comes from the traceback of the model's own
    forward. A model that cannot be captured is re-run as it is, and named without a node."""
    from ...graph.capture import capture

    inputs, target = batch
    device = next((x.device for x in inputs if isinstance(x, Tensor)), None)
    example = tuple(x.to(device) if isinstance(x, Tensor) and device is not None else x for x in example_inputs)
    try:
        gm = capture(model, example, validate=False).gm
    except Exception:  # noqa: BLE001 - no graph: the node stays unnamed
        gm = None
    where: tuple[str | None, str | None] | None
    if gm is not None:
        where = rerun_failure(exc, gm, inputs, loss=lambda out: loss_fn(out, target))
    else:
        where = _eager_rerun(exc, model, loss_fn, inputs, target)
    if where is None:
        return None
    return UserCodeError(FailureSite(step, 0, 0, unit, where[0], where[1] or _user_frame(exc)), exc)


def _eager_rerun(exc: BaseException, model: nn.Module, loss_fn: Callable[[Any, Any], Any], inputs: Sequence[Any],
                 target: Any) -> tuple[str | None, str | None] | None:
    """``(None, None)`` when ``loss_fn(model(*inputs), target)`` raises as ``exc`` did, else ``None``."""
    try:
        with torch.enable_grad():
            loss_fn(model(*inputs), target)
    except Exception as e:  # noqa: BLE001 - the model's exception is what is looked for
        return (None, None) if _same_failure(exc, e) else None
    return None
