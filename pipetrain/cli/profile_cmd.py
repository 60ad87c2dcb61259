"""``pipetrain profile``: measure a model's per-layer costs, or print a saved profile.

    pipetrain profile --model resnet50 --batch-size 32 [--device cuda] [--output r50.json]
                      [--option layers=3,4,6,3] [--repeats 5] [--warmup 2] [--optimizer sgd]
    pipetrain profile r50.json          # or a PipeDream .txt profile: print its table
"""
from __future__ import annotations

import argparse
import os
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Profile ``--model`` or print ``PROFILE``; returns the exit code."""
    from ..profile import format_profile_table, load_profile, profile_model, save_profile

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
    resolve_device(args.device)  # fail before building the model
    optimizer_state_factor(args.optimizer, args.momentum)
    if args.output:
        check_writable(args.output)  # fail before a long profiling run, not after
    options = dict(parse_option(o) for o in args.option)
    bundle = load_model(args.model, batch_size=args.batch_size, **options)
    profile = profile_model(
        bundle, batch_size=args.batch_size or bundle.batch_size, device=args.device,
        warmup=args.warmup, repeats=args.repeats, optimizer=args.optimizer,
        momentum=args.momentum, model_name=args.model, threads=args.threads,
    )
    print(format_profile_table(profile))
    if args.output:
        save_profile(profile, args.output)
        print(f"wrote {args.output}")
    return 0
