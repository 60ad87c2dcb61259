"""Hugging Face architectures as users bring them: does each train on two stages as on one worker?

    python benchmarks/architectures.py                         # every architecture below
    python benchmarks/architectures.py --only mixtral,mamba --json out.json

For each architecture a small model is built from its config class's defaults with the sizes
of :data:`SMALL` wherever the config has that field (2 layers, width 64, 4 heads, vocabulary
128; :data:`EXTRA` where the defaults do not fit those sizes), written by ``save_pretrained``
into a temporary directory, and trained with ``pipetrain train --model hf:DIR --steps 2
--batch-size 4 --seq-len 16 --threads 1 --json``, once on one worker and once on two
(``--config 1-1 --schedule flush``). ``loss diff`` is the relative difference of their final
losses: flush on two stages computes what one worker does, so it is float rounding when the
pipeline is right. A model whose own eager forward fails (a config these sizes make
inconsistent) is reported as such, not as pipetrain's failure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

#: model_type -> the model class trained (a causal LM, a masked LM or an encoder-decoder)
ARCHITECTURES: dict[str, str] = {
    "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM", "cohere": "CohereForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM", "stablelm": "StableLmForCausalLM", "llama4_text": "Llama4ForCausalLM",
    "opt": "OPTForCausalLM", "gptj": "GPTJForCausalLM", "codegen": "CodeGenForCausalLM", "mpt": "MptForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM", "xglm": "XGLMForCausalLM",
    "electra": "ElectraForMaskedLM", "albert": "AlbertForMaskedLM", "deberta-v2": "DebertaV2ForMaskedLM",
    "mbart": "MBartForConditionalGeneration", "pegasus": "PegasusForConditionalGeneration",
    "mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM", "rwkv": "RwkvForCausalLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM", "jamba": "JambaForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
}
#: Sizes set wherever the config class has the field.
SMALL: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2,
    "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2, "num_attention_heads": 4,
    "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "max_position_embeddings": 64, "n_positions": 64, "head_dim": 16, "rotary_dim": 8,
}
#: Where the defaults do not fit :data:`SMALL` (fields a config would otherwise derive wrongly).
EXTRA: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4,
                    "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 2,
                    "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "num_experts": 4, "mamba_d_state": 8},
    "recurrent_gemma": {"num_hidden_layers": 3, "num_key_value_heads": 1, "lru_width": 64,
                        "attention_window_size": 16},
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32},
    "olmoe": {"num_experts": 8},
    "gpt_oss": {"num_local_experts": 8},
}

_BUILD = r"""
import inspect, json, sys, torch, transformers
model_type, cls, extra, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
small = json.loads(sys.argv[5])
base = transformers.AutoConfig.for_model(model_type)
fields = {k: v for k, v in small.items() if hasattr(base, k)}
if "layer_types" in inspect.signature(type(base).__init__).parameters:
    fields["layer_types"] = None                       # derived again from the layer count
for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
    if isinstance(getattr(base, token, None), int) and getattr(base, token) >= small["vocab_size"]:
        fields[token] = 0 if token == "pad_token_id" else 1
config = transformers.AutoConfig.for_model(model_type, **{**fields, **extra})
for k in dir(config):
    if ("dropout" in k or k.endswith("pdrop")) and isinstance(getattr(config, k, None), float):
        setattr(config, k, 0.0)
config.architectures = [cls]
torch.manual_seed(0)
model = getattr(transformers, cls)(config)
model.eval()
try:
    ids = torch.randint(0, small["vocab_size"], (2, 16))
    model(input_ids=ids, decoder_input_ids=ids) if config.is_encoder_decoder else model(input_ids=ids)
except Exception as exc:
    print(json.dumps({"eager": f"{type(exc).__name__}: {str(exc)[:160]}"}))
    sys.exit(0)
model.save_pretrained(out)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
"""


def build(model_type: str, cls: str, directory: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _BUILD, model_type, cls, json.dumps(EXTRA.get(model_type, {})),
                          directory, json.dumps(SMALL)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"build": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def train(directory: str, workers: int, env: dict[str, str]) -> dict[str, Any]:
    args = [sys.executable, "-m", "pipetrain", "train", "--model", f"hf:{directory}", "--steps", "2", "--batch-size",
            "4", "--seq-len", "16", "--threads", "1", "--json", "--log-every", "0", "--workers", str(workers),
            "--schedule", "flush", "--timeout", "240"] + (["--config", "1-1"] if workers > 1 else [])
    t0 = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.startswith("error")] or \
            out.stderr.strip().splitlines() or ["?"]
        return {"status": "failed", "message": lines[-1][:240]}
    return {"status": "ok", "final_loss": json.loads(out.stdout)["final_loss"], "wall_s": time.monotonic() - t0}


def _cell(r: dict[str, Any], key: str) -> str:
    run = r.get(key)
    if run is None:
        return r.get("build") or f"the model's own forward fails ({r.get('eager')})"
    return f"loss {run['final_loss']:.6f}" if run["status"] == "ok" else run["message"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated model types (default all: {', '.join(ARCHITECTURES)})")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        ap.error(f"unknown model type {unknown[0]!r}; choose from {', '.join(ARCHITECTURES)}")
    results: dict[str, Any] = {}
    print("| model type | class | parameters | one worker | two stages (flush 1-1) | loss diff |")
    print("|---|---|---:|---|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PIPETRAIN_CACHE": os.path.join(tmp, "cache")}
        for name in names:
            directory = os.path.join(tmp, name)
            r: dict[str, Any] = {"class": ARCHITECTURES[name], **build(name, ARCHITECTURES[name], directory)}
            if "parameters" in r:
                r["one"], r["two"] = train(directory, 1, env), train(directory, 2, env)
                if r["one"]["status"] == r["two"]["status"] == "ok":
                    a, b = r["one"]["final_loss"], r["two"]["final_loss"]
                    r["loss_diff"] = abs(a - b) / abs(a)
            results[name] = r
            diff = f"{r['loss_diff']:.1e}" if "loss_diff" in r else "-"
            print(f"| {name} | {r['class']} | {r.get('parameters', '-')} | {_cell(r, 'one')} | {_cell(r, 'two')} | "
                  f"{diff} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
