"""``meshtrain export RUN --out HF_DIR``: a run's checkpoint as a HuggingFace model folder."""

from __future__ import annotations

from meshtrain.commands.common import add_device_args
from meshtrain.hf.convert import DTYPES
from meshtrain.train.interop import export_hf


def add_parser(sub):
    p = sub.add_parser("export", help="a run's checkpoint -> a HuggingFace model folder (config.json + safetensors)",
                       description="Write a run's parameters as a HuggingFace model folder that `transformers` "
                                   "loads (Llama or Mixtral layout, PyTorch naming), with the run's tokenizer.")
    p.add_argument("run_dir", metavar="RUN", help="the run folder")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the latest valid one)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="tensor dtype (default: the imported model's, else float32)")
    add_device_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    done = export_hf(args.run_dir, args.out, step=args.step, dtype=args.dtype, devices=args.devices)
    print(f"wrote {args.out}: step {done['step']}, {done['tensors']:,} tensors, {done['bytes'] / 2 ** 20:,.1f} MiB "
          f"({done['dtype']}) in {done['files']} file(s)")
    return 0
