"""``meshtrain train``: train a model with a recipe (no arguments: ``small`` on the embedded corpus)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshtrain.commands.common import add_device_args
from meshtrain.commands.run_flags import Resolved, add_peak_tflops, add_run_flags, preparer, resolved_of, train_keys
from meshtrain.errors import ConfigError
from meshtrain.train.config import TrainConfig, fitted_batch_size

# The models, the trainer and JAX load when a run starts, not when the flags are read: `meshtrain launch`
# parses its child's `train` command line with this module's parser and must not load JAX.
if TYPE_CHECKING:
    from meshtrain.train.trainer import Trainer


def add_parser(sub):
    p = sub.add_parser("train", help="train a model (default: small on the embedded corpus, all devices)",
                       description="Train a model with a recipe. With no arguments: the `small` decoder on the "
                                   "Python standard library's source, over all devices (8 simulated CPU devices "
                                   "without an accelerator).")
    # one flag per setting of the run configuration's training sections (help and default from there),
    # the recipe's flags, --config and --set
    add_run_flags(p, train_keys(), recipe_options=True)
    add_device_args(p)
    # Flags that are not TrainConfig fields: a unit conversion, and process set-up done before JAX starts.
    add_peak_tflops(p)
    p.add_argument("--xla-flags", choices=("auto", "none"), default="auto",
                   help="auto: add meshtrain's XLA scheduling flags for the backend (GPU: latency-hiding "
                        "scheduler, pipelined/combined collectives; TPU: async collective fusion) to XLA_FLAGS / "
                        "LIBTPU_INIT_ARGS, keeping any flag you set; none: leave them alone")
    p.set_defaults(run=run, prepare=preparer(train_keys(), recipe_options=True))


def resolve_args(args) -> Resolved:
    """The run configuration of ``meshtrain train``'s arguments (defaults < --config < flags < --set)."""
    return resolved_of(args, train_keys(), recipe_options=True)


def config_from_args(args) -> TrainConfig:
    """The :class:`TrainConfig` of the arguments (the settings not given keep their defaults)."""
    return resolve_args(args).config.train_config()


def model_config(model: str):
    """The model config ``--model`` names (:mod:`meshtrain.model_source`: a built-in name, HF_DIR or RUN);
    ``None`` for a model factory (file.py:fn), whose file the Trainer imports, once."""
    from meshtrain.model_source import SourceKind, model_source, source_kind  # lazy: model kinds off the flag-reading path

    return None if source_kind(model) is SourceKind.FACTORY else model_source(model).config


def decoder_memory_estimate(model_name: str):
    """The planner's full per-device estimate (activations included) for a built-in decoder, as the
    Trainer's pre-flight ``memory_estimate``; ``None`` for other models."""
    from meshtrain.models import DecoderConfig  # lazy: models load JAX: not on launch's flag-reading path

    try:
        cfg = model_config(model_name)
    except Exception:  # noqa: BLE001 - an unknown model is reported by the Trainer
        return None
    if not isinstance(cfg, DecoderConfig):
        return None

    def estimate(plan):
        from meshtrain.analysis.memory import estimate_memory  # lazy: analysis (~50 ms) off the CLI's path
        from meshtrain.analysis.moe import moe_terms  # lazy: analysis (~50 ms) off the CLI's path
        from meshtrain.analysis.pipeline import pipeline_shape  # lazy: analysis (~50 ms) off the CLI's path

        est = estimate_memory(plan, cfg)  # pipelines (schedule, stages, micro-batches) and MoE included
        parts = " + ".join(f"{c.value} {b / 2 ** 30:.2f} GiB" for c, b in est.components if b)
        pipe, moe = pipeline_shape(plan), moe_terms(plan, cfg)
        if pipe is not None:
            parts += f"; pipeline {pipe.describe()}"
        if moe is not None:
            parts += f"; MoE: expert weights {moe.expert_bytes_per_device / 2 ** 30:.2f} GiB per device (ep={moe.ep})"
        return int(est.total), parts

    return estimate


def check_flags(args) -> None:
    """Refuse ``--seq-len`` for an image model; warn that ``--dcn`` in a single-process run places
    nothing on slow links. The other settings are checked by :class:`TrainConfig`."""
    import warnings

    import jax

    from meshtrain.models import ViTConfig  # lazy: models load JAX: not on launch's path

    resolved = resolve_args(args)
    cfg = resolved.config
    if resolved.given_here("data.seq_len") and isinstance(model_config(cfg.model.name), ViTConfig):
        raise ConfigError(f"--seq-len does not apply to {cfg.model.name} (an image model: its sequence is the "
                          f"image's patches); drop --seq-len (data.seq_len)")
    if cfg.distributed.dcn and jax.process_count() == 1:
        # A warning, not an error: the layout is valid (one process's devices split into the DCN groups)
        # and the same command line then runs unchanged under `meshtrain launch`, srun or mpirun.
        warnings.warn(f"--dcn {cfg.distributed.dcn} in a single-process run: no axis crosses a slow link (there are no other "
                      f"processes or slices; the devices are only regrouped); it takes effect under `meshtrain "
                      f"launch`, srun or mpirun")


def check_context(trainer: Trainer, config: TrainConfig) -> None:
    """A language model's ``--seq-len`` must split over the recipe's context axes (zig-zag: twice
    over): refused here, before the run folder is made, naming the lengths that work."""
    from meshtrain.models import ViTConfig  # lazy: models load JAX: not on launch's path
    from meshtrain.parallel.context import check_seq_len as check_context_seq_len  # lazy: kernels load JAX: not on launch's path

    if isinstance(model_config(config.model), ViTConfig):
        return  # an image model's sequence is its patches, fixed by the config
    recipe, mesh = trainer._recipe_and_mesh()
    check_context_seq_len(recipe, recipe.axis_rules(), dict(mesh.shape), config.seq_len)


def run(args) -> int:
    from meshtrain.train.trainer import Trainer  # lazy: the trainer loads JAX: not on launch's path

    resolved = resolve_args(args)
    check_flags(args)
    config = resolved.config.train_config()
    trainer = Trainer(config, memory_estimate=decoder_memory_estimate(config.model))
    check_context(trainer, config)
    if not resolved.given_here("data.batch_size"):
        multiple = trainer.batch_multiple()
        if config.batch_size % multiple:
            fitted = fitted_batch_size(config.batch_size, multiple)
            print(f"meshtrain: --batch-size not given: using {fitted}, the smallest multiple of {multiple} "
                  f"(data-parallel size × micro-batches) >= the default {config.batch_size}", flush=True)
            config = dataclasses.replace(config, batch_size=fitted)
            trainer = Trainer(config, memory_estimate=decoder_memory_estimate(config.model))
    summary = trainer.run()
    return 0 if summary.steps or summary.preempted or summary.already_done else 1
