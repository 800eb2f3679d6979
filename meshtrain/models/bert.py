"""A BERT-style bidirectional encoder in Flax NNX that speaks logical axis names only.

Token + learned position embeddings (LayerNorm, dropout), encoder blocks (post-LN as in BERT, or
pre-LN with a final LayerNorm), a masked-LM head tied to the token embedding (dense → GELU →
LayerNorm → embedding transpose + bias) and a sequence-classification head on the first ([CLS])
position (tanh pooler → dropout → linear). No token-type (sentence A/B) embeddings: DistilBERT has
none and meshtrain's MLM data does not use them.

``segment_ids`` follows meshtrain's meaning (packed documents, as in :mod:`meshtrain.data.packing`):
a token attends only to tokens with the same id. To keep padding out, give padding its own id.

Example::

    cfg = get_config("bert-tiny")                # bytes + [PAD] [CLS] [SEP] [MASK], padded to 264
    model = Bert(cfg, rngs=nnx.Rngs(0))
    logits_btv = model(input_ids_bt)             # masked-LM logits; training mode (dropout on)
    scores_bl = model.classify(input_ids_bt)     # (batch, num_labels) from position 0
    model.eval()                                 # dropout off; model.train() turns it back on

Losses (meshtrain's contract, sums + weight): :func:`mlm_loss`, :func:`bert_classification_loss`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshtrain.annotate import constrain
from meshtrain.errors import ConfigError
from meshtrain.models.encoder import (RESIDUAL, EncoderStack, LayerNorm, class_cross_entropy, dense_init,
                                      dropout_key, param, zeros)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT encoder. ``pre_ln=False`` is the original post-LN BERT / DistilBERT."""

    name: str
    vocab_size: int
    max_positions: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int
    num_labels: int = 2
    dropout: float = 0.1
    pre_ln: bool = False
    norm_eps: float = 1e-12

    def num_params(self) -> int:
        d, f, nh = self.d_model, self.d_ff, self.n_heads * self.head_dim
        block = 4 * d * nh + 3 * nh + 2 * d * f + f + 2 * d + 4 * d
        emb = self.vocab_size * d + self.max_positions * d + 2 * d
        mlm = d * d + d + 2 * d + self.vocab_size
        cls = d * d + d + d * self.num_labels + self.num_labels
        return self.n_layers * block + emb + mlm + cls + (2 * d if self.pre_ln else 0)


class Bert(nnx.Module):
    """Token ids ``(batch, seq)`` → masked-LM logits ``(batch, seq, vocab)`` (``__call__``) or
    class logits ``(batch, num_labels)`` (:meth:`classify`)."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)  # the model's RNG stream (see encoder.py)
        normal = jax.nn.initializers.normal(0.02)
        self.tok_vd = param(rngs, normal, (cfg.vocab_size, d), ("vocab", "embed"))
        self.pos_pd = param(rngs, normal, (cfg.max_positions, d), (None, "embed"))
        self.emb_norm = LayerNorm(d, cfg.norm_eps)
        self.encoder = EncoderStack(cfg.n_layers, rngs, d=d, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
                                    d_ff=cfg.d_ff, dropout=cfg.dropout, eps=cfg.norm_eps, pre_ln=cfg.pre_ln)
        if cfg.pre_ln:
            self.final_norm = LayerNorm(d, cfg.norm_eps)
        # d x d weights: one side named `embed`, the other unsharded (a mesh axis cannot shard both).
        self.mlm_dense_dd = param(rngs, dense_init(), (d, d), ("embed", None))
        self.mlm_dense_bias_d = zeros((d,), ("embed",))
        self.mlm_norm = LayerNorm(d, cfg.norm_eps)
        self.mlm_bias_v = zeros((cfg.vocab_size,), ("vocab",))
        self.pooler_dd = param(rngs, dense_init(), (d, d), ("embed", None))
        self.pooler_bias_d = zeros((d,), ("embed",))
        self.classifier_dl = param(rngs, dense_init(), (d, cfg.num_labels), ("embed", None))
        self.classifier_bias_l = zeros((cfg.num_labels,), (None,))

    def _check(self, input_ids_bt):
        cfg = self.cfg
        if input_ids_bt.ndim != 2:
            raise ConfigError(f"model {cfg.name!r} takes token ids of shape (batch, seq); got "
                              f"{tuple(input_ids_bt.shape)}")
        if input_ids_bt.shape[1] > cfg.max_positions:
            raise ConfigError(f"sequence length {input_ids_bt.shape[1]} exceeds max_positions "
                              f"{cfg.max_positions} of model {cfg.name!r}")

    def _encode(self, input_ids_bt, positions_bt, segment_ids_bt, det: bool, key):
        cfg = self.cfg
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(input_ids_bt.shape[1]), input_ids_bt.shape)
        k_embed, k_layers = (None, None) if key is None else tuple(jax.random.split(key))
        x_btd = jnp.take(self.tok_vd[...], input_ids_bt, axis=0) + jnp.take(self.pos_pd[...], positions_bt, axis=0)
        x_btd = constrain(self.emb_norm(x_btd), RESIDUAL)
        x_btd = self.dropout(x_btd, deterministic=det, rngs=k_embed)
        x_btd = self.encoder(x_btd, segment_ids_bt, deterministic=det, key=k_layers)
        return self.final_norm(x_btd) if cfg.pre_ln else x_btd

    def encode(self, input_ids_bt, positions_bt=None, segment_ids_bt=None, *,
               deterministic: Optional[bool] = None) -> jax.Array:
        """Hidden states ``(batch, seq, d_model)``."""
        self._check(input_ids_bt)
        det, key = dropout_key(self.dropout, deterministic)
        return self._encode(input_ids_bt, positions_bt, segment_ids_bt, det, key)

    def __call__(self, input_ids_bt, positions_bt=None, segment_ids_bt=None, *,
                 deterministic: Optional[bool] = None) -> jax.Array:
        """Masked-LM logits ``(batch, seq, vocab)``; the output matrix is the token embedding."""
        h_btd = self.encode(input_ids_bt, positions_bt, segment_ids_bt, deterministic=deterministic)
        h_btd = jax.nn.gelu(h_btd @ self.mlm_dense_dd[...] + self.mlm_dense_bias_d[...])
        h_btd = self.mlm_norm(h_btd)
        logits = jnp.einsum("btd,vd->btv", h_btd, self.tok_vd[...]) + self.mlm_bias_v[...]
        return constrain(logits, ("batch", "seq", "vocab"))

    def classify(self, input_ids_bt, positions_bt=None, segment_ids_bt=None, *,
                 deterministic: Optional[bool] = None) -> jax.Array:
        """Class logits ``(batch, num_labels)`` from the first position (the [CLS] token)."""
        self._check(input_ids_bt)
        det, key = dropout_key(self.dropout, deterministic)
        k_enc, k_cls = (None, None) if key is None else tuple(jax.random.split(key))
        h_btd = self._encode(input_ids_bt, positions_bt, segment_ids_bt, det, k_enc)
        pooled_bd = jnp.tanh(h_btd[:, 0] @ self.pooler_dd[...] + self.pooler_bias_d[...])
        pooled_bd = self.dropout(pooled_bd, deterministic=det, rngs=k_cls)
        return constrain(pooled_bd @ self.classifier_dl[...] + self.classifier_bias_l[...], ("batch", None))

    # -- pipeline contract (meshtrain.parallel.pipeline): embeddings, encoder.blocks, MLM head ----------
    def pipeline_parts(self) -> "PipelineParts":
        """Embeddings, the ``encoder.blocks`` stack and the masked-LM head (``__call__``; ``classify``
        is not pipelined), for the pipeline schedules; dropout must be off."""
        return PipelineParts(stack="encoder.blocks", before=self.pipeline_before, layer=_pipeline_layer,
                             after=self.pipeline_after)

    def pipeline_before(self, input_ids_bt, positions_bt=None, segment_ids_bt=None, *,
                        deterministic: Optional[bool] = None):
        self._check(input_ids_bt)
        det, _ = dropout_key(self.dropout, deterministic)
        if not det:
            raise ConfigError(f"model {self.cfg.name!r} has dropout {self.cfg.dropout} on: a pipeline recipe runs its "
                              f"layer stack without dropout; set dropout=0.0 or pick a recipe without 'pp'")
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(input_ids_bt.shape[1]), input_ids_bt.shape)
        x_btd = jnp.take(self.tok_vd[...], input_ids_bt, axis=0) + jnp.take(self.pos_pd[...], positions_bt, axis=0)
        return constrain(self.emb_norm(x_btd), RESIDUAL), {"segment_ids": segment_ids_bt}

    def pipeline_after(self, x_btd, side):
        h_btd = self.final_norm(x_btd) if self.cfg.pre_ln else x_btd
        h_btd = jax.nn.gelu(h_btd @ self.mlm_dense_dd[...] + self.mlm_dense_bias_d[...])
        h_btd = self.mlm_norm(h_btd)
        logits = jnp.einsum("btd,vd->btv", h_btd, self.tok_vd[...]) + self.mlm_bias_v[...]
        return constrain(logits, ("batch", "seq", "vocab"))


def mlm_loss(model: nnx.Module, batch: Dict[str, jax.Array], *, deterministic: Optional[bool] = None
             ) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    """Masked-LM cross-entropy on the masked positions only.

    ``batch``: ``input_ids`` ``(B, T)`` with masks applied, ``targets`` ``(B, T)`` (the original
    token where masked, ``-1`` elsewhere), optional ``positions`` and ``segment_ids``.
    Returns ``(loss_sum, weight, {"accuracy": masked tokens predicted right})``: sums over this
    batch, ``weight`` = number of masked tokens, so the step divides loss and metrics by the global
    weight (``masked accuracy = correct / weight``).
    """
    logits = model(batch["input_ids"], batch.get("positions"), batch.get("segment_ids"),
                   deterministic=deterministic).astype(jnp.float32)
    targets = batch["targets"]
    mask = (targets >= 0).astype(jnp.float32)
    labels = jnp.maximum(targets, 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask), {"accuracy": jnp.sum(correct * mask)}


def bert_classification_loss(model: nnx.Module, batch: Dict[str, jax.Array], *,
                             deterministic: Optional[bool] = None
                             ) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    """Cross-entropy of ``batch["labels"]`` ``(B,)`` under ``model.classify(batch["input_ids"], ...)``.
    Returns sums and a weight (labelled examples) like :func:`mlm_loss`."""
    logits = model.classify(batch["input_ids"], batch.get("positions"), batch.get("segment_ids"),
                            deterministic=deterministic)
    return class_cross_entropy(logits, batch["labels"])


def _pipeline_layer(block, x_btd, side):
    return block(x_btd, side["segment_ids"], deterministic=True, key=None)


from meshtrain.parallel.pipeline import PipelineParts  # noqa: E402  (appended: the pipeline contract type)
