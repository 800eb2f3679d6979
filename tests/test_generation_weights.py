"""Generation's weight formats and memory: int8 weights halve bf16's bytes and score like them (and agree
on 90 % of greedy tokens of a trained model), the planned bytes equal the arrays', and layer weights
streamed from host memory give the same tokens with one layer on the device."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GENERATION_NEW, GENERATION_PROMPTS, make_decoder

from meshtrain.generation import WeightFormat, WeightMemory, load
from meshtrain.parallel.resolved import DecodeMatmul


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dp", "fsdp_tp"])
def test_int8_halves_weight_bytes_against_bf16_and_scores_like_it(recipe):
    model = make_decoder("tiny")
    engines = {f: load(model, recipe=recipe, quantize=f) for f in (WeightFormat.BF16, WeightFormat.INT8)}
    bf16, int8 = (engines[f].engine.weight_bytes_per_device() for f in (WeightFormat.BF16, WeightFormat.INT8))
    ratio = int8 / bf16
    # int8 + bf16 scales (one per output channel: 1/64 of a d=64 matrix; replicated over fsdp) + bf16 norms
    # and the bf16 output projection (1/8 of the tiny model's weights; 2 % of small's)
    assert 0.5 < ratio < {"dp": 0.6, "fsdp_tp": 0.66}[recipe]
    # layer 0's (the compiled decode loop's engine stores one array per layer)
    q = engines[WeightFormat.INT8].engine.params["blocks"][0]["attn"]["wq_dnh"]
    ref = engines[WeightFormat.BF16].engine.params["blocks"][0]["attn"]["wq_dnh"]
    assert q.q.dtype == jnp.int8 and q.q.sharding.spec == ref.sharding.spec
    if recipe == "dp":
        # dp's int8 tokens and scores are checked on a trained model by the near-ties test below (int8 against
        # bf16 under dp on one device: dp replicates the weights, so each device here holds what that one
        # does); here dp's bytes and layout only. fsdp_tp's sharded weights and scales are scored next.
        return
    # An untrained model's logits are nearly flat, so free-running greedy paths part at the first near-tie
    # (bf16 and f32 part too); compare the two on the same sequence instead (teacher forcing).
    outs = {f: e.generate(GENERATION_PROMPTS, 16).generations for f, e in engines.items()}
    seqs = [list(g.prompt_ids) + list(g.new_ids) for g in outs[WeightFormat.BF16]]
    scored = {f: e.generate(seqs, 0, prompt_logprobs=True).generations for f, e in engines.items()}
    gap = max(float(np.max(np.abs(np.subtract(a.prompt_logprobs, b.prompt_logprobs))))
              for a, b in zip(scored[WeightFormat.BF16], scored[WeightFormat.INT8]))
    firsts = [g.new_ids[:4] for g in outs[WeightFormat.BF16]] == [g.new_ids[:4] for g in outs[WeightFormat.INT8]]
    print(f"{recipe}: weight bytes per device: bf16 {bf16}, int8 {int8} ({ratio:.3f}); max |logprob int8 - bf16| "
          f"{gap:.4f}")
    assert gap < 0.1 and firsts


@pytest.mark.parametrize("recipe", ["fsdp_tp", "fsdp_ep"])
def test_planned_generation_bytes_equal_the_arrays_and_int8_halves_bf16(recipe):
    from meshtrain.generation.memory import generation_bytes

    name = "tiny-moe" if recipe.endswith("ep") else "tiny"
    model = make_decoder(name)
    measured = {}
    for fmt in WeightFormat:
        loaded = load(model, recipe=recipe, quantize=fmt)
        measured[fmt.value] = loaded.engine.weight_bytes_per_device()
    plan = loaded.engine.plan
    planned = generation_bytes(model.cfg, plan, batch=3, seq=40)
    assert {f: planned[f"weights_{f}"] for f in measured} == measured
    assert 0.5 < planned["weights_int8"] / planned["weights_bf16"] < 0.66  # (tiny: a bf16 head is 1/8)
    cache = loaded.engine.cache_bytes_per_device(3, 40)  # int8 engine: a bf16 cache
    rows = loaded.engine.padded_batch(3)  # a multiple of the data-parallel size (fsdp_tp: 4, fsdp_ep: 8)
    c = model.cfg
    assert planned["kv_cache_bf16"] == cache == 2 * c.n_layers * rows * 40 * c.n_kv_heads * c.head_dim * 2 // 8


@pytest.mark.slow
@pytest.mark.parametrize("name, recipe, devices, fmt", [
    ("tiny", "dp", 1, WeightFormat.NONE),
    ("tiny", "fsdp_tp", 8, WeightFormat.INT8),
    ("tiny-moe", "fsdp_ep", 8, WeightFormat.BF16),
])
def test_layers_streamed_from_host_memory_give_the_same_tokens_and_one_layer_on_the_device(name, recipe, devices,
                                                                                           fmt):
    from meshtrain.generation.memory import generation_bytes

    model = make_decoder(name)
    runs = {m: load(model, recipe=recipe, devices=devices, quantize=fmt, weight_memory=m) for m in WeightMemory}
    outs = {m: r.generate(GENERATION_PROMPTS, GENERATION_NEW).generations for m, r in runs.items()}
    assert [g.new_ids for g in outs[WeightMemory.HOST]] == [g.new_ids for g in outs[WeightMemory.DEVICE]]
    gap = max(abs(a - b) for g, h in zip(outs[WeightMemory.HOST], outs[WeightMemory.DEVICE])
              for a, b in zip(g.new_logprobs, h.new_logprobs))
    # the same program but for where the layer weights come from; a small f32/bf16 model on 1 CPU device decodes
    # from device memory with the fused step (meshtrain.kernels.decode_step: XLA's arithmetic, summed in its order)
    fused = runs[WeightMemory.DEVICE].engine.decode_matmul is DecodeMatmul.FUSED_STEP
    assert gap <= (1e-5 if fused else 0.0), gap
    host = runs[WeightMemory.HOST].engine
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(host.params["blocks"])}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host.params["embedding_vd"])} == {"device"}
    planned = generation_bytes(model.cfg, host.plan, batch=3, seq=40)
    on_device = runs[WeightMemory.DEVICE].engine.weight_bytes_per_device()
    assert (planned[f"weights_{fmt.value}"], planned[f"weights_{fmt.value}_offloaded"],
            planned[f"host_weights_{fmt.value}"]) == (on_device, host.weight_bytes_per_device(),
                                                       host.host_weight_bytes_per_device())
    # the device keeps what is outside the stack and one of the stack's n_layers layers
    layers = model.cfg.n_layers
    assert on_device - host.weight_bytes_per_device() == host.host_weight_bytes_per_device() * (layers - 1) // layers


def bench_generate():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench_generate.py")
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_int8_greedy_parts_from_bf16_only_at_near_ties_of_a_trained_model(tmp_path):
    """int8 vs bf16 greedy agreement as tools/bench_generate.py --agreement measures it (4 hand-written + 16
    held-out prompts x 64 greedy tokens) on a briefly trained tiny model (the trained small main job and the
    issue's 90 % bar: BENCHMARKS.md)."""
    from meshtrain.train import TrainConfig, Trainer

    run = str(tmp_path / "tiny")
    # 150 steps of 16 x 32 (loss 6.41 -> 2.15, 8.9 CPU s; 16 x 64 reached 2.11 for 22.8 CPU s, 300 x 128 2.02):
    # trained enough that bf16's greedy choices are mostly clear, which is what the near-tie property needs
    Trainer(TrainConfig(model="tiny", recipe="dp", devices=1, steps=150, batch_size=16, seq_len=32, ckpt_every=150,
                        eval_every=0, progress="none", out=run)).run()
    bench = bench_generate()
    # the pair the bar is about: the f32 ("none") engine, which only the other two pairs read, is not run
    result = bench.measure_agreement(run, "dp", 1, 64, list(bench.HAND_PROMPTS) + bench.held_out_prompts(),
                                     pairs=(("int8", "bf16"),))
    bench.print_agreement(result, len(bench.HAND_PROMPTS))
    # int8 moves only near-ties of bf16: every divergence is where bf16's top two tokens are < 0.1 nats
    # apart. The share is a count of such coin flips, so it moves with the program's bf16 rounding: 100 %
    # with the scanned per-token step, 84.7 % with the compiled loop's per-layer weights after 300 x 16 x 128
    # steps (4 of 20 prompts part, at margins 0.004-0.05 nats; BENCHMARKS.md), 95.3 % after this test's 150
    # x 16 x 32 (1 prompt, margin 0.018; 98.0 % after 150 x 16 x 64). The 90 % is measured on the trained small.
    r = result["int8 vs bf16"]
    assert r["share"] >= 0.8, r
    assert all(m is None or m < 0.1 for m in r["margin"]), r
