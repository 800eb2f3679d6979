"""The decoder config of a run folder (its run header's ``model_config``), or a :class:`ConfigError`
that names the file and the field: for the commands that need a language model's run (``export``,
``generate``) and must refuse a ViT or BERT run, or a damaged header, in one line.

    cfg = run_decoder_config("runs/ft", "export")    # DecoderConfig, or ConfigError naming metrics.jsonl
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict

from meshtrain.errors import ConfigError
from meshtrain.models import DecoderConfig
from meshtrain.train.rundir import METRICS_FILE
from meshtrain.train.sources import run_header

#: DecoderConfig's integer fields that must be at least 1 (the others: at least 0).
POSITIVE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len",
            "experts_per_token")
FIELDS = {f.name: f for f in dataclasses.fields(DecoderConfig)}
REQUIRED = [f.name for f in dataclasses.fields(DecoderConfig)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field_problem(name: str, value: Any) -> str:
    """What is wrong with ``value`` for DecoderConfig field ``name`` ('' when nothing)."""
    kind = str(FIELDS[name].type)
    if name == "rope_scaling":
        ok = value is None or (isinstance(value, (list, tuple)) and len(value) == 4 and all(map(_number, value)))
        return "" if ok else "null or [factor, low_freq_factor, high_freq_factor, original_context]"
    if value is None and kind.startswith("Optional"):
        return ""
    if "int" == kind:
        low = 1 if name in POSITIVE else 0
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        return "" if ok else f"an integer >= {low}"
    if "float" in kind:
        return "" if _number(value) else "a number"
    if kind == "bool":
        return "" if isinstance(value, bool) else "true or false"
    if kind == "str":
        return "" if isinstance(value, str) else "a string"
    return ""


def run_decoder_config(run: str, command: str) -> DecoderConfig:
    """The :class:`DecoderConfig` run folder ``run`` trained (its ``metrics.jsonl`` run header);
    ``command`` (e.g. ``"export"``) is named in the refusal of a run that is not a decoder's."""
    header = run_header(run)
    path = os.path.join(run, METRICS_FILE)
    if header is None:
        raise ConfigError(f"{run!r} is not a run folder (no run header in {METRICS_FILE}); pass a folder `meshtrain "
                          f"train` or `meshtrain import` wrote")
    config: Dict[str, Any] = header.get("model_config")
    settings = header.get("run_settings") if isinstance(header.get("run_settings"), dict) else {}
    model = settings.get("model", "?")
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the run header's model_config is {config!r}, not a model's fields; `meshtrain "
                          f"{command}` needs a decoder run (a language model such as tiny, small or an imported "
                          f"HuggingFace model)")
    unknown = sorted(set(config) - set(FIELDS))
    if unknown:
        raise ConfigError(f"run {run!r} trained model {model!r}, which is not a decoder (its model_config has "
                          f"{', '.join(unknown[:3])}); `meshtrain {command}` needs a decoder run (a language model "
                          f"such as tiny, small or an imported HuggingFace model)")
    missing = [name for name in REQUIRED if name not in config]
    if missing:
        raise ConfigError(f"{path}: the run header's model_config lacks {missing}; the file is damaged: restore it "
                          f"from a copy of the run")
    for name, value in config.items():
        problem = _field_problem(name, value)
        if problem:
            raise ConfigError(f"{path}: the run header's model_config.{name}={value!r} is not valid: it must be "
                              f"{problem}; the file is damaged: restore it from a copy of the run")
    if config["n_heads"] % config["n_kv_heads"]:
        raise ConfigError(f"{path}: the run header's model_config.n_heads={config['n_heads']} is not a multiple of "
                          f"n_kv_heads={config['n_kv_heads']}; the file is damaged: restore it from a copy of the run")
    try:
        return DecoderConfig(**config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
