"""Hugging Face model directories for the benchmarks: ``save_pretrained`` of a model built
from a config, in a child process (so that the benchmark's own process stays small and
imports no ``transformers``)."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any


def save_pretrained(config_cls: str, model_cls: str, fields: Mapping[str, Any], directory: str,
                    env: Mapping[str, str] | None = None, seed: int = 0) -> None:
    """``transformers.<model_cls>(transformers.<config_cls>(**fields)).save_pretrained(directory)``,
    its weights drawn after ``torch.manual_seed(seed)``."""
    code = ("import json, sys, torch, transformers\n"
            f"torch.manual_seed({int(seed)})\n"
            f"config = transformers.{config_cls}(**json.loads(sys.argv[1]))\n"
            f"transformers.{model_cls}(config).save_pretrained(sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(dict(fields)), directory], check=True, capture_output=True,
                   env=None if env is None else dict(env))
