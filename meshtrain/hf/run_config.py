"""The decoder config of a run folder (its run header's ``model_config``), or a :class:`ConfigError`
that names the file and the field: for the commands that need a language model's run (``export``,
``generate``) and must refuse a ViT or BERT run, or a damaged header, in one line.

    cfg = run_decoder_config("runs/ft", "export")    # DecoderConfig, or ConfigError naming metrics.jsonl
"""

from __future__ import annotations

import os

from meshtrain.errors import ConfigError
from meshtrain.models import DecoderConfig
from meshtrain.models.configs import config_from_fields
from meshtrain.train.rundir import METRICS_FILE
from meshtrain.train.sources import run_header


def run_decoder_config(run: str, command: str) -> DecoderConfig:
    """The :class:`DecoderConfig` run folder ``run`` trained (its ``metrics.jsonl`` run header);
    ``command`` (e.g. ``"export"``) is named in the refusal of a run that is not a decoder's."""
    header = run_header(run)
    path = os.path.join(run, METRICS_FILE)
    if header is None:
        raise ConfigError(f"{run!r} is not a run folder (no run header in {METRICS_FILE}); pass a folder `meshtrain "
                          f"train` or `meshtrain import` wrote")
    config = config_from_fields(header.get("model_config"), path)   # names the file and the field
    if not isinstance(config, DecoderConfig):
        model = (header.get("run_settings") or {}).get("model", "?") if isinstance(
            header.get("run_settings"), dict) else "?"
        raise ConfigError(f"run {run!r} trained model {model!r} ({type(config).__name__}), which is not a decoder; "
                          f"`meshtrain {command}` needs a decoder run (a language model such as tiny, small or an "
                          f"imported HuggingFace model)")
    return config
