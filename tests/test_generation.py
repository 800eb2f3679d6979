"""Generation on the training plan: the KV cache is right (generated tokens' log-probabilities equal
the same sequence scored in one pass), under every recipe, with left-padded batches, sampling, and from
a restored (pipeline-trained) run. Weight formats (int8) and weights streamed from host memory:
tests/test_generation_weights.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import GENERATION_NEW, GENERATION_PROMPTS, make_decoder

import meshtrain as mt
from meshtrain.errors import ConfigError
from meshtrain.generation import Sampling, choose, load


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
    model = make_decoder(name)
    continuations, gaps = {}, {}
    for recipe, devices in CASES[name]:
        loaded = load(model, recipe=recipe, devices=devices)
        out = loaded.generate(GENERATION_PROMPTS, GENERATION_NEW)
        gaps[recipe] = gap_to_one_pass(loaded, out.generations)
        continuations[recipe] = [g.new_ids for g in out.generations]
        assert all(len(g.new_ids) == GENERATION_NEW for g in out.generations)
    print(f"{name}: max |logprob(generated) - logprob(one pass)| per recipe: {gaps}")
    assert max(gaps.values()) < 1e-4, gaps
    first = next(iter(continuations.values()))
    assert all(c == first for c in continuations.values()), continuations


@pytest.mark.slow
def test_prompt_logprobs_equal_the_training_forward_and_padding_changes_nothing():
    model = make_decoder("tiny")
    loaded = load(model, recipe="dp", devices=1)
    batch = loaded.generate(GENERATION_PROMPTS, 3, prompt_logprobs=True).generations
    # the training forward, compiled as the train step compiles it, once for all prompts: right-padded to the
    # longest (a causal model's logits at a position do not read later ones, so the padding changes none)
    longest = max(map(len, GENERATION_PROMPTS))
    padded = jnp.asarray([p + [0] * (longest - len(p)) for p in GENERATION_PROMPTS])
    all_logits = nnx.jit(lambda m, tokens: m(tokens))(model, padded)
    for row, (prompt, g) in enumerate(zip(GENERATION_PROMPTS, batch)):
        alone = loaded.generate([prompt], 3, prompt_logprobs=True).generations[0]
        assert alone.new_ids == g.new_ids  # left padding: a row does not depend on the others
        np.testing.assert_allclose(alone.prompt_logprobs, g.prompt_logprobs, atol=1e-5)
        logits = all_logits[row, :len(prompt) - 1]
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
    model = make_decoder("tiny")
    loaded = load(model, recipe="dp", devices=1)
    s = Sampling(temperature=0.9, top_k=20, seed=3)
    # (the prompts and token count of the other generation tests: their compiled greedy program is reused)
    a, b = (loaded.generate(GENERATION_PROMPTS, GENERATION_NEW, s).generations for _ in range(2))
    assert [g.new_ids for g in a] == [g.new_ids for g in b]
    greedy = loaded.generate(GENERATION_PROMPTS, GENERATION_NEW).generations[0]
    stop = greedy.new_ids[2]
    stopped = loaded.generate(GENERATION_PROMPTS, GENERATION_NEW, stop_ids=[stop]).generations[0]
    assert stopped.stopped and stopped.new_ids == greedy.new_ids[:greedy.new_ids.index(stop) + 1]


@pytest.mark.parametrize("bad, message", [
    (([[]], 4), "prompt 0 is empty"),
    (([[1] * 257], 0), "more than max_seq_len 256"),
    (([[1] * 250], 7), "exceeds max_seq_len 256"),
    (([[300]], 1), "outside the vocabulary"),
    (([[1]], -1), "--max-new-tokens -1"),
])
def test_bad_prompts_raise_one_line_config_errors(bad, message):
    loaded = load(make_decoder("tiny"), recipe="dp", devices=1)
    with pytest.raises(ConfigError, match=message) as info:
        loaded.engine.check(*bad)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("setting, message", [
    ({"quantize": "int4"}, "--quantize 'int4': use one of ['none', 'bf16', 'int8']"),
    ({"weight_memory": "disk"}, "weight_memory 'disk': use one of ['device', 'host']"),
])
def test_unknown_weight_format_or_memory_is_a_one_line_config_error(setting, message):
    with pytest.raises(ConfigError) as info:
        load(make_decoder("tiny"), recipe="dp", devices=1, **setting)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


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
