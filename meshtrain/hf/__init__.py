"""HuggingFace interoperability: ``config.json`` and ``*.safetensors`` (PyTorch naming) in and out.

Import reads each device's blocks straight from the memory-mapped files onto the plan's shardings
(:func:`load_params`); export writes a folder ``transformers`` loads (:func:`write_folder`).
"""

from meshtrain.hf.config import decoder_config, hf_config, is_hf_folder, read_hf_config
from meshtrain.hf.convert import GENERATION_FILE, load_params, model_config, source_dtype, write_folder

__all__ = ["GENERATION_FILE", "decoder_config", "hf_config", "is_hf_folder", "load_params", "model_config",
           "read_hf_config", "source_dtype", "write_folder"]
