"""Model FLOPs utilisation of meshtrain's train step against a hand-written pure-JAX step.

A Llama-style decoder, mixed precision (f32 parameters, bf16 compute by default), AdamW, sized to
the devices found: on one GPU/TPU a ~1.2B model (Llama-3.2-1B shapes), on several an 8B model
(Llama-3-8B) under ``fsdp``; on CPU the ``tiny`` model, so the script runs anywhere. The same
model, shardings and batch go through

* ``meshtrain``: ``make_train_step(plan)`` (loss division by the global weight, gradient norm,
  finiteness flag, the recipe's attention kind and activation layout);
* ``hand-written``: ``jax.jit(value_and_grad + optax update)`` with the plan's shardings and the
  model's own activation constraints, no meshtrain step code;

timed alternately in one process (the median of ``--steps`` steps each). Reported per variant:
tokens/s, TFLOP/s per device and MFU, with the README's formula::

    MFU = model_flops_per_token(cfg, T) · tokens per step / (step time · devices · peak FLOP/s)
    model_flops_per_token = 6·N + 6·L·n·h·T   (N matmul parameters; causal attention counted once)

The peak is the named chip's bf16 dense figure (``meshtrain.hardware``); on CPU it is the measured
matmul rate of this host shared by the simulated devices (``--hardware cpu``), so CPU MFU is only
a sanity figure.

    python tools/bench_mfu.py                       # sized to the devices found
    python tools/bench_mfu.py --model small --batch-size 8 --seq-len 256 --steps 5   # CPU, quick
    python tools/bench_mfu.py --json                # one JSON line for BENCHMARKS.md tooling

Exits 1 when ``--min-mfu`` or ``--max-ratio`` (meshtrain / hand-written step time) is not met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# Llama-3.2-1B shapes (1.24B parameters, tied embeddings): the one-accelerator default.
LLAMA_1B = dict(name="llama3.2-1b", vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                head_dim=64, d_ff=8192, max_seq_len=8192, rope_theta=500_000.0, tie_embeddings=True)

#: A packed batch's keys (``--packing unpacked`` drops the last).
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids")
#: ``jax.Device.device_kind`` prefixes -> hardware profile names.
DEVICE_KINDS = (("NVIDIA H100", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100", "a100"), ("NVIDIA B200", "b200"),
                ("TPU v4", "tpu-v4"), ("TPU v5 lite", "tpu-v5e"), ("TPU v5e", "tpu-v5e"), ("TPU v5p", "tpu-v5p"),
                ("TPU v5", "tpu-v5p"), ("TPU v6", "tpu-v6e"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="auto",
                   help="a meshtrain config name, llama3.2-1b, or auto (by device: 1B, 8B or tiny)")
    p.add_argument("--recipe", default="auto", help="auto: dp on one device, fsdp on several")
    p.add_argument("--batch-size", type=int, default=None, help="global sequences per step (auto by device)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (auto by device)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (after one compile step)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator is present")
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--compute-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--remat", default=None, help="remat policy (auto: none on one device / CPU, full for 8B)")
    p.add_argument("--attention", default="auto", help="attention kind (auto: flash where meshtrain has it)")
    p.add_argument("--hardware", default="auto", help="peak FLOP/s profile (auto from the device kind)")
    p.add_argument("--min-mfu", type=float, default=None, help="exit 1 if meshtrain's MFU is below this")
    p.add_argument("--max-ratio", type=float, default=None, help="exit 1 if meshtrain / hand-written is above this")
    p.add_argument("--xla-flags", choices=("auto", "none"), default="auto",
                   help="auto: meshtrain's XLA scheduling flags for the backend (as `meshtrain train`); none: off")
    p.add_argument("--offload", default="none", choices=("none", "optimizer"),
                   help="meshtrain's step with its optimizer state in host memory (the hand-written step keeps it "
                        "on the device: the ratio is then offload's cost)")
    p.add_argument("--packing", default="packed", choices=("packed", "unpacked"),
                   help="packed: batches carry segment ids (flash on a Hopper GPU runs cuDNN's ragged layout, on "
                        "an older one blockwise XLA); unpacked: no segment ids (flash on a GPU runs cuDNN)")
    p.add_argument("--layers", type=int, default=None,
                   help="cut the model to this many layers (an 8B-shaped model on one chip: --model llama3-8b "
                        "--layers 8)")
    p.add_argument("--fp8", default=None,
                   help="the recipe's fp8 option (e.g. delayed) where the installed meshtrain has one")
    p.add_argument("--hand", choices=("yes", "no"), default="yes",
                   help="no: time meshtrain's step only (the device check runs the hand-written step on its "
                        "baseline rows)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def _hardware_name(device) -> str:
    if device.platform == "cpu":
        return "cpu"
    for prefix, name in DEVICE_KINDS:
        if device.device_kind.startswith(prefix):
            return name
    raise SystemExit(f"no peak FLOP/s profile for device kind {device.device_kind!r}; pass --hardware "
                     f"(e.g. h100, tpu-v5p)")


def main(argv=None) -> int:
    args = _parse(argv)
    from meshtrain.hardware import apply_scheduling_flags

    flags = apply_scheduling_flags() if args.xla_flags == "auto" else {}  # before the backend starts
    import jax

    # Before any backend use; only the CPU backend reads it (jax.devices() lists accelerators first).
    jax.config.update("jax_num_cpu_devices", args.devices)
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import meshtrain as mt
    from meshtrain.annotate import step_context
    from meshtrain.hardware import get_hardware
    from meshtrain.models import get_config, model_factory
    from meshtrain.models.decoder import DecoderConfig
    from meshtrain.models.flops import model_flops_per_token
    from meshtrain.parallel.flash import flash_backend, target_compute_capability
    from meshtrain.recipes import AttentionKind
    from meshtrain.train.step import next_token_loss, step_context_for

    devices = jax.devices()
    n, platform = len(devices), devices[0].platform
    # Sizes by device: what fits without remat on one 80 GB GPU, 8B with remat on a node, tiny on CPU.
    if args.model == LLAMA_1B["name"]:
        cfg = DecoderConfig(**LLAMA_1B)
    elif args.model != "auto":
        cfg = get_config(args.model)
    elif platform == "cpu":
        cfg = get_config("tiny")
    elif n == 1:
        cfg = DecoderConfig(**LLAMA_1B)
    else:
        cfg = get_config("llama3-8b")
    if args.layers:
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{args.layers}l", n_layers=args.layers)
    accel = platform != "cpu"
    batch = args.batch_size or (8 if not accel else (8 if n == 1 else 2 * n))
    seq = args.seq_len or (128 if not accel else (2048 if n == 1 else 4096))
    seq = min(seq, cfg.max_seq_len)
    remat = args.remat or ("full" if accel and cfg.num_params() > 4e9 else "none")
    recipe_name = args.recipe if args.recipe != "auto" else ("dp" if n == 1 else "fsdp")
    kinds = {k.value for k in AttentionKind}
    attention = args.attention if args.attention != "auto" else ("flash" if "flash" in kinds else "dense")
    recipe = mt.get_recipe(recipe_name).with_options(param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
                                                     remat=remat, attention=attention, offload=args.offload)
    if args.fp8:
        recipe = recipe.with_options(fp8=args.fp8)
    hw = get_hardware(args.hardware if args.hardware != "auto" else _hardware_name(devices[0]), num_devices=n)

    tx = optax.adamw(1e-4, weight_decay=0.1)
    abstract = mt.abstract_state(model_factory(cfg), tx)
    packed = args.packing == "packed"
    spec = mt.BatchSpec(batch, seq, keys=BATCH_KEYS if packed else BATCH_KEYS[:-1])  # segment_ids last
    plan = mt.make_plan(abstract, recipe, batch=spec)
    # the hand-written step keeps its optimizer state on the device (with --offload: the baseline)
    hand_plan = (plan if args.offload == "none" else
                 mt.make_plan(abstract, recipe.with_options(offload="none"), batch=spec))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(4, batch, seq + 1), dtype=np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    segments = {"segment_ids": np.ones((batch, seq), np.int32)} if packed else {}
    batches = [jax.device_put({"inputs": t[:, :-1], "targets": t[:, 1:], "positions": positions, **segments},
                              plan.batch_shardings) for t in tokens]
    # the kernel flash attention gets here (packed documents run cuDNN on Hopper or newer GPUs)
    kernel = (flash_backend(platform=platform, dtype=args.compute_dtype, segmented=packed,
                            compute_capability=target_compute_capability())[0].value
              if attention == "flash" else attention)

    mt_step = mt.make_train_step(plan)
    mt_state = mt.init_state(plan, seed=0)

    # Hand-written: the same model and shardings; jit(value_and_grad + optax), nothing else.
    graphdef, compute = abstract.graphdef, jnp.dtype(args.compute_dtype)

    def hand_loss(params, b):
        params = jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        total, count = next_token_loss(nnx.merge(graphdef, params, {}), b)
        return total / count

    def hand_step(params, opt_state, b):
        with step_context(step_context_for(hand_plan)):  # the model's own activation constraints and attention
            loss, grads = jax.value_and_grad(hand_loss)(params, b)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    hand = jax.jit(hand_step, in_shardings=(hand_plan.param_shardings, hand_plan.opt_shardings,
                                            hand_plan.batch_shardings),
                   out_shardings=(hand_plan.param_shardings, hand_plan.opt_shardings, None), donate_argnums=(0, 1))
    with_hand = args.hand == "yes"
    if with_hand:  # (its own copy of the state: skipped with --hand no, which also frees that memory)
        init = mt.init_state(hand_plan, seed=0)
        params, opt_state = init.params, init.opt_state
        del init

    t0 = time.perf_counter()
    mt_state, m = mt_step(mt_state, batches[0])
    first_mt = float(m["loss"])
    compile_mt = time.perf_counter() - t0
    first_hand = compile_hand = None
    if with_hand:
        t0 = time.perf_counter()
        params, opt_state, loss = hand(params, opt_state, batches[0])
        first_hand = float(loss)
        compile_hand = time.perf_counter() - t0

    times = {"meshtrain": [], "hand-written": []} if with_hand else {"meshtrain": []}
    for i in range(args.steps):
        b = batches[(i + 1) % len(batches)]
        t0 = time.perf_counter()
        mt_state, m = mt_step(mt_state, b)
        jax.block_until_ready(m["loss"])
        times["meshtrain"].append(time.perf_counter() - t0)
        if with_hand:
            t0 = time.perf_counter()
            params, opt_state, loss = hand(params, opt_state, b)
            jax.block_until_ready(loss)
            times["hand-written"].append(time.perf_counter() - t0)

    tokens_per_step = batch * seq
    flops_per_step = model_flops_per_token(cfg, seq) * tokens_per_step
    rows = {}
    for name, ts in times.items():
        dt = statistics.median(ts)
        rows[name] = {"step_s": dt, "tokens_per_s": tokens_per_step / dt,
                      "tflops_per_device": flops_per_step / dt / n / 1e12,
                      "mfu": flops_per_step / dt / n / hw.peak_flops}
    ratio = rows["meshtrain"]["step_s"] / rows["hand-written"]["step_s"] if with_hand else None
    result = {
        "device": f"{n} x {devices[0].device_kind} ({platform})", "hardware": hw.name,
        "peak_tflops_per_device": hw.peak_flops / 1e12, "model": cfg.name, "params": cfg.num_params(),
        "recipe": recipe.name, "attention": attention, "attention_kernel": kernel,
        "packing": args.packing, "offload": args.offload, "remat": remat, "param_dtype": args.param_dtype,
        "compute_dtype": args.compute_dtype, "batch": batch, "seq_len": seq, "steps": args.steps,
        "model_flops_per_step": flops_per_step, "first_loss": {"meshtrain": first_mt, "hand-written": first_hand},
        "compile_s": {"meshtrain": compile_mt, "hand-written": compile_hand}, "results": rows,
        "ratio_meshtrain_over_hand": ratio, "xla_flags_added": flags, "config": dataclasses.asdict(cfg),
    }
    if args.json:
        print(json.dumps(result))
    else:
        unit, uname = (1e12, "TFLOP/s") if accel else (1e9, "GFLOP/s")  # CPU rates are GFLOP/s
        print(f"{result['device']}, peak {hw.peak_flops / unit:.1f} {uname} per device ({hw.name})")
        print(f"{cfg.name} ({cfg.num_params() / 1e6:,.1f}M params), recipe {recipe.name}, attention {attention}, "
              f"remat {remat}, params {args.param_dtype}, compute {args.compute_dtype}, "
              f"batch {batch} x {seq} tokens, {args.steps} alternating steps")
        print(f"XLA scheduling flags added: {flags or 'none'}")
        print(f"first-step loss: meshtrain {first_mt:.6f}" + (f", hand-written {first_hand:.6f}" if with_hand else ""))
        print(f"{'variant':<14}{'step ms':>10}{'tokens/s':>14}{uname + '/dev':>14}{'MFU':>9}")
        for name, r in rows.items():
            print(f"{name:<14}{r['step_s'] * 1e3:>10.1f}{r['tokens_per_s']:>14,.0f}{r['tflops_per_device'] * 1e12 / unit:>14.2f}"
                  f"{r['mfu'] * 100:>8.1f}%")
        if ratio is not None:
            print(f"meshtrain / hand-written step time: {ratio:.3f}")
    ok = True
    if args.min_mfu is not None and rows["meshtrain"]["mfu"] < args.min_mfu:
        print(f"MFU {rows['meshtrain']['mfu']:.3f} is below --min-mfu {args.min_mfu}", file=sys.stderr)
        ok = False
    if args.max_ratio is not None and ratio is not None and ratio > args.max_ratio:
        print(f"ratio {ratio:.3f} is above --max-ratio {args.max_ratio}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
