"""The model zoo beyond the decoder: ViT and BERT (shapes, dropout train/eval, loss contract, logical
axes), the digits and masked-LM data iterators (determinism, resume, per-process rows, masking),
and the Linen adapter (logical axes from Linen boxes and from path rules).

Kept cheap on CPU: models get numpy-drawn parameters (compiling the init program costs seconds per
model; ``abstract_state`` still traces it), and each check group runs under one ``nnx.jit``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.data.mlm import MASK_ID, MLM_VOCAB, MLMBatches
from meshtrain.data.sources import TokenSource
from meshtrain.errors import ConfigError, RulesError
from meshtrain.models import (bert_classification_loss, from_linen, get_config, mlm_loss, model_factory,
                              vit_loss)


def _build(name, seed=0, **overrides):
    """The model with parameters drawn in numpy (N(0, 0.1); LayerNorm scales 1)."""
    factory = model_factory(get_config(name, **overrides))
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(seed))))
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(seed)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.zeros(x.shape, x.dtype)
        if path_str(path).endswith("scale"):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(rng.normal(0.0, 0.1, x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


@pytest.fixture(scope="module")
def vit():
    return _build("vit-tiny")


@pytest.fixture(scope="module")
def bert():
    return _build("bert-tiny")


def _images(b=4):
    return jnp.asarray(np.random.default_rng(0).normal(size=(b, 8, 8, 1)), jnp.float32)


def _ids(b=2, t=16):
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (b, t)), jnp.int32)


@nnx.jit
def _modes(model, x):
    """Two calls in the model's mode, then one with ``deterministic=True`` (one compile)."""
    return model(x), model(x), model(x, deterministic=True)


_call = nnx.jit(lambda model, x: model(x))


# -- ViT -----------------------------------------------------------------------------------------

def test_vit_shapes_dropout_and_eval(vit):
    x = _images()
    vit.train()
    count = int(vit.dropout.rngs.count[...])
    a, b, c = _modes(vit, x)
    assert a.shape == (4, 10) and a.dtype == jnp.float32
    assert not np.allclose(a, b)                                 # a fresh dropout mask per call
    assert int(vit.dropout.rngs.count[...]) == count + 2         # only training calls draw a key
    vit.eval()
    try:
        assert all(m.deterministic for _, m in nnx.iter_modules(vit) if isinstance(m, nnx.Dropout))
        np.testing.assert_allclose(_call(vit, x), c, rtol=1e-6, atol=1e-6)   # == deterministic=True
        np.testing.assert_array_equal(_call(vit, x), _call(vit, x))
    finally:
        vit.train()
    assert vit.dropout.deterministic is False
    assert nnx.view(vit, deterministic=True).dropout.deterministic is True and vit.dropout.deterministic is False


def _shape_of(cfg, x):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: model_factory(cfg)(nnx.Rngs(0))(x))


def test_vit_cls_pool_and_bad_input():
    assert get_config("vit-tiny").num_tokens == 16                       # mean pooling
    cfg = get_config("vit-tiny", pool="cls")
    assert _shape_of(cfg, _images(2)).shape == (2, 10) and cfg.num_tokens == 17
    with pytest.raises(ConfigError, match="8, 8, 1"):
        _shape_of(cfg, jnp.zeros((2, 16, 16, 1)))
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        get_config("vit-tiny", patch_size=3)


def test_vit_abstract_state_axes_and_vit_b16_size():
    a = mt.abstract_state(model_factory("vit-tiny"))
    assert a.param_axes["encoder/blocks/attn/wq_dnh"] == ("layers", "embed", "heads", "head_dim")
    assert a.param_axes["encoder/blocks/mlp/up_df"] == ("layers", "embed", "mlp")
    assert a.param_axes["patch_ppcd"] == (None, None, None, "embed")
    assert a.param_axes["head_dc"] == ("embed", None)
    assert a.num_params == get_config("vit-tiny").num_params()
    key = a.model_state["dropout"]["rngs"]["key"]                        # the model's RNG stream
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    big = mt.abstract_state(model_factory("vit-b16"))
    assert big.num_params == get_config("vit-b16").num_params() == 86_567_656   # published ViT-B/16


@pytest.mark.slow
def test_vit_loss_contract_and_learning(vit):
    """vit_loss returns sums + weight; jitted SGD steps on a digits batch lower the loss and
    gradients reach every parameter."""
    pytest.importorskip("sklearn")
    from meshtrain.data.images import DigitsBatches
    batch = {k: jnp.asarray(v) for k, v in next(DigitsBatches(32, seed=0)).items()}
    batch["labels"] = batch["labels"].at[-1].set(-1)                      # ignored
    graphdef, params, rest = nnx.split(vit, nnx.Param, ...)
    eval_loss = functools.partial(vit_loss, deterministic=True)

    @jax.jit
    def step(params):
        def f(p):
            model = nnx.merge(graphdef, p, rest)
            total, weight, metrics = eval_loss(model, batch)
            return total / weight, (total, weight, metrics, model(batch["images"], deterministic=True))
        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
        return loss, aux, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), grads

    loss0, (total, weight, metrics, logits), params, grads = step(params)
    assert float(weight) == 31.0
    ce = -jax.nn.log_softmax(logits)[jnp.arange(31), batch["labels"][:31]]
    np.testing.assert_allclose(total, ce.sum(), rtol=1e-5)
    assert float(metrics["accuracy"]) == float((jnp.argmax(logits[:31], -1) == batch["labels"][:31]).sum())
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    for _ in range(4):
        loss, _, params, _ = step(params)
    assert float(loss) < float(loss0)


# -- BERT ----------------------------------------------------------------------------------------

def test_bert_shapes_dropout_and_eval(bert):
    ids = _ids()
    bert.train()
    a, b, c = _modes(bert, ids)
    assert a.shape == (2, 16, get_config("bert-tiny").vocab_size) and MLM_VOCAB <= a.shape[-1]
    assert not np.allclose(a, b)
    bert.eval()
    try:
        np.testing.assert_allclose(_call(bert, ids), c, rtol=1e-6, atol=1e-6)
    finally:
        bert.train()
    with pytest.raises(ConfigError, match="max_positions"):
        nnx.eval_shape(lambda: bert(jnp.zeros((1, 300), jnp.int32)))


@nnx.jit
def _bert_checks(model, ids, targets, seg, pos):
    mlm = mlm_loss(model, {"input_ids": ids, "targets": targets}, deterministic=True)
    logits = model(ids, deterministic=True)
    cls = bert_classification_loss(model, {"input_ids": ids, "labels": jnp.array([0, 1])}, deterministic=True)
    packed = model(ids[:1, :8], pos, seg, deterministic=True)
    alone = model(ids[:1, :4], deterministic=True)
    return mlm, logits, cls, packed, alone


def test_bert_losses_classify_and_segments(bert):
    ids = _ids()
    targets = jnp.full((2, 16), -1, jnp.int32).at[0, 3].set(7).at[1, 5].set(9).at[1, 6].set(1)
    seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    (loss, weight, metrics), logits, cls, packed, alone = _bert_checks(bert, ids, targets, seg, pos)
    assert float(weight) == 3.0 and 0.0 <= float(metrics["accuracy"]) <= 3.0       # masked tokens only
    logp = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(loss, -(logp[0, 3, 7] + logp[1, 5, 9] + logp[1, 6, 1]), rtol=1e-5)
    assert float(cls[1]) == 2.0 and 0.0 <= float(cls[2]["accuracy"]) <= 2.0
    np.testing.assert_allclose(packed[:, :4], alone, rtol=1e-5, atol=1e-5)         # no attention across


def test_bert_axes_tied_embedding_and_distilbert_size():
    a = mt.abstract_state(model_factory("bert-tiny"))
    assert a.param_axes["tok_vd"] == ("vocab", "embed")
    assert a.param_axes["mlm_bias_v"] == ("vocab",)
    assert a.param_axes["encoder/blocks/attn/wo_nhd"] == ("layers", "heads", "head_dim", "embed")
    assert not any(p.startswith("lm_head") for p in a.param_axes)       # MLM output is the embedding
    cfg = get_config("distilbert-base")
    big = mt.abstract_state(model_factory(cfg))
    d = cfg.d_model
    heads = (d * d + 3 * d + cfg.vocab_size) + (d * d + d + d * cfg.num_labels + cfg.num_labels)
    assert big.num_params == cfg.num_params()
    assert big.num_params - heads == 66_362_880                           # published DistilBERT base


@pytest.mark.parametrize("recipe", ["fsdp", "fsdp_tp_sp", "tp"])
def test_encoders_plan_on_8_devices(recipe):
    """Every logical name the encoders use is mapped, and the tiny configs divide an 8-device mesh.
    (Pure TP keeps `embed`-only weights whole: position tables, d x d heads, norms; 4 % of vit-tiny
    and 18 % of bert-tiny, over the 2 % guard meant for real sizes, so that case lifts the guard.)"""
    recipe = mt.get_recipe(recipe)
    if recipe.name == "tp":
        recipe = recipe.with_options(max_replicated_fraction=1.0)
    mesh = recipe.mesh.build(jax.devices()[:8])
    images = {"images": jax.ShapeDtypeStruct((16, 8, 8, 1), jnp.float32),
              "labels": jax.ShapeDtypeStruct((16,), jnp.int32)}
    tokens = {k: jax.ShapeDtypeStruct((16, 32), jnp.int32) for k in ("input_ids", "targets", "segment_ids")}
    for name, batch in (("vit-tiny", images), ("bert-tiny", tokens)):
        plan = mt.make_plan(mt.abstract_state(model_factory(name)), recipe, mesh, batch=batch)
        assert plan.mesh is mesh


# -- data ----------------------------------------------------------------------------------------

def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(xs, ys):
    for x, y in zip(xs, ys, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_digits_batches_deterministic_resumable_per_process():
    pytest.importorskip("sklearn")
    from meshtrain.data.images import DigitsBatches
    it = DigitsBatches(64, seed=3)
    first = next(it)
    assert first["images"].shape == (64, 8, 8, 1) and first["images"].dtype == np.float32
    assert first["labels"].dtype == np.int32 and set(np.unique(first["labels"])) <= set(range(10))
    assert it.num_examples + DigitsBatches(8, split="val").num_examples == 1797
    state = it.state()
    rest = _take(it, 30)                                       # crosses epochs (1438 train examples)
    again = DigitsBatches(64, seed=3)
    again.restore(state)
    _same(rest, _take(again, 30))
    _same([first], [next(DigitsBatches(64, seed=3))])
    assert not np.array_equal(first["labels"], next(DigitsBatches(64, seed=4))["labels"])
    halves = [next(DigitsBatches(64, seed=3, process_index=i, process_count=2)) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["labels"] for h in halves]), first["labels"])
    with pytest.raises(ConfigError, match="seed"):
        DigitsBatches(64, seed=5).restore(state)


def _source(n=20_000):
    toks = np.random.default_rng(0).integers(0, 256, n).astype(np.uint16)
    return TokenSource("rand", toks, np.array([0, n // 3], np.int64), 256, "test-rand")


def test_mlm_masking_rate_and_targets():
    src = _source()
    batch = next(MLMBatches(src, 16, 100, seed=0))
    assert set(batch) == {"input_ids", "targets", "positions", "segment_ids"}
    assert all(v.shape == (16, 100) and v.dtype == np.int32 for v in batch.values())
    masked = batch["targets"] >= 0
    assert (masked.sum(axis=1) == 15).all()                              # 15 % of every row
    assert (batch["targets"][~masked] == -1).all()
    ids, tgt = batch["input_ids"], batch["targets"]
    frac_mask = (ids[masked] == MASK_ID).mean()
    frac_same = (ids[masked] == tgt[masked]).mean()
    assert 0.7 < frac_mask < 0.9 and 0.03 < frac_same < 0.2             # 80 / 10 / 10 (240 samples)
    assert (ids < MLM_VOCAB).all() and (ids[~masked] < 256).all()


def test_mlm_batches_deterministic_resumable_per_process():
    src = _source()
    it = MLMBatches(src, 8, 64, seed=1)
    first = _take(it, 2)
    state = it.state()
    rest = _take(it, 3)
    again = MLMBatches(src, 8, 64, seed=1)
    _same(first, _take(again, 2))
    fresh = MLMBatches(src, 8, 64, seed=1)
    fresh.restore(state)
    _same(rest, _take(fresh, 3))
    parts = [next(MLMBatches(src, 8, 64, seed=1, process_index=i, process_count=4)) for i in range(4)]
    _same([{k: np.concatenate([p[k] for p in parts]) for k in parts[0]}], first[:1])
    with pytest.raises(ConfigError, match="not divisible"):
        MLMBatches(src, 6, 64, process_count=4)


# -- Linen adapter -------------------------------------------------------------------------------

class _AnnotatedMLP(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = False):
        lp = nn.with_logical_partitioning
        h = nn.Dense(16, kernel_init=lp(nn.initializers.normal(0.1), ("embed", "mlp")),
                     bias_init=lp(nn.initializers.zeros, ("mlp",)))(x)
        h = nn.Dropout(0.5, deterministic=deterministic)(nn.relu(h))
        return nn.Dense(8, kernel_init=lp(nn.initializers.normal(0.1), ("mlp", "embed")),
                        bias_init=lp(nn.initializers.zeros, ("embed",)))(h)


class _PlainMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


def test_linen_adapter_keeps_logical_axes():
    factory = from_linen(_AnnotatedMLP(), jax.ShapeDtypeStruct((2, 8), jnp.float32))
    a = mt.abstract_state(factory)
    assert a.param_axes == {"Dense_0/kernel": ("embed", "mlp"), "Dense_0/bias": ("mlp",),
                            "Dense_1/kernel": ("mlp", "embed"), "Dense_1/bias": ("embed",)}
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(a.model_state))
    model = factory(nnx.Rngs(0))
    x = jnp.ones((2, 8))
    assert model(x).shape == (2, 8)
    assert not np.allclose(model(x), model(x))                           # Linen dropout gets fresh keys
    np.testing.assert_array_equal(model(x, deterministic=True), model(x, deterministic=True))


def test_linen_adapter_path_rules():
    rules = mt.PathRules([(r"Dense_0/kernel", ("embed", "mlp")), (r"Dense_1/kernel", ("mlp", "embed")),
                          (r".*bias", (None,))])
    factory = from_linen(_PlainMLP(), jnp.zeros((1, 8)), rules=rules)
    a = mt.abstract_state(factory)
    assert a.param_axes["Dense_1/kernel"] == ("mlp", "embed") and a.param_axes["Dense_0/bias"] == (None,)
    assert factory(nnx.Rngs(1))(jnp.ones((3, 8))).shape == (3, 8)
    with pytest.raises(RulesError, match="without logical axes"):
        mt.abstract_state(from_linen(_PlainMLP(), jnp.zeros((1, 8))))
    bad = mt.PathRules([(r".*", ("embed", "mlp", "heads"))])  # more names than dimensions (fewer: trailing unsharded)
    with pytest.raises(RulesError, match="Dense_0/kernel"):
        mt.abstract_state(from_linen(_PlainMLP(), jnp.zeros((1, 8)), rules=bad))
