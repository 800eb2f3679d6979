"""HuggingFace folders ↔ meshtrain run folders (``meshtrain import`` / ``meshtrain export``).

    import_hf("hf/Llama-3-8B", "runs/llama")       # step-0 checkpoint, model config, tokenizer
    export_hf("runs/ft", "hf/ft")                   # the latest checkpoint as config.json + safetensors

An imported run is a starting point: fine-tune it with ``meshtrain train --model runs/llama --init-from
runs/llama --out runs/ft`` under any recipe (the optimizer starts fresh). The import keeps the source's
dtype in the run header, and the export writes that dtype again: bfloat16 → float32 parameters →
bfloat16 is exact, so import → export reproduces every tensor bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional

import jax
import numpy as np

from meshtrain import hf
from meshtrain.abstract import abstract_state, tree_paths
from meshtrain.checkpoint import Checkpointer
from meshtrain.errors import ConfigError
from meshtrain.folders import new_folder
from meshtrain.mesh import select_devices
from meshtrain.models import DecoderConfig, model_factory
from meshtrain.plan import make_plan
from meshtrain.recipes import get_recipe
from meshtrain.settings import plain_settings
from meshtrain.state import init_state
from meshtrain.train.config import TrainConfig, default_optimizer
from meshtrain.train.metrics import open_outputs
from meshtrain.train.rundir import copy_tokenizer
from meshtrain.train.sources import model_config_for, run_header


def _plan(cfg: DecoderConfig, recipe: str, devices: Optional[int], train: TrainConfig):
    factory = model_factory(cfg)
    tx = default_optimizer(train, abstract_state(factory).param_axes)
    devs = select_devices(devices)
    built = get_recipe(recipe)
    return make_plan(abstract_state(factory, tx), built, built.mesh.build(devs))


def import_hf(source: str, out: str, *, recipe: str = "fsdp", devices: Optional[int] = None) -> Dict[str, Any]:
    """Turn HuggingFace folder ``source`` into run folder ``out`` (which must not exist, or be empty):
    a step-0 checkpoint (the weights; a fresh optimizer), the run header (model config, source and
    dtype), the tokenizer files. Written beside ``out`` and renamed at the end."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):  # before reading any weight
        raise ConfigError(f"--out {out!r} already exists and is not an empty folder; pass a new folder")
    cfg = hf.model_config(source)
    dtype = hf.source_dtype(source)
    train = TrainConfig(model=out, init_from=out)
    plan = _plan(cfg, recipe, devices, train)
    state = init_state(plan, params=hf.load_params(source, plan, cfg))
    with new_folder(out) as partial:
        ckpt = Checkpointer(os.path.join(partial, "checkpoints"), save_every=1, async_save=False)
        try:
            ckpt.maybe_save(0, state, data_state={}, force=True,
                            metadata={"imported_from": os.path.abspath(source), "model": out,
                                      "recipe": plan.recipe.to_dict(), "num_params": plan.abstract.num_params})
        finally:
            ckpt.close()
        header = {"run_settings": plain_settings(train, skip=("recipe_options",)),
                  "model_config": dataclasses.asdict(cfg), "imported_from": os.path.abspath(source),
                  "source_dtype": dtype}
        open_outputs(partial, plan, None, True, header).close()
        copy_tokenizer(source, partial)
    return {"model_config": cfg, "dtype": dtype, "num_params": plan.abstract.num_params, "recipe": recipe}


def export_hf(run: str, out: str, *, step: Optional[int] = None, dtype: Optional[str] = None,
              devices: Optional[int] = None) -> Dict[str, Any]:
    """Write the parameters of run folder ``run`` (``step``, default the latest valid one) as a
    HuggingFace folder ``out`` in ``dtype`` (default: the imported source's, else float32)."""
    header = run_header(run)
    if header is None:
        raise ConfigError(f"{run!r} is not a run folder (no metrics.jsonl run header); pass a folder `meshtrain "
                          f"train` or `meshtrain import` wrote")
    cfg = model_config_for(run)
    if not isinstance(cfg, DecoderConfig):
        raise ConfigError(f"{run!r} trained {type(cfg).__name__}; only decoders export to HuggingFace")
    plan = _plan(cfg, "fsdp", devices, TrainConfig())
    step, params = Checkpointer.read_params(os.path.join(run, "checkpoints"), plan, step)
    host = {path: np.asarray(jax.device_get(x)) for path, x in zip(jax.tree.leaves(tree_paths(params)),
                                                                   jax.tree.leaves(params))}
    summary = hf.write_folder(cfg, host, out, dtype=dtype or header.get("source_dtype") or "float32",
                              tokenizer_from=run)
    return {**summary, "step": step}
