"""Shared pieces of the benchmark harness: models, the two-stage split, timing, processes.

Everything here is imported both by the orchestrator (``benchmarks/run.py``) and by the
measured worker processes (``python benchmarks/run.py _worker SPEC``). It imports torch
lazily; the orchestrator builds each model once before the first round (for its size and
split in the report) and otherwise only waits on its workers.

Models. The benchmark models are sequences of layers so that every pipeline configuration
(the PyTorch baselines and the ``ceiling``) cuts them in the same place:

- ``mlp``: 16 x (Linear(1024, 1024) + ReLU), batch 64, cross-entropy over 1024 classes;
- ``lm``: a GPT-style decoder (d 256, 4 heads, 8 pre-LN blocks, context 128, vocabulary
  8192, untied LM head), batch 16 sequences of 128 tokens, next-token cross-entropy.

``pipetrain.models.get_model`` is used instead of the local definition when it exists: an
``nn.Sequential`` as it is, pipetrain's ``GPT`` re-expressed as the sequence
(embedding, block 0..7, final LayerNorm + head) over the *same* modules, so that the
baselines train exactly the model pipetrain trains. ``BenchModel.source`` says which.
"""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULT_TAG = "BENCH_RESULT "  # a worker's last stdout line: RESULT_TAG + one JSON object

# Built-in pipetrain model name of each benchmark model, and its batch size (the issue's).
MODEL_NAMES = {"mlp": "mlp", "lm": "gpt"}
BATCH_SIZES = {"mlp": 64, "lm": 16}

# Sizes of the local definitions (kept equal to the description).
MLP_DEPTH, MLP_WIDTH = 16, 1024
# The LM mirrors pipetrain.models.gpt's defaults (vocab 8192, 4 heads, untied head).
LM_LAYERS, LM_D, LM_HEADS, LM_SEQ, LM_VOCAB = 8, 256, 4, 128, 8192


# --------------------------------------------------------------------------- models
@dataclass
class BenchModel:
    """One benchmark model, built identically (same seed) in every process.

    Attributes:
        name: benchmark name (``mlp`` or ``lm``).
        batch_size: samples per minibatch (the full batch of the pipeline configurations).
        layers: the model as an ``nn.Sequential`` whose children are cut for the stages.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over the batch.
        make_batch: ``make_batch(batch_size, generator) -> (inputs tuple, target)``.
        source: ``"pipetrain.models"`` or ``"local"`` (benchmarks/common.py).
        pipetrain_spec: what to pass as ``pipetrain train --model`` to train the same model.
    """

    name: str
    batch_size: int
    layers: Any
    loss_fn: Callable[[Any, Any], Any]
    make_batch: Callable[[int, Any], tuple[tuple[Any, ...], Any]]
    source: str
    pipetrain_spec: str
    child_names: list[str] | None = None  # qualified module name of each child in pipetrain's model

    def cut_names(self, cuts: Sequence[int]) -> list[str] | None:
        """pipetrain's ``--cut`` names for child-index cuts: the module each stage begins with."""
        if self.child_names is None:
            return None
        return [self.child_names[c] for c in cuts]

    def num_parameters(self) -> int:
        """Number of trainable scalars of the whole model."""
        return sum(p.numel() for p in self.layers.parameters())


def mlp_loss(output: Any, target: Any) -> Any:
    """Cross-entropy of ``(B, classes)`` logits against ``(B,)`` class ids (batch mean)."""
    from torch.nn import functional as F

    return F.cross_entropy(output, target)


def lm_loss(logits: Any, target: Any) -> Any:
    """Next-token cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` ids (token mean)."""
    from torch.nn import functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class MlpBatches:
    """``randn(B, 1024)`` inputs and uniform class ids (module level: picklable)."""

    def __call__(self, batch_size: int, gen: Any) -> tuple[tuple[Any, ...], Any]:
        import torch

        x = torch.randn(batch_size, MLP_WIDTH, generator=gen)
        y = torch.randint(0, MLP_WIDTH, (batch_size,), generator=gen)
        return (x,), y


@dataclass(frozen=True)
class LmBatches:
    """``LM_SEQ + 1`` uniform tokens per sample: inputs ``[:-1]``, targets ``[1:]``."""

    def __call__(self, batch_size: int, gen: Any) -> tuple[tuple[Any, ...], Any]:
        import torch

        seq = torch.randint(0, LM_VOCAB, (batch_size, LM_SEQ + 1), generator=gen)
        return (seq[:, :-1].contiguous(),), seq[:, 1:].contiguous()


def _local_mlp() -> tuple[Any, Callable, Callable]:
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(MLP_DEPTH):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers), mlp_loss, MlpBatches()


def _lm_modules() -> dict[str, type]:
    """The local GPT pieces, as pipetrain.models.gpt computes them (classes built lazily)."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        """Token + learned position embedding: (B, T) int64 -> (B, T, d)."""

        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(LM_VOCAB, LM_D)
            self.wpe = nn.Embedding(LM_SEQ, LM_D)
            self.register_buffer("positions", torch.arange(LM_SEQ))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.wte(idx) + self.wpe(self.positions)

    class Block(nn.Module):
        """Pre-LN block: x + attn(ln_1(x)), then x + fc_proj(gelu(fc(ln_2(x)))).

        Attention: ``softmax(mask(Q K^T / sqrt(d_head))) V`` with separate Q, K, V
        projections and a causal-mask buffer, as in pipetrain.models.gpt.
        """

        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(LM_D)
            self.query = nn.Linear(LM_D, LM_D)
            self.key = nn.Linear(LM_D, LM_D)
            self.value = nn.Linear(LM_D, LM_D)
            self.proj = nn.Linear(LM_D, LM_D)
            self.ln_2 = nn.LayerNorm(LM_D)
            self.fc = nn.Linear(LM_D, 4 * LM_D)
            self.gelu = nn.GELU()
            self.fc_proj = nn.Linear(4 * LM_D, LM_D)
            self.register_buffer("causal_mask", torch.ones(LM_SEQ, LM_SEQ, dtype=torch.bool).triu(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            split = lambda z: z.unflatten(-1, (LM_HEADS, LM_D // LM_HEADS)).transpose(1, 2)  # noqa: E731
            h = self.ln_1(x)
            q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
            att = torch.matmul(q, k.transpose(-2, -1)) * (LM_D // LM_HEADS) ** -0.5
            att = torch.softmax(att.masked_fill(self.causal_mask, float("-inf")), dim=-1)
            x = x + self.proj(torch.matmul(att, v).transpose(1, 2).flatten(2))
            return x + self.fc_proj(self.gelu(self.fc(self.ln_2(x))))

    class Head(nn.Module):
        """Final LayerNorm and the vocabulary projection: (B, T, d) -> (B, T, V)."""

        def __init__(self) -> None:
            super().__init__()
            self.ln_f = nn.LayerNorm(LM_D)
            self.lm_head = nn.Linear(LM_D, LM_VOCAB, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.ln_f(x))

    return {"Embed": Embed, "Block": Block, "Head": Head}


def _local_lm() -> tuple[Any, Callable, Callable]:
    from torch import nn

    mods = _lm_modules()
    model = nn.Sequential(mods["Embed"](), *[mods["Block"]() for _ in range(LM_LAYERS)], mods["Head"]())
    return model, lm_loss, LmBatches()


_LOCAL = {"mlp": _local_mlp, "lm": _local_lm}


def as_sequential(model: Any) -> Any:
    """``model`` as an ``nn.Sequential`` over the same modules, or None if its form is unknown.

    An ``nn.Sequential`` is returned as it is. A GPT with pipetrain's attribute names
    (``wte``, ``wpe``, ``positions``, ``blocks``, ``ln_f``, ``lm_head``, optional ``drop``)
    becomes (embedding, block 0, ..., block L-1, head), computing what ``GPT.forward`` does.
    """
    from torch import nn

    if isinstance(model, nn.Sequential):
        return model if len(model) >= 2 else None
    needed = ("wte", "wpe", "blocks", "ln_f", "lm_head")
    if not all(hasattr(model, a) for a in needed) or not isinstance(model.blocks, nn.ModuleList):
        return None

    class GPTEmbedding(nn.Module):
        """``wte(tokens) + wpe(positions)`` (then dropout, if the model has it)."""

        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, getattr(gpt, "drop", None)
            if hasattr(gpt, "positions"):
                self.register_buffer("positions", gpt.positions.clone())
            else:
                self.positions = None

        def forward(self, tokens: Any) -> Any:
            import torch

            pos = self.positions if self.positions is not None else torch.arange(tokens.shape[1])
            x = self.wte(tokens) + self.wpe(pos)
            return x if self.drop is None else self.drop(x)

    class GPTHead(nn.Module):
        """``lm_head(ln_f(x))``."""

        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

        def forward(self, x: Any) -> Any:
            return self.lm_head(self.ln_f(x))

    return nn.Sequential(GPTEmbedding(model), *model.blocks, GPTHead(model))


def build_bench_model(name: str, seed: int = 0, source: str | None = None) -> BenchModel:
    """The benchmark model ``name`` with weights drawn from ``seed``.

    ``source`` ``None`` (auto): ``pipetrain.models.get_model`` when it works and gives a model
    :func:`as_sequential` understands, else the local definition of the same size (see the
    module docstring). ``"pipetrain.models"`` or ``"local"`` force one: the orchestrator
    decides once and pins it in every worker, so that a package being edited during the
    run cannot make configurations train different models.
    """
    import torch

    if name not in _LOCAL:
        raise SystemExit(f"unknown benchmark model {name!r}; choose from {sorted(_LOCAL)}")
    if source not in (None, "pipetrain.models", "local"):
        raise SystemExit(f"unknown model source {source!r}; use pipetrain.models or local")
    batch = BATCH_SIZES[name]
    torch.manual_seed(seed)
    if source != "local":
        try:
            from pipetrain.models import get_model  # type: ignore[attr-defined]

            bundle = get_model(MODEL_NAMES[name], batch_size=batch)
            layers = as_sequential(bundle.model)
            if layers is None:
                raise TypeError(f"pipetrain's {MODEL_NAMES[name]} is not a sequence of layers")
            if layers is bundle.model:
                names = [str(i) for i in range(len(layers))]
            else:  # GPT as (embedding, blocks..., head): the modules each child starts with
                names = ["wte"] + [f"blocks.{i}" for i in range(len(bundle.model.blocks))] + ["ln_f"]
            return BenchModel(name, batch, layers, bundle.loss_fn, bundle.make_batch,
                              "pipetrain.models", MODEL_NAMES[name], names)
        except Exception:  # not written yet, or a different shape: use the local one
            if source == "pipetrain.models":
                raise
    torch.manual_seed(seed)
    model, loss_fn, make_batch = _LOCAL[name]()
    return BenchModel(name, batch, model, loss_fn, make_batch, "local", f"common:{name}_bundle",
                      [str(i) for i in range(len(model))])


def _bundle(name: str, batch_size: int | None = None, **_: Any) -> Any:
    """A pipetrain ``ModelBundle`` (or ``(model, example_inputs)``) of the local model."""
    import torch

    torch.manual_seed(0)
    model, loss_fn, make_batch = _LOCAL[name]()
    bs = batch_size or BATCH_SIZES[name]
    inputs, _target = make_batch(bs, torch.Generator().manual_seed(0))
    try:
        from pipetrain.models import ModelBundle  # type: ignore[attr-defined]

        return ModelBundle(model=model, example_inputs=inputs, loss_fn=loss_fn, make_batch=make_batch,
                           name=f"common:{name}_bundle")
    except Exception:
        return model, inputs


def mlp_bundle(batch_size: int | None = None, **options: Any) -> Any:
    """``pipetrain train --model common:mlp_bundle`` (with benchmarks/ on PYTHONPATH)."""
    return _bundle("mlp", batch_size, **options)


def lm_bundle(batch_size: int | None = None, **options: Any) -> Any:
    """``pipetrain train --model common:lm_bundle`` (with benchmarks/ on PYTHONPATH)."""
    return _bundle("lm", batch_size, **options)


def split_point(layers: Any, stages: int = 2) -> list[int]:
    """Child indices where each stage after the first begins: equal counts of layers.

    "Layers" are the children holding parameters (Linear, Block, ...); each parameter-free
    child (ReLU) stays with the layer before it. For the MLP (32 children) the cut is after
    the 8th Linear+ReLU; for the LM (embedding, 8 blocks, head) after block 3 (embedding +
    4 blocks | 4 blocks + head).
    """
    children = list(layers)
    weighted = [i for i, c in enumerate(children) if any(True for _ in c.parameters())]
    cuts: list[int] = []
    for s in range(1, stages):
        k = math.ceil(len(weighted) * s / stages)  # layers before the cut
        cuts.append(weighted[k] if k < len(weighted) else len(children))
    return cuts


def split_stages(layers: Any, stages: int = 2, cuts: Sequence[int] | None = None) -> list[Any]:
    """The model cut into ``stages`` ``nn.Sequential`` pieces (modules shared, not copied).

    ``cuts`` (child indices where stages 1.. begin) defaults to :func:`split_point`.
    """
    from torch import nn

    children = list(layers)
    cuts = list(cuts) if cuts is not None else split_point(layers, stages)
    if len(cuts) != stages - 1 or sorted(cuts) != cuts or not all(0 < c < len(children) for c in cuts):
        raise SystemExit(f"bad stage cuts {cuts} for {stages} stages of {len(children)} children")
    bounds = [0, *cuts, len(children)]
    return [nn.Sequential(*children[a:b]) for a, b in zip(bounds, bounds[1:])]


def profile_children(bm: BenchModel, repeats: int = 3, seed: int = 0) -> list[float]:
    """Median forward + backward seconds of each child on the full batch (one thread).

    Used by ``--split balanced``. Each child runs on a detached copy of its input (so its
    backward is timed alone, input gradient included); the last child includes the loss.
    """
    import statistics as st

    import torch

    torch.set_num_threads(1)
    inputs, target = bm.make_batch(bm.batch_size, torch.Generator().manual_seed(seed + 1))
    children = list(bm.layers)
    acts: list[tuple[Any, ...]] = [tuple(inputs)]
    with torch.no_grad():
        for c in children:
            out = c(*acts[-1])
            acts.append(out if isinstance(out, tuple) else (out,))
    times: list[float] = []
    for i, c in enumerate(children):
        samples = []
        for _ in range(repeats + 1):  # the first run warms up
            x = tuple(a.clone().requires_grad_(a.is_floating_point()) for a in acts[i])
            t = time.perf_counter()
            out = c(*x)
            if i == len(children) - 1:
                bm.loss_fn(out, target).backward()
            elif out.requires_grad:
                out.backward(torch.ones_like(out))
            samples.append(time.perf_counter() - t)
        c.zero_grad(set_to_none=True)
        times.append(st.median(samples[1:]))
    return times


def balanced_cuts(times: Sequence[float], stages: int) -> list[int]:
    """Cuts into ``stages`` contiguous parts minimising the largest part's time (exact DP)."""
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[k][j]: minimal max-part time of the first j children in k parts; arg[k][j]: last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], arg[k][j] = v, i
    cuts, j = [], n
    for k in range(stages, 1, -1):
        j = arg[k][j]
        cuts.append(j)
    return sorted(cuts)


# --------------------------------------------------------------------------- measuring
def _proc_status_mib(field_name: str) -> float | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB, if readable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024.0  # the file says kB
    except OSError:
        pass
    return None


def rss_mib() -> float:
    """Peak resident set size of this process, MiB, since the last :func:`reset_peak_rss`.

    ``VmHWM`` of ``/proc/self/status`` (which :func:`reset_peak_rss` can reset), else
    ``ru_maxrss`` (KiB on Linux; never reset).
    """
    hwm = _proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float:
    """Resident set size of this process now, MiB."""
    now = _proc_status_mib("VmRSS")
    return now if now is not None else rss_mib()


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count from the current RSS (Linux ``clear_refs`` 5); True if done.

    Workers call it once set up (other stages dropped), so that their peak measures the
    training phase of their own stage and not the building of the whole model.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed_loop(step: Callable[[], Any], warmup: int, steps: int,
               sync: Callable[[], None] | None = None) -> tuple[float, list[float]]:
    """Run ``warmup`` untimed steps, ``sync()``, then ``steps`` timed ones.

    Returns the wall time of the timed steps (seconds) and each step's duration.
    ``sync`` is a barrier in multi-process configurations, so that every rank starts the
    timed window together (the warm-up is where gloo connects and buffers get allocated).
    """
    for _ in range(warmup):
        step()
    if sync is not None:
        sync()
    times: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return time.perf_counter() - t0, times


def emit_result(payload: dict[str, Any]) -> None:
    """Print a worker's result as its last stdout line."""
    sys.stdout.write(RESULT_TAG + json.dumps(payload) + "\n")
    sys.stdout.flush()


def median_or_none(values: Sequence[float]) -> float | None:
    """The median of ``values`` or ``None`` when there are none."""
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------- processes
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every measured process: one intra-op thread, benchmarks/ importable."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    path = [BENCH_DIR, REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra or {})
    return env


@dataclass
class ProcResult:
    """The end of one launched process: exit status, outputs, its tree's peak memory."""

    returncode: int | None  # None: killed by the harness (timeout or a failed peer)
    stdout: str
    stderr: str
    tree_peaks_mib: list[float]  # sampled VmHWM of the process and each descendant, pid order
    timed_out: bool = False
    wall_s: float = 0.0

    @property
    def peak_rss_mib(self) -> float:
        """The largest peak RSS of any process of the tree (0 if none was sampled)."""
        return max(self.tree_peaks_mib, default=0.0)

    def result_json(self) -> dict[str, Any] | None:
        """The ``RESULT_TAG`` object a harness worker printed, if any."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG):])
        return None

    def error_line(self) -> str:
        """One line saying why the process failed (the last informative stderr line)."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s (killed)"
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        for ln in reversed(lines):
            if ln.startswith("error:") or "Error" in ln or "error" in ln:
                return ln[:300]
        return (lines[-1][:300] if lines else f"exit status {self.returncode}")


def _kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (each launched process leads its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class TreeMemory:
    """Peak RSS of every process of some process trees, sampled from ``/proc``.

    ``VmHWM`` is a process's own peak since its ``exec``, so a sample taken shortly before
    it exits sees (nearly) its whole-life peak. Used for launches whose processes do not
    report their memory themselves (``pipetrain train`` and the workers it starts).
    ``rusage`` cannot serve: a child's ``ru_maxrss`` starts from the forking parent's RSS.
    """

    def __init__(self) -> None:
        self.peaks: dict[int, float] = {}  # pid -> MiB

    @staticmethod
    def _children(pid: int) -> list[int]:
        kids: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            pass
        return kids

    @staticmethod
    def _hwm(pid: int) -> float | None:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0
        except (OSError, ValueError):
            pass
        return None

    def sample(self, root: int) -> None:
        """Record the current peak of ``root`` and all its descendants."""
        stack = [root]
        while stack:
            pid = stack.pop()
            hwm = self._hwm(pid)
            if hwm is not None:
                self.peaks[pid] = max(self.peaks.get(pid, 0.0), hwm)
            stack += self._children(pid)

    def of_tree(self, pids: set[int]) -> list[float]:
        """The peaks of the given pids (in pid order)."""
        return [self.peaks[p] for p in sorted(pids) if p in self.peaks]


def run_group(commands: Sequence[Sequence[str]], timeout_s: float,
              env: dict[str, str] | None = None, sample_s: float = 0.25) -> list[ProcResult]:
    """Start ``commands`` at once, wait for all of them at most ``timeout_s`` seconds.

    Each command runs in a new session (its own process group) so that it and whatever it
    starts (a launcher's workers) can be killed together. When one process fails, the
    others are killed right away (they would otherwise wait on a collective until gloo's
    timeout); past the deadline every survivor is killed. Every ``sample_s`` seconds the
    peak RSS of each process of each tree is sampled (:class:`TreeMemory`).
    """
    outs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    errs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    procs = [subprocess.Popen(list(cmd), stdout=o, stderr=e, env=env or bench_env(),
                              cwd=REPO_ROOT, start_new_session=True)
             for cmd, o, e in zip(commands, outs, errs)]
    t0 = time.monotonic()
    mem = TreeMemory()
    members: list[set[int]] = [{p.pid} for p in procs]  # every pid seen in each tree
    status: dict[int, tuple[int | None, bool]] = {}
    failed = False
    last_sample = -math.inf

    def sample_all() -> None:
        for i, p in enumerate(procs):
            if i not in status:
                before = set(mem.peaks)
                mem.sample(p.pid)
                members[i] |= set(mem.peaks) - before

    try:
        while len(status) < len(procs):
            if time.monotonic() - last_sample >= sample_s:
                sample_all()
                last_sample = time.monotonic()
            for i, p in enumerate(procs):
                if i in status or p.poll() is None:
                    continue
                status[i] = (p.returncode, False)
                _kill_group(p.pid)  # leftovers of a launcher that exited
                failed = failed or p.returncode != 0
            timed_out = time.monotonic() - t0 > timeout_s
            if (failed or timed_out) and len(status) < len(procs):
                sample_all()
                for i, p in enumerate(procs):
                    if i not in status:
                        _kill_group(p.pid)
                        p.wait()
                        status[i] = (None, timed_out)
                break
            time.sleep(0.05)
    finally:
        for i, p in enumerate(procs):
            if i not in status:  # interrupted: leave nothing behind
                _kill_group(p.pid)
                try:
                    p.wait(timeout=10)
                except Exception:
                    pass
    wall = time.monotonic() - t0
    results: list[ProcResult] = []
    for i, (o, e) in enumerate(zip(outs, errs)):
        o.seek(0)
        e.seek(0)
        rc, to = status.get(i, (None, False))
        results.append(ProcResult(rc, o.read(), e.read(), mem.of_tree(members[i]), to, wall))
        o.close()
        e.close()
    return results


@dataclass
class Measurement:
    """One configuration run once (one round): throughput and memory, or why it failed."""

    samples_per_second: float | None
    status: str  # "ok", "failed", "unavailable"
    error: str = ""
    peak_rss_mib: list[float] = field(default_factory=list)  # per worker (or per launch)
    extra: dict[str, Any] = field(default_factory=dict)
