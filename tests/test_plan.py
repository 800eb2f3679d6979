"""ShardingPlan: golden dumps per recipe, memory against the compiler, the replication guard,
path-pattern rules for unannotated models, sharded init."""

import json
import os

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import meshtrain as mt

from helpers import mesh_for, put, rel_diff, run_steps, single_device, tiny_abstract, token_batch

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("name", list(mt.BUILTIN_RECIPES))
def test_golden_plan(name, update_golden):
    recipe, mesh = mesh_for(name)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 64))
    got = json.loads(plan.to_json())
    path = os.path.join(GOLDEN, f"plan_tiny_{name}.json")
    if update_golden or not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        if not update_golden:
            pytest.fail(f"wrote missing golden file {path}; rerun")
    with open(path) as f:
        want = json.load(f)
    assert got == want, f"plan for {name} changed; if intended, rerun pytest with --update-golden and review the diff"


def _compiled(name, **sizes):
    recipe, mesh = mesh_for(name, **sizes)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 64))
    state = mt.init_state(plan)
    compiled = mt.make_train_step(plan).lower(state, put(token_batch(0), plan)).compile()
    return plan, compiled


def test_fsdp_memory_is_one_eighth():
    plan, compiled = _compiled("fsdp")
    total = {g: sum(l.bytes_total for l in plan.group(g)) for g in ("params", "optimizer")}
    replicated = sum(l.bytes_total for g in ("params", "optimizer") for l in plan.group(g) if l.is_replicated)
    expected = (total["params"] + total["optimizer"] - replicated) / 8 + replicated
    per_device = plan.per_device_bytes()
    assert abs(per_device["params"] + per_device["optimizer"] - expected) <= 0.05 * expected
    # The compiled step's arguments are exactly the state shards plus the batch shard.
    args = compiled.memory_analysis().argument_size_in_bytes - per_device["batch"]
    assert abs(args - expected) <= 0.05 * expected, (args, expected)


@pytest.mark.slow
def test_zero1_shards_only_optimizer_state():
    plan, compiled = _compiled("zero1")
    per_device = plan.per_device_bytes()
    total_opt = sum(l.bytes_total for l in plan.group("optimizer"))
    total_params = sum(l.bytes_total for l in plan.group("params"))
    assert per_device["params"] == total_params  # weights whole on every device
    assert abs(per_device["optimizer"] - total_opt / 8) <= 0.05 * total_opt / 8
    args = compiled.memory_analysis().argument_size_in_bytes - per_device["batch"]
    assert abs(args - (total_params + total_opt / 8)) <= 0.05 * (total_params + total_opt / 8)


class Unnamed(nnx.Module):
    """A model someone else wrote: plain nnx.Linear layers, no logical names."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(256, 64, rngs=rngs)
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 256, rngs=rngs)

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.out(jax.nn.gelu(self.hidden(self.embed(tokens))))


PATTERNS = mt.PathRules([(r"embed/embedding", ("vocab", "embed")), (r".*/kernel", ("embed", "mlp")),
                         (r"hidden/bias", ("mlp",)), (r"out/bias", ("vocab",))])


@pytest.mark.slow
def test_path_rules_shard_an_unannotated_model():
    tx = optax.adamw(1e-3)
    with pytest.raises(mt.RulesError, match="parameters without logical axes: embed/embedding"):
        mt.abstract_state(Unnamed, tx)
    abstract = mt.abstract_state(Unnamed, tx, annotations=PATTERNS)
    assert abstract.param_axes["hidden/kernel"] == ("embed", "mlp")
    recipe, mesh = mesh_for("fsdp_tp")
    losses, plan, state = run_steps(recipe, mesh, steps=3, abstract=abstract)
    assert state.params["hidden"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    one, one_mesh = single_device("dp")
    base, _, _ = run_steps(one, one_mesh, steps=3, abstract=abstract)
    assert rel_diff(losses, base) <= 1e-5


def test_replication_guard_names_largest_leaves():
    # Claim nothing shardable for the big kernels: FSDP would leave them whole on every device.
    bad = mt.PathRules([(r"embed/embedding", ("vocab", "embed")), (r".*/kernel", (None, None)), (r".*/bias", (None,))])
    abstract = mt.abstract_state(Unnamed, optax.adamw(1e-3), annotations=bad)
    recipe, mesh = mesh_for("fsdp")
    with pytest.raises(mt.PlanError, match=r"leaves .*% of their bytes replicated.*out/kernel"):
        mt.make_plan(abstract, recipe, mesh)
    loose = recipe.with_options(max_replicated_fraction=1.0)
    assert mt.make_plan(abstract, loose, mesh).replicated("params")[0].path == "out/kernel"


def test_batch_not_divisible_by_data_parallel_size():
    recipe, mesh = mesh_for("fsdp")
    with pytest.raises(mt.ConfigError, match="batch size 12 is not divisible by data-parallel size 8"):
        mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(12, 64))


def test_indivisible_param_opt_in_replication_is_reported():
    abstract = tiny_abstract(n_heads=4, n_kv_heads=4, head_dim=16)  # 4 heads cannot split 8 ways
    recipe, mesh = mesh_for("tp")
    recipe = recipe.with_options(indivisible_heads="refuse")  # tp keeps heads whole by itself (test_odd_heads.py)
    with pytest.raises(mt.RulesError, match=r"'kv_heads' \(size 4 by tensor=8; blocks/attn/wk_dkh.*'heads'"):
        mt.make_plan(abstract, recipe, mesh)
    ok = recipe.with_options(replicate_indivisible=("heads", "kv_heads"), max_replicated_fraction=1.0)
    plan = mt.make_plan(abstract, ok, mesh)
    wk = next(l for l in plan.group("params") if l.path == "blocks/attn/wk_dkh")
    assert wk.replicated_dims and "kv_heads" in wk.replicated_dims[0]
    assert "kv_heads" in plan.describe()


@pytest.mark.slow
def test_sharded_init_never_builds_the_whole_model_on_one_device():
    recipe, mesh = mesh_for("fsdp")
    plan = mt.make_plan(tiny_abstract(), recipe, mesh)
    state = mt.init_state(plan, seed=0)
    emb = state.params["embedding_vd"]
    assert emb.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert {s.data.shape for s in emb.addressable_shards} == {(256, 8)}
    # Same values as a single-device init (mesh-independent RNG).
    one, one_mesh = single_device("dp")
    plan1 = mt.make_plan(tiny_abstract(), one, one_mesh)
    emb1 = mt.init_state(plan1, seed=0).params["embedding_vd"]
    assert jnp.array_equal(jax.device_get(emb), jax.device_get(emb1))
    # The jitted init's output shardings are the plan's: nothing was gathered to one device.
    assert all(leaf.sharding.mesh.shape == mesh.shape for leaf in jax.tree.leaves(state.opt_state))
