"""Framework overhead: meshtrain's train step vs a hand-written jax/flax/optax step with the same
model, shardings (parameters, optimizer state, batch, and the model's activation constraints),
optimizer and donation, run alternately in one process. Prints the median step
times and their ratio (meshtrain / hand-written); exits 1 above --max-ratio.

    python tools/bench_overhead.py [--model small] [--recipe fsdp] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--recipe", default="fsdp")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--max-ratio", type=float, default=1.05)
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import meshtrain as mt
    from meshtrain.data import BatchIterator, load_source

    tx = optax.adamw(1e-3)
    abstract = mt.abstract_state(mt.models.model_factory(args.model), tx)
    plan = mt.make_plan(abstract, args.recipe, batch=mt.BatchSpec(args.batch_size, args.seq_len))
    data = BatchIterator(load_source(None), args.batch_size, args.seq_len, shardings=plan.batch_shardings)
    batches = [next(data) for _ in range(4)]

    # meshtrain
    mt_state = mt.init_state(plan, seed=0)
    mt_step = mt.make_train_step(plan)

    # hand-written: plain jit with the plan's shardings, no meshtrain code in the step
    graphdef = abstract.graphdef

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

    from meshtrain.annotate import step_context
    from meshtrain.train.step import step_context_for

    def hand_step_constrained(params, opt_state, batch):
        # The same activation layout as meshtrain: the model's own constrain() calls, made active.
        with step_context(step_context_for(plan)):
            return hand_step(params, opt_state, batch)

    def jit(fn):
        return jax.jit(fn, in_shardings=(plan.param_shardings, plan.opt_shardings, plan.batch_shardings),
                       out_shardings=(plan.param_shardings, plan.opt_shardings, None), donate_argnums=(0, 1))

    hand = jit(hand_step_constrained)
    bare = jit(hand_step)
    init = mt.init_state(plan, seed=0)
    params, opt_state = init.params, init.opt_state
    init2 = mt.init_state(plan, seed=0)
    bare_params, bare_opt = init2.params, init2.opt_state

    # compile both, check they compute the same thing
    mt_state, m = mt_step(mt_state, batches[0])
    params, opt_state, loss = hand(params, opt_state, batches[0])
    bare_params, bare_opt, _ = bare(bare_params, bare_opt, batches[0])
    print(f"first-step loss: meshtrain {float(m['loss']):.6f}, hand-written {float(loss):.6f}")

    t_mt, t_hand, t_bare = [], [], []
    for i in range(args.steps):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        mt_state, m = mt_step(mt_state, batch)
        float(m["loss"])
        t_mt.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        params, opt_state, loss = hand(params, opt_state, batch)
        float(loss)
        t_hand.append(time.perf_counter() - t0)
        if i % 4 == 0:  # fewer samples: this variant is only for information
            t0 = time.perf_counter()
            bare_params, bare_opt, loss = bare(bare_params, bare_opt, batch)
            float(loss)
            t_bare.append(time.perf_counter() - t0)
    a, b = statistics.median(t_mt), statistics.median(t_hand)
    ratio = a / b
    print(f"{args.model} / {args.recipe} on {plan.num_devices} {jax.devices()[0].platform} devices, "
          f"batch {args.batch_size}x{args.seq_len}, {args.steps} alternating steps")
    print(f"median step: meshtrain {a * 1e3:.1f} ms, hand-written {b * 1e3:.1f} ms, ratio {ratio:.3f} "
          f"(limit {args.max_ratio})")
    print(f"(hand-written without activation constraints, for information: {statistics.median(t_bare) * 1e3:.1f} ms)")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
