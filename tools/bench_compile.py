"""Compile time of the reference decoder's train step at 4 and at 32 layers. A scan over layers keeps
it flat; the default layer loop (``auto``) unrolls shallow stacks (faster steps) and scans deep ones.
Prints both and their ratio; exits 1 if the ratio exceeds --max-ratio.

    python tools/bench_compile.py [--model small] [--recipe fsdp] [--layers 4 32] [--repeats 2]
                                  [--layer-loop auto|scan|unrolled]
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--recipe", default="fsdp")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="compile each this many times, report the fastest")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--max-ratio", type=float, default=1.5)
    p.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax

    import meshtrain as mt

    def setup(layers):
        cfg = mt.models.get_config(args.model, n_layers=layers)
        abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
        recipe = mt.get_recipe(args.recipe).with_options(layer_loop=args.layer_loop)
        plan = mt.make_plan(abstract, recipe, batch=mt.BatchSpec(args.batch_size, args.seq_len))
        state = mt.abstract_train_state(plan)  # ShapeDtypeStructs: nothing is allocated
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_shardings[k])
                 for k, v in plan.batch.abstract().items()}
        return abstract, plan, state, batch

    setups = {layers: setup(layers) for layers in args.layers}
    times = {layers: float("inf") for layers in args.layers}
    hlo_ops = {}
    _, plan, state, batch = setups[args.layers[0]]
    mt.make_train_step(plan).lower(state, batch).compile()  # warm-up: first compile pays one-time costs
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        for layers, (abstract, plan, state, batch) in setups.items():
            step = mt.make_train_step(plan)  # a fresh jit: no cache hit
            t0 = time.perf_counter()
            lowered = step.lower(state, batch)
            compiled = lowered.compile()
            times[layers] = min(times[layers], time.perf_counter() - t0)
            text = compiled.as_text()
            # while loops of the program meshtrain lowers (a scanned layer stack is one), not of XLA's output:
            # the backend adds its own (XLA:CPU's elemental emitters expand a scatter into a loop)
            hlo_ops[layers] = (sum(1 for line in text.splitlines() if " = " in line),
                               lowered.as_text().count("stablehlo.while"))
    for layers, (abstract, _, _, _) in setups.items():
        print(f"{args.model} with {layers:>3} layers ({abstract.num_params / 1e6:.1f}M params): "
              f"lower+compile {times[layers]:.2f} s (best of {args.repeats}), {hlo_ops[layers][0]} HLO instructions, "
              f"{hlo_ops[layers][1]} while loops (lowered)",
              flush=True)
    lo, hi = min(times), max(times)
    ratio = times[hi] / times[lo]
    print(f"layer loop {args.layer_loop}; ratio {hi} layers / {lo} layers: {ratio:.2f} (limit {args.max_ratio})")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
