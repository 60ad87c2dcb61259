"""``pipetrain profile``: measure a model's per-layer costs, or print a saved profile.

    pipetrain profile --model resnet50 --batch-size 32 [--device cuda] [--output r50.json]
                      [--option layers=3,4,6,3] [--repeats 5] [--warmup 2] [--optimizer sgd] [--no-cache]
    pipetrain profile r50.json          # or a PipeDream .txt profile: print its table

A measured profile ends with its step check (the profile's forward + backward against the
whole model's, measured in the same run, :mod:`pipetrain.profile.step_check`; a model whose
activations exceed ``--check-memory`` is checked on the tail of its graph that fits, one whose
forward + backward exceeds ``--check-seconds`` on a tail within that) and a
one-line warning when they disagree by more than 15%. Profiles are kept in the measurement cache
(:mod:`pipetrain.profile.cache`: ``$PIPETRAIN_CACHE`` or ``~/.cache/pipetrain``) and reused
for the same model, options, batch, device, threads, optimizer and repeats on the same
machine; ``--no-cache`` measures again. Long profiles show progress on stderr. The
allocator is tuned as in the workers (:func:`pipetrain.runtime.process.rss.tune_malloc`),
so large tensors reuse their pages instead of faulting them in again every step.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import PipetrainError

_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def parse_scalar(text: str) -> Any:
    """``"4"`` -> 4, ``"0.5"`` -> 0.5, ``"true"`` -> True, anything else stays a string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return _BOOLS.get(text.lower(), text)


def parse_option(item: str) -> tuple[str, Any]:
    """Parse ``KEY=VALUE`` (``VALUE`` int, float, bool or str; ``a,b,c`` a tuple of numbers)."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise PipetrainError(f"--option {item!r} must be KEY=VALUE, e.g. --option depth=4")
    value = value.strip()
    if "," in value:
        parts = [parse_scalar(p.strip()) for p in value.split(",") if p.strip()]
        if parts and all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts):
            return key.replace("-", "_"), tuple(parts)
    return key.replace("-", "_"), parse_scalar(value)


def check_writable(path: str) -> None:
    """Raise a one-line error unless a file can be written at ``path`` (checked without creating it)."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise PipetrainError(f"--output {path!r} is a directory; "
                             f"give a file name such as {str(target / 'profile.json')!r}")
    if not parent.is_dir():
        raise PipetrainError(f"--output {path!r}: directory {str(parent)!r} does not exist; "
                             "create it first or choose another path")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise PipetrainError(f"--output {path!r} is not writable; choose a path you can write")


def register(subparsers: Any) -> None:
    """Add the ``profile`` subcommand."""
    p = subparsers.add_parser(
        "profile",
        help="measure per-layer forward/backward time, activation and parameter bytes of a model",
        description="Profile a model layer by layer (--model), or print the table of a saved profile "
        "(a .json file or a PipeDream .txt file).",
    )
    p.add_argument("path", nargs="?", metavar="PROFILE",
                   help="an existing profile (.json, or PipeDream .txt) to print instead of profiling")
    p.add_argument("--model", metavar="NAME",
                   help="a built-in model (mlp, alexnet, vgg16, resnet50, gnmt, gpt, hf-gpt2) "
                   "or package.module:function returning (model, example_batch) or a ModelBundle")
    p.add_argument("--batch-size", type=int, metavar="N", help="minibatch size (default: the model's)")
    p.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu or cuda (default: cpu)")
    p.add_argument("--output", "-o", metavar="FILE.json", help="also write the profile as JSON")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option (repeatable), e.g. --option depth=4 --option layers=1,1,1,1")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer (median; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per layer first (default 2)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                   help="sets the optimizer state size per parameter byte (default sgd)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0: no state; default 0.9)")
    p.add_argument("--threads", type=int, default=None, help="torch threads while profiling (default: unchanged)")
    p.add_argument("--check-memory", type=float, default=1.0, metavar="GIB",
                   help="activations the final whole-model check may hold, GiB (default 1; a larger model is "
                        "checked on the tail of its graph that fits)")
    p.add_argument("--check-seconds", type=float, default=4.0, metavar="S",
                   help="forward + backward the final check's region may take, seconds, as the profile measured "
                        "it (default 4, pipetrain.profile.measure.CHECK_SECONDS; a longer model is checked on a "
                        "tail of its graph within it)")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="measure again instead of reusing a profile of the same model, options and settings from "
                        "the measurement cache ($PIPETRAIN_CACHE or ~/.cache/pipetrain), and leave the cache alone")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile ``--model`` or print ``PROFILE``; returns the exit code."""
    from ..profile import format_profile_table, load_profile, save_profile
    from ..profile.cache import cache_dir
    from ..profile.step_check import step_check

    if args.path and args.model:
        raise PipetrainError(
            f"give either a profile file ({args.path!r}) or --model ({args.model!r}), not both"
        )
    if args.path:
        print(format_profile_table(load_profile(args.path)))
        return 0
    if not args.model:
        raise PipetrainError(
            "nothing to profile: pass --model NAME (e.g. --model resnet50 --batch-size 32) "
            "or the path of a saved profile to print"
        )
    from ..models import load_model
    from ..profile.profiler import optimizer_state_factor, resolve_device

    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--repeats", args.repeats, 1),
                             ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)):
        if value is not None and value < low:
            raise PipetrainError(f"{flag} must be an integer >= {low}, got {value}; pass e.g. {flag} {max(low, 2)}")
    if not args.check_memory > 0:
        raise PipetrainError(f"--check-memory must be > 0 GiB, got {args.check_memory:g}; pass e.g. --check-memory 1")
    if not args.check_seconds >= 0:
        raise PipetrainError(f"--check-seconds must be >= 0, got {args.check_seconds:g}; pass e.g. --check-seconds 4")
    resolve_device(args.device)  # fail before building the model
    optimizer_state_factor(args.optimizer, args.momentum)
    if args.output:
        check_writable(args.output)  # fail before a long profiling run, not after
    options = dict(parse_option(o) for o in args.option)
    bundle = load_model(args.model, batch_size=args.batch_size, **options)
    profile, hit = _measured(args, bundle, options)
    print(format_profile_table(profile))
    check = step_check(profile)
    if check is not None:
        print(check.line())
        warning = check.warning()
        if warning is not None:
            print(warning, file=sys.stderr)
    if hit is not None:
        print(f"profile from the measurement cache ({cache_dir()}), written {hit}; pass --no-cache to measure again")
    if args.output:
        save_profile(profile, args.output)
        print(f"wrote {args.output}")
    return 0


def _measured(args: argparse.Namespace, bundle: Any, options: dict[str, Any]) -> tuple[Any, str | None]:
    """The profile of ``bundle`` (from the measurement cache when it holds one), and when the
    cached one was written (None: measured now)."""
    from ..profile import profile_model
    from ..profile.cache import MeasurementCache, cached_profile, model_dtype, model_fingerprint
    from ..profile.profiler import fast_counts
    from ..runtime.process.log import setup_logging
    from ..runtime.process.rss import tune_malloc

    setup_logging(to_stderr=True)  # progress lines of a long profile, off the table's stdout
    tune_malloc()  # the allocator the workers run with (their pages reused, not faulted in every step)
    batch = args.batch_size or bundle.batch_size
    threads = args.threads if args.threads is not None else torch_threads()
    key = {"model": args.model, "structure": model_fingerprint(bundle.model, bundle.example_inputs),
           "options": options, "batch_size": batch, "device": args.device,
           "dtype": model_dtype(bundle.model), "threads": threads, "optimizer": args.optimizer,
           "momentum": args.momentum, "counts": fast_counts(args.warmup, args.repeats),
           "check_memory": args.check_memory, "check_seconds": args.check_seconds}
    cache = MeasurementCache(enabled=args.cache)
    profile, hit = cached_profile(cache, key, lambda: profile_model(
        bundle, batch_size=batch, device=args.device, warmup=args.warmup, repeats=args.repeats,
        optimizer=args.optimizer, momentum=args.momentum, model_name=args.model, threads=args.threads,
        progress=True, check_memory=args.check_memory * 2**30,
        check_seconds=args.check_seconds), device=args.device)
    return profile, (min(cache.reused.values()) if hit and cache.reused else None)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())
