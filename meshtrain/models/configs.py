"""Named model configs.

Decoders: ``tiny`` (tests), ``small`` (the laptop main job), and shape-only Llama 2 / 3 / 3.1
configs for planning at scale (their parameter counts match the published 7B / 70B / 8B / 405B).

Encoders: ``vit-tiny`` / ``vit-small`` (8x8 greyscale digits, 10 classes; see
:mod:`meshtrain.data.images`), shape-only ``vit-b16`` (ViT-B/16, 224px, ImageNet-1k head);
``bert-tiny`` / ``bert-small`` (byte vocabulary + 4 special tokens, padded to 264, see
:mod:`meshtrain.data.mlm`), shape-only ``distilbert-base``. The tiny and small encoders have 8 heads
and widths divisible by 8, and the tiny/small ViTs mean-pool (16 tokens, no CLS), so every built-in
recipe (sequence parallelism included) fits them on 8 devices.

:func:`model_factory` builds the model class that matches the config's type.
"""

from __future__ import annotations

import dataclasses
import numbers
import typing
from typing import Dict, Union

from meshtrain.errors import ConfigError
from meshtrain.models.bert import Bert, BertConfig
from meshtrain.models.decoder import Decoder, DecoderConfig
from meshtrain.models.vit import ViT, ViTConfig

_BYTES = 256  # byte-level vocabulary of the embedded corpus
# Bytes + [PAD] [CLS] [SEP] [MASK] (meshtrain.data.mlm) = 260 ids, padded to 264 (a multiple of 8)
# so the tied embedding splits over tensor-parallel meshes of 2, 4 or 8; ids 260..263 are unused.
_BYTES_MLM = 264

ModelConfig = Union[DecoderConfig, ViTConfig, BertConfig]

CONFIGS: Dict[str, ModelConfig] = {c.name: c for c in [
    DecoderConfig("tiny", _BYTES, d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8, d_ff=128,
                  max_seq_len=256),
    DecoderConfig("small", _BYTES, d_model=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=16, d_ff=768,
                  max_seq_len=4096),
    # Llama 2 (MHA at 7B, GQA at 70B, 4k context, 32k vocabulary): MaxText's published MFU runs.
    DecoderConfig("llama2-7b", 32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                  d_ff=11_008, max_seq_len=4096),
    DecoderConfig("llama2-70b", 32_000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                  d_ff=28_672, max_seq_len=4096),
    DecoderConfig("llama3-8b", 128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                  d_ff=14_336, max_seq_len=8192, rope_theta=500_000.0),
    DecoderConfig("llama3.1-8b", 128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                  d_ff=14_336, max_seq_len=131_072, rope_theta=500_000.0, rope_scaling=(8.0, 1.0, 4.0, 8192)),
    DecoderConfig("llama3-70b", 128_256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                  d_ff=28_672, max_seq_len=8192, rope_theta=500_000.0),
    DecoderConfig("llama3-405b", 128_256, d_model=16_384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128,
                  d_ff=53_248, max_seq_len=8192, rope_theta=500_000.0),
    # Mixture of experts: trainable tiny/small, shape-only published models (totals in tests/test_moe.py).
    DecoderConfig("tiny-moe", _BYTES, d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8, d_ff=128,
                  max_seq_len=256, n_experts=8, experts_per_token=2, d_expert=32, n_shared_experts=1),
    DecoderConfig("small-moe", _BYTES, d_model=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=16, d_ff=768,
                  max_seq_len=512, n_experts=8, experts_per_token=2, d_expert=256),
    DecoderConfig("mixtral-8x7b", 32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                  d_ff=14_336, max_seq_len=32_768, rope_theta=1e6, n_experts=8, experts_per_token=2),
    DecoderConfig("qwen3-30b-a3b", 151_936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                  d_ff=6144, max_seq_len=32_768, rope_theta=1e6, n_experts=128, experts_per_token=8, d_expert=768),
    DecoderConfig("qwen1.5-moe-a2.7b", 151_936, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16,
                  head_dim=128, d_ff=5632, max_seq_len=8192, rope_theta=1e6, n_experts=60, experts_per_token=4,
                  d_expert=1408, n_shared_experts=4, router_norm_topk=False),
    ViTConfig("vit-tiny", image_size=8, patch_size=2, channels=1, num_classes=10, d_model=64, n_layers=2,
              n_heads=8, head_dim=8, d_ff=128, dropout=0.1, pool="mean"),
    ViTConfig("vit-small", image_size=8, patch_size=2, channels=1, num_classes=10, d_model=256, n_layers=6,
              n_heads=8, head_dim=32, d_ff=1024, dropout=0.1, pool="mean"),
    ViTConfig("vit-b16", image_size=224, patch_size=16, channels=3, num_classes=1000, d_model=768, n_layers=12,
              n_heads=12, head_dim=64, d_ff=3072, dropout=0.0),
    BertConfig("bert-tiny", _BYTES_MLM, max_positions=256, d_model=64, n_layers=2, n_heads=8, head_dim=8,
               d_ff=256, dropout=0.1),
    BertConfig("bert-small", _BYTES_MLM, max_positions=512, d_model=256, n_layers=4, n_heads=8, head_dim=32,
               d_ff=1024, dropout=0.1),
    BertConfig("distilbert-base", 30_522, max_positions=512, d_model=768, n_layers=6, n_heads=12, head_dim=64,
               d_ff=3072, dropout=0.1),
]}


def get_config(name: str, **overrides) -> ModelConfig:
    """A named config, optionally with fields replaced (``get_config("small", n_layers=32)``)."""
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


_MODELS = {DecoderConfig: Decoder, ViTConfig: ViT, BertConfig: Bert}


def model_factory(cfg: "ModelConfig | str"):
    """``rngs -> model`` (``Decoder``, ``ViT`` or ``Bert`` by the config's type): what
    :func:`meshtrain.abstract_state` and the Trainer take."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    try:
        cls = _MODELS[type(cfg)]
    except KeyError:
        raise ConfigError(f"no model class for config {cfg!r}; use one of {', '.join(CONFIGS)}") from None
    return lambda rngs: cls(cfg, rngs=rngs)


#: Integer fields that are sizes or counts of at least one (the configs' other integers may be 0).
_POSITIVE = frozenset({"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                       "max_seq_len", "image_size", "patch_size", "channels", "num_classes", "max_positions",
                       "num_labels"})


def config_from_fields(fields, where: str) -> ModelConfig:
    """The config a saved mapping of fields describes (a run header's ``model_config``): the class whose
    fields it has (decoder, ViT or BERT), every value of the field's type, or a ``ConfigError`` that
    names ``where`` (the file) and the field. A run's header is data: a damaged one must not surface as
    a ``TypeError`` deep in a constructor."""
    if not isinstance(fields, dict):
        raise ConfigError(f"{where}: model_config is a {type(fields).__name__}, not a mapping of config fields; "
                          f"the run header is damaged: train the run again or restore the file")
    cls, problem = _config_class(fields)
    if problem:
        raise ConfigError(f"{where}: model_config {problem}; the run header is damaged: train the run again or "
                          f"restore the file")
    hints = typing.get_type_hints(cls)
    for name, value in fields.items():
        if not _has_type(value, hints[name]) or (name in _POSITIVE and value < 1):
            want = "an integer >= 1" if name in _POSITIVE else _type_text(hints[name])
            raise ConfigError(f"{where}: model_config field {name!r} is {value!r}, expected {want} "
                              f"({cls.__name__}.{name}); the run header is damaged: train the run again or restore "
                              f"the file")
    try:
        return cls(**fields)
    except ConfigError as exc:  # a value of the right type out of its range (e.g. capacity_factor inf)
        raise ConfigError(f"{where}: model_config: {exc}") from None


def _config_class(fields: dict):
    """``(class, None)`` for the config class ``fields`` fit, else ``(closest class, what is wrong)``."""
    best = None
    for cls in (DecoderConfig, ViTConfig, BertConfig):
        known = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        unknown, missing = sorted(set(fields) - known, key=str), sorted(required - set(fields))
        if not unknown and not missing:
            return cls, None
        score = len(set(fields) & known)
        if best is None or score > best[0]:
            what = (f"has field {unknown[0]!r}, which {cls.__name__} does not" if unknown
                    else f"lacks the field {missing[0]!r} of {cls.__name__}")
            best = (score, cls, what)
    return best[1], best[2]


def _has_type(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        return isinstance(value, (list, tuple)) and (len(args) == len(value) or not args) and all(
            _has_type(v, a) for v, a in zip(value, args))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_text(hint) -> str:
    if typing.get_origin(hint) is Union:
        return " or ".join(_type_text(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {len(typing.get_args(hint))} values"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))
