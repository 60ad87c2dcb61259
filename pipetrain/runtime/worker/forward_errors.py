"""The executor hook that names where the model's own code raised in a forward or its loss.

:class:`ForwardErrors` wraps every F action (``forward_scope``, :mod:`pipetrain.runtime.engine.hooks`).
When the action raises, it re-runs the unit's forward on the same inputs and weights node by
node (:func:`~pipetrain.runtime.process.user_code.rerun_failure`); when the re-run raises the
same way, the failure is the model's, re-raised as a
:class:`~pipetrain.runtime.process.user_code.UserCodeError` naming the step, stage, rank,
unit, node and code line. Anything else (pipetrain's own errors, a broken wait, a non-finite
value the numerics guard found, an exception that does not recur) passes unchanged.

The inputs of a stage after the first are the received wire tensors, which the forward takes
out of the executor's inbox: the scope notes the received tensors when it is entered (a list
of references, no copy), and the ones gone when it exits with an exception are the unit's.

What a forward writes to ``sys.stderr`` is held until it ends, then written out; a forward
that fails with the model's error drops it unless ``--debug`` (``torch.fx`` prints a
GraphModule's generated code and a traceback there when a line of it raises: the error is
one line). Nothing else runs on the normal path.
"""
from __future__ import annotations

import io
import sys
from types import TracebackType
from typing import Any

from ...errors import PipetrainError
from ...schedule.action import Action
from ..engine.hooks import EngineHooks, EngineView
from ..guards.numerics import NonFiniteError
from ..process.peers import PeerLost
from ..process.user_code import FailureSite, UserCodeError, rerun_failure

__all__ = ["ForwardErrors"]

#: Exceptions that are never the model's own: passed on as they are.
_NOT_THE_MODELS = (PipetrainError, NonFiniteError, PeerLost)


class ForwardErrors(EngineHooks):
    """Names the step, stage, rank, unit and node of an exception in a forward (module docstring)."""

    def __init__(self, rank: int, debug: bool = False) -> None:
        self.rank = rank
        self.debug = debug  # --debug: a failing forward's stderr output is kept

    def forward_scope(self, ex: EngineView, a: Action) -> _Scope:
        return _Scope(self, ex, a)


class _Scope:
    """One F action: on an exception from the model's code, raise it with where it happened."""

    __slots__ = ("hook", "ex", "a", "received", "stderr", "held")

    def __init__(self, hook: ForwardErrors, ex: EngineView, a: Action) -> None:
        self.hook, self.ex, self.a = hook, ex, a
        self.received = None if ex.stages[a.stage].stage.is_first else ex.received()

    def __enter__(self) -> _Scope:
        self.stderr, self.held = sys.stderr, io.StringIO()
        sys.stderr = self.held
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        sys.stderr = self.stderr
        error = None
        if exc is not None and isinstance(exc, Exception) and not isinstance(exc, _NOT_THE_MODELS):
            error = self._locate(exc)
        text = self.held.getvalue()
        if text and (error is None or self.hook.debug):
            self.stderr.write(text)
        if error is not None:
            raise error from exc

    def _inputs(self) -> list[Any] | None:
        """The unit's forward inputs: stage 0's from the data, later stages' from the wires it took."""
        ex, a = self.ex, self.a
        sm = ex.stages[a.stage].stage
        if self.received is None:
            return list(ex.data.unit(a.mb)[0])
        now = ex.received()
        taken = [t for t in self.received if not any(t is r for r in now)]
        codec = sm.in_codec
        if codec is None or len(taken) != len(codec.specs):
            return None  # the forward failed before it took its input: not in the model's code
        return list(codec.decode(taken))

    def _locate(self, exc: BaseException) -> UserCodeError | None:
        ex, a = self.ex, self.a
        try:
            inputs = self._inputs()
            if inputs is None:
                return None
            st = ex.stages[a.stage]
            sm = st.stage
            params = st.versions.get(a.version if a.version is not None else st.versions.newest)
            loss = None
            if sm.is_last:
                target = ex.data.unit(a.mb)[1]

                def loss(out: Any) -> Any:
                    return ex.loss_fn(sm.finish_output(out), target)
            where = rerun_failure(exc, sm.module, inputs, params, loss)
            if where is None:
                return None
            site = FailureSite(ex.data.step_of(a.mb), a.stage, self.hook.rank, a.mb, where[0], where[1])
        except Exception:  # noqa: BLE001 - the search is a diagnosis: the original error is reported as it is
            return None
        return UserCodeError(site, exc)
