"""Any model, loss and data through the Trainer (issue 10).

* Parity: for a ViT (images), a BERT with dropout (masked LM), an annotated Linen classifier
  (``from_linen``) and an unannotated NNX model given logical axes by path rules, every built-in
  recipe on 8 devices gives the per-step losses of one device (5 f32 steps, relative difference
  <= 1e-5), with the user's ``model=``, ``loss_fn=`` and ``data=``. Each model runs under one sharded
  recipe (``CASES`` says which and why; ``MESHTRAIN_FULL_PARITY=1``: every recipe on every model).
* Bad input: a clear ``MeshtrainError`` (exit 2 from the CLI) naming what to change.
* Data: the first batch (read to find the layout) is not repeated; a source with
  ``state()``/``restore()`` resumes bit-exact; a source that ends keeps the committed checkpoint.
"""

import itertools
import json
import os

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import meshtrain as mt
from meshtrain.data import default_corpus
from meshtrain.data.feed import DataExhausted
from meshtrain.data.images import DigitsBatches
from meshtrain.data.mlm import MLMBatches
from meshtrain.models import from_linen, get_config, mlm_loss, model_factory, vit_loss
from meshtrain.train import TrainConfig, Trainer

STEPS, BATCH, DIM, HIDDEN = 5, 16, 32, 128
# The data/FSDP/ZeRO/TP/SP recipes: every model runs them. Context, expert and pipeline recipes
# have their own parity tests (they need a model with attention, experts or pipeline parts).
RECIPES = ["dp", "fsdp", "zero1", "zero2", "hsdp", "tp", "fsdp_tp", "fsdp_tp_sp"]


def losses_of(run_dir):
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                by_step[rec["step"]] = rec["loss"]
    return np.array([by_step[s] for s in sorted(by_step)])


# -- the user's parts ----------------------------------------------------------------------------

class PlainMLP(nnx.Module):
    """An NNX classifier without any logical names (they come from PATH_RULES), with dropout."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.1):
        self.up = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.down = nnx.Linear(HIDDEN, DIM, rngs=rngs)

    def __call__(self, x, deterministic=None):
        h = nnx.relu(self.up(x))
        if self.drop is not None:
            h = self.drop(h, deterministic=deterministic)
        return self.down(h)


PATH_RULES = mt.PathRules([(r"up/kernel", ("embed", "mlp")), (r"up/bias", ("mlp",)),
                           (r"down/kernel", ("mlp", "embed")), (r"down/bias", ("embed",))])


def with_path_rules(factory, rules: mt.PathRules):
    """The Trainer takes no ``annotations=``: give the factory's unannotated parameters their axes
    (``out_sharding`` metadata) from ``rules``, as ``abstract_state(..., annotations=rules)`` would."""
    def annotated(rngs):
        model = factory(rngs)
        for path, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param) and var.get_metadata().get("out_sharding") is None:
                axes = rules.lookup("/".join(str(p) for p in path))
                if axes is not None:
                    var.set_metadata("out_sharding", tuple(axes))
        return model
    return annotated


class LinenMLP(nn.Module):
    """A Linen classifier annotated with ``nn.with_logical_partitioning``, with dropout."""

    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        lp = nn.with_logical_partitioning
        h = nn.Dense(HIDDEN, kernel_init=lp(nn.initializers.lecun_normal(), ("embed", "mlp")),
                     bias_init=lp(nn.initializers.zeros, ("mlp",)))(x)
        h = nn.Dropout(0.1, deterministic=deterministic)(nn.relu(h))
        return nn.Dense(DIM, kernel_init=lp(nn.initializers.lecun_normal(), ("mlp", "embed")),
                        bias_init=lp(nn.initializers.zeros, ("embed",)))(h)


def classify(model, batch):
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return ce.sum(), ce.size, {"accuracy": (logits.argmax(-1) == batch["y"]).sum()}


def numpy_batches(seed=0, limit=None):
    """The user's generator: batch i is a function of (seed, i) only."""
    for i in itertools.count() if limit is None else range(limit):
        yield _batch(seed, i)


def _batch(seed, i):
    rng = np.random.default_rng([seed, i])
    return {"x": rng.normal(size=(BATCH, DIM)).astype(np.float32),
            "y": rng.integers(0, DIM, size=(BATCH,)).astype(np.int32)}


class ResumableBatches:
    """A numpy source with ``state()`` / ``restore()``: the Trainer checkpoints its position."""

    def __init__(self, seed=0, limit=None):
        self.seed, self.limit, self.position = seed, limit, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.limit is not None and self.position >= self.limit:
            raise StopIteration
        self.position += 1
        return _batch(self.seed, self.position - 1)

    def state(self):
        return {"position": self.position, "seed": self.seed}

    def restore(self, state):
        assert state["seed"] == self.seed
        self.position = int(state["position"])


def _plain(rngs):
    """PlainMLP without dropout, with its axes from PATH_RULES (below)."""
    return PlainMLP(rngs, 0.0)


def _mlm_data(req):
    return MLMBatches(default_corpus(), req.batch_size, req.seq_len, req.seed, rows=req.rows)


#: name -> (a function giving fresh Trainer keyword arguments, lift the replication guard under pure TP).
#: The encoders are the built-in tiny configs with one layer (the layer stack is scanned either way).
MODELS = {
    "vit": (lambda: dict(model=model_factory(get_config("vit-tiny", n_layers=1)), loss_fn=vit_loss,
                         data=DigitsBatches(BATCH, 0)), True),
    "bert": (lambda: dict(model=model_factory(get_config("bert-tiny", n_layers=1)), loss_fn=mlm_loss,
                          data=_mlm_data), True),
    "linen": (lambda: dict(model=from_linen(LinenMLP(), jax.ShapeDtypeStruct((1, DIM), np.float32)),
                           loss_fn=classify, data=numpy_batches()), False),
    "nnx_rules": (lambda: dict(model=PlainMLP, path_rules=PATH_RULES, loss_fn=classify,
                               data=numpy_batches()), False),
}


def _config(out, recipe="dp", **kw):
    base = dict(recipe=recipe, steps=STEPS, batch_size=BATCH, seq_len=32, eval_every=0, progress="none",
                out=str(out), recipe_options={"compute_dtype": "float32"})
    base.update(kw)
    return TrainConfig(**base)


def _recipe_arg(name, lift, folder):
    """The recipe name, or (pure TP on the tiny encoders) a recipe file without the replication guard:
    TP keeps their `embed`-only weights whole (position tables, heads, norms: 4 % of vit-tiny and
    18 % of bert-tiny), over the 2 % guard meant for real sizes."""
    if not (lift and name == "tp"):
        return name
    path = folder / f"{name}-unguarded.yaml"
    path.write_text(mt.get_recipe(name).with_options(max_replicated_fraction=1.0).to_yaml())
    return str(path)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    cache = {}

    def get(model):
        if model not in cache:
            out = tmp_path_factory.mktemp(f"one-{model}")
            summary = Trainer(_config(out / "run", devices=1), **MODELS[model][0]()).run()
            cache[model] = losses_of(summary.run_dir)
        return cache[model]

    return get


#: Each Trainer run costs ~3-8 s of CPU (init + step compile), so by default each model runs under one
#: sharded recipe (cut from the 8 recipes x 4 models product; MESHTRAIN_FULL_PARITY=1 runs all of it).
#: Every built-in recipe runs against one device on the tiny decoder (test_parity.py, losses, gradients
#: and shard shapes); what this file adds is the user's model, loss and data through the Trainer, so each
#: model takes the recipe whose layout its own code meets:
#: * vit: fsdp_tp_sp, FSDP x tensor x sequence (its 16 mean-pooled patch tokens split over `tensor`);
#: * bert: tp, the pure tensor layout that needs the unguarded recipe file (``_recipe_arg``), dropout on;
#: * linen: fsdp_tp, from_linen's logical names onto both fsdp and tensor, Linen dropout on a split batch;
#: * nnx_rules: zero2, path rules giving the axes, sharded optimizer state and gradients, NNX dropout.
#: test_source_that_ends_keeps_checkpoint_and_resumes_bit_exact runs the path-rules model under fsdp too.
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
CASES = [(r, m) for r in RECIPES for m in MODELS] if FULL else [
    ("fsdp_tp_sp", "vit"), ("tp", "bert"), ("fsdp_tp", "linen"), ("zero2", "nnx_rules")]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, model", CASES)
def test_recipe_matches_one_device(recipe, model, baseline, tmp_path):
    base = baseline(model)
    assert len(base) == STEPS and np.all(np.isfinite(base))
    make, lift = MODELS[model]
    summary = Trainer(_config(tmp_path / "run", _recipe_arg(recipe, lift, tmp_path)), **make()).run()
    got = losses_of(summary.run_dir)
    rel = float(np.max(np.abs(got - base) / np.abs(base)))
    print(f"parity {model} {recipe}: max rel diff {rel:.2e}")
    assert rel <= 1e-5, (model, recipe, got, base)


def test_path_rules_wrapper_gives_the_trainer_the_axes():
    a = mt.abstract_state(with_path_rules(PlainMLP, PATH_RULES))
    assert a.param_axes == {"up/kernel": ("embed", "mlp"), "up/bias": ("mlp",), "down/kernel": ("mlp", "embed"),
                            "down/bias": ("embed",)}
    assert a.param_axes == mt.abstract_state(PlainMLP, annotations=PATH_RULES).param_axes
    with pytest.raises(mt.RulesError, match="without logical axes"):
        Trainer(_config("unused"), model=PlainMLP, loss_fn=classify, data=numpy_batches()).build_plan()


# -- data ----------------------------------------------------------------------------------------

def test_first_batch_is_not_repeated(tmp_path):
    """The Trainer reads one batch to find the layout; the run then continues that source."""
    calls, seen = [], []

    def data(req):
        calls.append(req.split)
        return ({"x": np.full((BATCH, DIM), i, np.float32), "y": np.zeros((BATCH,), np.int32)}
                for i in itertools.count())

    def loss(model, batch):
        jax.debug.callback(lambda v: seen.append(int(v)), batch["x"][0, 0])
        return classify(model, batch)

    Trainer(_config(tmp_path / "f", devices=1, steps=4), model=with_path_rules(_plain, PATH_RULES),
            loss_fn=loss, data=data).run()
    assert calls == ["train"] and seen == [0, 1, 2, 3]
    seen.clear()
    listed = [{"x": np.full((BATCH, DIM), i, np.float32), "y": np.zeros((BATCH,), np.int32)} for i in range(3)]
    Trainer(_config(tmp_path / "l", devices=1, steps=4), model=with_path_rules(_plain, PATH_RULES),
            loss_fn=loss, data=listed).run()
    assert seen == [0, 1, 2, 0]                                        # a list repeats


def test_source_that_ends_keeps_checkpoint_and_resumes_bit_exact(tmp_path):
    """6 steps uninterrupted == 3 steps (the source ends; the step-3 checkpoint holds its position)
    + `--resume` with the source restored to batch 3."""
    factory = with_path_rules(_plain, PATH_RULES)
    full = Trainer(_config(tmp_path / "full", "fsdp", steps=6), model=factory, loss_fn=classify,
                   data=ResumableBatches()).run()
    cut = _config(tmp_path / "cut", "fsdp", steps=6, ckpt_every=3)
    with pytest.raises(DataExhausted, match=r"ended after 3 batches.*(repeats|itertools.cycle).*--steps"):
        Trainer(cut, model=factory, loss_fn=classify, data=ResumableBatches(limit=3)).run()
    assert os.path.isdir(tmp_path / "cut" / "checkpoints" / "3")          # the committed checkpoint is kept
    assert isinstance(DataExhausted("x"), mt.MeshtrainError)              # the CLI: error line, exit 2
    resumed = Trainer(_config(tmp_path / "cut", "fsdp", steps=6, ckpt_every=3, resume="latest"), model=factory,
                      loss_fn=classify, data=ResumableBatches()).run()
    assert resumed.resumed_from == 3 and resumed.steps == 3
    np.testing.assert_array_equal(losses_of(tmp_path / "cut"), losses_of(full.run_dir))


def test_checkpoint_of_a_model_with_dropout_rng(tmp_path):
    """The dropout stream (a ``key<fry>`` leaf and its counter) is saved and restored: a run resumed
    from step 2 gives the uninterrupted run's losses, dropout masks included."""
    full = Trainer(_config(tmp_path / "full", devices=1, steps=4), model=PlainMLP, path_rules=PATH_RULES,
                   loss_fn=classify, data=ResumableBatches(), tx=optax.adam(1e-2)).run()
    Trainer(_config(tmp_path / "r", devices=1, steps=2, ckpt_every=2), model=PlainMLP, path_rules=PATH_RULES,
            loss_fn=classify, data=ResumableBatches(), tx=optax.adam(1e-2)).run()   # no schedule: 2 of 4 steps
    Trainer(_config(tmp_path / "r", devices=1, steps=4, ckpt_every=2, resume="latest"), model=PlainMLP,
            path_rules=PATH_RULES, loss_fn=classify, data=ResumableBatches(), tx=optax.adam(1e-2)).run()
    np.testing.assert_array_equal(losses_of(tmp_path / "r"), losses_of(full.run_dir))


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("loss, message", [
    (lambda m, b: classify(m, b)[0], r"returned an array float32\[\]; expected \(loss_sum, weight\)"),
    (lambda m, b: {"loss": classify(m, b)[0]}, r"returned a dict with keys \['loss'\]; expected"),
    (lambda m, b: (classify(m, b)[0], 1.0, [1]), r"returned metrics = a list of 1"),
    (lambda m, b: (m(b["x"]), 1.0), r"returned loss_sum = an array float32\[16, 32\]"),
])
def test_loss_with_the_wrong_structure(loss, message, tmp_path):
    with pytest.raises(mt.ConfigError, match=message):
        Trainer(_config(tmp_path / "r", devices=1), model=with_path_rules(_plain, PATH_RULES), loss_fn=loss,
                data=numpy_batches()).run()


@pytest.mark.parametrize("axes, message", [
    ({"x": ("batch",), "y": ("batch",)},
     r"batch_axes=.*does not fit the first batch: batch leaf 'x' \(shape \(16, 32\).*rank 1 but the array has rank 2"),
    ({"x": ("batch", None, None)}, r"batch leaf 'x'.*rank 3 but the array has rank 2.*\('batch', None\)"),
    ({"x": ("batch", None), "z": ("batch",)}, r"batch_axes=.*: axes name keys \['z'\].*keys: \['x', 'y'\]"),
])
def test_batch_axes_that_do_not_fit(axes, message, tmp_path):
    t = Trainer(_config(tmp_path / "r"), model=with_path_rules(_plain, PATH_RULES), loss_fn=classify,
                data=numpy_batches(), batch_axes=axes)
    with pytest.raises(mt.MeshtrainError, match=message):
        t.run()
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")


class _KeywordOnly(nnx.Module):
    def __init__(self, *, rngs):
        self.inner = _plain(rngs)

    def __call__(self, x):
        return self.inner(x)


def test_model_factories():
    kw = dict(loss_fn=classify, data=numpy_batches())
    with pytest.raises(mt.ConfigError, match=r"factory <lambda>\(\) cannot be called with one argument, an "
                                             r"nnx.Rngs.*lambda rngs: MyModel\(\.\.\., rngs=rngs\)"):
        Trainer(_config("unused"), model=lambda: _plain(nnx.Rngs(0)), **kw)
    with pytest.raises(mt.ConfigError, match=r"factory <lambda>\(rngs, cfg\) cannot be called with one argument"):
        Trainer(_config("unused"), model=lambda rngs, cfg: _plain(rngs), **kw)
    with nnx.use_eager_sharding(False):
        built = _plain(nnx.Rngs(0))
    with pytest.raises(mt.ConfigError, match="got a built PlainMLP instance; pass a factory"):
        Trainer(_config("unused"), model=built, **kw)
    with pytest.raises(mt.ConfigError, match="Linen module LinenMLP; wrap it: model=meshtrain.models.from_linen"):
        Trainer(_config("unused"), model=LinenMLP(), **kw)
    with pytest.raises(mt.ConfigError, match="cannot be called with one argument"):
        Trainer(_config("unused"), model=lambda: None)                       # token data path checks too
    # A class whose rngs is keyword-only is called as Model(rngs=rngs).
    t = Trainer(_config("unused"), model=_KeywordOnly, **kw)
    assert isinstance(t.factory(nnx.Rngs(0)), _KeywordOnly)
