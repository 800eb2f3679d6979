"""Load HuggingFace weights onto a plan's shardings; write a model's parameters as a HuggingFace folder.

    params = load_params("Llama-3-8B", plan)            # each device reads its own blocks only
    write_folder(cfg, host_params, "out/", dtype="bfloat16", tokenizer_from="runs/ft")
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import jax
import numpy as np

from meshtrain.abstract import tree_paths
from meshtrain.data.tokenizer import copy_tokenizer_files
from meshtrain.errors import ConfigError
from meshtrain.folders import new_folder
from meshtrain.hf.config import CONFIG_FILE, decoder_config, hf_config, read_hf_config
from meshtrain.hf.weights import (INDEX_FILE, SINGLE_FILE, SafetensorsFolder, block_reader, check_coverage,
                                  hf_tensors, mappings, unused_tensors)
from meshtrain.models import DecoderConfig

#: Largest safetensors file :func:`write_folder` writes before starting another (HF's own default: 5 GB).
MAX_SHARD_BYTES = 5 * 10 ** 9
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

    def one(path, sds, sharding):
        read = block_reader(files, by_path[path], sds.shape)
        return jax.make_array_from_callback(sds.shape, sharding, lambda index: read(index).astype(sds.dtype))

    return jax.tree.map(one, paths, abstract, plan.param_shardings)


def unread(folder: str, cfg: DecoderConfig):
    """Tensors of ``folder`` that the import leaves out (none for the supported architectures)."""
    return unused_tensors(SafetensorsFolder(folder), cfg)


def source_dtype(folder: str) -> str:
    """The dtype the HF folder stores (``torch_dtype`` of its config, else its first tensor's)."""
    config = read_hf_config(folder)
    declared = config.get("torch_dtype") or config.get("dtype")
    return declared if declared in DTYPES else SafetensorsFolder(folder).dtype()


def write_folder(cfg: DecoderConfig, params: Dict[str, np.ndarray], out: str, *, dtype: str = "float32",
                 tokenizer_from: Optional[str] = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Dict[str, Any]:
    """Write ``params`` (``{path: whole host array}``) as a HuggingFace folder ``out`` (config.json,
    safetensors in PyTorch naming, an index when there are several files, the tokenizer files of
    ``tokenizer_from`` when it has them). Written beside ``out`` and renamed at the end: on any error
    nothing is left at ``out``."""
    from safetensors.numpy import save_file  # lazy: only exports write safetensors

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    config = hf_config(cfg, dtype)
    with new_folder(out) as partial:
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
        copy_tokenizer_files(tokenizer_from, partial)
    return {"files": len(shards), "tensors": len(weight_map), "bytes": total, "dtype": dtype}
