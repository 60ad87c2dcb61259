"""Profiles and predictions on models nobody here wrote: Hugging Face Llama, BERT and T5 built
from configs, and the zoo's ``gpt``, each at batch 8 x 32 tokens.

    python benchmarks/predict_models.py                     # every model, 1 round
    python benchmarks/predict_models.py --models llama,bert --rounds 2 --json out.json
    python benchmarks/predict_models.py --pythonpath ../before      # the code before a change
    python benchmarks/predict_models.py --models others             # GPT-2, GPT-NeoX, Phi, ..., Mixtral
    python benchmarks/predict_models.py --models qwen2              # a Qwen2 sized unlike the others
    python benchmarks/predict_models.py --models defaults           # Llama, BERT, T5 at the library's sizes

For each model, in this order:

1. **Profile against the model's own step**: ``pipetrain profile --model M --batch-size 8
   --threads 1 --no-cache``; its last line is the step check, the profile's forward + backward
   over the model's own eager step measured in the same run (``ratio``; within 15% is the
   profiler's bar).
2. **The automatic choice against its run**: ``pipetrain train --model M --batch-size 8
   --workers 2 --schedule auto --steps 60 --json`` (its measurement cache in a temporary
   directory, so the choice measures everything here); ``predicted`` is the chosen
   configuration's ``predicted_time_per_minibatch``, ``measured`` the run's steady-state
   time per minibatch (``batch / samples_per_second_steady``), ``error`` ``|p - m| / m``.
   The run is traced (``--trace``), and each stage's compute in the run (the mean F + B,
   I + W included, of one unit over its ranks' timed window; STEP apart) is set against the
   choice's simulated compute of that stage (``stage_unit_seconds``): ``compute in run /
   predicted`` tells the part of the error that is the stages computing slower or faster
   than timed from the part that is the schedule, the transfers and the waits.
3. **Every candidate, fixed** (``--candidates``): the auto run's other configurations, each
   run as ``--schedule S --microbatches m --config C`` with the predicted time the choice gave
   it, so the errors of the configurations it did not choose are seen too.

The Hugging Face directories are written by ``save_pretrained`` in a child process (seed 0)
into a temporary directory, deleted afterwards. ``--rounds N`` repeats steps 1-3 and reports
each round (a 2-core machine shared with other work moves the measured times by 10-40%).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from hf_dirs import save_pretrained
from trace_summary import load

BATCH = 8
SEQ = 32
STEPS = 60

HF_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (config class, model class, config arguments)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}),
    "bert": ("BertConfig", "BertForMaskedLM",
             {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0}),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           {"vocab_size": 256, "d_model": 256, "d_kv": 64, "d_ff": 512, "num_layers": 2, "num_decoder_layers": 2,
            "num_heads": 4, "dropout_rate": 0.0, "decoder_start_token_id": 0, "pad_token_id": 0}),
}
#: More architectures, as users bring them (``--models others``): the same sizes (4 layers or
#: 2 + 2, width 256, feed-forward 512, 4 heads, vocabulary 256), dropout off where it has one;
#: the mixtures of experts route each token to 2 experts (Mixtral 4 of width 256, Qwen2-MoE 8
#: of width 128 beside a shared one of 256).
OTHER_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"vocab_size": 256, "n_positions": 64, "n_embd": 256, "n_layer": 4, "n_head": 4, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
             {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 4, "num_attention_heads": 4}),
    "phi": ("PhiConfig", "PhiForCausalLM",
            {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 4, "num_attention_heads": 4}),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               {"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"vocab_size": 256, "hidden_size": 256, "n_layer": 4, "n_head": 4}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 256, "intermediate_size": 512,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM",
                {"vocab_size": 256, "max_position_embeddings": 66, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_dropout_prob": 0.0,
                 "attention_probs_dropout_prob": 0.0}),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
                   {"vocab_size": 256, "max_position_embeddings": 64, "dim": 256, "hidden_dim": 512, "n_layers": 4,
                    "n_heads": 4, "dropout": 0.0, "attention_dropout": 0.0}),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             {"vocab_size": 256, "max_position_embeddings": 64, "d_model": 256, "encoder_layers": 2,
              "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
              "encoder_ffn_dim": 512, "decoder_ffn_dim": 512, "dropout": 0.0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 256, "intermediate_size": 256,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 256, "intermediate_size": 512,
                  "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
                  "num_experts_per_tok": 2}),
}
HF_CONFIGS.update(OTHER_CONFIGS)
#: Sized unlike the groups above (``--models qwen2``): 6 layers, width 192, 6 heads over 2
#: key-value heads, vocabulary 512.
HF_CONFIGS["qwen2"] = ("Qwen2Config", "Qwen2ForCausalLM",
                       {"vocab_size": 512, "hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 6,
                        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64})
#: The same three architectures as a user writes their configs in a line (``--models
#: defaults``): depth, width and heads set, every other size the library's default (Llama:
#: vocabulary 32000, intermediate 11008; BERT: 30522, 3072, dropout 0.1; T5: 32128, d_ff
#: 2048, 8 heads of 64, dropout 0.1). The vocabulary and the feed-forward then outweigh the
#: attention many times over, where the small configs above keep them alike.
DEFAULT_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama_defaults": ("LlamaConfig", "LlamaForCausalLM",
                       {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
    "bert_defaults": ("BertConfig", "BertForMaskedLM",
                      {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
    "t5_defaults": ("T5Config", "T5ForConditionalGeneration",
                    {"d_model": 256, "num_layers": 2, "num_decoder_layers": 2}),
}
HF_CONFIGS.update(DEFAULT_CONFIGS)
GPT = ["--model", "gpt", "--option", "d_model=256", "--option", "layers=4", "--option", "heads=4",
       "--option", f"seq_len={SEQ}", "--option", "vocab=256"]
DESCRIPTION = {
    "llama": "Hugging Face Llama (4 layers, hidden 256, intermediate 512, 4 heads, vocab 256)",
    "bert": "Hugging Face BERT masked LM (4 layers, hidden 256, intermediate 512, 4 heads, vocab 256)",
    "t5": "Hugging Face T5 (2 + 2 layers, d_model 256, d_ff 512, 4 heads, vocab 256)",
    "gpt": "zoo gpt (d_model 256, 4 layers, 4 heads, vocab 256)",
    **{name: f"Hugging Face {model} ({'2 + 2 layers' if name == 'bart' else '4 layers'}, width 256, vocab 256)"
       for name, (_, model, _) in OTHER_CONFIGS.items()},
    "qwen2": "Hugging Face Qwen2ForCausalLM (6 layers, width 192, 6 heads over 2 key-value heads, vocab 512)",
    "llama_defaults": "Hugging Face Llama (4 layers, hidden 256, 4 heads; intermediate 11008, vocab 32000)",
    "bert_defaults": "Hugging Face BERT masked LM (4 layers, hidden 256, 4 heads; intermediate 3072, vocab 30522)",
    "t5_defaults": "Hugging Face T5 (2 + 2 layers, d_model 256; d_ff 2048, 8 heads, vocab 32128)",
}


def write_hf(name: str, directory: str) -> None:
    """``save_pretrained`` of the model ``name`` (weights from seed 0) in a child process."""
    config_cls, model_cls, kwargs = HF_CONFIGS[name]
    save_pretrained(config_cls, model_cls, kwargs, directory)


def model_args(name: str, dirs: dict[str, str]) -> list[str]:
    if name == "gpt":
        return list(GPT)
    return ["--model", f"hf:{dirs[name]}", "--option", f"seq_len={SEQ}"]


def _pipetrain(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    # python -m puts its working directory first on sys.path: the checkout under test is it
    return subprocess.run([sys.executable, "-m", "pipetrain", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=env.get("PREDICT_CWD", tempfile.gettempdir()))


def profile_check(margs: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The profile's step check: its forward + backward, the model's own step, their ratio."""
    out = _pipetrain(["profile", *margs, "--batch-size", str(BATCH), "--threads", "1", "--no-cache"], env)
    m = re.search(r"step check: profile total ([\d.]+) ms / measured whole-model step ([\d.]+) ms = ([\d.]+)",
                  out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        return {"status": "failed", "message": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return {"status": "ok", "profile_ms": float(m.group(1)), "own_step_ms": float(m.group(2)),
            "ratio": float(m.group(3))}


COMPUTE_OPS = ("F", "B", "I", "W")


def trace_compute(directory: Path) -> dict[int, dict[str, float]]:
    """Stage -> the mean seconds of one unit's forward (F), backward (B, or I + W) and of one
    STEP over the stage's ranks, from ``directory/trace.json`` (``pipetrain train --trace``,
    read by :func:`trace_summary.load`)."""
    seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for events in load(str(directory)).values():
        for e in events:
            if e["stage"] is None or e["op"] not in (*COMPUTE_OPS, "STEP"):
                continue
            kind = "forward" if e["op"] == "F" else "step" if e["op"] == "STEP" else "backward"
            seconds[e["stage"]][kind] += (e["end"] - e["start"]) / 1e3
            if e["op"] in ("F", "STEP"):
                counts[e["stage"]][kind] += 1
    return {int(stage): {"forward": t["forward"] / counts[stage]["forward"],
                         "backward": t["backward"] / counts[stage]["forward"],
                         "step": t["step"] / max(1, counts[stage]["step"])}
            for stage, t in seconds.items() if counts[stage]["forward"]}


def compute_ratio(predicted: list[dict[str, float]], measured: dict[int, dict[str, float]]) -> float | None:
    """The stages' measured forward + backward per unit over the predicted, summed over stages."""
    pred = sum(p["forward"] + p["backward"] for p in predicted)
    meas = sum(measured[k]["forward"] + measured[k]["backward"] for k in range(len(predicted)) if k in measured)
    return meas / pred if pred > 0 and len(measured) == len(predicted) else None


def train(margs: list[str], extra: list[str], env: dict[str, str], trace: Path | None = None) -> dict[str, Any]:
    """One ``train --json`` run: its configuration, predicted and measured time per minibatch
    (and, traced into ``trace``, each stage's compute in the run against the prediction's)."""
    out = _pipetrain(["train", *margs, "--batch-size", str(BATCH), "--workers", "2", "--steps", str(STEPS),
                      "--json", *extra, *(["--trace", str(trace)] if trace is not None else [])], env)
    if out.returncode != 0:
        return {"status": "failed", "message": out.stderr.strip().splitlines()[-1:]}
    d = json.loads(out.stdout)
    measured = BATCH / d["samples_per_second_steady"] if d.get("samples_per_second_steady") else None
    predicted = d.get("predicted_time_per_minibatch")
    row = {"status": "ok", "schedule": d["schedule"], "microbatches": d["microbatches"], "config": d["config"],
           "measured_s": measured, "predicted_s": predicted,
           "error": abs(predicted - measured) / measured if predicted and measured else None}
    if d.get("auto"):
        row["candidates"] = [{k: c[k] for k in ("schedule", "microbatches", "config", "predicted_time_per_minibatch")}
                             for c in d["auto"]["candidates"] if c.get("predicted_time_per_minibatch")]
        row["choice_seconds"] = d["auto"].get("seconds")
        predicted_stages = d["auto"].get("stage_unit_seconds") or []
        if trace is not None and predicted_stages:
            measured_stages = trace_compute(trace)
            row["stage_unit_seconds"] = {"predicted": predicted_stages,
                                         "measured": [measured_stages.get(k) for k in range(len(predicted_stages))]}
            row["compute_ratio"] = compute_ratio(predicted_stages, measured_stages)
    return row


def one_round(name: str, dirs: dict[str, str], env: dict[str, str], candidates: bool,
              trace: Path | None = None) -> dict[str, Any]:
    margs = model_args(name, dirs)
    out: dict[str, Any] = {"profile": profile_check(margs, env)}
    out["auto"] = auto = train(margs, ["--schedule", "auto"], env, trace)
    if candidates and auto.get("status") == "ok":
        fixed = []
        for c in auto.get("candidates", []):
            row = train(margs, ["--schedule", c["schedule"], "--microbatches", str(c["microbatches"]),
                                "--config", c["config"]], env)
            if row.get("status") == "ok":
                row["predicted_s"] = c["predicted_time_per_minibatch"]
                row["error"] = abs(row["predicted_s"] - row["measured_s"]) / row["measured_s"]
            fixed.append(row)
        out["fixed"] = fixed
    return out


def _fmt(x: float | None, scale: float = 1e3) -> str:
    return "-" if x is None else f"{x * scale:.1f}"


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| model | round | profile / own step | auto chose | predicted ms | measured ms | error "
             "| compute in run / predicted |", "|---|---|---|---|---|---|---|---|"]
    for name, rounds in results.items():
        for i, r in enumerate(rounds, 1):
            p, a = r["profile"], r["auto"]
            ratio = f"{p['ratio']:.2f} ({p['profile_ms']:.1f} / {p['own_step_ms']:.1f} ms)" if p["status"] == "ok" \
                else "failed"
            chose = f"{a['schedule']} m={a['microbatches']} `{a['config']}`" if a["status"] == "ok" else "failed"
            err = f"{a['error']:.2f}" if a.get("error") is not None else "-"
            comp = f"{a['compute_ratio']:.2f}" if a.get("compute_ratio") is not None else "-"
            lines.append(f"| {DESCRIPTION[name]} | {i} | {ratio} | {chose} | {_fmt(a.get('predicted_s'))} | "
                         f"{_fmt(a.get('measured_s'))} | {err} | {comp} |")
    return "\n".join(lines)


def fixed_table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| model | round | configuration | predicted ms | measured ms | error |", "|---|---|---|---|---|---|"]
    for name, rounds in results.items():
        for i, r in enumerate(rounds, 1):
            for f in r.get("fixed", []):
                if f["status"] != "ok":
                    continue
                lines.append(f"| {name} | {i} | {f['schedule']} m={f['microbatches']} `{f['config']}` | "
                             f"{_fmt(f['predicted_s'])} | {_fmt(f['measured_s'])} | {f['error']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,bert,t5,gpt",
                    help=f"comma-separated: llama, bert, t5, gpt, {', '.join(OTHER_CONFIGS)}, "
                         f"{', '.join(DEFAULT_CONFIGS)}; 'others' or 'defaults' for each group")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--candidates", action="store_true", help="also run every candidate the choice predicted")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--pythonpath", default=None, help="run this checkout's pipetrain instead (the code before)")
    args = ap.parse_args(argv)
    groups = {"others": list(OTHER_CONFIGS), "defaults": list(DEFAULT_CONFIGS)}
    names = [m for n in args.models.split(",") if n for m in groups.get(n, [n])]
    unknown = sorted(set(names) - set(DESCRIPTION))
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; choose from {', '.join(DESCRIPTION)}")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="pipetrain-predict-") as tmp:
        dirs = {}
        for n in names:
            if n in HF_CONFIGS:
                dirs[n] = str(Path(tmp) / n)
                write_hf(n, dirs[n])
        for r in range(args.rounds):
            for n in names:
                cache = Path(tmp) / f"cache-{n}-{r}"  # each round's choice measures everything again
                env = {**os.environ, "PIPETRAIN_CACHE": str(cache)}
                if args.pythonpath:
                    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.pythonpath, env.get("PYTHONPATH")) if p)
                    env["PREDICT_CWD"] = args.pythonpath
                results[n].append(one_round(n, dirs, env, args.candidates, Path(tmp) / f"trace-{n}-{r}"))
                a = results[n][-1]["auto"]
                print(f"{n} round {r + 1}: profile {results[n][-1]['profile'].get('ratio')}, auto "
                      f"{a.get('schedule')} m={a.get('microbatches')} {a.get('config')}: predicted "
                      f"{_fmt(a.get('predicted_s'))} ms, measured {_fmt(a.get('measured_s'))} ms, compute in run "
                      f"/ predicted {a.get('compute_ratio')}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    if args.candidates:
        print()
        print(fixed_table(results))


if __name__ == "__main__":
    main()
