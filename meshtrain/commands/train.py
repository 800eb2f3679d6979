"""``meshtrain train``: train a model with a recipe (no arguments: ``small`` on the embedded corpus)."""

from __future__ import annotations

import dataclasses

from meshtrain.cli import add_device_args
from meshtrain.commands.recipe_flags import add_recipe_flags, recipe_overrides
from meshtrain.errors import ConfigError
from meshtrain.models import DecoderConfig, ViTConfig, get_config
from meshtrain.train.config import TrainConfig
from meshtrain.train.trainer import Trainer


def add_parser(sub):
    d = TrainConfig()
    p = sub.add_parser("train", help="train a model (default: small on the embedded corpus, all devices)",
                       description="Train a model with a recipe. With no arguments: the `small` decoder on the "
                                   "Python standard library's source, over all devices (8 simulated CPU devices "
                                   "without an accelerator).")
    p.add_argument("--model", default=d.model, help="model config: tiny, small, llama3-8b, ... (`meshtrain plan "
                   "--help` lists them)")
    p.add_argument("--recipe", default=d.recipe, help="recipe name (`meshtrain recipes`) or .yaml file")
    p.add_argument("--mesh", default=None, help="mesh size overrides, e.g. fsdp=4,tensor=2 (default: the recipe's)")
    p.add_argument("--dcn", default=None,
                   help="how much of each mesh axis spans processes/slices (DCN), e.g. data=2; the total sizes "
                        "stay as --mesh says (default: the outermost axes, when devices span several processes)")
    add_device_args(p)
    p.add_argument("--steps", type=int, default=d.steps, help="train until this step (with --resume: in total)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"global batch, in sequences (default: {d.batch_size}, rounded up to a multiple of the "
                        f"recipe's data-parallel size × micro-batches when it needs one, e.g. 32 for --recipe "
                        f"pp_fsdp --pipeline-micro-batches 8 on 8 devices)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default: {d.seq_len}; language models only, not vit-*)")
    add_recipe_flags(p)
    p.add_argument("--seed", type=int, default=d.seed, help="seeds initialisation, data order and dropout (>= 0)")
    p.add_argument("--data", default=None,
                   help="text file/folder or .npy/.bin token file (default: the embedded corpus, this Python's "
                        "standard library)")
    p.add_argument("--out", default=None, help="run folder (default: runs/<model>-<recipe>-<time>)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW, warmup then cosine)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate every N steps; 0 disables")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="batches per evaluation")
    p.add_argument("--log-every", type=int, default=d.log_every, help="print a progress line every N steps")
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="save a checkpoint every N steps; 0: off")
    p.add_argument("--keep-last", type=int, default=d.keep_last, help="keep the newest N checkpoints")
    p.add_argument("--keep-every", type=int, default=None, help="also keep every K-th step (default: none)")
    p.add_argument("--resume", action="store_const", const="latest", default="no",
                   help="continue from the newest valid checkpoint in --out (a new run if --out holds none; "
                        "refused if it holds checkpoints of which none is valid)")
    p.add_argument("--xla-flags", choices=("auto", "none"), default="auto",
                   help="auto: add meshtrain's XLA scheduling flags for the backend (GPU: latency-hiding "
                        "scheduler, pipelined/combined collectives; TPU: async collective fusion) to XLA_FLAGS / "
                        "LIBTPU_INIT_ARGS, keeping any flag you set; none: leave them alone")
    p.add_argument("--nonfinite", choices=("raise", "skip"), default="raise",
                   help="a non-finite loss or gradient stops the run (raise) or skips that update (skip)")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="live bar on a terminal (auto), bar, plain lines, or nothing")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: known accelerators; omitted on CPU)")
    p.add_argument("--hardware", default=None,
                   help="hardware profile for MFU's peak: h100, tpu-v5p, ..., or cpu (measured on this host) "
                        "(default: from the device kind)")
    p.add_argument("--memory-check", choices=("on", "off"), default="on",
                   help="refuse to start when the plan's per-device memory exceeds the device's")
    p.set_defaults(run=run)


def config_from_args(args):
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    # Unset flags keep TrainConfig's defaults (batch size: rounded by `run`; seq len: not for images).
    values = {k: v for k, v in vars(args).items()
              if k in fields and not (k in ("batch_size", "seq_len") and v is None)}
    if args.peak_tflops is not None:
        values["peak_flops_per_device"] = args.peak_tflops * 1e12
    values["memory_check"] = args.memory_check
    values["recipe_options"] = tuple(recipe_overrides(args).items())
    return TrainConfig(**values)


def decoder_memory_estimate(model_name: str):
    """The planner's full per-device estimate (activations included) for a built-in decoder, as the
    Trainer's pre-flight ``memory_estimate``; ``None`` for other models."""
    try:
        cfg = get_config(model_name)
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

    if args.seq_len is not None and isinstance(get_config(args.model), ViTConfig):
        raise ConfigError(f"--seq-len does not apply to {args.model} (an image model: its sequence is the image's "
                          f"patches); drop --seq-len")
    if args.dcn and jax.process_count() == 1:
        # A warning, not an error: the layout is valid (one process's devices split into the DCN groups)
        # and the same command line then runs unchanged under `meshtrain launch`, srun or mpirun.
        warnings.warn(f"--dcn {args.dcn} in a single-process run: no axis crosses a slow link (there are no other "
                      f"processes or slices; the devices are only regrouped); it takes effect under `meshtrain "
                      f"launch`, srun or mpirun")


def run(args) -> int:
    check_flags(args)
    config = config_from_args(args)
    trainer = Trainer(config, memory_estimate=decoder_memory_estimate(config.model))
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
