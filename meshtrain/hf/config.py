"""HuggingFace ``config.json`` ↔ :class:`~meshtrain.models.DecoderConfig`.

Supported: Llama 2/3/3.1 (``llama``, with Llama 3's rope scaling and tied or untied heads), Mistral
(``mistral``), Mixtral (``mixtral``, dropless MoE), Qwen2 (``qwen2``: q/k/v biases) and Gemma
(``gemma``: GeGLU, ``1 + w`` norms, ``sqrt(d)`` embedding scale, tied head). Anything a field asks
for that meshtrain's decoder does not compute (output or MLP biases, another rope scaling, a
sliding window shorter than the context, another activation) is refused by name here, before a
weight is read, rather than imported into a model that would compute something else. Example::

    cfg = decoder_config(read_hf_config("Llama-3-8B"))     # DecoderConfig(name='Llama-3-8B', ...)
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from meshtrain.errors import ConfigError
from meshtrain.hf.validate import check_config
from meshtrain.models import DecoderConfig

CONFIG_FILE = "config.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "gemma": "GemmaForCausalLM"}
#: HF activation names → meshtrain's ``mlp_activation``.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a folder with a HuggingFace ``config.json`` (and no meshtrain run in it)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_hf_config(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{folder!r} holds no {CONFIG_FILE}: pass a HuggingFace model folder (config.json and "
                          f"*.safetensors)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path!r} is not a JSON object")
    return config


def _refuse(folder: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{folder}/{CONFIG_FILE}: {key}={value!r} is not supported ({why}); meshtrain imports "
                       f"{', '.join(sorted(ARCHITECTURES))} models without it")


def decoder_config(hf: Dict[str, Any], name: str = "hf", folder: str = "") -> DecoderConfig:
    """The :class:`DecoderConfig` computing what HuggingFace's model of ``hf`` computes."""
    where = folder or name
    kind = hf.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise ConfigError(f"{where}/{CONFIG_FILE}: model_type {kind!r} is not supported; meshtrain imports "
                          f"{sorted(ARCHITECTURES)}")
    check_config(hf, where)  # every field read below: its type and range, named with its value
    try:
        d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = dict(vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]),
                      n_heads=n, n_kv_heads=int(hf.get("num_key_value_heads") or n),
                      head_dim=int(hf.get("head_dim") or d // n), d_ff=int(hf["intermediate_size"]),
                      max_seq_len=int(hf.get("max_position_embeddings", 4096)),
                      rope_theta=float(hf.get("rope_theta", 10_000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    except KeyError as exc:
        raise ConfigError(f"{where}/{CONFIG_FILE}: the field {exc.args[0]!r} is missing") from None
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS or (kind != "gemma" and act != "silu"):
        raise _refuse(where, "hidden_act", act, "meshtrain's MLP is SwiGLU (silu), or GeGLU (gelu tanh) for gemma")
    fields["mlp_activation"] = ACTIVATIONS[act]
    if hf.get("mlp_bias"):
        raise _refuse(where, "mlp_bias", hf["mlp_bias"], "meshtrain's MLP has no biases")
    if hf.get("attention_bias"):
        raise _refuse(where, "attention_bias", hf["attention_bias"], "biases on all four attention projections; "
                      "meshtrain has q/k/v biases only (qwen2)")
    fields["qkv_bias"] = kind == "qwen2"
    scaling = hf.get("rope_scaling")
    if scaling:
        kind_of = scaling.get("rope_type") or scaling.get("type")
        if kind_of != "llama3":
            raise _refuse(where, "rope_scaling", scaling, "meshtrain implements Llama 3's rope scaling only")
        try:
            fields["rope_scaling"] = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                      float(scaling["high_freq_factor"]),
                                      int(scaling["original_max_position_embeddings"]))
        except KeyError as exc:
            raise ConfigError(f"{where}/{CONFIG_FILE}: rope_scaling of type llama3 lacks {exc.args[0]!r}") from None
    tied = hf.get("tie_word_embeddings", kind == "gemma")
    fields.update(tie_embeddings=bool(tied), tied_head_scale=1.0 if tied else None)
    if kind == "gemma":
        fields.update(norm_offset=1.0, embed_scale=float(d) ** 0.5)
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) and int(window) < fields["max_seq_len"]:
        raise _refuse(where, "sliding_window", window, f"meshtrain attends over the whole context; a window of at "
                      f"least max_position_embeddings={fields['max_seq_len']} (or null) imports")
    if kind == "mixtral":
        fields.update(n_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                      capacity_factor=None,  # HF computes every routed token: dropless
                      router_aux_coef=float(hf.get("router_aux_loss_coef", 0.02)), router_z_coef=0.0,
                      router_norm_topk=True)
    return DecoderConfig(name, **fields)


def hf_config(cfg: DecoderConfig, dtype: str) -> Dict[str, Any]:
    """The ``config.json`` that :func:`decoder_config` reads back as ``cfg`` (export)."""
    kind = ("mixtral" if cfg.n_experts else "gemma" if cfg.norm_offset else "qwen2" if cfg.qkv_bias else "llama")
    if cfg.tie_embeddings and cfg.tied_head_scale != 1.0:
        raise ConfigError(f"model {cfg.name!r} ties its embeddings with logits scaled by d_model^-0.5 (meshtrain's "
                          f"own tied head); HuggingFace's models compute unscaled tied logits: export an untied model")
    if kind == "gemma" and (cfg.embed_scale != cfg.d_model ** 0.5 or cfg.mlp_activation != "gelu_tanh"):
        raise ConfigError(f"model {cfg.name!r}: a 1 + w norm offset exports as gemma, which also needs embed_scale "
                          f"sqrt(d_model) and mlp_activation gelu_tanh")
    if cfg.n_experts and (cfg.n_shared_experts or cfg.capacity_factor is not None or not cfg.router_norm_topk):
        raise ConfigError(f"model {cfg.name!r}: Mixtral's layout has dropless routing, renormalised top-k and no "
                          f"shared experts; this MoE config (capacity_factor={cfg.capacity_factor}, n_shared_experts="
                          f"{cfg.n_shared_experts}, router_norm_topk={cfg.router_norm_topk}) does not export")
    out: Dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "gelu_pytorch_tanh" if kind == "gemma" else "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "rope_scaling": None, "torch_dtype": dtype,
    }
    if cfg.rope_scaling:
        factor, low, high, original = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": original}
    if kind == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.router_aux_coef, sliding_window=None)
    return out
