"""Context-parallel recipes for any task (issue 18): the Trainer puts every batch leaf with a
``seq`` axis in the zig-zag order of causal context attention itself (inputs, targets, segment ids,
masks; positions the model computes come from the layout), keeps bidirectional models (bert) in
natural order, and refuses what it cannot reorder; the Ulysses head-count error names the device
counts that work."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.annotate import StepContext, step_context
from meshtrain.errors import ConfigError
from meshtrain.models import get_config, model_factory
from meshtrain.parallel.attention import AttentionKind, attention
from meshtrain.parallel.context import plan_layout
from meshtrain.rules import AxisRules
from meshtrain.train import TrainConfig, Trainer
from meshtrain.train.tasks import DataRequest, local_rows

from helpers import rel_diff, token_batch

STEPS, BATCH, SEQ = 3, 8, 64
SEQ_AXES = ("batch", "seq")


# -- a causal task of the user's own: a decoder on batches without positions, with a loss mask ---

def _causal_batches():
    out = []
    for i in range(STEPS):
        b = token_batch(i, batch=BATCH, seq=SEQ)
        weights = (np.random.default_rng(i).random((BATCH, SEQ)) < 0.7).astype(np.float32)
        out.append({"tokens": b["inputs"], "targets": b["targets"], "segment_ids": b["segment_ids"],
                    "weights": weights})
    return out


def _causal_loss(model, batch):
    logits = model(batch["tokens"], None, batch["segment_ids"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["weights"]), jnp.sum(batch["weights"])


def _causal_task(batch_axes=True):
    axes = {k: SEQ_AXES for k in ("tokens", "targets", "segment_ids", "weights")} if batch_axes else None
    return dict(model=model_factory(get_config("tiny")), loss_fn=_causal_loss, data=_causal_batches(),
                eval_data=_causal_batches()[:1], batch_axes=axes)


TASKS = {"bert": dict, "causal": _causal_task}  # bert: the built-in masked-LM task of bert-tiny


def _run(tmp, task, recipe, devices=None):
    """Through the Trainer's own plan, task and feeds: the loss and gradients of the first training
    batch, the loss of the first evaluation batch, and those two batches as the feeds deliver them."""
    cfg = TrainConfig(model="bert-tiny", recipe=recipe, devices=devices, steps=1, batch_size=BATCH, seq_len=SEQ,
                      progress="none", out=str(tmp / f"{task}-{recipe}"))
    trainer = Trainer(cfg, **TASKS[task]())
    plan = trainer.build_plan()
    grad_fn, state = mt.make_grad_fn(plan, loss_fn=trainer.task.loss_fn), mt.init_state(plan, seed=0)
    out = {}
    for split in ("train", "val"):
        request = DataRequest(plan.batch.batch_size, SEQ, 0, 0, 1, local_rows(plan), split, plan.batch_shardings)
        batch = next(trainer.task.feed(request, plan))
        out[f"{split} loss"], grads = grad_fn(state, batch)
        out[f"{split} batch"] = jax.tree.map(np.asarray, batch)
        if split == "train":
            out["grads"] = {path_str(k): np.asarray(g) for k, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    return plan, out


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The same task on one device (``dp``), per task, computed once."""
    runs = {}

    def get(task):
        if task not in runs:
            runs[task] = _run(tmp_path_factory.mktemp("one"), task, "dp", devices=1)
        return runs[task]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("task,recipe", [("bert", "cp"), ("bert", "fsdp_cp_usp"), ("causal", "cp")])
def test_cp_recipe_trains_any_task_like_one_device(task, recipe, one_device, tmp_path, capsys):
    _, base = one_device(task)
    plan, got = _run(tmp_path, task, recipe)
    printed = capsys.readouterr().out
    assert plan_layout(plan).reorders  # zig-zag over a ring of context devices
    perm = mt.sequence_permutation(plan, SEQ) if task == "causal" else np.arange(SEQ)
    if task == "bert":  # bidirectional: nothing to balance, natural order, said once
        assert printed.count("bidirectional attention is balanced over the context devices as it is") == 1
    for split in ("train", "val"):  # causal: every leaf with a `seq` axis in zig-zag order (the loss mask too)
        for key, value in got[f"{split} batch"].items():
            np.testing.assert_array_equal(value, base[f"{split} batch"][key][:, perm])
    losses = [rel_diff(got[k], base[k]) for k in ("train loss", "val loss")]
    # A gradient is compared at the scale of the largest one: the key biases' true gradient is 0
    # (softmax ignores a shift shared by all keys), so what they hold is f32 rounding noise.
    scale = max(float(np.abs(g).max()) for g in base["grads"].values())
    grads = {p: float(np.abs(g - base["grads"][p]).max()) / max(float(np.abs(base["grads"][p]).max()), scale * 1e-3)
             for p, g in got["grads"].items()}
    print(task, recipe, "rel diff: losses", losses, "worst gradient", max(grads.items(), key=lambda kv: kv[1]))
    assert max(losses) <= 1e-5 and got["grads"].keys() == base["grads"].keys()
    assert max(grads.values()) <= 1e-5, grads


def test_causal_task_without_a_seq_axis_is_refused_naming_batch_axes(tmp_path):
    trainer = Trainer(TrainConfig(model="tiny", recipe="cp", steps=1, batch_size=BATCH, seq_len=SEQ, eval_every=0,
                                  progress="none", out=str(tmp_path / "run")), **_causal_task(batch_axes=False))
    with pytest.raises(ConfigError, match=r"causal attention 'ring' with zig-zag.*no batch leaf has a 'seq' axis.*"
                                          r"batch_axes=\{'tokens': \('batch', 'seq'\)\}"):
        trainer.run()


# -- Ulysses: the head count decides the context sizes that work -------------------------------

@pytest.mark.parametrize("kind,sizes,heads,kv,fix", [
    ("ulysses", {"context": 5}, 16, 8, "use 1, 2 or 4 context devices"),
    ("ulysses", {"context": 8}, 12, 4, "use 1, 2 or 4 context devices"),  # 3 and 6 do not split 4 kv heads
    ("ulysses", {"context": 4}, 12, 3, "use 1 or 3 context devices"),  # 3 kv heads neither divide nor are divided by 4
    ("usp", {"context": 2, "ulysses": 3}, 16, 8, "use a ulysses axis of size 1, 2 or 4"),
])
def test_ulysses_head_count_error_names_the_sizes_that_work(kind, sizes, heads, kv, fix):
    n = int(np.prod(list(sizes.values())))
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes),
                         devices=jax.devices()[:n])
    rules = AxisRules.defaults().merged(AxisRules.of(activations={"seq": tuple(sizes)}, source="test"))
    ctx = StepContext(mesh, rules, attention=AttentionKind(kind))
    t = 2 * n * 4
    q = jax.ShapeDtypeStruct((2, t, heads, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((2, t, kv, 8), jnp.float32)
    with pytest.raises(ConfigError) as err, jax.set_mesh(mesh), step_context(ctx):
        jax.eval_shape(lambda q, k, v: attention(q, k, v), q, k, k)
    print(err.value)
    assert f"attention {kind!r}" in str(err.value) and fix in str(err.value) and "\n" not in str(err.value)
    assert f"fit the {n} devices" in str(err.value) and "or attention 'ring'" in str(err.value)
