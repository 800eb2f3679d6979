"""A Vision Transformer (ViT) image classifier in Flax NNX that speaks logical axis names only.

Patch embedding (a stride-``patch`` convolution written as an einsum over non-overlapping patches;
its kernel is laid out like a conv kernel, ``(patch, patch, channels, d_model)``), a CLS token or
mean pooling, a learned position embedding, pre-LN encoder blocks (non-causal attention, GELU MLP)
stacked on a ``layers`` axis and scanned, a final LayerNorm and a linear classifier head.

Example::

    cfg = get_config("vit-tiny")                       # 8x8x1 digits, 10 classes
    model = ViT(cfg, rngs=nnx.Rngs(0))
    logits_bc = model(images_bhwc)                     # training mode: dropout on
    model.eval(); logits_bc = model(images_bhwc)       # evaluation: dropout off (model.train() undoes)
    logits_bc = model(images_bhwc, deterministic=True) # or per call

Loss (meshtrain's contract, sums + weight): ``vit_loss(model, {"images", "labels"})``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.annotate import constrain
from meshtrain.errors import ConfigError
from meshtrain.models.encoder import (RESIDUAL, EncoderStack, LayerNorm, class_cross_entropy, dense_init,
                                      dropout_key, param, zeros)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shape of a ViT. ``pool`` is ``"cls"`` (a learned CLS token) or ``"mean"`` (mean of patches)."""

    name: str
    image_size: int
    patch_size: int
    channels: int
    num_classes: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int
    dropout: float = 0.0
    pool: str = "cls"
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ConfigError(f"model {self.name!r}: image_size {self.image_size} is not a multiple of "
                              f"patch_size {self.patch_size}")
        if self.pool not in ("cls", "mean"):
            raise ConfigError(f"model {self.name!r}: pool must be 'cls' or 'mean', not {self.pool!r}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + (1 if self.pool == "cls" else 0)

    def num_params(self) -> int:
        d, f, nh = self.d_model, self.d_ff, self.n_heads * self.head_dim
        block = 4 * d * nh + 3 * nh + 2 * d * f + f + 2 * d + 4 * d  # attn (+biases), mlp (+biases), 2 norms
        patch = self.patch_size ** 2 * self.channels * d + d
        return (self.n_layers * block + patch + self.num_tokens * d + (d if self.pool == "cls" else 0)
                + 2 * d + d * self.num_classes + self.num_classes)


def patchify(images_bhwc: jax.Array, patch: int) -> jax.Array:
    """``(B, H, W, C)`` → ``(B, H/p * W/p, p, p, C)``, patches in row-major order."""
    b, h, w, c = images_bhwc.shape
    x = images_bhwc.reshape(b, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch, patch, c)


class ViT(nnx.Module):
    """Images ``(batch, height, width, channels)`` → class logits ``(batch, num_classes)``."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, p = cfg.d_model, cfg.patch_size
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)  # the model's RNG stream (see encoder.py)
        self.patch_ppcd = param(rngs, dense_init((0, 1, 2), 3), (p, p, cfg.channels, d),
                                (None, None, None, "embed"))
        self.patch_bias_d = zeros((d,), ("embed",))
        if cfg.pool == "cls":
            self.cls_d = zeros((d,), ("embed",))
        self.pos_td = param(rngs, jax.nn.initializers.normal(0.02), (cfg.num_tokens, d), (None, "embed"))
        self.encoder = EncoderStack(cfg.n_layers, rngs, d=d, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
                                    d_ff=cfg.d_ff, dropout=cfg.dropout, eps=cfg.norm_eps, pre_ln=True)
        self.final_norm = LayerNorm(d, cfg.norm_eps)
        # The class dimension is left unsharded (None): class counts (10, 1000) rarely divide a mesh axis.
        self.head_dc = param(rngs, dense_init(), (d, cfg.num_classes), ("embed", None))
        self.head_bias_c = zeros((cfg.num_classes,), (None,))

    def __call__(self, images_bhwc: jax.Array, *, deterministic: Optional[bool] = None) -> jax.Array:
        cfg = self.cfg
        expected = (cfg.image_size, cfg.image_size, cfg.channels)
        if images_bhwc.ndim != 4 or tuple(images_bhwc.shape[1:]) != expected:
            raise ConfigError(f"model {cfg.name!r} takes images of shape (batch, {expected[0]}, {expected[1]}, "
                              f"{expected[2]}) (NHWC); got {tuple(images_bhwc.shape)}")
        det, key = dropout_key(self.dropout, deterministic)
        k_embed, k_layers = (None, None) if key is None else tuple(jax.random.split(key))

        patches = patchify(images_bhwc.astype(self.patch_ppcd[...].dtype), cfg.patch_size)
        x_btd = jnp.einsum("bnpqc,pqcd->bnd", patches, self.patch_ppcd[...]) + self.patch_bias_d[...]
        if cfg.pool == "cls":
            cls = jnp.broadcast_to(self.cls_d[...].astype(x_btd.dtype), (x_btd.shape[0], 1, cfg.d_model))
            x_btd = jnp.concatenate([cls, x_btd], axis=1)
        x_btd = constrain(x_btd + self.pos_td[...].astype(x_btd.dtype), RESIDUAL)
        x_btd = self.dropout(x_btd, deterministic=det, rngs=k_embed)

        x_btd = self.encoder(x_btd, deterministic=det, key=k_layers)
        x_btd = self.final_norm(x_btd)
        pooled_bd = x_btd[:, 0] if cfg.pool == "cls" else jnp.mean(x_btd, axis=1)
        logits = pooled_bd @ self.head_dc[...] + self.head_bias_c[...]
        return constrain(logits, ("batch", None))

    # -- pipeline contract (meshtrain.parallel.pipeline): patch embedding, encoder.blocks, pooled head --
    def pipeline_parts(self) -> "PipelineParts":
        """Patch embedding, the ``encoder.blocks`` stack and norm + pooled head, for the pipeline
        schedules (dropout must be off: its per-layer keys do not travel with the micro-batches)."""
        return PipelineParts(stack="encoder.blocks", before=self.pipeline_before, layer=_pipeline_layer,
                             after=self.pipeline_after)

    def pipeline_before(self, images_bhwc: jax.Array, *, deterministic: Optional[bool] = None):
        cfg = self.cfg
        det, _ = dropout_key(self.dropout, deterministic)
        if not det:
            raise ConfigError(f"model {cfg.name!r} has dropout {cfg.dropout} on: a pipeline recipe runs its layer "
                              f"stack without dropout; set dropout=0.0 or pick a recipe without 'pp'")
        patches = patchify(images_bhwc.astype(self.patch_ppcd[...].dtype), cfg.patch_size)
        x_btd = jnp.einsum("bnpqc,pqcd->bnd", patches, self.patch_ppcd[...]) + self.patch_bias_d[...]
        if cfg.pool == "cls":
            cls = jnp.broadcast_to(self.cls_d[...].astype(x_btd.dtype), (x_btd.shape[0], 1, cfg.d_model))
            x_btd = jnp.concatenate([cls, x_btd], axis=1)
        return constrain(x_btd + self.pos_td[...].astype(x_btd.dtype), RESIDUAL), {}

    def pipeline_after(self, x_btd, side):
        x_btd = self.final_norm(x_btd)
        pooled_bd = x_btd[:, 0] if self.cfg.pool == "cls" else jnp.mean(x_btd, axis=1)
        return constrain(pooled_bd @ self.head_dc[...] + self.head_bias_c[...], ("batch", None))


def vit_loss(model: nnx.Module, batch: Dict[str, jax.Array], *, deterministic: Optional[bool] = None
             ) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    """Softmax cross-entropy of ``batch["labels"]`` (``(B,)`` int; < 0 ignored) under
    ``model(batch["images"])``.

    Returns ``(loss_sum, weight, {"accuracy": number correct})``: the loss and every metric are sums
    over this batch's examples and ``weight`` is the number of labelled examples, so the step divides
    all of them by the *global* weight (``accuracy = correct / weight``). Pass
    ``functools.partial(vit_loss, deterministic=True)`` to evaluate without dropout.
    """
    logits = model(batch["images"], deterministic=deterministic)
    return class_cross_entropy(logits, batch["labels"])


def _pipeline_layer(block, x_btd, side):
    return block(x_btd, None, deterministic=True, key=None)


from meshtrain.parallel.pipeline import PipelineParts  # noqa: E402  (appended: the pipeline contract type)
