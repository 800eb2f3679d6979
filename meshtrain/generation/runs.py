"""A run folder as generation reads it: its model, recipe, tokenizer and one checkpoint step's
parameters, restored onto a generation plan through the checkpoint's restore-against-a-plan path
(another recipe, mesh or device count reshards on load; 16-bit runs through their master weights).

The generation recipe: the one asked for, else the run's own, unless it has a pipeline (generation
runs the layer stack whole on every device group): then ``fsdp`` over the same devices.

The run's end-of-sequence ids (:attr:`RunInfo.end_ids`, where generation stops by default): its
tokenizer's eos token, and the ``eos_token_id`` (an id or a list) of the ``generation_config.json``
that ``meshtrain import`` carried in, else of the imported ``config.json`` (recorded in the run
header), as transformers' ``generate`` stops.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from meshtrain import hf
from meshtrain.abstract import abstract_state
from meshtrain.checkpoint import Checkpointer
from meshtrain.checkpoint.inspection import read_meta, resolve_directory
from meshtrain.checkpoint.integrity import step_dirs
from meshtrain.checkpoint.types import CheckpointError
from meshtrain.data.chat import ChatTemplate, load_chat_template
from meshtrain.errors import ConfigError, RecipeError
from meshtrain.generation.engine import generation_config
from meshtrain.generation.tokenizer import ByteTokenizer, tokenizer_for_run
from meshtrain.mesh import MeshSpec, select_devices
from meshtrain.model_source import SourceKind, model_source, source_kind
from meshtrain.models import DecoderConfig, get_config, model_factory
from meshtrain.models.configs import config_from_fields
from meshtrain.plan import make_plan
from meshtrain.recipes import Recipe, get_recipe
from meshtrain.strategies import Pipeline
from meshtrain.train.config import TrainConfig, default_optimizer
from meshtrain.train.rundir import METRICS_FILE
from meshtrain.train.sources import run_header

#: the generation recipe of a run trained with a pipeline, or of a model given without a recipe
FALLBACK_RECIPE = "fsdp"
#: HuggingFace's generation defaults file, which `meshtrain import` copies into the run folder
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a run folder says about itself (from a checkpoint step's metadata; no arrays read)."""

    directory: Path
    step: int
    model: str
    cfg: DecoderConfig
    recipe: Optional[Recipe]
    tokenizer: Optional[ByteTokenizer]
    metadata: Dict[str, Any]
    #: the run folder (``directory`` may be its ``checkpoints/``)
    folder: Optional[Path] = None
    #: where generation stops by default (see the module docstring); ``()``: nowhere
    end_ids: Tuple[int, ...] = ()

    def chat_template(self) -> Optional[ChatTemplate]:
        """The run tokenizer's chat template (``None``: it has none, or the run has no tokenizer)."""
        if self.folder is None or self.tokenizer is None or isinstance(self.tokenizer, ByteTokenizer):
            return None
        return load_chat_template(str(self.folder))
    #: a run folder (a checkpoint step), or a HuggingFace folder (its safetensors; ``step`` is 0)
    source: SourceKind = SourceKind.RUN


def read_run(run: str, step: Optional[int] = None) -> RunInfo:
    """The run at ``run`` (a run folder or its ``checkpoints/``): ``step`` (default: the newest step
    folder) and its model, recipe and tokenizer. ``run`` may also be a HuggingFace folder (what
    ``--model HF_DIR`` names, :mod:`meshtrain.model_source`): its weights and tokenizer. Unknown
    steps, non-decoder models and sources without weights (a built-in name, a factory) raise."""
    if os.path.isdir(run) and source_kind(run, "RUN") is SourceKind.HF_FOLDER:
        return _read_hf_folder(run, step)
    if not os.path.exists(run) and os.sep not in run and not run.startswith("."):  # a name, not a path
        kind = source_kind(run, "RUN")
        raise ConfigError(f"{run!r} is a {kind.value}, which holds no trained weights; generate from a run folder "
                          f"(`meshtrain train` or `meshtrain import` wrote it) or a HuggingFace folder")
    directory = resolve_directory(run)
    steps = step_dirs(directory)
    if not steps:
        raise CheckpointError(f"{directory} holds no checkpoint steps; train with --ckpt-every N first")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise CheckpointError(f"--step {step}: no such checkpoint step in {directory}; steps: {sorted(steps)}")
    meta = (read_meta(steps[step]).get("user") or {})
    name = meta.get("model")
    if not name:
        raise CheckpointError(f"checkpoint step {step} in {directory} does not name its model (trained without "
                              f"the Trainer?); generate with mt.generate(model, ...) instead")
    run_dir = directory.parent if directory.name == "checkpoints" else directory
    cfg = trained_config(run_dir, name)
    if not isinstance(cfg, DecoderConfig):
        raise ConfigError(f"run {run!r} trained model {name!r} ({type(cfg).__name__}), not a decoder: generation "
                          f"needs a decoder run (a language model: tiny, small, tiny-moe, ...)")
    saved = meta.get("recipe")
    recipe = Recipe.from_dict(saved, source=f"{directory}/{step}") if isinstance(saved, dict) else None
    tokenizer = tokenizer_for_run(str(run_dir), meta.get("data"), cfg.vocab_size)
    return RunInfo(directory, step, name, cfg, recipe, tokenizer, meta, run_dir,
                   end_ids(run_dir, tokenizer, cfg.vocab_size))


def end_ids(run_dir: Path, tokenizer, vocab_size: int) -> Tuple[int, ...]:
    """The run's end-of-sequence ids (see the module docstring), in the vocabulary, without repeats."""
    found: List[Any] = [getattr(tokenizer, "eos_id", None)]
    path = run_dir / GENERATION_CONFIG_FILE
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path} ({exc}); replace it with the model's own, or remove it") from None
        eos = config.get("eos_token_id") if isinstance(config, dict) else None
    else:
        eos = ((run_header(str(run_dir)) or {}).get("special_token_ids") or {}).get("eos_token_id")
    found += eos if isinstance(eos, list) else [eos]
    ids = [int(t) for t in found if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size]
    return tuple(dict.fromkeys(ids))


def _read_hf_folder(folder: str, step: Optional[int]) -> RunInfo:
    if step not in (None, 0):  # (0: the step read_run gave it)
        raise ConfigError(f"--step {step}: {folder!r} is a HuggingFace folder (one set of weights, no steps); "
                          f"drop --step")
    cfg = model_source(folder, "RUN").config
    tokenizer = tokenizer_for_run(folder, None, cfg.vocab_size)
    return RunInfo(Path(folder), 0, folder, cfg, None, tokenizer, {}, folder=Path(folder),
                   end_ids=end_ids(Path(folder), tokenizer, cfg.vocab_size), source=SourceKind.HF_FOLDER)


def trained_config(run_dir: Path, name: str):
    """The model config the run trained: its header's (an imported or token-data run's vocabulary
    differs from the built-in name's), checked field by field (a damaged header names the file and the
    field), else the built-in config of that name."""
    header = run_header(str(run_dir))
    if header is None or header.get("model_config") is None:
        return get_config(name)
    return config_from_fields(header["model_config"], f"run header {str(run_dir / METRICS_FILE)!r}")


def generation_recipe(requested: "str | Recipe | None", trained: Optional[Recipe] = None,
                      mesh: Optional[str] = None) -> Recipe:
    """The recipe generation runs under (see the module docstring), with ``mesh`` (``"fsdp=4,tensor=2"``)."""
    if requested is not None:
        recipe = get_recipe(requested)
        if recipe.dimension(Pipeline) is not None:
            raise RecipeError(f"--recipe {recipe.name}: generation runs without a pipeline (pp); use a recipe "
                              f"without one (e.g. {FALLBACK_RECIPE}, tp, fsdp_tp); a pipeline-trained run restores "
                              f"onto it")
    elif trained is not None and trained.dimension(Pipeline) is None:
        recipe = trained
    else:
        recipe = get_recipe(FALLBACK_RECIPE)
    return recipe.with_mesh(**MeshSpec.parse(mesh)) if mesh else recipe


def params_plan(cfg: DecoderConfig, recipe: Recipe, devices=None, tx=None):
    """A plan of ``cfg``'s parameters (and ``tx``'s state, for a restore) over ``devices``."""
    devices = select_devices(None) if devices is None else devices
    abstract = abstract_state(model_factory(generation_config(cfg)), tx)
    return make_plan(abstract, recipe, recipe.mesh.build(devices))


def restore_params(info: RunInfo, recipe: Recipe, devices=None):
    """``(params, plan)``: ``info.step``'s parameters on ``recipe``'s plan (only the parameters are
    read: whatever optimizer the run used; a 16-bit run gives its f32 master weights)."""
    cfg = info.cfg
    if info.source is SourceKind.HF_FOLDER:  # the safetensors, each device reading its own blocks
        plan = params_plan(cfg, recipe, devices)
        return hf.load_params(str(info.directory), plan, cfg), plan
    axes = abstract_state(model_factory(cfg)).param_axes
    plan = params_plan(cfg, recipe, devices, default_optimizer(TrainConfig(), axes))
    _, params = Checkpointer.read_params(info.directory, plan, info.step)
    return params, plan
