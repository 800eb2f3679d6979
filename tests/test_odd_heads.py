"""Odd head counts under tensor parallelism (issue 31): a Llama with 9 query heads and 3 KV heads trains and
generates under tp, fsdp_tp and fsdp_tp_sp on 8 devices with no recipe file, matching one device; the plan
states what it did with the heads and what it costs; every indivisible name is named in one error;
``--replicate-indivisible`` is one setting for plan, train and generate."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.cli import build_parser
from meshtrain.generation import load
from meshtrain.parallel.heads import HeadLayout
from meshtrain.train.run_config import RunConfig

from helpers import GENERATION_NEW, GENERATION_PROMPTS, mesh_for, rel_diff, run_steps_with_grads, single_device, \
    tiny_abstract

#: A tiny Llama with SmolLM-135M's head counts: 9 query heads, 3 KV heads.
ODD = dict(d_model=72, n_heads=9, n_kv_heads=3, head_dim=8)
SEQ = 16
TP_RECIPES = ("tp", "fsdp_tp", "fsdp_tp_sp")


def odd_abstract():
    return tiny_abstract(**ODD)


def test_head_layout_pads_queries_and_replicates_kv():
    lay = HeadLayout(9, 3, 2)
    assert (lay.query, lay.padded_heads, lay.kv_replicated, lay.expand_kv) == ("padded", 10, True, True)
    rep = HeadLayout(9, 3, 8, mt.recipes.IndivisibleHeads.REPLICATE)
    assert (rep.query, rep.padded_heads, rep.expand_kv) == ("replicated", 9, False)
    gqa = HeadLayout(8, 2, 4)  # fewer KV heads than tensor ranks: queries split, KV heads repeated per rank
    assert (gqa.query, gqa.padded_heads, gqa.kv_replicated, gqa.expand_kv) == ("split", 8, True, True)
    assert not HeadLayout(16, 8, 8).changed and not HeadLayout(9, 3, 1).changed


@pytest.mark.parametrize("name", TP_RECIPES)
def test_plan_states_the_choice_and_its_cost_in_bytes(name):
    recipe, mesh = mesh_for(name)
    plan = mt.make_plan(odd_abstract(), recipe, mesh)  # no recipe file, no option: it plans
    heads = plan.to_dict()["heads"]
    tensor = plan.mesh_sizes["tensor"]
    assert heads["query"] == "padded" and heads["padded_heads"] == -(-9 // tensor) * tensor
    assert heads["kv"] == "replicated" and heads["tensor"] == tensor
    # the cost: each whole head weight (and its optimizer moments) holds (1 - 1/tensor) of its bytes more
    whole = [l for l in plan.leaves if l.group in ("params", "optimizer") and l.replicated_dims]
    assert {l.path.split("/")[-1] for l in whole if l.group == "params"} == {"wq_dnh", "wk_dkh", "wv_dkh", "wo_nhd"}
    for group in ("params", "optimizer"):
        want = sum(l.bytes_per_device - l.bytes_per_device // tensor for l in whole if l.group == group)
        assert heads["extra_bytes_per_device"][group] == want > 0
    assert "query heads padded to" in plan.describe() and "KV heads replicated" in plan.describe()
    replicate = mt.make_plan(odd_abstract(), recipe.with_options(indivisible_heads="replicate"), mesh)
    assert replicate.heads["query"] == "replicated"
    assert mt.make_plan(tiny_abstract(), recipe, mesh).heads is None  # 16 / 8 heads divide: nothing to say


def test_a_divisibility_error_names_every_offending_name_at_once():
    recipe, mesh = mesh_for("tp")
    refuse = recipe.with_options(indivisible_heads="refuse")
    abstract = tiny_abstract(**ODD, d_ff=100)  # heads 9, kv_heads 3, mlp 100: none divides tensor=8
    with pytest.raises(mt.RulesError) as err:
        mt.make_plan(abstract, refuse, mesh)
    text = str(err.value)
    for name, size in (("kv_heads", 3), ("heads", 9), ("mlp", 100)):
        assert f"'{name}' (size {size} by tensor=8" in text, text
    assert "--replicate-indivisible" in text and "3 logical names" in text
    # the flag's names keep them whole: the same plan then succeeds
    ok = refuse.with_options(replicate_indivisible="heads,kv_heads,mlp", max_replicated_fraction=1.0)
    assert mt.make_plan(abstract, ok, mesh).heads["query"] == "replicated"
    # one name: the tensor's own message, as before
    with pytest.raises(mt.RulesError, match=r"blocks/mlp/.*'mlp', size 100\) is not divisible by mesh axes "
                                            r"tensor=8.*--replicate-indivisible mlp"):
        mt.make_plan(tiny_abstract(d_ff=100), recipe, mesh)


def test_replicate_indivisible_is_one_setting_for_plan_train_and_generate():
    cfg = RunConfig().with_values({"recipe.options.replicate_indivisible": "vocab, mlp"})
    assert cfg.recipe.options.replicate_indivisible == ("vocab", "mlp")
    assert cfg.to_dict()["recipe"]["options"]["replicate_indivisible"] == ["vocab", "mlp"]
    assert RunConfig.from_dict({"recipe": {"options": {"replicate_indivisible": ["kv_heads"]}}}) \
        .recipe.options.replicate_indivisible == ("kv_heads",)
    with pytest.raises(mt.ConfigError, match=r"replicate_indivisible=3: use a list of names"):
        RunConfig().with_values({"recipe.options.replicate_indivisible": 3})
    assert mt.get_recipe("tp").with_options(replicate_indivisible="vocab,mlp").replicate_indivisible == ("vocab", "mlp")
    with pytest.raises(mt.RecipeError, match="did you mean 'kv_heads'"):
        mt.get_recipe("tp").with_options(replicate_indivisible="kv_head")
    for command in (["plan"], ["train"], ["generate", "RUN", "--prompt", "x"]):
        args = build_parser(command).parse_args(command + ["--replicate-indivisible", "vocab,mlp",
                                                           "--indivisible-heads", "replicate"])
        assert (args.replicate_indivisible, args.indivisible_heads) == ("vocab,mlp", "replicate")


def _by_path(grads):
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}


@pytest.mark.slow
def test_odd_heads_train_under_tensor_parallel_recipes_like_one_device():
    # gradients: the first train step's, kept by the optimizer (helpers.run_steps_with_grads): one compiled
    # program and one initialisation per case, not also a make_grad_fn program and a second init_state
    one, one_mesh = single_device("dp")
    base, base_grads, _, _ = run_steps_with_grads(one, one_mesh, steps=4, abstract=odd_abstract(), seq=SEQ)
    base_grads = _by_path(base_grads)
    # fsdp_tp is left out: fsdp_tp_sp is fsdp_tp plus sequence parallelism (the same fsdp x tensor mesh and
    # head padding, and more), tp is the tensor axis alone; each policy and mesh kind still trains here
    cases = [("tp", "pad"), ("fsdp_tp_sp", "pad"), ("tp", "replicate")]
    for name, policy in cases:
        recipe, mesh = mesh_for(name)
        recipe = recipe.with_options(indivisible_heads=policy)
        losses, grads, plan, _ = run_steps_with_grads(recipe, mesh, steps=4, abstract=odd_abstract(), seq=SEQ)
        assert plan.heads["query"] == ("padded" if policy == "pad" else "replicated")
        assert rel_diff(losses, base) <= 1e-5, (name, policy, losses, base)
        assert abs(losses[0] - base[0]) / base[0] <= 1e-5   # the loss the gradients are of
        for path, g in _by_path(grads).items():  # the padded heads give the real ones exactly their gradients
            assert g.shape == base_grads[path].shape and rel_diff(g, base_grads[path]) <= 1e-5, (name, path)


@pytest.mark.slow
def test_odd_heads_generate_the_same_greedy_tokens_under_tensor_parallel_recipes():
    with nnx.use_eager_sharding(False):
        model = mt.models.Decoder(mt.models.get_config("tiny", **ODD), rngs=nnx.Rngs(0))
    tokens, logprobs = {}, {}
    # fsdp_tp is left out, as in training above: fsdp_tp_sp is the same fsdp x tensor mesh and head
    # padding with sequence parallelism on top; tp is the tensor axis alone
    recipes = ("tp", "fsdp_tp_sp")
    for recipe, devices in [("dp", 1)] + [(name, 8) for name in recipes]:
        loaded = load(model, recipe=recipe, devices=devices)
        if devices > 1:
            assert loaded.engine.plan.heads["query"] == "padded", recipe
        out = loaded.generate(GENERATION_PROMPTS, GENERATION_NEW).generations
        tokens[recipe] = [g.new_ids for g in out]
        logprobs[recipe] = np.array([g.new_logprobs for g in out])
    for recipe in recipes:
        assert tokens[recipe] == tokens["dp"], (recipe, tokens)
        assert np.max(np.abs(logprobs[recipe] - logprobs["dp"])) <= 1e-4, recipe
