"""Choosing the next token: greedy, temperature, top-k and top-p (nucleus), seeded.

The log-probability reported for a token is always the model's (``log_softmax`` of the raw logits),
before temperature, top-k and top-p reshape the distribution it is drawn from.

Example::

    s = Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1)
    tokens_b = choose(logits_bv, s.key(step), s)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy (argmax; top-k / top-p then change nothing). ``top_k`` 0: off.
    ``top_p`` 1.0: off. ``seed`` seeds the draws; the same seed, prompts and batch give the same tokens."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError(f"--temperature {self.temperature}: use a number >= 0 (0: greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: use an integer >= 0 (0: off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"--top-p {self.top_p}: use a number in (0, 1] (1: off)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 32:
            # the compiled steps make the key from a uint32 seed (no host dispatch per generation)
            raise ConfigError(f"--seed {self.seed}: use an integer in 0 .. {2 ** 32 - 1}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def key(self, step):
        """The key of decode step ``step`` (0: the token chosen from the prefill's last logits); the
        compiled loop makes the same keys from the seed inside the program."""
        return jax.random.fold_in(jax.random.key(self.seed), step)


def token_logprobs(logits_btv, tokens_bt):
    """``log p(tokens[b, t])`` under ``logits[b, t]`` (f32)."""
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens_bt[..., None], axis=-1)[..., 0]


def choose_with_logprobs(logits_bv, key, sampling: Sampling):
    """``(tokens_b, logprobs_b)``: :func:`choose`'s tokens and :func:`token_logprobs` of them. Greedy takes the
    log-probability from the argmax's own pass: at the maximum ``log_softmax`` is ``-log(sum(exp(l - max)))``
    (the same arithmetic, without a second pass over the vocabulary and a gather: fewer kernels per decode step)."""
    if not sampling.greedy:
        tokens_b = choose(logits_bv, key, sampling)
        return tokens_b, token_logprobs(logits_bv, tokens_b)
    logits = logits_bv.astype(jnp.float32)
    top_b = jnp.max(logits, axis=-1)
    return (jnp.argmax(logits, axis=-1).astype(jnp.int32),
            -jnp.log(jnp.sum(jnp.exp(logits - top_b[:, None]), axis=-1)))


def choose(logits_bv, key, sampling: Sampling):
    """The next token of each row (int32 ``(batch,)``) under ``sampling`` (static: one compile each)."""
    logits = logits_bv.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        # keep the smallest set of most likely tokens whose probability reaches top_p (the first always)
        sorted_bv = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_bv, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        kept = jnp.where(before < sampling.top_p, sorted_bv, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
