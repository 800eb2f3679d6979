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

import json
import os
from typing import Dict

import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.hf.weights import mappings
from meshtrain.models import DecoderConfig
from meshtrain.models.lora import LoRAConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _adapted(params: Dict[str, np.ndarray]) -> Dict[str, tuple]:
    """``{weight path: (A, B)}`` of the adapters in ``params``."""
    return {p[:-len("/lora_a")]: (params[p], params[p[:-len("/lora_a")] + "/lora_b"])
            for p in params if p.endswith("/lora_a")}


def delta(a: np.ndarray, b: np.ndarray, ndim: int) -> np.ndarray:
    """``A @ B`` in the shape of the weight (``ndim`` dims), in float64: the products of f32 values are exact
    and the sum over r is rounded once, at the end. ``A``: ``(stacked..., in..., r)``, ``B``:
    ``(stacked..., r, out...)``, so the stacked dims number ``a.ndim + b.ndim - 2 - ndim``."""
    lead, r = a.ndim + b.ndim - 2 - ndim, a.shape[-1]
    a2 = a.astype(np.float64).reshape(a.shape[:lead] + (-1, r))
    b2 = b.astype(np.float64).reshape(b.shape[:lead] + (r, -1))
    return np.matmul(a2, b2).reshape(a.shape[:-1] + b.shape[lead + 1:])


def merge_lora(params: Dict[str, np.ndarray], model_state: Dict[str, np.ndarray], lora: LoRAConfig,
               dtype=np.float32) -> Dict[str, np.ndarray]:
    """The base model's weights with every adapter merged: ``base + (alpha / r) · A @ B`` (computed in
    float64, rounded once to ``dtype``); frozen weights as they are (int8 bases dequantised)."""
    adapted = _adapted(params)
    out = {}
    for path, value in model_state.items():
        weight = path.rsplit("/", 1)[0]
        if path.endswith("/base") and weight in adapted:
            base = np.asarray(value, np.float64)
            a, b = adapted[weight]
            scale = model_state.get(weight + "/base_scale")
            if scale is not None:  # int8: one scale per output channel, broadcast over the input dims
                n_in = base.ndim - np.ndim(scale)
                lead = a.ndim - 1 - n_in
                base = base * np.expand_dims(np.asarray(scale, np.float64), tuple(range(lead, lead + n_in)))
            out[weight] = (base + lora.scale * delta(a, b, base.ndim)).astype(dtype)
        elif not path.endswith("/base_scale") and weight not in adapted:
            out[path] = np.asarray(value)
    return out


def _module(name: str) -> str:
    return name.rsplit(".", 2)[-2]  # model.layers.{l}.self_attn.q_proj.weight -> q_proj


def peft_tensors(cfg: DecoderConfig, params: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``{PEFT name: tensor}`` of the adapters (lora_A ``(r, in)``, lora_B ``(out, r)``, per layer)."""
    by_path = {m.path: m for m in mappings(cfg)}
    out = {}
    for path, (a, b) in _adapted(params).items():
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


