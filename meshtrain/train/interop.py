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
import shutil
from typing import Any, Dict, Optional

import jax
import numpy as np

from meshtrain import hf
from meshtrain.abstract import abstract_state, tree_paths
from meshtrain.checkpoint import Checkpointer
from meshtrain.errors import ConfigError
from meshtrain.hf.output import Interrupts, output_folder
from meshtrain.hf.peft import LoRAExport, write_peft_adapters
from meshtrain.hf.run_config import run_decoder_config
from meshtrain.hf.validate import check_generation_config, check_tokenizer, read_json_object, special_token_ids
from meshtrain.mesh import select_devices
from meshtrain.models import DecoderConfig, model_factory
from meshtrain.models.lora import LoRAConfig
from meshtrain.plan import make_plan
from meshtrain.recipes import get_recipe
from meshtrain.settings import plain_settings
from meshtrain.state import init_state
from meshtrain.train.config import TrainConfig, default_optimizer
from meshtrain.train.metrics import open_outputs
from meshtrain.train.rundir import copy_tokenizer, file_error
from meshtrain.train.sources import run_header

#: HuggingFace's generation defaults (stop ids), carried from an import's source into the run folder
GENERATION_CONFIG_FILE = "generation_config.json"


def _plan(cfg: DecoderConfig, recipe: str, devices: Optional[int], train: TrainConfig):
    factory = model_factory(cfg)
    model = abstract_state(factory)
    tx = default_optimizer(train, model.param_axes)
    devs = select_devices(devices)
    built = get_recipe(recipe)
    return make_plan(model.with_optimizer(tx), built, built.mesh.build(devs))


def import_hf(source: str, out: str, *, recipe: str = "fsdp", devices: Optional[int] = None) -> Dict[str, Any]:
    """Turn HuggingFace folder ``source`` into run folder ``out`` (which must not exist, or be empty):
    a step-0 checkpoint (the weights; a fresh optimizer), the run header (model config, source and
    dtype, special token ids), the tokenizer files. Every input is checked before anything is written
    (:mod:`meshtrain.hf.validate`, :mod:`meshtrain.hf.audit`); written beside ``out`` and renamed at
    the end: on any error or Ctrl-C nothing is left at ``out``."""
    guard = Interrupts()
    try:
        return _import(source, out, recipe, devices, guard)
    except Exception:
        if guard.interrupted:  # a Ctrl-C that a library swallowed or turned into its own error
            raise KeyboardInterrupt from None
        raise
    finally:
        guard.restore()


def _import(source: str, out: str, recipe: str, devices: Optional[int], guard: Interrupts) -> Dict[str, Any]:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):  # before reading any weight
        raise ConfigError(f"--out {out!r} already exists and is not an empty folder; pass a new folder")
    cfg = hf.model_config(source)
    check_tokenizer(source)  # copied into the run: a broken one would fail only at `meshtrain generate`
    check_generation_config(source)
    dtype = hf.source_dtype(source)
    train = TrainConfig(model=out, init_from=out)
    plan = _plan(cfg, recipe, devices, train)
    state = init_state(plan, params=hf.load_params(source, plan, cfg))
    guard.check()
    with output_folder(out, guard=guard) as partial:
        with guard.deferred():  # a Ctrl-C waits for the save to end, then the partial folder is removed
            ckpt = Checkpointer(os.path.join(partial, "checkpoints"), save_every=1, async_save=False)
            try:
                ckpt.maybe_save(0, state, data_state={}, force=True,
                                metadata={"imported_from": os.path.abspath(source), "model": out,
                                          "recipe": plan.recipe.to_dict(), "num_params": plan.abstract.num_params})
            finally:
                ckpt.close()
        source_config = hf.read_hf_config(source)
        header = {"run_settings": plain_settings(train, skip=("recipe_options",)),
                  "model_config": dataclasses.asdict(cfg), "imported_from": os.path.abspath(source),
                  "source_dtype": dtype, "special_token_ids": special_token_ids(source_config),
                  # every other field transformers reads, for the export to carry over
                  "source_config": source_config, "source_generation_config": generation_config(source)}
        open_outputs(partial, plan, None, True, header).close()
        copy_tokenizer(source, partial)
        copy_generation_config(source, partial)
    return {"model_config": cfg, "dtype": dtype, "num_params": plan.abstract.num_params, "recipe": recipe}


def copy_generation_config(source: str, run_dir: str) -> None:
    """Copy ``source``'s ``generation_config.json`` (its stop ids: :func:`meshtrain.generation.runs.end_ids`)
    into the run folder, when it has one."""
    path = os.path.join(source, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        try:
            shutil.copyfile(path, os.path.join(run_dir, GENERATION_CONFIG_FILE))
        except OSError as exc:
            raise file_error(os.path.join(run_dir, GENERATION_CONFIG_FILE), exc, "while importing") from None


def generation_config(folder: str) -> Optional[Dict[str, Any]]:
    """``folder``'s ``generation_config.json`` (sampling defaults, special ids), or ``None`` when it has
    none; a damaged one is refused, naming the file (the export would carry it over)."""
    path = os.path.join(folder, hf.GENERATION_FILE)
    return read_json_object(path) if os.path.isfile(path) else None


def _mapping(value: Any) -> Optional[Dict[str, Any]]:
    return value if isinstance(value, dict) else None


def export_hf(run: str, out: str, *, step: Optional[int] = None, dtype: Optional[str] = None,
              devices: Optional[int] = None, lora: "LoRAExport | str" = LoRAExport.MERGED) -> Dict[str, Any]:
    """Write the parameters of run folder ``run`` (``step``, default the latest valid one) as a
    HuggingFace folder ``out`` in ``dtype`` (default: the imported source's, else float32), with the
    special token ids the import recorded (else the run's tokenizer's) in config.json and
    generation_config.json. A LoRA run (``--lora-rank``): ``lora="merged"`` writes the base with the
    adapters merged (``base + alpha/r·A@B``), ``"adapters"`` PEFT's adapter folder
    (:func:`meshtrain.hf.peft.write_peft_adapters`) and nothing else."""
    guard = Interrupts()
    try:
        cfg = run_decoder_config(run, "export")
        header = run_header(run)
        if not os.path.isdir(os.path.join(run, "checkpoints")):
            raise ConfigError(f"run {run!r} has no checkpoints/ folder; export a run trained with checkpoints "
                              f"(--ckpt-every N) or made by `meshtrain import`")
        if LoRAExport(lora) is LoRAExport.ADAPTERS:
            return _export_adapters(run, out, cfg, header, step, guard)
        plan = _plan(cfg, "fsdp", devices, TrainConfig())
        step, params = Checkpointer.read_params(os.path.join(run, "checkpoints"), plan, step)
        host = {path: np.asarray(jax.device_get(x)) for path, x in zip(jax.tree.leaves(tree_paths(params)),
                                                                       jax.tree.leaves(params))}
        guard.check()
        ids = header.get("special_token_ids")
        summary = hf.write_folder(cfg, host, out, dtype=dtype or header.get("source_dtype") or "float32",
                                  tokenizer_from=run, special_ids=ids if isinstance(ids, dict) and ids else None,
                                  guard=guard, source_config=_mapping(header.get("source_config")),
                                  source_generation=_mapping(header.get("source_generation_config")))
    except Exception:
        if guard.interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        guard.restore()
    return {**summary, "step": step}


def _export_adapters(run: str, out: str, cfg: DecoderConfig, header: Dict[str, Any], step: Optional[int],
                     guard: Interrupts) -> Dict[str, Any]:
    """PEFT's adapter folder of LoRA run ``run`` (``base_model_name_or_path``: the run's ``--init-from``)."""
    step, parts = Checkpointer.read_adapters(os.path.join(run, "checkpoints"), step)
    settings = header.get("run_settings") if isinstance(header.get("run_settings"), dict) else {}
    base_model = settings.get("init_from") or ""
    guard.check()
    lora = LoRAConfig(parts.rank, parts.alpha, parts.targets or ("q",), parts.base)
    with output_folder(out, guard=guard) as partial:
        done = write_peft_adapters(cfg, parts.adapters, lora, partial,
                                   base_model=os.path.abspath(base_model) if os.path.isdir(base_model) else base_model)
    return {**done, "step": step, "dtype": "float32", "files": 2, "base_model": base_model}
