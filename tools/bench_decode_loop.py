"""Decode speed, alternated in one process: meshtrain's per-token loop (``DecodeLoop.HOST``, the engine
before the compiled loop) vs its compiled loop (``DecodeLoop.DEVICE``) vs transformers' Flax Llama
``generate`` on the same weights, plus the memory-bandwidth floor of a decode step.

    python tools/bench_decode_loop.py                                  # tiny-llama and llama-114m, f32 and bf16, 3 rounds
    python tools/bench_decode_loop.py --models tiny-llama --formats none bf16 int8 --rounds 5 --json
    python tools/bench_decode_loop.py --bandwidth                      # only the copy bandwidth

Models: randomly initialised (weights do not change the speed), 1 device. ``tiny-llama``: the ``tiny``
model with 8 query / 4 key-value heads of 8 (transformers' Flax Llama takes head_dim = d_model / heads,
which ``tiny``'s 16 heads of 8 in a d_model of 64 are not); ``llama-114m``: a Llama of
~114M parameters (d_model 640, 16 layers, 10 query / 5 key-value heads of 64, d_ff 1728, a 32,000
vocabulary, untied head: transformers' Flax Llama has no tied head). transformers gets the same weights
(meshtrain's HuggingFace export layout, :func:`meshtrain.hf.weights.hf_tensors`) in its Flax tree, and
its greedy tokens are checked against meshtrain's (``agree``). Formats: ``none`` (f32), ``bf16``
(weights and compute; transformers with ``dtype=bfloat16`` and bf16 params), ``int8`` (meshtrain only).

Contenders: ``host``, ``device`` (the engine as the resolved step chooses: bf16 on 1 CPU device uses the
row kernel, :mod:`meshtrain.kernels.bf16_rows`; a small f32 or bf16 model the whole decode step in one call,
:mod:`meshtrain.kernels.decode_step`), ``xla`` (the compiled loop on XLA's dot: bf16 as before the
kernel) and ``transformers``. Each round runs every contender ``--repeats`` times for ``--new-tokens`` tokens and
``--repeats`` times for 1 token on a ``--prompt-len``-token prompt, greedy and with no stop id, after one warm-up (compiling) call of each
length; each figure is the fastest of its calls (on a shared host the fastest is the least disturbed). The
contenders run one after another in each round, so every round compares them under the same load. Figures,
the same arithmetic for every contender:

* **e2e tok/s**: new tokens ÷ the wall seconds of one whole call (prompt in, tokens on the host);
* **decode tok/s**: ``new_tokens - 1`` ÷ (the call for ``new_tokens`` − the call for 1 token): the decode steps
  alone, every fixed cost of a call (prefill, transfers, dispatch) cancelled;
* meshtrain's ``timed_decode``: its decode program's own timing (:class:`~meshtrain.generation.engine.Timing`);
* the medians over rounds, and compiled-loop ÷ transformers per round.

**Bandwidth floor**: a decode step reads every weight it multiplies by (all of them but the embedding
table, of which it gathers one row; a tied head reads the table) and the whole KV cache (the attention
runs over every slot, masked); floor = those bytes ÷ the machine's copy bandwidth, measured with a
numpy copy of a 256 MiB array (bytes read + written per second, the best of 5; a step's matmuls read
only, so this is a floor, not a bound). The load average (1, 5, 15 min) is printed before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

#: the ~100M-parameter Llama of the comparison (untied: transformers' Flax Llama has an untied lm_head)
LLAMA_114M = dict(vocab_size=32_000, d_model=640, n_layers=16, n_heads=10, n_kv_heads=5, head_dim=64, d_ff=1728,
                  max_seq_len=2048, tie_embeddings=False)


#: ``tiny`` with heads transformers' Flax Llama can hold (head_dim = d_model / n_heads)
TINY_LLAMA = dict(n_heads=8, n_kv_heads=4, head_dim=8)


def config(name: str):
    """A built-in config, or one of the two Llama shapes of this benchmark."""
    from meshtrain.models import get_config

    if name == "llama-114m":
        return dataclasses.replace(get_config("small"), name=name, **LLAMA_114M)
    if name == "tiny-llama":
        return dataclasses.replace(get_config("tiny"), name=name, **TINY_LLAMA)
    return get_config(name)


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second a numpy copy of a ``mib`` MiB array moves (read + write), the best of ``repeats``."""
    import numpy as np

    src = np.ones(mib * 2 ** 20 // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def bytes_per_token(engine, prompt_len: int, new_tokens: int) -> dict:
    """Weight and KV-cache bytes one decode step reads (batch 1; see the module docstring)."""
    import jax

    params = engine.params
    weights = sum(x.nbytes for x in jax.tree.leaves(params))  # an Int8Weight counts its q and scale
    table = sum(x.nbytes for x in jax.tree.leaves(params["embedding_vd"]))
    read = weights - (0 if engine.cfg.tie_embeddings else table)
    cache = engine.cache_bytes_per_device(1, prompt_len + new_tokens - 1)
    return {"weight_bytes": read, "cache_bytes": cache}


def flax_llama(cfg, params, dtype):
    """transformers' Flax Llama of ``cfg`` holding meshtrain's ``params`` (nested dict of host arrays)."""
    import jax.numpy as jnp
    import numpy as np
    import transformers

    from meshtrain.hf.config import hf_config
    from meshtrain.hf.weights import hf_tensors

    flat = {}

    def walk(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}/")
            else:
                flat[prefix + k] = np.asarray(v, np.float32)

    walk(params)
    tree: dict = {}
    for name, tensor in hf_tensors(cfg, flat):
        parts = name.split(".")
        leaf = parts.pop()  # weight
        if parts[-1] == "embed_tokens":
            leaf, value = "embedding", tensor
        elif parts[-1].endswith("norm") or parts[-1].endswith("layernorm"):
            value = tensor
        else:
            leaf, value = "kernel", tensor.T  # torch (out, in) -> flax (in, out)
        node = tree
        for p in parts:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(value, dtype)
    hf = transformers.LlamaConfig(**{k: v for k, v in hf_config(cfg, "float32").items()
                                     if k not in ("architectures", "model_type", "torch_dtype")})
    model = transformers.FlaxLlamaForCausalLM(hf, dtype=dtype, _do_init=False)
    model.generation_config.eos_token_id = cfg.vocab_size  # past the vocabulary: exactly new_tokens tokens
    model.generation_config.pad_token_id = 0
    return model, tree


def transformers_call(model, params, new_tokens: int):
    """``ids_bt -> sequences_bt`` (numpy): transformers' greedy ``generate`` under ``jax.jit``."""
    import jax
    import numpy as np

    run = jax.jit(lambda p, ids: model.generate(ids, params=p, max_new_tokens=new_tokens, do_sample=False).sequences)
    return lambda ids: np.asarray(run(params, ids))


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def bench_model(name: str, fmt: str, args) -> list:
    """One row per round: e2e and decode tokens/s of each contender (see the module docstring)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshtrain.generation import Engine, load
    from meshtrain.models import Decoder

    cfg = config(name)
    with nnx.use_eager_sharding(False):
        model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    new = load(model, recipe="dp", devices=1, quantize=fmt).engine
    old = Engine(cfg, params, new.plan, weights=fmt, loop="host") if "host" in args.contenders else None
    # the compiled loop with XLA's dot whatever the resolved step would choose (bf16: before the row kernel)
    xla = Engine(cfg, params, new.plan, weights=fmt, decode_matmul="xla") if "xla" in args.contenders else None
    prompt = [[(7 * t + 3) % cfg.vocab_size for t in range(args.prompt_len)]]
    n = args.new_tokens
    calls = {"host": lambda k: old.run(prompt, k), "device": lambda k: new.run(prompt, k),
             "xla": lambda k: xla.run(prompt, k)}
    calls = {k: f for k, f in calls.items() if k in args.contenders}
    hf = None
    if fmt in ("none", "bf16") and "transformers" in args.contenders:
        dtype = jnp.float32 if fmt == "none" else jnp.bfloat16
        hf_model, hf_params = flax_llama(cfg, params, dtype)
        hf = {k: transformers_call(hf_model, hf_params, k) for k in (n, 1)}
        ids = np.asarray(prompt, np.int32)
        calls["transformers"] = lambda k: hf[k](ids)
    warm = {k: (f(n), f(1)) for k, f in calls.items()}  # compiles both lengths
    agree = None
    if hf is not None and "device" in warm:
        agree = list(warm["transformers"][0][0, args.prompt_len:]) == list(warm["device"][0].generations[0].new_ids)
    floor = bytes_per_token(new, args.prompt_len, n)
    rows = []
    for r in range(args.rounds):
        row = {"model": name, "format": fmt, "round": r, "load_before": os.getloadavg(),
               "decode_matmul": new.decode_matmul.value}
        for k, f in calls.items():
            full = min((timed(f, n) for _ in range(args.repeats)), key=lambda x: x[1])
            one = min(timed(f, 1)[1] for _ in range(args.repeats))
            row[k] = {"e2e": n / full[1], "decode": (n - 1) / (full[1] - one) if full[1] > one else None}
            if k != "transformers":  # meshtrain's own timing of its decode program(s)
                t = full[0].timing
                row[k]["timed_decode"] = t.decode_steps / sum(t.decode_s) if t.decode_steps else None
        row["load_after"] = os.getloadavg()
        row["agree_with_transformers"] = agree
        row.update(floor)
        rows.append(row)
    return rows


def summary(rows, bandwidth: float) -> str:
    r0 = rows[0]
    lines = [f"{r0['model']} {r0['format']}: weights read/token {r0['weight_bytes'] / 2 ** 20:.1f} MiB, cache "
             f"{r0['cache_bytes'] / 2 ** 20:.2f} MiB -> floor "
             f"{1e3 * (r0['weight_bytes'] + r0['cache_bytes']) / bandwidth:.2f} ms/token "
             f"({bandwidth / (r0['weight_bytes'] + r0['cache_bytes']):.0f} tokens/s); greedy tokens equal "
             f"transformers': {r0['agree_with_transformers']}; device's matmuls: {r0['decode_matmul']}"]
    kinds = [k for k in ("host", "xla", "device", "transformers") if k in r0]
    for r in rows:
        cells = "  ".join(f"{k} e2e {r[k]['e2e']:7.1f} dec {r[k]['decode'] or 0:7.1f}" for k in kinds)
        vs = (f"  device/transformers e2e {r['device']['e2e'] / r['transformers']['e2e']:.2f}x "
              f"dec {r['device']['decode'] / r['transformers']['decode']:.2f}x" if "transformers" in r
              and r["transformers"]["decode"] else "")
        lines.append(f"  round {r['round']}: {cells}{vs}  load {r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}")
    for fig in ("decode", "e2e"):
        med = {k: statistics.median(r[k][fig] or 0 for r in rows) for k in kinds}
        lines.append(f"  median {fig} tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    for other in ("transformers", "xla"):
        if other in kinds and "device" in kinds:
            ratios = {fig: statistics.median(r["device"][fig] / r[other][fig] for r in rows
                                             if r["device"][fig] and r[other][fig]) for fig in ("decode", "e2e")}
            lines.append(f"  median of the per-round ratios device/{other}: decode {ratios['decode']:.2f}x, "
                         f"e2e {ratios['e2e']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny-llama", "llama-114m"])
    p.add_argument("--formats", nargs="+", default=["none", "bf16"], help="none (f32), bf16, int8")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="each figure of a round: the fastest of this many calls")
    p.add_argument("--contenders", nargs="+", default=["host", "device", "transformers"],
                   help="which to run: host (per-token loop), device (compiled loop, matmuls as the resolved step "
                        "chooses), xla (compiled loop, XLA's dot: bf16 before the row kernel), transformers")
    p.add_argument("--bandwidth", action="store_true", help="only measure the copy bandwidth")
    p.add_argument("--json", action="store_true", help="one JSON object per round")
    args = p.parse_args(argv)
    if "transformers" in args.contenders:
        # transformers' Flax Llama projects to n_heads · head_dim = d_model and has a SwiGLU MLP, no MoE
        for name in args.models:
            c = config(name)
            if c.n_heads * c.head_dim != c.d_model or c.n_experts or c.mlp_activation != "silu":
                p.error(f"--models {name}: transformers' Flax Llama needs n_heads·head_dim = d_model (here "
                        f"{c.n_heads}·{c.head_dim} vs {c.d_model}), a SwiGLU MLP and no experts; use tiny-llama or "
                        f"llama-114m, or leave transformers out of --contenders")
    from meshtrain.cli import setup_devices

    setup_devices(1)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e9:.2f} GB/s (read + write); load {os.getloadavg()}", flush=True)
    if args.bandwidth:
        return 0
    for name in args.models:
        for fmt in args.formats:
            rows = bench_model(name, fmt, args)
            print("\n".join(json.dumps(r) for r in rows) if args.json else summary(rows, bandwidth), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
