"""transformers' Flax ResNet (BatchNorm), unedited, through ``from_linen`` with the README's glue lines and the
shipped rules file (``recipes/rules/hf_resnet.yaml``), issue 31 deliverable 7: the plain loss
``model(x, deterministic=False)`` (no ``mutable=`` keyword) updates the batch statistics, which the train step
carries out as model state; ``--list-params`` lists them with their rules; and on 8 devices (a data split and a
composed fsdp x tensor x sequence layout: ``PARITY_RECIPES``) the losses and the updated statistics match one
device (relative difference <= 1e-5). Skipped without
`transformers` (a test-only dependency)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshtrain as mt

transformers = pytest.importorskip("transformers")

from helpers import rel_diff, single_device  # noqa: E402
from hf_models import RECIPES, shipped_rules  # noqa: E402  (needs transformers)

from meshtrain.models import from_linen  # noqa: E402

BATCH, SIDE, STEPS = 8, 16, 3
RULES = shipped_rules("resnet")


def resnet(rules=RULES):
    """The README's glue lines: a tiny HF ResNet, a sample input of its Flax module (NHWC), the rules file."""
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type="basic", num_labels=10)
    hf = transformers.FlaxResNetForImageClassification(config, input_shape=(1, SIDE, SIDE, 3), _do_init=False)
    return from_linen(hf, jax.ShapeDtypeStruct((1, SIDE, SIDE, 3), jnp.float32), rules=rules, weights="init")


def loss(model, batch):
    """The obvious loss: training mode, no ``mutable=["batch_stats"]``."""
    logits = model(batch["images"], deterministic=False).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return ce.sum(), ce.size


def batch_of(step):
    rng = np.random.default_rng(step)
    return {"images": (3.0 * rng.standard_normal((BATCH, SIDE, SIDE, 3)) + 1.0).astype(np.float32),
            "labels": rng.integers(0, 10, (BATCH,)).astype(np.int32)}


def stats_of(state) -> dict:
    """``{path: array}`` of the BatchNorm running statistics in a train state's model state."""
    flat = jax.tree_util.tree_flatten_with_path(state.model_state)[0]
    return {mt.abstract.path_str(kp): np.array(x) for kp, x in flat
            if mt.abstract.path_str(kp).endswith(("/mean", "/var"))}


def test_resnet_lists_its_batch_stats_with_their_rules():
    state = {i.path: i for i in mt.list_model_state(resnet())}
    mean = state["resnet/embedder/embedder/normalization/mean"]
    assert (mean.shape, mean.names, mean.source, mean.group) == ((8,), (None,), "rules", "model_state")
    assert sum(p.endswith(("/mean", "/var")) for p in state) == 12
    assert state["to_nnx__rngs/dropout/key"].source == "rng stream: replicated"
    # A path rule names model state like a parameter (given rules come before the factory's): the statistics
    # follow their channels onto `tensor`.
    own = {"paths": {".*/normalization/(mean|var)": ["mlp"]}}
    abstract = mt.abstract_state(resnet(), optax.adam(1e-3), annotations=own)
    path = "resnet/encoder/stages/1/layers/0/shortcut/normalization/var"
    assert abstract.model_state_axes[path] == ("mlp",)
    recipe = mt.get_recipe("tp")
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:8]),
                        batch={"images": jax.ShapeDtypeStruct((BATCH, SIDE, SIDE, 3), jnp.float32)})
    spec = {leaf.path: leaf.spec for leaf in plan.group("model_state")}[path]
    assert spec == jax.sharding.PartitionSpec("tensor"), spec


def test_the_plain_training_call_updates_batch_stats_like_the_hf_wrapper():
    """``model(x, deterministic=False)`` works (it raised ModifyScopeVariableError) and its statistics are the HF
    wrapper's ``train=True`` ones; the wrapper takes NCHW images, the Flax module (what from_linen calls) NHWC."""
    from flax import nnx

    model = resnet()(nnx.Rngs(0))
    _, params, before = nnx.split(model, nnx.Param, ...)
    images = batch_of(0)["images"]
    logits = model(jnp.asarray(images), deterministic=False).logits
    _, _, after = nnx.split(model, nnx.Param, ...)
    before, after = nnx.to_pure_dict(before), nnx.to_pure_dict(after)

    hf = transformers.FlaxResNetForImageClassification(resnet().config, input_shape=(1, SIDE, SIDE, 3),
                                                       _do_init=False)
    variables = {"params": nnx.to_pure_dict(params), "batch_stats": {"resnet": before["resnet"]}}
    out, updates = hf(images.transpose(0, 3, 1, 2), params=variables, train=True)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(out.logits), rtol=1e-5, atol=1e-6)
    ours = jax.tree.leaves(after["resnet"])
    theirs = jax.tree.leaves(updates["batch_stats"]["resnet"])
    assert len(ours) == len(theirs) == 12
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(before["resnet"]), ours))


def train(recipe, mesh):
    """``STEPS`` steps of the plain loss; returns (losses, initial statistics, final statistics)."""
    abstract = mt.abstract_state(resnet(), optax.adam(1e-2))
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_of(0))
    plan = mt.make_plan(abstract, recipe, mesh, batch=example)
    state = mt.init_state(plan, seed=0)
    first = stats_of(state)
    step = mt.make_train_step(plan, loss_fn=loss)
    losses = []
    for i in range(STEPS):
        batch = {k: jax.device_put(v, plan.batch_shardings[k]) for k, v in batch_of(i).items()}
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), first, stats_of(state)


@pytest.fixture(scope="module")
def one_device():
    """``train`` on one device with ``recipe``'s knobs (helpers.single_device), once per distinct knob set."""
    runs = {}

    def get(recipe):
        one, one_mesh = single_device(recipe)
        key = one.to_yaml()
        if key not in runs:
            runs[key] = train(one, one_mesh)
        return runs[key]
    return get


#: Cut from the 8 built-in recipes (MESHTRAIN_FULL_PARITY=1 runs all eight): every recipe runs against one
#: device on the tiny decoder (test_parity.py); what this model adds is BatchNorm statistics taken over a batch
#: split across devices, and its rules file's kernels on `embed` and `mlp`. dp: the batch split over `data`,
#: every weight whole; fsdp_tp_sp: the batch split over `fsdp`, kernels split on fsdp and tensor (the
#: statistics' channels computed from tensor-split activations). zero1/zero2/hsdp/fsdp/tp/fsdp_tp shard the
#: same kernels or the optimizer state in ways none of the statistics' code sees.
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
PARITY_RECIPES = RECIPES if FULL else ["dp", "fsdp_tp_sp"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", PARITY_RECIPES)
def test_resnet_matches_one_device_with_batch_stats_updated(recipe, one_device):
    """Must show (issue 31): the plain loss under ``recipe`` on 8 devices = one device, statistics included."""
    base, first, base_stats = one_device(recipe)
    got, _, stats = train(mt.get_recipe(recipe), mt.get_recipe(recipe).mesh.build(jax.devices()[:8]))
    assert np.all(np.isfinite(base)) and rel_diff(got, base) <= 1e-5, (recipe, got, base)
    assert sorted(stats) == sorted(base_stats) and len(stats) == 12
    for path, value in stats.items():
        assert rel_diff(value, base_stats[path]) <= 1e-5, (recipe, path)
        assert not np.allclose(value, first[path]), f"{path} did not move from its initial value"


def test_the_readme_resnet_lines_list_their_model_state(tmp_path, monkeypatch, capsys):
    """The README's ResNet block, as a model file, through ``meshtrain plan --list-params``: the model state lines
    the README quotes are what the CLI prints."""
    import os
    import re

    from hf_models import ROOT
    from meshtrain.cli import main

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```python\n(from transformers import FlaxResNetForImageClassification.*?)```", readme,
                      re.S).group(1)
    model = tmp_path / "resnet_model.py"
    model.write_text("import jax, jax.numpy as jnp, optax\nfrom meshtrain.models import from_linen\n" + block)
    monkeypatch.chdir(ROOT)  # the block names the shipped rules file from the repository's root
    assert main(["plan", "--model", f"{model}:make", "--list-params"]) == 0
    lines = capsys.readouterr().out.splitlines()
    quoted = re.findall(r"\(`(resnet/[^`]*|to_nnx__rngs/[^`]*)`\)", readme)
    assert len(quoted) == 2 and all(q in lines for q in quoted), (quoted, lines[-20:])
    assert "# 0 without logical axes" in lines and any(l.startswith("# 16 model state variables") for l in lines)


def test_pretrained_batch_stats_are_loaded_and_eval_matches_the_hf_wrapper():
    """An HF object's ``params`` hold ``batch_stats`` too: from_linen starts from them (they were dropped before),
    so in eval mode the model's logits are the wrapper's (NCHW there, NHWC here)."""
    from flax import nnx

    hf = transformers.FlaxResNetForImageClassification(resnet().config, input_shape=(1, SIDE, SIDE, 3))
    hf.params = {"params": hf.params["params"],
                 "batch_stats": jax.tree.map(lambda x: x + 0.5, hf.params["batch_stats"])}  # not the init values
    model = from_linen(hf, jax.ShapeDtypeStruct((1, SIDE, SIDE, 3), jnp.float32), rules=RULES)(nnx.Rngs(0))
    _, _, state = nnx.split(model, nnx.Param, ...)
    ours = nnx.to_pure_dict(state)["resnet"]
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(hf.params["batch_stats"]["resnet"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    images = batch_of(1)["images"][:2]
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(images), deterministic=True).logits),
                               np.asarray(hf(images.transpose(0, 3, 1, 2)).logits), rtol=1e-5, atol=1e-6)
