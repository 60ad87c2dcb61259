"""``pipetrain train``: train a model with a pipeline schedule on local or torchrun workers.

    pipetrain train --model mlp --workers 2 --schedule pipedream --steps 30 --batch-size 32
    pipetrain train --model vgg16 --workers 4 --config 3-1 --schedule flush --microbatches 4 --json
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m pipetrain train --model gpt --config 1-1-1-1 --schedule 2bw --microbatches 4

This module only parses arguments and calls :func:`pipetrain.runtime.train`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..errors import PipetrainError
from ..runtime.config import OPTIMIZERS, SCHEDULES, OptimizerConfig, TrainConfig, parse_model_option


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model with a pipeline schedule (pipedream, 2bw, flush, gpipe, interleaved, dp)",
        description="Train a model on N workers with a pipeline schedule. Starts N local processes through "
                    "torchrun's launcher, or runs as one worker when started by torchrun. --workers 1 trains in "
                    "this process (plain training, the reference).",
    )
    p.add_argument("--model", default="mlp", help="zoo model (mlp, alexnet, vgg16, resnet50, gnmt, gpt, hf-gpt2) or "
                                                  "package.module:function (default: mlp)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="model option, repeatable (e.g. --option depth=4 --option width=256)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: what --config/--plan needs, else 1; under torchrun: its world size)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--plan", help="plan JSON written by `pipetrain plan --output`")
    g.add_argument("--config", help="replicas per stage, e.g. 2-1-1 (stages cut by balanced estimated compute)")
    p.add_argument("--cut", metavar="NAME[,NAME...]",
                   help="where stages 1, 2, ... begin: a node name or a module name of the captured model (e.g. "
                        "blocks.4, or 16 for child 16 of an nn.Sequential); with --config for replicas, else one "
                        "worker per stage")
    p.add_argument("--schedule", default="pipedream", help=f"one of {', '.join(SCHEDULES)} (default: pipedream)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per minibatch (default: the model's)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="units per minibatch (default: 1 for pipedream, else the number of workers)")
    p.add_argument("--steps", type=int, default=10, help="minibatches to train, i.e. optimizer steps (default 10)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="untimed minibatches before the timed ones (default 0)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS, help="optimizer (default sgd)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    p.add_argument("--nesterov", action="store_true", help="SGD Nesterov momentum")
    p.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    p.add_argument("--betas", default="0.9,0.999", help="Adam betas (default 0.9,0.999)")
    p.add_argument("--eps", type=float, default=1e-8, help="Adam epsilon (default 1e-8)")
    p.add_argument("--lr-schedule", default="constant",
                   help="constant | step:size=N,gamma=G | cosine:warmup=W,total=T,min=M (default constant)")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip gradients to this 2-norm (global for flushed schedules, per stage for pipedream/2bw)")
    p.add_argument("--seed", type=int, default=0, help="seed of model init and data (default 0)")
    p.add_argument("--vertical-sync", action="store_true", help="pipedream: vertical sync of weight versions")
    p.add_argument("--virtual-stages", type=int, default=None, help="interleaved: model chunks per rank (default 2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--save", help="write the final model state_dict (and PATH.trainer) to PATH")
    p.add_argument("--resume", help="continue from a checkpoint written by --save")
    p.add_argument("--trace", metavar="DIR", help="write each worker's measured timeline as Chrome traces in DIR")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any receive or collective may wait (default 120)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker on CPU (default 1; 0: torch's default)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every n steps (default 10; 0: never)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the run's figures at the end")
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="leave glibc's malloc thresholds alone (by default freed memory is kept for reuse)")
    p.add_argument("--no-fused-grads", action="store_true",
                   help="accumulate Linear weight gradients through autograd (by default the backward's GEMM "
                        "adds them into the accumulator in place)")
    p.add_argument("--lookahead", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--debug-fail", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed arguments (raises RuntimeConfigError on bad values)."""
    from ..errors import RuntimeConfigError

    options = dict(parse_model_option(o) for o in args.option)
    schedule = str(args.schedule).lower()
    if args.virtual_stages is not None and schedule != "interleaved":
        raise RuntimeConfigError(
            f"--virtual-stages applies to the interleaved schedule only (got --schedule {args.schedule}); "
            f"drop --virtual-stages or pass --schedule interleaved")
    try:
        betas = tuple(float(x) for x in str(args.betas).split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise RuntimeConfigError(f"--betas takes two numbers like 0.9,0.999, got {args.betas!r}")
    opt = OptimizerConfig(name=args.optimizer, lr=args.lr, momentum=args.momentum, nesterov=args.nesterov,
                          weight_decay=args.weight_decay, betas=(betas[0], betas[1]), eps=args.eps)
    return TrainConfig(
        model=args.model, model_options=options, workers=args.workers, plan=args.plan, config=args.config, cut=args.cut,
        schedule=args.schedule, batch_size=args.batch_size, microbatches=args.microbatches, steps=args.steps,
        warmup_steps=args.warmup_steps, optimizer=opt, lr_schedule=args.lr_schedule,
        clip_grad_norm=args.clip_grad_norm, seed=args.seed, vertical_sync=args.vertical_sync,
        virtual_stages=args.virtual_stages if args.virtual_stages is not None else 2, device=args.device, save=args.save, resume=args.resume,
        trace=args.trace, log_every=args.log_every, timeout=args.timeout,
        threads=args.threads if args.threads else None, lookahead=args.lookahead, debug_fail=args.debug_fail,
        log_to_stderr=args.json, tune_malloc=not args.no_malloc_tuning,
        fused_grads=not args.no_fused_grads)


def run(args: argparse.Namespace) -> int:
    from ..runtime.launch import WorkerFailure, train, under_torchrun

    cfg = config_from_args(args)
    try:
        result = train(cfg)
    except WorkerFailure as e:
        # A user error in a worker reads as if this process had found it; a crash names the rank.
        print(f"error: {e.message if e.user_error else e}", file=sys.stderr)
        return 2 if e.user_error else 1
    except PipetrainError:
        raise
    except Exception as e:  # noqa: BLE001 - a worker under torchrun: one line, not a traceback
        if not under_torchrun() or os.environ.get("PIPETRAIN_DEBUG"):
            raise
        print(f"error: rank {os.environ.get('RANK')}: {e}", file=sys.stderr)
        return 1
    if result.get("rank", 0) != 0 or "steps" not in result:
        return 0
    result.pop("state", None)
    result["config_detail"] = {"model": cfg.model, "model_options": cfg.model_options, "optimizer": cfg.optimizer.name,
                               "lr": cfg.optimizer.lr}
    if args.json:
        print(json.dumps(result, default=str))
    else:
        loss = result["final_loss"]
        print(f"trained {result['steps']} steps of {cfg.model} on {result['workers']} worker(s): schedule "
              f"{result['schedule']}, config {result['config']}, batch {result['batch_size']} "
              f"({result['microbatches']} units); final loss {loss:.6f}; {result['samples_per_second']:.1f} samples/s"
              if loss is not None else f"trained {result['steps']} steps")
        print(f"plan: {result['plan_source']}")
        if result.get("saved"):
            print(f"saved {result['saved']} (and {result['saved']}.trainer)")
    return 0
