"""Peak host memory of a HuggingFace import: meshtrain's sharded loading vs reading the whole file first.

Writes a random Llama-shaped HF folder (f32, default ~0.5 GB), then in two fresh processes on the same
8 simulated CPU devices (whose "device" memory is host memory, so the sharded weights themselves count):

* ``sharded``: ``meshtrain.hf.load_params`` (each device's blocks cut from the memory-mapped file);
* ``whole``: ``safetensors.numpy.load_file`` (every tensor in host memory), then ``jax.device_put``
  onto the same shardings — what a loader without slicing does.

It prints each one's peak resident memory (``ru_maxrss``) above the process's baseline after JAX
started, in units of the model's bytes. ``--plan-only llama3-8b --devices 64`` instead plans a
built-in config's import on that many simulated devices without any file: every device's blocks are
cut from zero-stride stand-ins of the HF tensors, counting the elements each device reads, against
the plan's parameter elements per device. Example::

    python tools/bench_import.py --layers 8 --d-model 1024
    python tools/bench_import.py --plan-only llama3-8b --devices 64 --recipe fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np


def write_folder(path: str, layers: int, d: int, vocab: int) -> int:
    from safetensors.numpy import save_file

    heads, kv, f = d // 64, max(d // 256, 1), int(d * 8 / 3) // 64 * 64
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": d, "intermediate_size": f,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 64,
              "max_position_embeddings": 2048, "hidden_act": "silu", "torch_dtype": "float32"}
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for l in range(layers):
        p = f"model.layers.{l}."
        tensors.update({p + "self_attn.q_proj.weight": (heads * 64, d), p + "self_attn.k_proj.weight": (kv * 64, d),
                        p + "self_attn.v_proj.weight": (kv * 64, d), p + "self_attn.o_proj.weight": (d, heads * 64),
                        p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                        p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                        p + "post_attention_layernorm.weight": (d,)})
    arrays = {k: rng.standard_normal(s, dtype=np.float32) for k, s in tensors.items()}
    os.makedirs(path, exist_ok=True)
    save_file(arrays, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return sum(a.nbytes for a in arrays.values())


def child(folder: str, how: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import meshtrain as mt
    from meshtrain.abstract import tree_paths
    from meshtrain.hf import load_params, model_config
    from meshtrain.hf.weights import mappings

    cfg = model_config(folder)
    plan = mt.make_plan(mt.abstract_state(mt.models.model_factory(cfg)), "fsdp")
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if how == "sharded":
        params = load_params(folder, plan, cfg)
    else:
        from safetensors.numpy import load_file

        tensors = load_file(os.path.join(folder, "model.safetensors"))
        whole = {}
        for m in mappings(cfg):
            if m.per_layer:
                whole[m.path] = np.stack([_ours(m.kind, tensors[m.name.format(l=l)], cfg, m.path)
                                          for l in range(cfg.n_layers)])
            else:
                whole[m.path] = _ours(m.kind, tensors[m.name], cfg, m.path)
        paths = tree_paths(plan.abstract.params)
        params = jax.tree.map(lambda p, s: jax.device_put(whole[p], s), paths, plan.param_shardings)
    jax.block_until_ready(params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"how": how, "above_baseline": peak - base}))


def plan_only(model: str, devices: int, recipe: str) -> None:
    """Elements each device reads from the HF tensors (stand-ins, no file) vs the plan's (see above)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import meshtrain as mt
    from meshtrain.abstract import tree_paths
    from meshtrain.hf.weights import block_reader, check_coverage, mappings

    cfg = mt.models.get_config(model)
    plan = mt.make_plan(mt.abstract_state(mt.models.model_factory(cfg)), recipe)
    read = {d: 0 for d in jax.devices()}

    class StandIns:  # HF tensors of the right shapes, zero-stride: slicing reads no memory
        def slice(self, name, shape):
            return Counted(np.broadcast_to(np.zeros((), np.float32), shape))

    class Counted:
        def __init__(self, array):
            self.array = array

        def __getitem__(self, index):
            block = self.array[index]
            read[current[0]] += block.size
            return block

    current = [None]
    by_path = {m.path: m for m in mappings(cfg)}
    paths = tree_paths(plan.abstract.params)
    check_coverage(cfg, jax.tree.leaves(paths), model)  # (shared experts, say, have no HF layout)
    for path, sds, sharding in zip(jax.tree.leaves(paths), jax.tree.leaves(plan.abstract.params),
                                   jax.tree.leaves(plan.param_shardings)):
        reader = block_reader(StandIns(), by_path[path], sds.shape)
        for device, index in sharding.devices_indices_map(sds.shape).items():
            current[0] = device
            reader(index)
    per_device = plan.per_device_bytes()["params"] // np.dtype(plan.abstract.params["embedding_vd"].dtype).itemsize
    counts = sorted(set(read.values()))
    print(f"{model} on {devices} devices, {recipe}: {cfg.num_params():,} parameters; the plan holds {per_device:,} "
          f"elements per device; each device reads {counts[0]:,}" + (f"..{counts[-1]:,}" if len(counts) > 1 else "")
          + f" elements; equal: {counts == [per_device]}")


def _ours(kind, t, cfg, path):
    from meshtrain.hf.weights import cut

    shape = {"blocks/attn/wq_dnh": (cfg.d_model, cfg.n_heads, cfg.head_dim),
             "blocks/attn/wk_dkh": (cfg.d_model, cfg.n_kv_heads, cfg.head_dim),
             "blocks/attn/wv_dkh": (cfg.d_model, cfg.n_kv_heads, cfg.head_dim),
             "blocks/attn/wo_nhd": (cfg.n_heads, cfg.head_dim, cfg.d_model)}.get(path, t.shape[::-1] if kind == "T"
                                                                                else t.shape)
    return cut(kind, t, tuple(slice(None) for _ in shape), shape)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--plan-only", metavar="MODEL", help="plan a built-in config's import without files")
    ap.add_argument("--devices", type=int, default=64, help="with --plan-only: simulated devices")
    ap.add_argument("--recipe", default="fsdp", help="with --plan-only: the recipe")
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "HOW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.plan_only:
        plan_only(args.plan_only, args.devices, args.recipe)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = write_folder(tmp, args.layers, args.d_model, args.vocab)
        print(f"model: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}: "
              f"{model_bytes / 2 ** 20:,.0f} MiB (f32)")
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        for how in ("sharded", "whole"):
            out = subprocess.run([sys.executable, __file__, "--child", tmp, how], capture_output=True, text=True,
                                 env=env, timeout=900)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            peak = json.loads(out.stdout.strip().splitlines()[-1])["above_baseline"]
            print(f"{how:8s} peak host memory above baseline: {peak / 2 ** 20:8,.0f} MiB = "
                  f"{peak / model_bytes:.2f} x the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
