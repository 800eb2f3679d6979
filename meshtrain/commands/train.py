"""``meshtrain train``: train a model with a recipe (no arguments: ``small`` on the embedded corpus)."""

from __future__ import annotations

import dataclasses

from meshtrain.commands.common import add_device_args
from meshtrain.commands.recipe_flags import add_recipe_flags, recipe_overrides
from meshtrain.errors import ConfigError
from meshtrain.settings import add_flags, given_flags, settings_of
from meshtrain.models import BertConfig, DecoderConfig, ViTConfig
from meshtrain.parallel.context import check_seq_len as check_context_seq_len
from meshtrain.train.config import TrainConfig
from meshtrain.train.sources import model_config_for
from meshtrain.train.trainer import Trainer


def add_parser(sub):
    p = sub.add_parser("train", help="train a model (default: small on the embedded corpus, all devices)",
                       description="Train a model with a recipe. With no arguments: the `small` decoder on the "
                                   "Python standard library's source, over all devices (8 simulated CPU devices "
                                   "without an accelerator).")
    add_flags(p, settings_of(TrainConfig))  # one flag per TrainConfig setting, its help and default from there
    add_device_args(p)
    add_recipe_flags(p)
    # Flags that are not TrainConfig fields: a unit conversion, and process set-up done before JAX starts.
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: known accelerators; omitted on CPU)")
    p.add_argument("--xla-flags", choices=("auto", "none"), default="auto",
                   help="auto: add meshtrain's XLA scheduling flags for the backend (GPU: latency-hiding "
                        "scheduler, pipelined/combined collectives; TPU: async collective fusion) to XLA_FLAGS / "
                        "LIBTPU_INIT_ARGS, keeping any flag you set; none: leave them alone")
    p.set_defaults(run=run)


def config_from_args(args) -> TrainConfig:
    """The :class:`TrainConfig` of the flags given (the others keep its defaults)."""
    values = given_flags(args, settings_of(TrainConfig))
    values["devices"] = args.devices
    if args.peak_tflops is not None:
        values["peak_flops_per_device"] = args.peak_tflops * 1e12
    values["recipe_options"] = tuple(recipe_overrides(args).items())
    return TrainConfig(**values)


def decoder_memory_estimate(model_name: str):
    """The planner's full per-device estimate (activations included) for a built-in decoder, as the
    Trainer's pre-flight ``memory_estimate``; ``None`` for other models."""
    try:
        cfg = model_config_for(model_name)
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
    nothing on slow links. The other flags are checked by :class:`TrainConfig`."""
    import warnings

    import jax

    if args.seq_len is not None and isinstance(model_config_for(args.model), ViTConfig):
        raise ConfigError(f"--seq-len does not apply to {args.model} (an image model: its sequence is the image's "
                          f"patches); drop --seq-len")
    if args.dcn and jax.process_count() == 1:
        # A warning, not an error: the layout is valid (one process's devices split into the DCN groups)
        # and the same command line then runs unchanged under `meshtrain launch`, srun or mpirun.
        warnings.warn(f"--dcn {args.dcn} in a single-process run: no axis crosses a slow link (there are no other "
                      f"processes or slices; the devices are only regrouped); it takes effect under `meshtrain "
                      f"launch`, srun or mpirun")


def check_context(trainer: Trainer, config: TrainConfig) -> None:
    """A language model's ``--seq-len`` must split over the recipe's context axes (zig-zag: twice
    over): refused here, before the run folder is made, naming the lengths that work."""
    if not isinstance(model_config_for(config.model), (DecoderConfig, BertConfig)):
        return  # an image model's sequence is its patches, fixed by the config
    recipe, mesh = trainer._recipe_and_mesh()
    check_context_seq_len(recipe, recipe.axis_rules(), dict(mesh.shape), config.seq_len)


def run(args) -> int:
    check_flags(args)
    config = config_from_args(args)
    trainer = Trainer(config, memory_estimate=decoder_memory_estimate(config.model))
    check_context(trainer, config)
    if args.batch_size is None:
        multiple = trainer.batch_multiple()
        if config.batch_size % multiple:
            fitted = -(-config.batch_size // multiple) * multiple
            print(f"meshtrain: --batch-size not given: using {fitted}, the smallest multiple of {multiple} "
                  f"(data-parallel size × micro-batches) >= the default {config.batch_size}", flush=True)
            config = dataclasses.replace(config, batch_size=fitted)
            trainer = Trainer(config, memory_estimate=decoder_memory_estimate(config.model))
    summary = trainer.run()
    return 0 if summary.steps or summary.preempted or summary.already_done else 1
