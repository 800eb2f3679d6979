"""Reference models (Flax NNX, logical axis names only) and their named configs; the Linen adapter."""

from meshtrain.models.bert import Bert, BertConfig, bert_classification_loss, mlm_loss
from meshtrain.models.configs import CONFIGS, get_config, model_factory
from meshtrain.models.decoder import Decoder, DecoderConfig
from meshtrain.models.linen import LinenFactory, Weights, from_linen
from meshtrain.models.moe import MoE, MoEConfig, moe_loss_terms, pop_moe_stats
from meshtrain.models.vit import ViT, ViTConfig, vit_loss

__all__ = ["Bert", "BertConfig", "CONFIGS", "Decoder", "DecoderConfig", "ViT", "ViTConfig",
           "bert_classification_loss", "LinenFactory", "Weights", "from_linen", "get_config", "mlm_loss", "model_factory", "vit_loss",
           "MoE", "MoEConfig", "moe_loss_terms", "pop_moe_stats"]
