"""Named decoder configs: ``tiny`` (tests), ``small`` (the laptop main job), and shape-only Llama 3
configs for planning at scale (their parameter counts match the published 8B / 70B / 405B)."""

from __future__ import annotations

import dataclasses
from typing import Dict

from meshtrain.errors import ConfigError
from meshtrain.models.decoder import Decoder, DecoderConfig

_BYTES = 256  # byte-level vocabulary of the embedded corpus

CONFIGS: Dict[str, DecoderConfig] = {c.name: c for c in [
    DecoderConfig("tiny", _BYTES, d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8, d_ff=128,
                  max_seq_len=256),
    DecoderConfig("small", _BYTES, d_model=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=16, d_ff=768,
                  max_seq_len=512),
    DecoderConfig("llama3-8b", 128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                  d_ff=14_336, max_seq_len=8192, rope_theta=500_000.0),
    DecoderConfig("llama3-70b", 128_256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                  d_ff=28_672, max_seq_len=8192, rope_theta=500_000.0),
    DecoderConfig("llama3-405b", 128_256, d_model=16_384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128,
                  d_ff=53_248, max_seq_len=8192, rope_theta=500_000.0),
]}


def get_config(name: str, **overrides) -> DecoderConfig:
    """A named config, optionally with fields replaced (``get_config("small", n_layers=32)``)."""
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def model_factory(cfg: "DecoderConfig | str"):
    """``rngs -> Decoder``: what :func:`meshtrain.abstract_state` and the Trainer take."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    return lambda rngs: Decoder(cfg, rngs=rngs)
