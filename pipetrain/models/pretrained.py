"""Pretrained weights by name: Hugging Face model directories (``--model hf:DIR``) and
``--init-from PATH``, read one tensor at a time.

``hf:DIR`` is a directory as ``save_pretrained`` writes it: ``config.json`` and the weights,
``model.safetensors`` or the shards ``model-0000N-of-0000M.safetensors`` with
``model.safetensors.index.json`` (the shard of every tensor). The model is the class the
config names (``architectures[0]``, from ``transformers``), built from the config as it comes:
its forward returns its ``ModelOutput`` (the loss reads its logits), its tied weights stay
tied. The synthetic data is next-token prediction over the config's vocabulary
(``--option seq_len=N`` tokens, default ``min(128, max_position_embeddings)``); for an
encoder-decoder config (``is_encoder_decoder``: T5, BART) a learnable translation of ``seq_len``
source tokens into ``seq_len`` target tokens, fed as the source, its attention mask and the
decoder's tokens (teacher forcing).

:class:`TensorFiles` reads named tensors from safetensors files (``safe_open``: one tensor
without loading the file) or from a ``torch.save`` of ``{name: tensor}`` (``--save``'s file,
memory-mapped): a process reads only the tensors it holds. :meth:`TensorFiles.check` compares
the files' names and shapes (their headers) with the model's before any tensor is read.

Writing a directory back (``--save-hf``, :mod:`pipetrain.runtime.checkpoints.export`):
:func:`write_shard` writes one process's tensors as ``model-0000N-of-0000M.safetensors``,
:func:`write_index` the index and the source's config; :func:`hf_weight_names` gives the
names the source directory stores a model's tensors by (a tied tensor under one name).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ModelError
from .bundle import LanguageModelBatches, MaskedTranslationBatches, ModelBundle, make_bundle, token_loss

__all__ = ["HF_PREFIX", "TensorFiles", "build_hf", "hf_directory", "hf_files", "hf_model_names", "hf_weight_names",
           "load_into", "shard_name", "write_index", "write_shard"]

HF_PREFIX = "hf:"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SEQ_LEN = 128
DEFAULT_BATCH_SIZE = 8


def hf_directory(spec: str) -> Path:
    """The directory of an ``hf:DIR`` spec, checked to hold ``config.json``."""
    path = Path(spec[len(HF_PREFIX):]).expanduser()
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise ModelError(f"--model {spec}: {str(path)!r} {what}, so it is not a Hugging Face model directory; pass "
                         f"hf:DIR with DIR as save_pretrained writes it (config.json and model.safetensors)")
    return path


def _model_class(spec: str, config: Any) -> type[nn.Module]:
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    if not names:
        raise ModelError(f"--model {spec}: config.json names no model class (its 'architectures' is empty); add the "
                         f"class, e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    cls = getattr(transformers, names[0], None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ModelError(f"--model {spec}: config.json names the model class {names[0]!r}, which transformers "
                         f"{transformers.__version__} does not have; install a transformers version that has it")
    return cls


def _config(spec: str, directory: Path) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ModelError(f"--model {spec} needs the transformers package ({exc}); install it with "
                         f"`pip install transformers`") from None
    from .experts import EXPERTS, register

    # a mixture of experts runs as a capture can take it (models/experts.py)
    extra = {"experts_implementation": EXPERTS} if register() else {}
    try:
        return AutoConfig.from_pretrained(str(directory), **extra)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"--model {spec}: transformers cannot read {str(directory / 'config.json')!r} ({first}); "
                         f"install a transformers version that knows its model_type, or fix the file") from None


def build_hf(spec: str, batch_size: int | None, options: Mapping[str, Any]) -> ModelBundle:
    """The bundle of ``hf:DIR``: the config's model class built from the config (its weights
    come from the directory's files when materialised), next-token prediction batches."""
    directory = hf_directory(spec)
    config = _config(spec, directory)
    unknown = sorted(set(options) - {"seq_len"})
    if unknown:
        raise ModelError(f"--model {spec} takes only the option seq_len, got {unknown[0]!r}")
    limit = int(getattr(config, "max_position_embeddings", DEFAULT_SEQ_LEN) or DEFAULT_SEQ_LEN)
    seq_len = options.get("seq_len", min(DEFAULT_SEQ_LEN, limit))
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= limit:
        raise ModelError(f"--model {spec}: seq_len must be an integer in [1, {limit}] (max_position_embeddings), "
                         f"got {seq_len!r}")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise ModelError(f"--model {spec}: config.json has no vocab_size; hf:DIR trains language models over a "
                         f"vocabulary (causal, masked or encoder-decoder)")
    model = _model_class(spec, config)(config)
    # an encoder-decoder (T5, BART) translates seq_len source tokens into seq_len target tokens
    batches: Any = (MaskedTranslationBatches(vocab, seq_len, seq_len) if getattr(config, "is_encoder_decoder", False)
                    else LanguageModelBatches(vocab, seq_len))
    return make_bundle(spec, model, token_loss, batches, batch_size, DEFAULT_BATCH_SIZE, {"seq_len": seq_len})


class TensorFiles:
    """Named tensors in files, read one at a time (module docstring).

    Attributes:
        label: what the files are, for messages (``hf:DIR``, ``--init-from PATH``).
    """

    def __init__(self, label: str, files: Mapping[str, Path], torch_file: Path | None = None,
                 stored: Mapping[str, str] | None = None, converted: Mapping[str, _Converted] | None = None) -> None:
        self.label = label
        self._file_of = dict(files)               # tensor name -> its safetensors file
        self._stored = dict(stored or {})         # tensor name -> the name the files hold it by, where they differ
        self._converted = dict(converted or {})   # tensor name -> the stored tensors it is made of, and how
        self._torch_file = torch_file
        self._handles: dict[Path, Any] = {}
        self._state: dict[str, Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without open handles or a loaded checkpoint (a worker opens its own)."""
        return {**self.__dict__, "_handles": {}, "_state": None}

    @classmethod
    def at(cls, path: str | os.PathLike[str], label: str) -> TensorFiles:
        """The tensors of a directory (``model.safetensors``, or shards and their index), a
        ``.safetensors`` file, or a ``torch.save`` file of ``{name: tensor}``."""
        p = Path(path).expanduser()
        if p.is_dir():
            if (p / INDEX).is_file():
                try:
                    weight_map = json.loads((p / INDEX).read_text())["weight_map"]
                except (ValueError, KeyError) as exc:
                    raise ModelError(f"{label}: {str(p / INDEX)!r} is not a safetensors index ({exc}); write it "
                                     f"with save_pretrained") from None
                return cls(label, {name: p / file for name, file in weight_map.items()})
            if (p / SAFETENSORS).is_file():
                return cls(label, dict.fromkeys(cls._names(p / SAFETENSORS, label), p / SAFETENSORS))
            raise ModelError(f"{label}: {str(p)!r} has neither {SAFETENSORS} nor {INDEX}; write the weights with "
                             f"save_pretrained (safetensors)")
        if not p.is_file():
            raise ModelError(f"{label}: {str(p)!r} does not exist; pass a safetensors file or directory, or a "
                             f"checkpoint written by --save")
        if p.suffix == ".safetensors":
            return cls(label, dict.fromkeys(cls._names(p, label), p))
        return cls(label, {}, torch_file=p)

    @staticmethod
    def _names(file: Path, label: str) -> list[str]:
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: one line
            raise ModelError(f"{label}: cannot read {str(file)!r} as safetensors ({type(exc).__name__}: "
                             f"{str(exc)[:160]})") from None

    def _torch_state(self) -> dict[str, Tensor]:
        if self._state is None:
            assert self._torch_file is not None
            try:  # memory-mapped: a tensor's pages are read when it is
                state = torch.load(self._torch_file, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - not a torch file: one line
                raise ModelError(f"{self.label}: cannot read {str(self._torch_file)!r} as a checkpoint "
                                 f"({type(exc).__name__}: {str(exc)[:160]}); pass a safetensors file or the file "
                                 f"--save wrote") from None
            if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
                raise ModelError(f"{self.label}: {str(self._torch_file)!r} is not a {{name: tensor}} state dict; "
                                 f"pass the file --save wrote (not its .trainer sidecar)")
            self._state = state
        return self._state

    def names(self) -> list[str]:
        """Every tensor name the files hold (a converted tensor by its model name)."""
        if self._torch_file is not None:
            return list(self._torch_state())
        sources = {n for c in self._converted.values() for n in c.sources}
        return [n for n in self._file_of if n not in sources] + list(self._converted)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header (a converted tensor's: its conversion's, on ``meta``)."""
        if self._torch_file is not None:
            return tuple(self._torch_state()[name].shape)
        if name in self._converted:
            return self._converted[name].shapes[name]
        return tuple(self._handle(self._file_of[name]).get_slice(self.stored_name(name)).get_shape())

    def stored_name(self, name: str) -> str:
        """The name the files hold the tensor ``name`` by."""
        return self._stored.get(name, name)

    def renamed(self, names: Mapping[str, str], converted: Mapping[str, _Converted] | None = None) -> TensorFiles:
        """These files with their tensors named ``names[stored]`` (the model's names) where
        ``names`` gives one; read and shaped by the names the files hold them by. ``converted``:
        tensors made from several stored ones (:func:`hf_model_names`)."""
        if self._torch_file is not None:
            raise ValueError("a torch.save file's tensors are named as the model names them")
        sources = {n for c in (converted or {}).values() for n in c.sources}
        renamed = {names.get(n, n): n for n in self._file_of if n not in sources}
        return TensorFiles(self.label, {**{new: self._file_of[old] for new, old in renamed.items()},
                                        **{n: self._file_of[n] for n in sources}},
                           stored={new: old for new, old in renamed.items() if new != old}, converted=converted)

    def _handle(self, file: Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def close(self) -> None:
        """Let go of the open files (a memory-mapped file's pages read count as this process's
        memory while it stays open); a later read opens them again."""
        self._handles = {}
        self._state = None

    def read(self, name: str) -> Tensor | None:
        """The tensor ``name`` (only it is read), or ``None`` when the files do not hold it."""
        if self._torch_file is not None:
            t = self._torch_state().get(name)
            return None if t is None else t.clone()
        if name in self._converted:
            return self._converted[name].make(name, self._read_stored)
        return self._read_stored(name) if name in self._file_of else None

    def _read_stored(self, name: str) -> Tensor:
        """The tensor the files hold under ``name``'s stored name (a converted tensor's source
        is held by its own)."""
        from safetensors import safe_open

        # opened for this tensor alone: the file's pages it maps count as this process's
        # memory until the tensor read from them is let go, never the whole stage's at once
        with safe_open(str(self._file_of[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(self.stored_name(name))

    def check(self, model: nn.Module, ignore: Iterable[str] = ()) -> None:
        """The files hold a tensor of the right shape for every entry of the model's
        ``state_dict`` (a tied tensor under any of its names) and nothing else (``ignore``:
        regular expressions of names the model's authors let a checkpoint carry).

        Raises:
            ModelError: one line naming the missing, unexpected and mis-shaped tensors.
        """
        import re

        held = set(self.names())
        names_of: dict[int, list[str]] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            names_of.setdefault(id(t), []).append(name)
        tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
        missing, shaped = [], []
        for tid, names in names_of.items():
            found = next((n for n in names if n in held), None)
            if found is None:
                missing.append(names[0])
            elif self.shape(found) != tuple(tensors[tid].shape):
                shaped.append(f"{found} (file {list(self.shape(found))}, model {list(tensors[tid].shape)})")
        known = {n for names in names_of.values() for n in names}
        patterns = [re.compile(p) for p in ignore]
        unexpected = sorted(n for n in held - known if not any(p.search(n) for p in patterns))
        if not (missing or shaped or unexpected):
            return
        parts = [f"{what} {_some(items)}" for what, items in
                 (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shaped)) if items]
        raise ModelError(f"{self.label}: the weights do not match the model {type(model).__name__}: "
                         f"{'; '.join(parts)}; write them from this model (save_pretrained, --save) or fix the "
                         f"model's options")


def _some(items: list[str], shown: int = 4) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def load_into(model: nn.Module, files: TensorFiles) -> None:
    """Copy every ``state_dict`` tensor of a model built whole from ``files`` (checked first)."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            value = files.read(name)
            if value is not None:
                t.copy_(value)


# --------------------------------------------------------------------------- writing a directory

SHARD_PATTERN = "model-*-of-*.safetensors"
COPIED = ("config.json", "generation_config.json")


def shard_name(index: int, count: int) -> str:
    """The file of shard ``index`` (from 1) of ``count``: ``model-00001-of-00004.safetensors``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]] | None:
    """transformers' renamings and tensor conversions of ``model``'s checkpoints (what
    ``from_pretrained`` applies as it loads and ``save_pretrained`` reverses), or ``None``
    where transformers has none (before 5: a checkpoint holds the modules' own names)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


class _Converted:
    """A model tensor transformers makes from several stored ones as it loads (Mixtral's
    ``experts.gate_up_proj`` from every expert's ``w1`` and ``w3``): the stored names, in
    the order ``from_pretrained`` reads them (``dot_natural_key``), with the source pattern
    each matched, and transformers' own converter, applied as ``from_pretrained`` applies it
    (``WeightConverter.convert``)."""

    def __init__(self, first: str, converter: Any, sources: list[tuple[str, str]], config: Any) -> None:
        self.first = first                       # the name transformers collects the group under
        self.converter = converter
        self.sources = [n for _, n in sources]
        self.patterns = [p for p, _ in sources]
        self.config = config
        self.shapes: dict[str, tuple[int, ...]] = {}   # every model tensor the group makes (hf_model_names)

    def convert(self, read: Any) -> dict[str, Tensor]:
        import copy

        conv = copy.deepcopy(self.converter)
        for pattern, name in zip(self.patterns, self.sources, strict=True):
            conv.add_tensor(self.first, name, pattern, (lambda n=name: read(n)))
        out = conv.convert(self.first, config=self.config)
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def make(self, name: str, read: Any) -> Tensor:
        return self.convert(read)[name]


def hf_model_names(label: str, files: TensorFiles, model: nn.Module) -> tuple[dict[str, str], dict[str, _Converted]]:
    """How ``from_pretrained`` names a Hugging Face directory's tensors in the model:
    ``(renamed, converted)``. ``renamed``: ``stored name -> model name`` where they differ
    (transformers 5 keeps some architectures' checkpoints under older names than their
    modules': GPT-NeoX's head is ``embed_out.weight`` in the file, ``lm_head.weight`` in the
    model). ``converted``: ``model name ->`` the stored tensors transformers makes it from
    (a mixture of experts' per-expert tensors fused into one), its shapes from the
    conversion run on ``meta`` over the files' headers.

    Raises:
        ModelError: a conversion that cannot be applied per tensor group (one line).
    """
    found = _conversions(model)
    if found is None:
        return {}, {}
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = found
    renamed: dict[str, str] = {}
    groups: dict[str, list[tuple[str, str]]] = {}
    for name in sorted(files.names(), key=dot_natural_key):
        new, pattern = rename_source_key(name, renamings, converters)
        if pattern is not None:
            groups.setdefault(new, []).append((pattern, name))
        elif new != name:
            renamed[name] = new
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    converted: dict[str, _Converted] = {}
    for first, sources in groups.items():
        group = _Converted(first, by_pattern[sources[0][0]], sources, getattr(model, "config", None))
        try:
            made = group.convert(lambda n: torch.empty(files.shape(n), device="meta"))
        except Exception as exc:  # noqa: BLE001 - whatever the conversion raises: one line
            raise ModelError(f"{label}: transformers converts {sources[0][1]!r} and {len(sources) - 1} more tensors "
                             f"into {first!r} as it loads {type(model).__name__}, and that conversion fails here "
                             f"({type(exc).__name__}: {str(exc)[:120]}); load it with from_pretrained, "
                             f"torch.save(model.state_dict(), 'w.pt') and pass --init-from w.pt") from None
        group.shapes = {k: tuple(v.shape) for k, v in made.items()}
        converted.update(dict.fromkeys(made, group))
    return renamed, converted


def hf_files(spec: str, model: nn.Module) -> TensorFiles:
    """The tensors of ``hf:DIR`` under ``model``'s names (:func:`hf_model_names`)."""
    label = f"--model {spec}"
    files = TensorFiles.at(hf_directory(spec), label)
    names, converted = hf_model_names(label, files, model)
    return files.renamed(names, converted) if names or converted else files


def hf_weight_names(directory: str | os.PathLike[str], keys: Iterable[str]) -> dict[str, str]:
    """The names a Hugging Face directory's weights are stored under, among ``keys`` (a
    model's ``state_dict`` keys, in that order), as ``{key: stored name}``: a tied tensor
    under the one name the directory holds it by, as ``save_pretrained`` writes it (headers
    only, no tensor read; the names as :func:`hf_model_names` renames them, from the
    directory's model class built on ``meta``)."""
    files = TensorFiles.at(directory, f"hf:{directory}")
    spec = f"{HF_PREFIX}{directory}"
    config = _config(spec, Path(directory))
    with torch.device("meta"):
        model = _model_class(spec, config)(config)
    names, converted = hf_model_names(f"hf:{directory}", files, model)
    renamed = files.renamed(names, converted)
    held = set(renamed.names())  # a converted tensor under the model's name, which from_pretrained reads as it is
    return {k: renamed.stored_name(k) for k in keys if k in held}


def write_shard(directory: Path, index: int, count: int, tensors: Mapping[str, Tensor]) -> int:
    """Write shard ``index`` of ``count`` (``tensors``, each contiguous on the CPU) atomically
    (a temporary file, then ``os.replace``); returns its tensors' bytes."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / shard_name(index, count)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(plain, str(tmp), metadata={"format": "pt"})  # "pt": what from_pretrained requires
    os.replace(tmp, final)
    return sum(t.numel() * t.element_size() for t in plain.values())


def write_index(directory: Path, source: Path, weight_map: Mapping[str, str], total_size: int,
                dtype: str | None) -> None:
    """Finish a directory whose shards are written: ``model.safetensors.index.json``, the
    source's ``config.json`` (its dtype set to ``dtype``, the tensors' own) and
    ``generation_config.json``; weight files the index does not name (an earlier save's) are
    removed, so that ``from_pretrained`` reads these shards."""
    written = set(weight_map.values())
    for old in [directory / SAFETENSORS, *directory.glob(SHARD_PATTERN)]:
        if old.name not in written and old.is_file():
            old.unlink()
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    _write_text(directory / INDEX, json.dumps(index, indent=2) + "\n")
    for name in COPIED:
        if not (source / name).is_file() or (directory / name).resolve() == (source / name).resolve():
            continue
        text = (source / name).read_text()
        if name == "config.json" and dtype is not None:
            config = json.loads(text)
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = dtype
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        _write_text(directory / name, text)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
