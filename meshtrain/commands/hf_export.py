"""``meshtrain export RUN --out HF_DIR``: a run's checkpoint as a HuggingFace model folder."""

from __future__ import annotations

from meshtrain.commands.common import add_device_args
from meshtrain.hf.convert import DTYPES
from meshtrain.hf.peft import LoRAExport
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
    p.add_argument("--lora", choices=[e.value for e in LoRAExport], default=LoRAExport.MERGED.value,
                   help="a LoRA run (--lora-rank): merged (default: a plain HuggingFace folder, the adapters merged "
                        "into the base) or adapters (PEFT's adapter_config.json + adapter_model.safetensors)")
    add_device_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    done = export_hf(args.run_dir, args.out, step=args.step, dtype=args.dtype, devices=args.devices, lora=args.lora)
    if args.lora == LoRAExport.ADAPTERS.value:
        base = done["base_model"] or "not recorded (the run trained from scratch: export --lora merged)"
        print(f"wrote {args.out}: PEFT adapters of step {done['step']}, {done['tensors']:,} tensors, "
              f"{done['bytes'] / 2 ** 20:,.2f} MiB (float32); base model: {base}")
        return 0
    print(f"wrote {args.out}: step {done['step']}, {done['tensors']:,} tensors, {done['bytes'] / 2 ** 20:,.1f} MiB "
          f"({done['dtype']}) in {done['files']} file(s)")
    return 0
