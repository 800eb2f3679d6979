"""``meshtrain import HF_DIR --out RUN``: a HuggingFace model folder becomes a meshtrain run folder."""

from __future__ import annotations

from meshtrain.commands.common import add_device_args
from meshtrain.train.interop import import_hf


def add_parser(sub):
    p = sub.add_parser("import", help="a HuggingFace model folder (config.json + safetensors) -> a run folder",
                       description="Convert a HuggingFace model folder (Llama, Mistral, Mixtral: config.json, "
                                   "*.safetensors, optional tokenizer.json) into a run folder with a step-0 "
                                   "checkpoint; fine-tune it with `meshtrain train --model RUN --init-from RUN`.")
    p.add_argument("source", metavar="HF_DIR", help="the HuggingFace model folder")
    p.add_argument("--out", required=True, help="the run folder to write (must not exist, or be empty)")
    p.add_argument("--recipe", default="fsdp", help="the layout the weights are loaded in (each device reads its "
                                                    "own blocks of the files)")
    add_device_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    done = import_hf(args.source, args.out, recipe=args.recipe, devices=args.devices)
    cfg = done["model_config"]
    print(f"wrote {args.out}: {cfg.name} ({done['num_params']:,} parameters, {cfg.n_layers} layers, "
          f"{'%d experts, ' % cfg.n_experts if cfg.n_experts else ''}vocabulary {cfg.vocab_size:,}, stored as "
          f"{done['dtype']}); fine-tune with `meshtrain train --model {args.out} --init-from {args.out} --out RUN`")
    return 0
