"""Where a run's model and first weights come from: a built-in config name, a HuggingFace folder
(``config.json`` + ``*.safetensors``), or another run folder (its run header's model config, its
checkpoint's parameters).

    model_config_for("small")                 # the built-in config
    model_config_for("hf/Llama-3-8B")         # from config.json
    model_config_for("runs/imported")         # the model config the run trained (metrics.jsonl header)
    initial_params("hf/Llama-3-8B", plan)     # onto the plan's shardings; the optimizer starts fresh
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from meshtrain import hf
from meshtrain.checkpoint import Checkpointer
from meshtrain.errors import ConfigError
from meshtrain.models import DecoderConfig, get_config
from meshtrain.models.configs import config_from_fields
from meshtrain.train.rundir import METRICS_FILE


def run_header(run_dir: str) -> Optional[Dict[str, Any]]:
    """The run header (first ``start`` record of ``metrics.jsonl``) of ``run_dir``, or ``None``."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("event") == "start":
                    return record
    except (OSError, ValueError):
        return None
    return None


def model_config_for(name: str):
    """The model config ``name`` stands for: a HuggingFace folder, a run folder, or a built-in name."""
    if hf.is_hf_folder(name):
        return hf.model_config(name)
    if os.path.isdir(name):
        header = run_header(name)
        if header is None or not header.get("model_config"):
            raise ConfigError(f"--model {name!r} is a folder with neither a HuggingFace config.json nor a run "
                              f"header naming a built-in decoder (metrics.jsonl); pass a model name, a HuggingFace "
                              f"folder or a run folder")
        return config_from_fields(header["model_config"], os.path.join(name, METRICS_FILE))
    return get_config(name)


def initial_params(source: str, plan, model_cfg, notice=print):
    """The parameters in ``source`` (a HuggingFace folder, or a run folder's latest checkpoint) on
    ``plan``'s shardings; the caller's optimizer state starts fresh from them."""
    if hf.is_hf_folder(source):
        if not isinstance(model_cfg, DecoderConfig):
            raise ConfigError(f"--init-from {source!r}: HuggingFace weights load into a decoder; the model here is "
                              f"{type(model_cfg).__name__}")
        params = hf.load_params(source, plan, model_cfg)
        notice(f"weights from {source} (HuggingFace); the optimizer starts fresh")
        return params
    checkpoints = os.path.join(source, "checkpoints")
    if not os.path.isdir(checkpoints):
        what = ("a run folder without checkpoints (train it with --ckpt-every N)" if run_header(source) is not None
                else "neither a HuggingFace folder (config.json) nor a run folder with checkpoints/")
        raise ConfigError(f"--init-from {source!r} is {what}")
    step, params = Checkpointer.read_params(checkpoints, plan)
    notice(f"weights from {source} step {step}; the optimizer starts fresh")
    return params
