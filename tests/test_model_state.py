"""Model state of every kind: an NNX model with an RNG stream (Dropout) and batch statistics
(BatchNorm) plans, initialises sharded, trains under a batch split, a feature split and both with a mesh
sharding on every leaf, and matches one device (threefry-partitionable dropout masks do not depend on the mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshtrain as mt

from helpers import mesh_for, rel_diff

P = nnx.with_partitioning
KERNEL, ZEROS, ONES = nnx.initializers.lecun_normal(), nnx.initializers.zeros, nnx.initializers.ones


class DropoutMLP(nnx.Module):
    """8 → 32 (BatchNorm, ReLU, Dropout) → 8 classes."""

    def __init__(self, rngs):
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would amplify.
        self.l1 = nnx.Linear(8, 32, use_bias=False, kernel_init=P(KERNEL, ("embed", "mlp")), rngs=rngs)
        self.bn = nnx.BatchNorm(32, scale_init=P(ONES, ("mlp",)), bias_init=P(ZEROS, ("mlp",)), rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, kernel_init=P(KERNEL, ("mlp", "embed")), bias_init=P(ZEROS, ("embed",)),
                             rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def classify(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jnp.sum(ce), batch["y"].shape[0], {"correct": jnp.sum(jnp.argmax(logits, -1) == batch["y"])}


def _batch(step=0, n=16):
    rng = np.random.default_rng((7, step))
    return {"x": rng.normal(size=(n, 8)).astype(np.float32), "y": rng.integers(0, 8, n).astype(np.int32)}


@pytest.fixture(scope="module")
def abstract():
    return mt.abstract_state(DropoutMLP, optax.adam(1e-2))


def _plan(abstract, name, n_devices=8):
    recipe = mt.get_recipe(name).with_options(max_replicated_fraction=1.0)  # biases and BN scales stay whole
    if n_devices == 1:
        recipe = mt.get_recipe("dp").with_options(max_replicated_fraction=1.0)
    return mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:n_devices]), batch=_batch())


def _assert_mesh_shardings(tree, plan):
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = jax.tree_util.keystr(keypath)
        assert isinstance(leaf.sharding, jax.sharding.NamedSharding), where
        assert leaf.sharding.mesh.shape == plan.mesh.shape, where


def _train(plan, steps=5):
    state = mt.init_state(plan, seed=0)
    _assert_mesh_shardings(state, plan)
    step = mt.make_train_step(plan, loss_fn=classify)
    losses = []
    for i in range(steps):
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
    _assert_mesh_shardings(state, plan)
    return np.array(losses), metrics, state


@pytest.fixture(scope="module")
def one_device(abstract):
    return _train(_plan(abstract, "dp", 1))


def test_plan_counts_key_and_state_bytes(abstract):
    plan = _plan(abstract, "fsdp")
    leaves = {l.path: l for l in plan.group("model_state")}
    assert set(leaves) == {"bn/mean", "bn/var", "drop/rngs/count", "drop/rngs/key"}
    key = leaves["drop/rngs/key"]
    assert key.dtype.startswith("key") and key.bytes_total == 8  # threefry: 2 × uint32
    assert leaves["bn/mean"].bytes_total == 32 * 4
    assert plan.per_device_bytes()["model_state"] == sum(l.bytes_per_device for l in leaves.values())
    assert "drop/rngs/key" in plan.describe() and "model_state" in plan.to_dict()
    # A restore target carries the key dtype and a mesh sharding.
    target = mt.abstract_train_state(plan).model_state["drop"]["rngs"]["key"]
    assert jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key)
    assert target.sharding.mesh.shape == plan.mesh.shape


#: Cut from the 8 built-in recipes (each runs against one device on the tiny decoder in test_parity.py): the
#: model state's code paths are the batch split (BatchNorm statistics over the whole batch, dropout masks of
#: the rows a device holds) and the feature split (statistics and masks of `mlp` columns split on tensor).
#: dp splits the batch alone, tp the features alone, fsdp_tp_sp both with the weights on fsdp; zero1/zero2/
#: hsdp/fsdp/fsdp_tp add only weight and optimizer layouts the model state never sees.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "tp", "fsdp_tp_sp"])
def test_dropout_batchnorm_model_matches_one_device(name, abstract, one_device):
    base, base_metrics, base_state = one_device
    losses, metrics, state = _train(_plan(abstract, name))
    assert rel_diff(losses, base) <= 1e-5, (name, losses, base)
    assert abs(float(metrics["correct"]) - float(base_metrics["correct"])) <= 1e-6
    assert rel_diff(state.model_state["bn"]["mean"], base_state.model_state["bn"]["mean"]) <= 1e-5
    assert int(state.model_state["drop"]["rngs"]["count"]) == 5


def test_rng_counter_advances_and_changes_the_mask(abstract):
    plan = _plan(abstract, "dp")
    state = mt.init_state(plan, seed=0)
    count = lambda s: int(s.model_state["drop"]["rngs"]["count"])  # noqa: E731
    assert count(state) == 0
    step = mt.make_train_step(plan, loss_fn=classify, donate=False)
    after, _ = step(state, _batch(0))
    assert count(after) == 1
    # Same parameters, RNG state of step 0 vs step 1: the training-mode loss differs (a new
    # dropout mask); the same RNG state gives the same loss (deterministic for a seed).
    train_mode = mt.make_eval_step(plan, loss_fn=classify, eval_mode=False)
    moved = mt.TrainState(state.step, state.params, state.opt_state, after.model_state)
    first, again, second = (float(train_mode(s, _batch(0))["loss"]) for s in (state, state, moved))
    assert first == again and first != second
    # Eval mode: dropout off, running batch statistics; the RNG state does not matter.
    evaluate = mt.make_eval_step(plan, loss_fn=classify)
    frozen = mt.TrainState(state.step, state.params, state.opt_state,
                           {**after.model_state, "bn": state.model_state["bn"]})
    a, b = evaluate(state, _batch(0)), evaluate(frozen, _batch(0))
    assert float(a["loss"]) == float(b["loss"]) and 0.0 <= float(a["correct"]) <= 1.0


class StatefulNamed(nnx.Module):
    """A batch statistic that carries logical axes is sharded like a parameter with those names."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((8, 32)), out_sharding=("embed", "mlp"))
        self.ema = nnx.BatchStat(jnp.zeros((32,)), out_sharding=("mlp",))

    def __call__(self, x):
        return x @ self.w[...]


def test_named_model_state_is_sharded_by_its_axes():
    recipe, mesh = mesh_for("tp")
    plan = mt.make_plan(mt.abstract_state(StatefulNamed, optax.sgd(0.1)), recipe.with_options(
        max_replicated_fraction=1.0), mesh)
    leaf = next(l for l in plan.group("model_state") if l.path == "ema")
    assert leaf.spec == jax.sharding.PartitionSpec("tensor") and leaf.bytes_per_device == 32 * 4 // 8
    state = mt.init_state(plan)
    assert state.model_state["ema"].sharding.spec == jax.sharding.PartitionSpec("tensor")
