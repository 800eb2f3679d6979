"""Where a run's first weights come from: a HuggingFace folder (``config.json`` + ``*.safetensors``)
or another run folder (its checkpoint's parameters); and a run folder's header. What ``--model``
names is :mod:`meshtrain.model_source`'s business.

    initial_params("hf/Llama-3-8B", plan)     # onto the plan's shardings; the optimizer starts fresh
"""

from __future__ import annotations

import os

from meshtrain import hf
from meshtrain.checkpoint import Checkpointer
from meshtrain.errors import ConfigError
from meshtrain.model_source import SourceKind, run_header, source_kind
from meshtrain.models import DecoderConfig

__all__ = ["initial_params", "run_header"]


def initial_params(source: str, plan, model_cfg, notice=print):
    """The parameters in ``source`` (a HuggingFace folder, or a run folder's latest checkpoint) on
    ``plan``'s shardings; the caller's optimizer state starts fresh from them."""
    kind = source_kind(source, "--init-from") if os.path.isdir(source) and (
        hf.is_hf_folder(source) or run_header(source) is not None) else None   # else: refused below
    if kind is SourceKind.HF_FOLDER:
        if not isinstance(model_cfg, DecoderConfig):
            raise ConfigError(f"--init-from {source!r}: HuggingFace weights load into a decoder; the model here is "
                              f"{type(model_cfg).__name__}")
        params = hf.load_params(source, plan, model_cfg)
        notice(f"weights from {source} (HuggingFace); the optimizer starts fresh")
        return params
    checkpoints = os.path.join(source, "checkpoints")
    if kind is not SourceKind.RUN:
        raise ConfigError(f"--init-from {source!r} is neither a HuggingFace folder (config.json) nor a run folder "
                          f"with checkpoints/: give one of those")
    if not os.path.isdir(checkpoints):
        raise ConfigError(f"--init-from {source!r} is a run folder without checkpoints (train it with --ckpt-every N)")
    step, params = Checkpointer.read_params(checkpoints, plan)
    notice(f"weights from {source} step {step}; the optimizer starts fresh")
    return params
