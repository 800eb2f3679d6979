"""Reference models (Flax NNX, logical axis names only) and their named configs."""

from meshtrain.models.configs import CONFIGS, get_config, model_factory
from meshtrain.models.decoder import Decoder, DecoderConfig

__all__ = ["CONFIGS", "Decoder", "DecoderConfig", "get_config", "model_factory"]
