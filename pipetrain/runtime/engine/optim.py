"""Functional optimizers: torch.optim's update rules, producing new weights out of place.

Weight stashing keeps old weight versions alive by reference while a backward still needs
them (:mod:`pipetrain.runtime.engine.versions`); so an update must never write into the tensors of
the version it reads. These optimizers take the newest version's tensors and return new ones
(``new = old - update``), keeping their own state (momentum buffers, Adam moments) in place.
The arithmetic is torch.optim's single-tensor implementation, operation for operation, so
results match ``torch.optim.SGD/Adam/AdamW`` (tests check 1e-6 over several steps).

SGD (``torch.optim.SGD``), with ``g`` the mean gradient:

    g <- g + wd * w                          (weight decay)
    b <- g  (first step)  |  b <- mu * b + (1 - dampening) * g
    g <- g + mu * b  (nesterov)  |  g <- b
    w' = w - lr * g

Adam (Kingma & Ba, Algorithm 1) and AdamW (Loshchilov & Hutter, decoupled decay):

    m <- lerp(m, g, 1 - beta1);  v <- beta2 * v + (1 - beta2) * g^2
    w' = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    AdamW first scales w by (1 - lr * wd); Adam adds wd * w to g instead.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from ...job.config import OptimizerConfig

__all__ = ["FunctionalOptimizer", "clip_coefficient", "sum_of_squares"]


class FunctionalOptimizer:
    """One stage's optimizer: ``apply(params, grads, lr) -> new params``.

    Parameters whose gradient is ``None`` are left unchanged (the same tensor object goes
    into the new version), as torch.optim skips them. ``out`` may give pre-allocated tensors
    to write the new weights into (recycled memory of released versions).
    """

    def __init__(self, cfg: OptimizerConfig) -> None:
        self.cfg = cfg
        self.state: dict[str, dict[str, Any]] = {}
        self.steps = 0  # optimizer steps applied (drives the learning-rate schedule)

    # -- update ------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor | None], lr: float,
              out: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Return the next weights; ``grads`` are the mean gradients (may be modified)."""
        new: dict[str, Tensor] = {}
        for name, p in params.items():
            g = grads.get(name)
            if g is None:
                new[name] = p
                continue
            dst = out.get(name) if out is not None else None
            if self.cfg.name == "sgd":
                new[name] = self._sgd(name, p, g, lr, dst)
            else:
                new[name] = self._adam(name, p, g, lr, dst)
            new[name].requires_grad_(p.requires_grad)
        self.steps += 1
        return new

    def _sgd(self, name: str, p: Tensor, g: Tensor, lr: float, dst: Tensor | None) -> Tensor:
        c = self.cfg
        if c.weight_decay != 0:
            g = g.add(p, alpha=c.weight_decay)
        if c.momentum != 0:
            st = self.state.setdefault(name, {})
            buf = st.get("momentum_buffer")
            if buf is None:
                buf = g.detach().clone()
                st["momentum_buffer"] = buf
            else:
                buf.mul_(c.momentum).add_(g, alpha=1 - c.dampening)
            g = g.add(buf, alpha=c.momentum) if c.nesterov else buf
        if dst is not None:
            return torch.add(p, g, alpha=-lr, out=dst)
        return torch.add(p, g, alpha=-lr)

    def _adam(self, name: str, p: Tensor, g: Tensor, lr: float, dst: Tensor | None) -> Tensor:
        c = self.cfg
        beta1, beta2 = c.betas
        st = self.state.setdefault(name, {})
        if "exp_avg" not in st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] += 1
        step = st["step"]
        base = p
        if c.weight_decay != 0:
            if c.name == "adamw":
                decay = 1 - lr * c.weight_decay
                base = torch.mul(p, decay, out=dst) if dst is not None else p.mul(decay)
            else:
                g = g.add(p, alpha=c.weight_decay)
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(c.eps)
        if base is not p:  # AdamW's decayed copy is ours: finish it in place
            return base.addcdiv_(exp_avg, denom, value=-step_size)
        if dst is not None:
            return torch.addcdiv(p, exp_avg, denom, value=-step_size, out=dst)
        return torch.addcdiv(p, exp_avg, denom, value=-step_size)

    # -- state (checkpoints) -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"steps": n, "state": {param name: {...}}}`` with CPU tensor copies."""
        def cpu(v: Any) -> Any:
            return v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
        return {"steps": self.steps, "state": {n: {k: cpu(v) for k, v in st.items()} for n, st in self.state.items()}}

    def load_state_dict(self, sd: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
        """Restore from :meth:`state_dict` output (only the given parameter names)."""
        self.steps = int(sd.get("steps", 0))
        self.state = {n: {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in st.items()}
                      for n, st in sd.get("state", {}).items()}


def sum_of_squares(grads: Iterable[Tensor | None]) -> float:
    """Sum over tensors of their squared 2-norms (the stage's share of the global norm)."""
    total = 0.0
    for g in grads:
        if g is not None:
            total += float(torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)) ** 2
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (total_norm + 1e-6))``, torch.nn.utils.clip_grad_norm_'s factor."""
    if math.isnan(total_norm) or math.isinf(total_norm):
        return 1.0 if math.isnan(total_norm) else 0.0
    return min(1.0, max_norm / (total_norm + 1e-6))
