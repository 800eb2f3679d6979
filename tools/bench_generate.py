"""Generation speed per recipe and batch size, side by side: prefill tokens/s, decode tokens/s and
per-token latency (randomly initialised built-in decoders; weights do not change the speed).

    python tools/bench_generate.py                                   # tiny and small, dp/fsdp/tp/fsdp_tp, batch 1 and 8
    python tools/bench_generate.py --models small --recipes tp fsdp_tp --batch-sizes 1 8 32 --json

Each cell compiles prefill and decode once (a warm-up generation), then times ``--repeats``
generations of ``--new-tokens`` tokens after a ``--prompt-len``-token prompt per row and keeps the
fastest. Figures: prefill tokens/s = batch × prompt length ÷ prefill seconds; decode tokens/s =
batch × decode steps ÷ their seconds; per-token latency = the median decode step (each step ends
when its tokens reach the host). Rows are padded to a multiple of the recipe's data-parallel size
(``padded`` column); the figures count only the requested rows.
"""

from __future__ import annotations

import argparse
import json
import statistics


def bench_cell(model, name, recipe, batch, prompt_len, new_tokens, repeats, quantize, devices):
    from meshtrain.generation import Sampling, load

    loaded = load(model, recipe=recipe, devices=devices, quantize=quantize)
    prompts = [[(7 * b + t) % model.cfg.vocab_size for t in range(prompt_len)] for b in range(batch)]
    loaded.generate(prompts, new_tokens, Sampling())  # compiles prefill and decode
    best = None
    for _ in range(repeats):
        t = loaded.generate(prompts, new_tokens, Sampling()).timing
        if best is None or t.prefill_s + sum(t.decode_s) < best.prefill_s + sum(best.decode_s):
            best = t
    steps = len(best.decode_s)
    return {"model": name, "recipe": recipe, "quantize": quantize, "batch": batch, "padded": best.batch,
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "prefill_tokens_per_s": batch * prompt_len / best.prefill_s,
            "decode_tokens_per_s": batch * steps / sum(best.decode_s) if steps else None,
            "per_token_ms": 1e3 * statistics.median(best.decode_s) if steps else None,
            "weight_bytes_per_device": loaded.engine.weight_bytes_per_device(),
            "cache_bytes_per_device": loaded.engine.cache_bytes_per_device(batch, prompt_len + new_tokens - 1)}


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--recipes", nargs="+", default=["dp", "fsdp", "tp", "fsdp_tp"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quantize", nargs="+", default=["none"], help="weight formats: none bf16 int8")
    p.add_argument("--devices", type=int, default=None, help="(simulated) devices (default: all, or 8 on CPU)")
    p.add_argument("--json", action="store_true", help="one JSON object per cell instead of the table")
    args = p.parse_args(argv)
    from meshtrain.cli import setup_devices

    setup_devices(args.devices)
    import jax
    from flax import nnx

    from meshtrain.models import Decoder, get_config

    print(f"devices: {jax.device_count()} × {jax.devices()[0].device_kind}", flush=True)
    header = ("model", "recipe", "weights", "batch", "padded", "prefill tok/s", "decode tok/s", "ms/token",
              "weights/dev", "cache/dev")
    if not args.json:
        print("  ".join(f"{h:>13}" for h in header), flush=True)
    for name in args.models:
        with nnx.use_eager_sharding(False):
            model = Decoder(get_config(name), rngs=nnx.Rngs(0))
        for recipe in args.recipes:
            for quantize in args.quantize:
                for batch in args.batch_sizes:
                    r = bench_cell(model, name, recipe, batch, args.prompt_len, args.new_tokens, args.repeats,
                                   quantize, args.devices)
                    if args.json:
                        print(json.dumps(r), flush=True)
                        continue
                    cells = (name, recipe, quantize, batch, r["padded"], fmt(r["prefill_tokens_per_s"], ".0f"),
                             fmt(r["decode_tokens_per_s"], ".1f"), fmt(r["per_token_ms"], ".2f"),
                             f"{r['weight_bytes_per_device'] / 2 ** 20:.2f} MiB",
                             f"{r['cache_bytes_per_device'] / 2 ** 20:.3f} MiB")
                    print("  ".join(f"{c!s:>13}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
