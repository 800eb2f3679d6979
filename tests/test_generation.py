"""Generation on the training plan: the KV cache is right (generated tokens' log-probabilities equal
the same sequence scored in one pass), under every recipe, with left-padded batches, sampling,
int8 weights, layer weights streamed from host memory, and from a restored (pipeline-trained) run."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshtrain as mt
from meshtrain.errors import ConfigError
from meshtrain.generation import Sampling, WeightFormat, WeightMemory, choose, load
from meshtrain.models import Decoder, get_config

PROMPTS = [[10, 20, 30, 40, 50, 60, 70], [5, 6, 7], [101, 102, 103, 104, 105]]
NEW = 8


def make_model(name: str, seed: int = 0) -> Decoder:
    with nnx.use_eager_sharding(False):
        return Decoder(get_config(name), rngs=nnx.Rngs(seed))


def gap_to_one_pass(loaded, generations) -> float:
    """Max |log p| difference between each generated token and the same full sequence scored in one pass
    (all sequences in one left-padded batch: one prefill program per recipe, not one per length; padding
    changes nothing, test_prompt_logprobs_equal_the_training_forward_and_padding_changes_nothing)."""
    fulls = [list(g.prompt_ids) + list(g.new_ids) for g in generations]
    scored = loaded.generate(fulls, 0, prompt_logprobs=True).generations
    worst = 0.0
    for g, s in zip(generations, scored):
        tail = np.array(s.prompt_logprobs[len(g.prompt_ids) - 1:])
        worst = max(worst, float(np.max(np.abs(tail - np.array(g.new_logprobs)))))
    return worst


# (model, [(recipe, devices)]): 1 device, then the 8-device recipes; continuations must agree across all
CASES = {
    "tiny": [("dp", 1), ("tp", 8), ("fsdp_tp", 8)],
    "tiny-moe": [("dp", 1), ("fsdp_ep", 8)],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_logprobs_equal_one_pass_and_greedy_agrees_across_recipes(name):
    model = make_model(name)
    continuations, gaps = {}, {}
    for recipe, devices in CASES[name]:
        loaded = load(model, recipe=recipe, devices=devices)
        out = loaded.generate(PROMPTS, NEW)
        gaps[recipe] = gap_to_one_pass(loaded, out.generations)
        continuations[recipe] = [g.new_ids for g in out.generations]
        assert all(len(g.new_ids) == NEW for g in out.generations)
    print(f"{name}: max |logprob(generated) - logprob(one pass)| per recipe: {gaps}")
    assert max(gaps.values()) < 1e-4, gaps
    first = next(iter(continuations.values()))
    assert all(c == first for c in continuations.values()), continuations


@pytest.mark.slow
def test_prompt_logprobs_equal_the_training_forward_and_padding_changes_nothing():
    model = make_model("tiny")
    loaded = load(model, recipe="dp", devices=1)
    batch = loaded.generate(PROMPTS, 3, prompt_logprobs=True).generations
    forward = nnx.jit(lambda m, tokens: m(tokens))   # the training forward, compiled as the train step compiles it
    for prompt, g in zip(PROMPTS, batch):
        alone = loaded.generate([prompt], 3, prompt_logprobs=True).generations[0]
        assert alone.new_ids == g.new_ids  # left padding: a row does not depend on the others
        np.testing.assert_allclose(alone.prompt_logprobs, g.prompt_logprobs, atol=1e-5)
        logits = forward(model, jnp.asarray([prompt]))[0, :-1]
        ref = jax.nn.log_softmax(logits, -1)[jnp.arange(len(prompt) - 1), jnp.asarray(prompt[1:])]
        np.testing.assert_allclose(g.prompt_logprobs, np.asarray(ref), atol=1e-5)
        assert len(g.prompt_logprobs) == len(prompt) - 1


@pytest.mark.slow
def test_sampling_is_seeded_and_respects_top_k_top_p_and_stops():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 64))
    keys = [jax.random.key(i) for i in range(8)]
    top1 = {int(t) for k in keys for t in choose(logits, k, Sampling(temperature=1.0, top_k=1))}
    assert top1 == {0}
    nucleus = {int(t) for k in keys for t in choose(logits, k, Sampling(temperature=1.0, top_p=0.7))}
    assert nucleus == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    wide = {int(t) for k in keys for t in choose(logits, k, Sampling(temperature=1.0))}
    assert wide == {0, 1, 2, 3}
    model = make_model("tiny")
    loaded = load(model, recipe="dp", devices=1)
    s = Sampling(temperature=0.9, top_k=20, seed=3)
    a, b = (loaded.generate(PROMPTS, 6, s).generations for _ in range(2))
    assert [g.new_ids for g in a] == [g.new_ids for g in b]
    greedy = loaded.generate(PROMPTS[:1], 6).generations[0]
    stop = greedy.new_ids[2]
    stopped = loaded.generate(PROMPTS[:1], 6, stop_ids=[stop]).generations[0]
    assert stopped.stopped and stopped.new_ids == greedy.new_ids[:greedy.new_ids.index(stop) + 1]


@pytest.mark.parametrize("bad, message", [
    (([[]], 4), "prompt 0 is empty"),
    (([[1] * 257], 0), "more than max_seq_len 256"),
    (([[1] * 250], 7), "exceeds max_seq_len 256"),
    (([[300]], 1), "outside the vocabulary"),
    (([[1]], -1), "--max-new-tokens -1"),
])
def test_bad_prompts_raise_one_line_config_errors(bad, message):
    loaded = load(make_model("tiny"), recipe="dp", devices=1)
    with pytest.raises(ConfigError, match=message) as info:
        loaded.engine.check(*bad)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("setting, message", [
    ({"quantize": "int4"}, "--quantize 'int4': use one of ['none', 'bf16', 'int8']"),
    ({"weight_memory": "disk"}, "weight_memory 'disk': use one of ['device', 'host']"),
])
def test_unknown_weight_format_or_memory_is_a_one_line_config_error(setting, message):
    with pytest.raises(ConfigError) as info:
        load(make_model("tiny"), recipe="dp", devices=1, **setting)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dp", "fsdp_tp"])
def test_int8_halves_weight_bytes_against_bf16_and_scores_like_it(recipe):
    model = make_model("tiny")
    engines = {f: load(model, recipe=recipe, quantize=f) for f in (WeightFormat.BF16, WeightFormat.INT8)}
    bf16, int8 = (engines[f].engine.weight_bytes_per_device() for f in (WeightFormat.BF16, WeightFormat.INT8))
    ratio = int8 / bf16
    # int8 + bf16 scales (one per output channel: 1/64 of a d=64 matrix; replicated over fsdp) + bf16 norms
    # and the bf16 output projection (1/8 of the tiny model's weights; 2 % of small's)
    assert 0.5 < ratio < {"dp": 0.6, "fsdp_tp": 0.66}[recipe]
    q = engines[WeightFormat.INT8].engine.params["blocks"]["attn"]["wq_dnh"]
    ref = engines[WeightFormat.BF16].engine.params["blocks"]["attn"]["wq_dnh"]
    assert q.q.dtype == jnp.int8 and q.q.sharding.spec == ref.sharding.spec
    # An untrained model's logits are nearly flat, so free-running greedy paths part at the first near-tie
    # (bf16 and f32 part too); compare the two on the same sequence instead (teacher forcing).
    outs = {f: e.generate(PROMPTS, 16).generations for f, e in engines.items()}
    seqs = [list(g.prompt_ids) + list(g.new_ids) for g in outs[WeightFormat.BF16]]
    scored = {f: e.generate(seqs, 0, prompt_logprobs=True).generations for f, e in engines.items()}
    gap = max(float(np.max(np.abs(np.subtract(a.prompt_logprobs, b.prompt_logprobs))))
              for a, b in zip(scored[WeightFormat.BF16], scored[WeightFormat.INT8]))
    firsts = [g.new_ids[:4] for g in outs[WeightFormat.BF16]] == [g.new_ids[:4] for g in outs[WeightFormat.INT8]]
    print(f"{recipe}: weight bytes per device: bf16 {bf16}, int8 {int8} ({ratio:.3f}); max |logprob int8 - bf16| "
          f"{gap:.4f}")
    assert gap < 0.1 and firsts


@pytest.mark.slow
def test_pipeline_trained_run_generates_after_restore_on_a_non_pipeline_mesh(tmp_path):
    from meshtrain.train import TrainConfig, Trainer

    run = str(tmp_path / "pp")
    Trainer(TrainConfig(model="tiny", recipe="pp", steps=2, batch_size=16, seq_len=32, ckpt_every=2, eval_every=0,
                        progress="none", out=run)).run()
    out = mt.generate(run, ["def main(", "import os"], max_new_tokens=5, prompt_logprobs=True)
    assert [len(g.new_ids) for g in out] == [5, 5] and all(isinstance(g.new_text, str) for g in out)
    loaded = load(run)
    assert loaded.engine.plan.recipe.name == "fsdp"  # the run's pp recipe has a pipeline
    tp = load(run, recipe="tp")
    assert [g.new_ids for g in tp.generate(["def main(", "import os"], 5).generations] == [g.new_ids for g in out]
    with pytest.raises(mt.RecipeError, match="without a pipeline"):
        load(run, recipe="pp")


@pytest.mark.parametrize("recipe", ["fsdp_tp", "fsdp_ep"])
def test_planned_generation_bytes_equal_the_arrays_and_int8_halves_bf16(recipe):
    from meshtrain.generation.memory import generation_bytes

    name = "tiny-moe" if recipe.endswith("ep") else "tiny"
    model = make_model(name)
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

    model = make_model(name)
    runs = {m: load(model, recipe=recipe, devices=devices, quantize=fmt, weight_memory=m) for m in WeightMemory}
    outs = {m: r.generate(PROMPTS, NEW).generations for m, r in runs.items()}
    assert [g.new_ids for g in outs[WeightMemory.HOST]] == [g.new_ids for g in outs[WeightMemory.DEVICE]]
    gap = max(abs(a - b) for g, h in zip(outs[WeightMemory.HOST], outs[WeightMemory.DEVICE])
              for a, b in zip(g.new_logprobs, h.new_logprobs))
    assert gap == 0.0  # the same program but for where the layer weights come from
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
def test_int8_greedy_agrees_with_bf16_on_90_percent_of_64_tokens_of_a_trained_model(tmp_path):
    """The issue's bar, measured by tools/bench_generate.py --agreement (4 hand-written + 16 held-out prompts
    x 64 greedy tokens) on a briefly trained tiny model (the trained small main job: BENCHMARKS.md)."""
    from meshtrain.train import TrainConfig, Trainer

    run = str(tmp_path / "tiny")
    Trainer(TrainConfig(model="tiny", recipe="dp", devices=1, steps=300, batch_size=16, seq_len=128, ckpt_every=300,
                        eval_every=0, progress="none", out=run)).run()
    bench = bench_generate()
    # the pair the bar is about: the f32 ("none") engine, which only the other two pairs read, is not run
    result = bench.measure_agreement(run, "dp", 1, 64, list(bench.HAND_PROMPTS) + bench.held_out_prompts(),
                                     pairs=(("int8", "bf16"),))
    bench.print_agreement(result, len(bench.HAND_PROMPTS))
    assert result["int8 vs bf16"]["share"] >= 0.9, result["int8 vs bf16"]
