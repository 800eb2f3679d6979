"""Checks of a HuggingFace folder before anything is converted: every ``config.json`` field the import
reads (its type and range), the tensors' dtypes and the tokenizer. Each refusal is a
:class:`ConfigError` naming the file, the field and its value, and what to change.

    check_config(json.load(open("Llama/config.json")), "Llama")   # raises on vocab_size: 0, ...
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict

from meshtrain.errors import ConfigError

CONFIG_FILE = "config.json"
#: Fields every supported config.json must hold: positive integers.
REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: Optional positive integers; ``null`` means "the default" for these (HF writes ``head_dim: null``).
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "sliding_window")
#: Optional positive integers where ``null`` means nothing meshtrain could use.
OPTIONAL_STRICT_SIZES = ("max_position_embeddings",)
#: Optional positive, finite numbers (``null`` refused: the model needs a value).
POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps")
#: Optional flags (``null``: absent).
FLAGS = ("mlp_bias", "attention_bias", "tie_word_embeddings", "use_sliding_window")
#: Optional names (``null``: absent).
NAMES = ("hidden_act", "hidden_activation")
#: Tensor dtypes (safetensors' names) that hold weights meshtrain converts to its parameter dtype.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _bad(where: str, key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"{where}/{CONFIG_FILE}: {key}={value!r} is not valid: it must be {want}; fix that field "
                       f"(or use the config.json published with these weights)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(hf: Dict[str, Any], where: str, key: str, null_ok: bool) -> None:
    value = hf.get(key)
    if value is None and (null_ok or key not in hf):
        return
    if not _is_int(value) or value < 1:
        raise _bad(where, key, value, "a positive integer" + (" or null" if null_ok else ""))


def check_config(hf: Dict[str, Any], where: str) -> None:
    """Refuse any field of ``hf`` (a parsed config.json of folder ``where``) that the import reads
    and that has the wrong type or an impossible value, before anything is built from it."""
    for key in REQUIRED_SIZES:
        if key not in hf:
            raise ConfigError(f"{where}/{CONFIG_FILE}: the field {key!r} is missing; use the config.json published "
                              f"with these weights")
        _positive_int(hf, where, key, null_ok=False)
    for key in OPTIONAL_SIZES:
        _positive_int(hf, where, key, null_ok=True)
    for key in OPTIONAL_STRICT_SIZES:
        _positive_int(hf, where, key, null_ok=False)
    for key in POSITIVE_NUMBERS:
        if key in hf and not (_is_number(hf[key]) and hf[key] > 0):
            raise _bad(where, key, hf[key], "a positive number")
    for key in FLAGS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise _bad(where, key, hf[key], "true, false or null")
    for key in NAMES:
        if hf.get(key) is not None and not isinstance(hf[key], str):
            raise _bad(where, key, hf[key], "a name such as \"silu\", or null")
    _check_rope_scaling(hf, where)
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:
        raise ConfigError(f"{where}/{CONFIG_FILE}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv}; grouped-query attention shares each key/value head among "
                          f"the same number of query heads: fix one of the two fields")
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        raise ConfigError(f"{where}/{CONFIG_FILE}: hidden_size={hf['hidden_size']} is not a multiple of "
                          f"num_attention_heads={heads} and there is no head_dim; add the model's head_dim")
    if hf.get("model_type") == "mixtral":
        for key in ("num_local_experts", "num_experts_per_tok"):
            if key not in hf:
                raise ConfigError(f"{where}/{CONFIG_FILE}: a mixtral config needs {key!r}, and it is missing; use "
                                  f"the config.json published with these weights")
            _positive_int(hf, where, key, null_ok=False)
        if hf["num_experts_per_tok"] > hf["num_local_experts"]:
            raise _bad(where, "num_experts_per_tok", hf["num_experts_per_tok"],
                       f"at most num_local_experts={hf['num_local_experts']}")
        coef = hf.get("router_aux_loss_coef")
        if "router_aux_loss_coef" in hf and not (_is_number(coef) and coef >= 0):
            raise _bad(where, "router_aux_loss_coef", coef, "a number >= 0")


def _check_rope_scaling(hf: Dict[str, Any], where: str) -> None:
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise _bad(where, "rope_scaling", scaling, "an object such as {\"rope_type\": \"llama3\", \"factor\": 8.0, "
                   "...}, or null")
    if not scaling:
        return
    kind = scaling.get("rope_type") or scaling.get("type")
    if not isinstance(kind, str):
        raise _bad(where, "rope_scaling.rope_type", kind, "the name of the scaling (meshtrain imports \"llama3\")")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key in scaling and not (_is_number(scaling[key]) and scaling[key] > 0):
            raise _bad(where, f"rope_scaling.{key}", scaling[key], "a positive number")
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (not _is_int(original) or original < 1):
        raise _bad(where, "rope_scaling.original_max_position_embeddings", original, "a positive integer")


def special_token_ids(hf: Dict[str, Any]) -> Dict[str, Any]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of ``hf`` that are valid ids of its
    vocabulary (an int, or for eos a list of ints); others are left out (they only label the export)."""
    vocab = hf.get("vocab_size") if _is_int(hf.get("vocab_size")) else 0
    ok = lambda i: _is_int(i) and 0 <= i < vocab  # noqa: E731
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        if ok(value) or (key == "eos_token_id" and isinstance(value, list) and value and all(map(ok, value))):
            out[key] = value
    return out


def check_tokenizer(folder: str) -> None:
    """A ``tokenizer.json`` in ``folder`` must load (it is copied into the run, and a broken one would
    only fail at `meshtrain generate`); a ``tokenizer_config.json`` must be a JSON object, and its chat
    template (or ``chat_template.jinja``'s) must compile."""
    from tokenizers import Tokenizer  # lazy: only imports with a tokenizer pay its import

    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        try:
            Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception for any parse error
            raise ConfigError(f"{path} does not load as a tokenizer ({str(exc)[:200]}); replace it with the model's "
                              f"own tokenizer.json, or remove it to import the weights without a tokenizer") from None
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        read_json_object(path)
    from meshtrain.data.chat import load_chat_template  # lazy: chat templates (jinja2) only when the folder has one

    load_chat_template(folder)  # a chat template that does not compile: refused now, naming the file and line


def check_generation_config(folder: str) -> None:
    """A ``generation_config.json`` in ``folder`` (copied into the run: its ``eos_token_id`` is where
    generation stops) must be a JSON object."""
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        read_json_object(path)


def read_json_object(path: str) -> dict:
    """A model folder's JSON file (``tokenizer_config.json``, ``generation_config.json``) as a dict; one that
    does not read, or is not a JSON object, is refused naming the file and the fix."""
    import json

    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); replace it with the model's own, or remove it") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} is not a JSON object; replace it with the model's own, or remove it")
    return value
