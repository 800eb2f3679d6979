"""Batches as pytrees with logical axes: every leaf planned (per-device bytes), nothing silently
replicated, mismatched batches named, and the loss contract (loss sum, weight, metric sums)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshtrain as mt

from helpers import mesh_for, put, rel_diff, tiny_abstract, token_batch

P = nnx.with_partitioning
KERNEL, ZEROS = nnx.initializers.lecun_normal(), nnx.initializers.zeros


class Classifier(nnx.Module):
    """Images (B, 4, 4, 2) → 8 classes."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(32, 32, kernel_init=P(KERNEL, ("embed", "mlp")), bias_init=P(ZEROS, ("mlp",)),
                             rngs=rngs)
        self.l2 = nnx.Linear(32, 8, kernel_init=P(KERNEL, ("mlp", "embed")), bias_init=P(ZEROS, ("embed",)),
                             rngs=rngs)

    def __call__(self, images):
        return self.l2(jax.nn.gelu(self.l1(images.reshape(images.shape[0], -1))))


def image_batch(step=0, n=16):
    rng = np.random.default_rng((3, step))
    return {"images": rng.normal(size=(n, 4, 4, 2)).astype(np.float32),
            "labels": rng.integers(0, 8, n).astype(np.int32)}


def classify(model, batch):
    logits = model(batch["images"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["labels"])
    return jnp.sum(ce), batch["labels"].shape[0], {"accuracy": correct, "ce_squared": jnp.sum(ce * ce)}


@pytest.fixture(scope="module")
def lm_abstract():
    return tiny_abstract()


@pytest.fixture(scope="module")
def clf_abstract():
    return mt.abstract_state(Classifier, optax.adamw(1e-2))


@pytest.fixture(scope="module")
def dp_plan(clf_abstract):
    recipe, mesh = mesh_for("dp")
    plan = mt.make_plan(clf_abstract, _recipe("dp"), mesh, batch=image_batch())
    return plan, mt.init_state(plan)


def _recipe(name):
    return mt.get_recipe(name).with_options(max_replicated_fraction=1.0)


# -- layouts ----------------------------------------------------------------------------------

def test_from_example_defaults_and_overrides():
    batch = {"images": np.zeros((16, 4, 4, 2), np.float32), "labels": np.zeros((16,), np.int64),
             "meta": {"ids": np.zeros((16, 3), np.int32), "scale": np.float32(2.0)}}
    layout = mt.BatchLayout.from_example(batch)
    leaves = dict(layout.leaves())
    assert leaves["images"].axes == ("batch", None, None, None)
    assert leaves["labels"].axes == ("batch",) and leaves["labels"].dtype == np.int32  # jit's dtype
    assert leaves["meta/scale"].axes == () and leaves["meta/scale"].shape == ()
    over = mt.BatchLayout.from_example(batch, axes={"images": ("batch", "height", None, None),
                                                    "meta": {"ids": (None, None)}}, allow_replicated=("meta",))
    leaves = dict(over.leaves())
    assert leaves["images"].axes == ("batch", "height", None, None)
    assert leaves["meta/ids"].axes == (None, None) and leaves["labels"].axes == ("batch",)
    assert over.allows_replicated("meta/scale", leaves["meta/scale"])
    assert not over.allows_replicated("labels", leaves["labels"])
    # Abstract batches work the same; BatchSpec is the language-model layout.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
    assert mt.BatchLayout.from_example(abstract) == mt.BatchLayout.from_example(batch)
    lm = mt.BatchSpec(16, 64).layout()
    assert [p for p, _ in lm.leaves_as_given()] == ["inputs", "targets", "positions", "segment_ids"]
    assert lm.batch_size == 16 and lm.seq_len == 64


def test_layout_errors_name_the_leaf():
    batch = image_batch()
    with pytest.raises(mt.RulesError, match=r"batch leaf 'images' \(shape \(16, 4, 4, 2\).*logical axes "
                                            r"\('batch', None\) of rank 2 but the array has rank 4"):
        mt.BatchLayout.from_example(batch, axes={"images": ("batch", None)})
    with pytest.raises(mt.ConfigError, match=r"axes name keys \['lables'\]"):
        mt.BatchLayout.from_example(batch, axes={"lables": ("batch",)})
    with pytest.raises(mt.ConfigError, match=r"allow_replicated names \['mask'\]"):
        mt.BatchLayout.from_example(batch, allow_replicated=("mask",))


# -- planning ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(mt.BUILTIN_RECIPES))
def test_per_device_batch_bytes_are_global_over_data_parallel(name, lm_abstract):
    recipe, mesh = mesh_for(name)
    layouts = {"tokens": mt.BatchSpec(16, 64),
               "images": mt.BatchLayout.from_example(
                   {**image_batch(), "weights": np.ones((16, 1), np.float32)})}
    for kind, batch in layouts.items():
        plan = mt.make_plan(lm_abstract, recipe, mesh, batch=batch)
        dp = plan.data_parallel_size
        leaves = plan.group("batch")
        assert len(leaves) == len(plan.batch.leaves()) and leaves
        # context parallelism splits a leaf's `seq` dimension too (cp recipes)
        seq_rule = plan.rules.table("activations")["seq"]
        cp = math.prod(plan.mesh_sizes[a] for a in seq_rule.mesh_axes)
        ways = lambda leaf: dp * (cp if "seq" in leaf.logical_axes else 1)  # noqa: E731
        for leaf in leaves:
            assert leaf.bytes_per_device * ways(leaf) == leaf.bytes_total, (name, kind, leaf)
        assert plan.per_device_bytes()["batch"] == sum(l.bytes_total // ways(l) for l in leaves)
        shardings = jax.tree.leaves(plan.batch_shardings)
        assert len(shardings) == len(leaves) and all(s.mesh.shape == mesh.shape for s in shardings)
    assert plan.to_dict()["batch"][0]["path"] == "images"


def test_unplaced_batch_leaf_cannot_silently_replicate(clf_abstract):
    batch = {**image_batch(), "class_weights": np.ones((8,), np.float32)}
    recipe, mesh = mesh_for("fsdp")
    unplaced = mt.BatchLayout.from_example(batch, axes={"class_weights": (None,)})
    with pytest.raises(mt.PlanError, match=r"batch leaf 'class_weights' \(shape \(8,\), logical axes \(None,\)\) "
                                           r"would be replicated.*8 data-parallel devices \(fsdp=8\).*'batch' axis"
                                           r".*allow_replicated=\('class_weights',\)"):
        mt.make_plan(clf_abstract, _recipe("fsdp"), mesh, batch=unplaced)
    with pytest.raises(mt.PlanError, match=r"batch leaf 'temperature' \(shape \(\), logical axes \(\)\)"):
        mt.make_plan(clf_abstract, _recipe("fsdp"), mesh, batch={**image_batch(), "temperature": np.float32(1)})
    allowed = mt.BatchLayout.from_example(batch, axes={"class_weights": (None,)}, allow_replicated=("class_weights",))
    plan = mt.make_plan(clf_abstract, _recipe("fsdp"), mesh, batch=allowed)
    assert plan.batch_shardings["class_weights"].spec == jax.sharding.PartitionSpec()
    # Without data parallelism (pure TP), a whole batch on every device is the layout, not a mistake.
    tp, tp_mesh = mesh_for("tp")
    mt.make_plan(clf_abstract, _recipe("tp"), tp_mesh, batch=unplaced)
    # A plan without a batch layout cannot build a step (the batch would be replicated).
    with pytest.raises(mt.ConfigError, match="needs a plan with a batch layout"):
        mt.make_train_step(mt.make_plan(clf_abstract, _recipe("fsdp"), mesh), loss_fn=classify)


def test_mismatched_batch_raises_naming_the_leaf(dp_plan):
    plan, state = dp_plan
    step = mt.make_train_step(plan, loss_fn=classify, donate=False)
    state2, metrics = step(state, image_batch(1))
    assert np.isfinite(float(metrics["loss"]))
    bad = image_batch(1)
    with pytest.raises(mt.ConfigError, match=r"batch leaf 'labels' is \(8,\) int32 but the plan expects \(16,\) "
                                             r"int32"):
        step(state, {**bad, "labels": bad["labels"][:8]})
    with pytest.raises(mt.ConfigError, match=r"batch leaf 'images' is \(16, 4, 4, 2\) float16"):
        step(state, {**bad, "images": bad["images"].astype(np.float16)})
    with pytest.raises(mt.ConfigError, match=r"missing leaves \['labels'\].*unexpected leaves \['label'\]"):
        step(state, {"images": bad["images"], "label": bad["labels"]})
    with pytest.raises(mt.ConfigError, match="batch leaf 'labels'"):
        plan.check_batch({**bad, "labels": bad["labels"].reshape(16, 1)})
    # int64 numpy labels are what jit would make int32: accepted.
    plan.check_batch({**bad, "labels": bad["labels"].astype(np.int64)})


# -- steps and the loss contract ----------------------------------------------------------------

def _grads(abstract, recipe, mesh, batch, loss_fn, layout=None):
    plan = mt.make_plan(abstract, recipe, mesh, batch=batch if layout is None else layout)
    state = mt.init_state(plan)
    loss, grads = mt.make_grad_fn(plan, loss_fn=loss_fn)(state, batch)
    metrics = mt.make_eval_step(plan, loss_fn=loss_fn)(state, batch)
    return float(loss), jax.tree.leaves(jax.tree.map(np.asarray, grads)), metrics


@pytest.mark.slow
def test_any_layout_micro_batched_matches_one_device(clf_abstract):
    """Batch axis not first, a replicated-by-design leaf, metrics: micro-batches × devices = one device."""
    base = image_batch()
    batch = {"images_t": np.moveaxis(base["images"], 0, -1), "labels": base["labels"],
             "class_weights": np.linspace(0.5, 1.5, 8).astype(np.float32)}
    axes = {"images_t": (None, None, None, "batch"), "class_weights": (None,)}

    def weighted(model, b):
        logits = model(jnp.moveaxis(b["images_t"], -1, 0)).astype(jnp.float32)
        w = b["class_weights"][b["labels"]]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"])
        return jnp.sum(w * ce), jnp.sum(w), {"accuracy": jnp.sum(w * (jnp.argmax(logits, -1) == b["labels"]))}

    layout = mt.BatchLayout.from_example(batch, axes=axes, allow_replicated=("class_weights",))
    one = mt.get_recipe("dp")
    ref = _grads(clf_abstract, one, one.mesh.build(jax.devices()[:1]), batch, weighted)
    recipe, mesh = mesh_for("fsdp")
    got = _grads(clf_abstract, _recipe("fsdp").with_options(grad_accum=2), mesh, batch, weighted, layout)
    assert abs(got[0] - ref[0]) <= 1e-5 * ref[0]
    assert max(rel_diff(a, b) for a, b in zip(got[1], ref[1])) <= 1e-5
    assert abs(float(got[2]["accuracy"]) - float(ref[2]["accuracy"])) <= 1e-6
    assert abs(float(got[2]["weight"]) - float(np.sum(batch["class_weights"][batch["labels"]]))) <= 1e-4


@pytest.mark.slow
def test_step_metrics_are_sums_over_the_global_weight(clf_abstract):
    batch = image_batch(n=32)
    recipe, mesh = mesh_for("fsdp")
    out = {}
    for micro in (1, 4):
        plan = mt.make_plan(clf_abstract, _recipe("fsdp").with_options(grad_accum=micro), mesh, batch=batch)
        state = mt.init_state(plan)
        ev = mt.make_eval_step(plan, loss_fn=classify)(state, batch)
        _, metrics = mt.make_train_step(plan, loss_fn=classify)(state, batch)
        assert set(metrics) == {"loss", "grad_norm", "weight", "tokens", "finite", "accuracy", "ce_squared"}
        assert float(metrics["weight"]) == float(metrics["tokens"]) == 32.0
        out[micro] = {k: float(v) for k, v in metrics.items()}
        assert abs(out[micro]["loss"] - float(ev["loss"])) <= 1e-5 * float(ev["loss"])
        assert abs(out[micro]["accuracy"] - float(ev["accuracy"])) <= 1e-6
    # Micro-batch sums divided once by the global weight: the same numbers as one pass.
    for key in ("loss", "accuracy", "ce_squared", "grad_norm"):
        assert abs(out[4][key] - out[1][key]) <= 1e-5 * max(abs(out[1][key]), 1e-6), key
    # The language-model default still reports tokens.
    lm_recipe, lm_mesh = mesh_for("dp")
    lm_plan = mt.make_plan(tiny_abstract(), lm_recipe, lm_mesh, batch=mt.BatchSpec(16, 64))
    ev = mt.make_eval_step(lm_plan)(mt.init_state(lm_plan), put(token_batch(0), lm_plan))
    assert float(ev["tokens"]) == 16 * 64 and set(ev) == {"loss", "weight", "tokens"}


@pytest.mark.parametrize("bad, message", [
    (lambda l, w, m: l / w, r"returned an array float32\[\]; expected \(loss_sum, weight\)"),
    (lambda l, w, m: (l, w, m, m), r"returned a tuple of 4"),
    (lambda l, w, m: (l * jnp.ones(16), w), r"returned loss_sum = an array float32\[16\]"),
    (lambda l, w, m: (l, w, [m["accuracy"]]), r"returned metrics = a list of 1"),
    (lambda l, w, m: (l, w, {"loss": l}), r"a metric named 'loss'"),
    (lambda l, w, m: (l, w, {"per_row": jnp.ones(16)}), r"metric 'per_row' = an array float32\[16\]"),
])
def test_wrong_loss_structure_is_a_clear_error(bad, message, dp_plan):
    plan, state = dp_plan

    def loss_fn(model, batch):
        total, weight, metrics = classify(model, batch)
        return bad(total, jnp.asarray(weight, jnp.float32), metrics)

    with pytest.raises(mt.ConfigError, match=message):
        mt.make_train_step(plan, loss_fn=loss_fn).lower(state, image_batch())
