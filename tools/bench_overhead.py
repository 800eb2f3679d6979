"""Framework overhead: meshtrain's train step vs hand-written jax/flax/optax steps with the same
model, shardings (parameters, optimizer state, batch, and the model's activation constraints),
optimizer and donation, run alternately in one process. The hand-written step runs the layers two
ways, as one ``lax.scan`` and unrolled; meshtrain uses its default layer loop (``auto``: unrolled
for shallow stacks without remat). Prints the median step times and the ratio of meshtrain to the
best hand-written one, and each step's lower+compile time; exits 1 above --max-ratio.

    python tools/bench_overhead.py [--model small] [--layers 32] [--recipe fsdp] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def hand_written_step(plan, tx, batch_size: int, seq_len: int, loop: str):
    """A plain ``jax.jit`` train step for ``plan``'s model, no meshtrain code in the step: the plan's shardings
    (parameters, optimizer state, batch), the model's own activation constraints made active, ``tx`` and
    donation, the layers as one scan (``loop="scan"``) or unrolled (``"unrolled"``).
    ``fn(params, opt_state, batch) -> (params, opt_state, loss)``; tools/bench_vs_easydel.py reuses it."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import meshtrain as mt
    from meshtrain.annotate import step_context
    from meshtrain.train.step import step_context_for

    graphdef = plan.abstract.graphdef

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, {})
        logits = model(batch["inputs"], batch["positions"], batch["segment_ids"]).astype(jnp.float32)
        mask = batch["targets"] >= 0
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(batch["targets"], 0))
        return jnp.sum(ce * mask) / jnp.sum(mask)

    def hand_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # The same activation layout as meshtrain: the model's own constrain() calls, made active.
    ctx = step_context_for(mt.make_plan(plan.abstract, plan.recipe.with_options(layer_loop=loop),
                                        batch=mt.BatchSpec(batch_size, seq_len)))

    def fn(params, opt_state, batch):
        with step_context(ctx):
            return hand_step(params, opt_state, batch)

    return jax.jit(fn, in_shardings=(plan.param_shardings, plan.opt_shardings, plan.batch_shardings),
                   out_shardings=(plan.param_shardings, plan.opt_shardings, None), donate_argnums=(0, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--layers", type=int, default=None, help="override the config's layer count (e.g. 32)")
    p.add_argument("--recipe", default="fsdp")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--max-ratio", type=float, default=1.05)
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax

    import meshtrain as mt
    from meshtrain.data import BatchIterator, load_source

    tx = optax.adamw(1e-3)
    cfg = mt.models.get_config(args.model, **({"n_layers": args.layers} if args.layers else {}))
    abstract = mt.abstract_state(mt.models.model_factory(cfg), tx)
    plan = mt.make_plan(abstract, args.recipe, batch=mt.BatchSpec(args.batch_size, args.seq_len))
    data = BatchIterator(load_source(None), args.batch_size, args.seq_len, shardings=plan.batch_shardings)
    batches = [next(data) for _ in range(4)]

    # meshtrain
    mt_state = mt.init_state(plan, seed=0)
    mt_step = mt.make_train_step(plan)

    hands = {f"hand-written {loop}": hand_written_step(plan, tx, args.batch_size, args.seq_len, loop)
             for loop in ("scan", "unrolled")}
    states = {}
    for name in hands:
        init = mt.init_state(plan, seed=0)
        states[name] = (init.params, init.opt_state)

    # compile all (timed: lower + compile of each step), check they compute the same thing
    compile_s = {}
    t0 = time.perf_counter()
    mt_step = mt_step.lower(mt_state, batches[0]).compile()
    compile_s["meshtrain"] = time.perf_counter() - t0
    mt_state, m = mt_step(mt_state, batches[0])
    first = {"meshtrain": float(m["loss"])}
    for name, fn in hands.items():
        t0 = time.perf_counter()
        fn = hands[name] = fn.lower(*states[name], batches[0]).compile()
        compile_s[name] = time.perf_counter() - t0
        p_, o_, loss = fn(*states[name], batches[0])
        states[name] = (p_, o_)
        first[name] = float(loss)
    print(f"first-step loss: meshtrain {first['meshtrain']:.6f}, hand-written {first['hand-written scan']:.6f}, "
          f"unrolled {first['hand-written unrolled']:.6f}")

    times = {"meshtrain": [], **{name: [] for name in hands}}
    for i in range(args.steps):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        mt_state, m = mt_step(mt_state, batch)
        float(m["loss"])
        times["meshtrain"].append(time.perf_counter() - t0)
        for name, fn in hands.items():
            t0 = time.perf_counter()
            p_, o_, loss = fn(*states[name], batch)
            float(loss)
            states[name] = (p_, o_)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med["hand-written scan"], med["hand-written unrolled"])
    ratio = med["meshtrain"] / best
    print(f"{args.model} ({cfg.n_layers} layers, {abstract.num_params / 1e6:.1f}M params) / {args.recipe} on {plan.num_devices} {jax.devices()[0].platform} devices, "
          f"batch {args.batch_size}x{args.seq_len}, {args.steps} alternating steps, meshtrain layer loop "
          f"{plan.recipe.layer_loop.value}")
    print(f"median step: meshtrain {med['meshtrain'] * 1e3:.1f} ms, hand-written scan "
          f"{med['hand-written scan'] * 1e3:.1f} ms, hand-written unrolled {med['hand-written unrolled'] * 1e3:.1f} ms; "
          f"ratio to the best {ratio:.3f} (limit {args.max_ratio})")
    print(f"lower+compile: meshtrain {compile_s['meshtrain']:.2f} s, hand-written scan "
          f"{compile_s['hand-written scan']:.2f} s, hand-written unrolled {compile_s['hand-written unrolled']:.2f} s")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
