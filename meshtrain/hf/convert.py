"""Load HuggingFace weights onto a plan's shardings; write a model's parameters as a HuggingFace folder.

    params = load_params("Llama-3-8B", plan)            # each device reads its own blocks only
    write_folder(cfg, host_params, "out/", dtype="bfloat16", tokenizer_from="runs/ft")
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Optional

import jax
import numpy as np

from meshtrain.abstract import tree_paths
from meshtrain.data.tokenizer import copy_tokenizer_files
from meshtrain.errors import ConfigError
from meshtrain.hf.audit import audit
from meshtrain.hf.config import CONFIG_FILE, decoder_config, hf_config, read_hf_config
from meshtrain.hf.weights import (INDEX_FILE, SINGLE_FILE, SafetensorsFolder, block_reader, check_coverage,
                                  hf_tensors, mappings)
from meshtrain.hf.output import output_folder
from meshtrain.models import DecoderConfig

#: Largest safetensors file :func:`write_folder` writes before starting another (HF's own default: 5 GB).
MAX_SHARD_BYTES = 5 * 10 ** 9
#: transformers' generation defaults (the special token ids ``generate()`` starts and stops with).
GENERATION_FILE = "generation_config.json"
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


def model_config(folder: str) -> DecoderConfig:
    """The decoder config of HuggingFace folder ``folder`` (named after it)."""
    return decoder_config(read_hf_config(folder), os.path.basename(os.path.normpath(folder)), folder)


def load_params(folder: str, plan, cfg: Optional[DecoderConfig] = None):
    """The parameters in HF ``folder`` as a tree like ``plan.abstract.params``, each array created
    with its planned sharding from the blocks its devices hold (``jax.make_array_from_callback``:
    a process reads only its devices' slices of the memory-mapped files)."""
    cfg = cfg or model_config(folder)
    files = SafetensorsFolder(folder)
    abstract = plan.abstract.params
    paths = tree_paths(abstract)
    check_coverage(cfg, jax.tree.leaves(paths), folder)
    by_path = {m.path: m for m in mappings(cfg)}
    # every tensor's presence, shape and dtype before any is read; unread ones refused or reported
    for note in audit(files, cfg, {p: s.shape for p, s in zip(jax.tree.leaves(paths), jax.tree.leaves(abstract))}):
        warnings.warn(note, stacklevel=2)

    def one(path, sds, sharding):
        read = block_reader(files, by_path[path], sds.shape)
        return jax.make_array_from_callback(sds.shape, sharding, lambda index: read(index).astype(sds.dtype))

    return jax.tree.map(one, paths, abstract, plan.param_shardings)


def source_dtype(folder: str) -> str:
    """The dtype the HF folder stores (``torch_dtype`` of its config, else its first tensor's)."""
    config = read_hf_config(folder)
    declared = config.get("torch_dtype") or config.get("dtype")
    if declared in DTYPES:
        return declared
    stored = SafetensorsFolder(folder).dtype()
    return stored if stored in DTYPES else "float32"  # e.g. float64 weights: exported as float32


#: Fields of an imported config.json that an export does not carry over: the dtype is the export's own
#: (``torch_dtype``), and the writer's bookkeeping belongs to the writer.
NOT_CARRIED = ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "quantization_config")
#: The special ids: ``ids`` says which are declared (those of the vocabulary; others are dropped).
SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_config(cfg: DecoderConfig, dtype: str, ids: Dict[str, Any],
                  source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The exported ``config.json``: the imported one's fields (``source``: e.g. ``initializer_range``,
    ``attention_dropout``, ``use_cache``, which meshtrain does not compute with but transformers reads),
    overwritten by every field meshtrain's model determines (:func:`hf_config`) and the special ids."""
    carried = {k: v for k, v in (source or {}).items() if k not in NOT_CARRIED and k not in SPECIAL_ID_KEYS}
    return {**carried, **hf_config(cfg, dtype), **ids}


def write_folder(cfg: DecoderConfig, params: Dict[str, np.ndarray], out: str, *, dtype: str = "float32",
                 tokenizer_from: Optional[str] = None, max_shard_bytes: int = MAX_SHARD_BYTES,
                 special_ids: Optional[Dict[str, Any]] = None, guard=None,
                 source_config: Optional[Dict[str, Any]] = None,
                 source_generation: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write ``params`` (``{path: whole host array}``) as a HuggingFace folder ``out`` (config.json,
    safetensors in PyTorch naming, an index when there are several files, the tokenizer files of
    ``tokenizer_from`` when it has them, generation_config.json). ``special_ids``: the bos / eos /
    pad ids to declare (default: those of ``tokenizer_from``'s tokenizer). ``source_config`` /
    ``source_generation``: the imported folder's config.json and generation_config.json, whose other
    fields are carried over (:func:`export_config`; sampling settings such as ``temperature``). A tied
    head stays tied: no ``lm_head.weight``, ``tie_word_embeddings: true``. Written beside ``out`` and
    renamed at the end: on any error (a full disk: ``DiskError``) nothing is left at ``out``."""
    from safetensors.numpy import save_file  # lazy: only exports write safetensors

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    ids = special_ids if special_ids is not None else tokenizer_special_ids(tokenizer_from, cfg.vocab_size)
    config = export_config(cfg, dtype, ids, source_config)
    # the source's generation_config.json wins for generation (its eos may list several ids, e.g. a chat
    # model's end-of-turn token beside the end of text)
    generation = {**ids, **{k: v for k, v in (source_generation or {}).items() if k != "transformers_version"}}
    generation.setdefault("_from_model_config", source_generation is None)
    with output_folder(out, guard=guard) as partial:
        shards, current, size = [], {}, 0
        for name, tensor in hf_tensors(cfg, params):
            tensor = tensor.astype(DTYPES[dtype])
            if current and size + tensor.nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name] = tensor
            size += tensor.nbytes
        shards.append(current)
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(partial, file), metadata={"format": "pt"})  # "pt": transformers loads it
            weight_map.update({name: file for name in shard})
            total += sum(t.nbytes for t in shard.values())
        if len(shards) > 1:
            with open(os.path.join(partial, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(partial, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=1)
        with open(os.path.join(partial, GENERATION_FILE), "w") as f:  # transformers' generate() reads the ids here
            json.dump(generation, f, indent=1)
        copy_tokenizer_files(tokenizer_from, partial)
    return {"files": len(shards), "tensors": len(weight_map), "bytes": total, "dtype": dtype}


def tokenizer_special_ids(folder: Optional[str], vocab_size: int) -> Dict[str, Any]:
    """The bos / eos / pad ids named by ``folder``'s ``tokenizer_config.json`` (``bos_token`` etc.,
    looked up in its ``tokenizer.json``); none when it has no such files or they do not say."""
    if not folder:
        return {}
    paths = [os.path.join(folder, n) for n in ("tokenizer_config.json", "tokenizer.json")]
    if not all(os.path.isfile(p) for p in paths):
        return {}
    try:
        from tokenizers import Tokenizer  # lazy: only exports of runs with a tokenizer pay its import

        with open(paths[0], "rb") as f:
            config = json.loads(f.read().decode("utf-8"))
        tokenizer = Tokenizer.from_file(paths[1])
    except Exception:  # a damaged tokenizer only loses its ids in the export's metadata
        return {}
    ids = {}
    for key in ("bos", "eos", "pad"):
        token = config.get(f"{key}_token") if isinstance(config, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        found = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if found is not None and 0 <= found < vocab_size:
            ids[f"{key}_token_id"] = found
    return ids
