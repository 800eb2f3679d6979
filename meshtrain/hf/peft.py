"""LoRA exports: the adapters merged into the base (a plain HuggingFace folder's weights), or the adapters
alone in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``, tensors named
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; PEFT's ``lora_A`` is ``(r, in)`` and
``lora_B`` ``(out, r)``, so HF's ``W (out, in) += alpha/r · lora_B @ lora_A``).

Both take flat host dicts ``{path: array}`` of a LoRA state (``.../wq_dnh/lora_a``, ``.../lora_b``,
``.../base`` [``.../base_scale``], and the frozen weights at their own paths)::

    merged = merge_lora(flat_params, flat_model_state, lora)        # {path: f32 array} like the base model's
    write_peft_adapters(cfg, flat_params, lora, "runs/adapter")
"""

from __future__ import annotations

import enum
import json
import os
from typing import Dict

import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.hf.weights import mappings
from meshtrain.models import DecoderConfig
from meshtrain.models.lora import LoRAConfig, adapter_pairs, merge_adapters

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class LoRAExport(str, enum.Enum):
    """What ``meshtrain export --lora`` writes of a LoRA run: ``merged`` (a plain HuggingFace folder, the
    adapters merged into the base) or ``adapters`` (PEFT's adapter folder, to load on the base model)."""

    MERGED = "merged"
    ADAPTERS = "adapters"


def merge_lora(params: Dict[str, np.ndarray], model_state: Dict[str, np.ndarray], lora: LoRAConfig,
               dtype=np.float32) -> Dict[str, np.ndarray]:
    """The base model's weights with every adapter merged: ``base + (alpha / r) · A @ B`` (computed in
    float64, rounded once to ``dtype``); frozen weights as they are (int8 bases dequantised). See
    :func:`meshtrain.models.lora.merge_adapters`."""
    return merge_adapters(params, model_state, lora.scale, dtype)


def _module(name: str) -> str:
    return name.rsplit(".", 2)[-2]  # model.layers.{l}.self_attn.q_proj.weight -> q_proj


def peft_tensors(cfg: DecoderConfig, params: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``{PEFT name: tensor}`` of the adapters (lora_A ``(r, in)``, lora_B ``(out, r)``, per layer)."""
    by_path = {m.path: m for m in mappings(cfg)}
    out = {}
    for path, (a, b) in adapter_pairs(params).items():
        m = by_path.get(path)
        if m is None or m.per_expert:
            raise ConfigError(f"LoRA target {path} has no HuggingFace/PEFT counterpart; adapt q,k,v,o,gate,up,down "
                              f"or head to export adapters in PEFT's layout (or export merged weights)")
        r = a.shape[-1]
        layers = range(a.shape[0]) if m.per_layer else [None]
        for l in layers:
            al, bl = (a, b) if l is None else (a[l], b[l])
            stem = "base_model.model." + m.name.format(l=l)[:-len(".weight")]
            out[stem + ".lora_A.weight"] = np.ascontiguousarray(al.reshape(-1, r).T.astype(np.float32))
            out[stem + ".lora_B.weight"] = np.ascontiguousarray(bl.reshape(r, -1).T.astype(np.float32))
    return out


def write_peft_adapters(cfg: DecoderConfig, params: Dict[str, np.ndarray], lora: LoRAConfig, out: str,
                        base_model: str = "") -> Dict[str, int]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's layout) into folder ``out``."""
    from safetensors.numpy import save_file  # lazy: only exports need it

    tensors = peft_tensors(cfg, params)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    targets = sorted({_module(n[:-len(".lora_A.weight")] + ".weight") for n in tensors if n.endswith("lora_A.weight")})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": base_model, "inference_mode": True}
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return {"tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values())}


