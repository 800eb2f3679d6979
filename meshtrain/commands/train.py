"""``meshtrain train``: train a model with a recipe (no arguments: ``small`` on the embedded corpus)."""

from __future__ import annotations

import dataclasses

from meshtrain.cli import add_device_args

def add_parser(sub):
    from meshtrain.train.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train a model (default: small on the embedded corpus, all devices)",
                       description="Train a model with a recipe. With no arguments: the `small` decoder on the "
                                   "Python standard library's source, over all devices (8 simulated CPU devices "
                                   "without an accelerator).")
    p.add_argument("--model", default=d.model, help=f"model config (tiny, small, llama3-8b, ...; default {d.model})")
    p.add_argument("--recipe", default=d.recipe, help=f"recipe name or .yaml file (default {d.recipe})")
    p.add_argument("--mesh", default=None, help="mesh overrides, e.g. fsdp=4,tensor=2")
    p.add_argument("--dcn", default=None,
                   help="how much of each mesh axis spans processes/slices (DCN), e.g. data=2; the total sizes "
                        "stay as --mesh says (default: the outermost axes, when devices span several processes)")
    add_device_args(p)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default=None)
    p.add_argument("--micro-batches", type=int, default=None, help="gradient accumulation steps")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, help="text file/folder or .npy/.bin token file (default: embedded corpus)")
    p.add_argument("--out", default=None, help="run folder (default runs/<model>-<recipe>-<time>)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="0 disables evaluation")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="save every N steps (0: off)")
    p.add_argument("--keep-last", type=int, default=d.keep_last)
    p.add_argument("--keep-every", type=int, default=None, help="also keep every K-th step")
    p.add_argument("--resume", action="store_const", const="latest", default="no",
                   help="continue from the newest valid checkpoint in --out")
    p.add_argument("--nonfinite", choices=("raise", "skip"), default="raise")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for MFU (default: known accelerators; omitted on CPU)")
    p.add_argument("--hardware", default=None,
                   help="hardware profile for MFU's peak (h100, tpu-v5p, ..., or cpu: measured on this host)")
    p.set_defaults(run=run)


def config_from_args(args):
    from meshtrain.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if args.peak_tflops:
        values["peak_flops_per_device"] = args.peak_tflops * 1e12
    return TrainConfig(**values)


def run(args) -> int:
    from meshtrain.train.trainer import Trainer

    summary = Trainer(config_from_args(args)).run()
    return 0 if summary.steps or summary.preempted else 1
