"""The server's KV cache: ``slots`` rows of ``context`` tokens each, one request per row, on the plan.

A request **joins** by its prefill: its prompt runs through the model in a one-row cache (the prompt
right-padded to a power-of-two *bucket*, so a few programs serve every prompt length; a real token
never sees the padding after it), its first token is chosen from the logits of its last real token,
and the row's keys and values are copied into its slot. It **leaves** by being forgotten: nothing is
cleared, the next occupant's prefill overwrites the slot and the mask hides what lies past each
row's length.

One **decode step** feeds every slot its last token: row ``b`` writes at its own cache slot
``index[b]`` (its length so far; :func:`meshtrain.models.decoder.write_cache`) and sees the slots
``0 .. index[b]`` (:func:`meshtrain.generation.loop.cache_mask` with a per-row index). Free slots
compute too (the batch moves together) and their tokens are dropped. The caller (the scheduler)
keeps each row's length and sampling settings on the host and passes them every step, so joining
and leaving between steps is a host-side bookkeeping change, never a recompile.

The weights, the cache layout and the activations are the generation engine's
(:class:`~meshtrain.generation.engine.Engine`): the plan's shardings, the stored format (int8, bf16)
and the layers one array each.

Sampling is per row (:func:`choose_rows`): temperature 0 is greedy; otherwise temperature and top-p,
drawn with ``fold_in(key(seed), step)`` (the key :meth:`Sampling.key` makes for the same seed and step).

Example::

    slots = Slots(engine, n_slots=8, context=2048)
    token, logprob = slots.admit(0, prompt_ids, RowSampling(temperature=0.0))
    tokens_b, logprobs_b = slots.step(last_tokens_b, lengths_b, sampling_b)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.generation.engine import Engine
from meshtrain.generation.loop import LayerCache, empty_layer_cache
from meshtrain.generation.sampling import token_logprobs

#: the shortest prefill bucket: shorter prompts share one program
MIN_BUCKET = 16
#: the fewest cache positions a decode step reads (:meth:`Slots.span_for`)
MIN_SPAN = 32
#: the most decode steps one program runs (:meth:`Slots.decode`); the scheduler runs several only while
#: nobody waits for a slot (a request joins between programs)
MAX_STEPS = 8
#: the most requests one prefill program takes (:meth:`Slots.admit_many`): those waiting join together
MAX_JOIN = 16


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """One request's sampling: ``temperature`` 0 greedy; ``top_p`` 1 off; ``seed`` the draws' seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Every slot's sampling settings as arrays (``(slots,)`` each), and each row's step number
    (0: the prefill's token), which picks its key."""

    temperature_b: np.ndarray
    top_p_b: np.ndarray
    seed_b: np.ndarray
    step_b: np.ndarray

    @classmethod
    def empty(cls, n: int) -> "SamplingRows":
        return cls(np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.uint32), np.zeros(n, np.int32))

    def set(self, b: int, s: RowSampling, step: int = 0) -> None:
        self.temperature_b[b], self.top_p_b[b], self.seed_b[b], self.step_b[b] = s.temperature, s.top_p, s.seed, step


def choose_rows(logits_bv, temperature_b, top_p_b, seed_b, step_b):
    """The next token of each row (int32 ``(batch,)``), each under its own settings: greedy where the
    temperature is 0, else temperature and top-p (the smallest set of most likely tokens whose
    probability reaches ``top_p``, the first always kept), drawn with ``fold_in(key(seed), step)``.
    The draws (a sort of the vocabulary per row for top-p) run only when some row samples: ``lax.cond``
    skips them at run time for an all-greedy batch (at 64 rows they cost more than the tiny model's step)."""
    logits = logits_bv.astype(jnp.float32)
    greedy_b = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def top_p(scaled):
        sorted_bv = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_bv, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        threshold = jnp.min(jnp.where(before < top_p_b[:, None], sorted_bv, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(scaled < threshold, -jnp.inf, scaled)

    def sample():
        scaled = logits / jnp.maximum(temperature_b, 1e-6)[:, None]
        masked = jax.lax.cond(jnp.any(top_p_b < 1), top_p, lambda x: x, scaled)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_b, step_b)
        drawn_b = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(temperature_b > 0, drawn_b, greedy_b)

    return jax.lax.cond(jnp.any(temperature_b > 0), sample, lambda: greedy_b)


def join_rows(joining: int) -> int:
    """The rows of a prefill program for ``joining`` requests: the next power of 4 (1, 4, 16), so a few
    programs serve every number that join together."""
    rows = 1
    while rows < joining:
        rows *= 4
    return rows


def prefill_bucket(length: int, context: int) -> int:
    """The padded prefill length of a ``length``-token prompt: the next power of two from
    :data:`MIN_BUCKET`, at most ``context``."""
    bucket = MIN_BUCKET
    while bucket < length:
        bucket *= 2
    return min(bucket, context)


class Slots:
    """The slotted cache of ``engine``'s model and its two compiled programs (module docstring).
    ``n_slots`` is rounded up to a multiple of the plan's data-parallel size (:attr:`n`); ``context``:
    tokens per slot (at most the model's ``max_seq_len``)."""

    def __init__(self, engine: Engine, n_slots: int, context: int):
        if not engine.layered:
            raise ConfigError("serving keeps the layer weights on the devices: drop --offload-weights "
                              "(generation.weight_memory: device)")
        if not 1 <= context <= engine.cfg.max_seq_len:
            raise ConfigError(f"serve.context {context}: give 1 .. {engine.cfg.max_seq_len} (max_seq_len of model "
                              f"{engine.cfg.name!r})")
        self.engine, self.context = engine, context
        self.n = engine.padded_batch(n_slots)
        cache = empty_layer_cache(engine.cfg, engine.plan, np.zeros(self.n, np.int32), context, engine.compute_dtype)
        self.k, self.v = cache.k, cache.v
        self._admit: Dict[Tuple[int, int], object] = {}
        self._decode: Dict[int, object] = {}

    # -- the two programs -----------------------------------------------------------------------------
    def _admit_fn(self, params, tokens_bt, length_b, slot_k, slot_v, slot_b, sampling):
        # the rows' prefill in a zero cache of their bucket (made here: no transfers), then each row's
        # bucket of keys and values scattered into its slot (a padding row's slot is past the end: dropped)
        rows, bucket = tokens_bt.shape
        zeros = tuple(jnp.zeros((rows, bucket) + k.shape[2:], self.engine.compute_dtype) for k in slot_k)
        index = jnp.zeros((), jnp.int32)
        logits_btv, row = self.engine._forward(params, tokens_bt, LayerCache(zeros, zeros, index,
                                                                             jnp.zeros(rows, jnp.int32)))
        last_bv = jnp.take_along_axis(logits_btv, (length_b - 1)[:, None, None], axis=1)[:, 0]
        token_b = choose_rows(last_bv, *sampling)
        k = tuple(s.at[slot_b, :bucket].set(r.astype(s.dtype), mode="drop") for s, r in zip(slot_k, row.k))
        v = tuple(s.at[slot_b, :bucket].set(r.astype(s.dtype), mode="drop") for s, r in zip(slot_v, row.v))
        return token_b, token_logprobs(last_bv, token_b), k, v

    def _decode_fn(self, params, tokens_b, index_b, steps, slot_k, slot_v, sampling, *, rows: int, span: int):
        # Only the first `rows` slots and their first `span` cache positions run (the scheduler fills the
        # lowest free slot first; `span` covers every running row's last write): a step reads rows x span
        # of the cache, not the whole of it. Up to MAX_STEPS steps run in one program (`steps` of them, a
        # run-time count: one program for every count), each feeding the token the last one chose; only
        # the positions written are scattered back into the full cache (donated: in place).
        full = rows == self.n and span == self.context
        part_k, part_v = (kv if full else tuple(x[:rows, :span] for x in kv) for kv in (slot_k, slot_v))
        temperature_b, top_p_b, seed_b, step_b = sampling
        out_kb = jnp.zeros((MAX_STEPS, rows), jnp.int32)

        def one_step(j, carry):
            token_b, k, v, out_tokens_kb, out_logprobs_kb = carry
            cache = LayerCache(k, v, index_b + j, jnp.zeros_like(index_b))
            logits_btv, cache = self.engine._forward(params, token_b[:, None], cache)
            token_b = choose_rows(logits_btv[:, 0], temperature_b, top_p_b, seed_b, step_b + j)
            logprob_b = token_logprobs(logits_btv[:, 0], token_b)
            return (token_b, cache.k, cache.v, out_tokens_kb.at[j].set(token_b), out_logprobs_kb.at[j].set(logprob_b))

        carry = (tokens_b, part_k, part_v, out_kb, jnp.zeros((MAX_STEPS, rows), jnp.float32))
        _, part_k, part_v, tokens_kb, logprobs_kb = jax.lax.fori_loop(0, steps, one_step, carry)
        if full:
            return tokens_kb, logprobs_kb, part_k, part_v
        # the written positions index_b .. index_b + steps - 1 of each row; the rest go past the end (dropped)
        at_bk = index_b[:, None] + jnp.arange(MAX_STEPS, dtype=jnp.int32)[None, :]
        written_bk = (at_bk < index_b[:, None] + steps) & (at_bk < span)
        read_bk = jnp.minimum(at_bk, span - 1)
        to_bk = jnp.where(written_bk, at_bk, self.context)
        rows_bk = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], at_bk.shape)

        def put_back(whole_bskh, part_bskh):
            new_bkkh = jnp.take_along_axis(part_bskh, read_bk[:, :, None, None], axis=1)
            return whole_bskh.at[rows_bk, to_bk].set(new_bkkh.astype(whole_bskh.dtype), mode="drop")

        slot_k = tuple(put_back(w, p) for w, p in zip(slot_k, part_k))
        slot_v = tuple(put_back(w, p) for w, p in zip(slot_v, part_v))
        return tokens_kb, logprobs_kb, slot_k, slot_v

    def rows_for(self, used: int) -> int:
        """The rows a decode step runs when the slots ``< used`` may be busy: the next power of two (a
        multiple of the data-parallel size), at most :attr:`n`: a few programs, and a lightly loaded server
        does not pay for its empty slots."""
        rows = 1
        while rows < used:
            rows *= 2
        return min(self.n, self.engine.padded_batch(rows))

    def span_for(self, end: int) -> int:
        """The cache positions a decode step reads when no row writes at ``end`` or past it: the next power
        of two from :data:`MIN_SPAN`, at most :attr:`context` (attention over a row's 40 tokens should not
        read all 2048 of its slot)."""
        span = MIN_SPAN
        while span < end:
            span *= 2
        return min(span, self.context)

    # -- joining and stepping ---------------------------------------------------------------------------
    def admit(self, slot: int, prompt_ids: Sequence[int], sampling: RowSampling) -> Tuple[int, float]:
        """Prefill ``prompt_ids`` into slot ``slot`` (:meth:`admit_many` of one)."""
        tokens, logprobs = self.admit_many([(slot, prompt_ids, sampling)])
        return tokens[0], logprobs[0]

    def admit_many(self, joins: Sequence[Tuple[int, Sequence[int], RowSampling]]) -> Tuple[List[int], List[float]]:
        """Prefill each ``(slot, prompt_ids, sampling)`` of ``joins`` into its slot, :data:`MAX_JOIN` at a
        time in one program (their prompts padded to the longest one's bucket); the first new token of
        each and its log-probability. A row's length is then ``len(prompt_ids)``; the caller checks that
        it fits :attr:`context`."""
        tokens: List[int] = []
        logprobs: List[float] = []
        for start in range(0, len(joins), MAX_JOIN):
            group = joins[start:start + MAX_JOIN]
            for _, ids, _ in group:
                if not 1 <= len(ids) <= self.context:
                    raise ConfigError(f"a prompt of {len(ids)} tokens does not fit a slot of {self.context}")
            bucket = prefill_bucket(max(len(ids) for _, ids, _ in group), self.context)
            rows = self.engine.padded_batch(join_rows(len(group)))  # padding rows: token 0, slot past the end
            tokens_bt = np.zeros((rows, bucket), np.int32)
            lengths_b, slot_b, sampling = np.ones(rows, np.int32), np.full(rows, self.n, np.int32), SamplingRows.empty(rows)
            for b, (slot, ids, row_sampling) in enumerate(group):
                tokens_bt[b, :len(ids)], lengths_b[b], slot_b[b] = ids, len(ids), slot
                sampling.set(b, row_sampling)
            if (rows, bucket) not in self._admit:
                self._admit[(rows, bucket)] = jax.jit(self._admit_fn, donate_argnums=(3, 4))
            token_b, logprob_b, self.k, self.v = self._admit[(rows, bucket)](
                self.engine.params, tokens_bt, lengths_b, self.k, self.v, slot_b, _arrays(sampling))
            token_b, logprob_b = jax.device_get((token_b, logprob_b))  # one transfer for both
            tokens += [int(t) for t in token_b[:len(group)]]
            logprobs += [float(x) for x in logprob_b[:len(group)]]
        return tokens, logprobs

    def step(self, tokens_b: np.ndarray, index_b: np.ndarray, sampling: SamplingRows,
             used: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """One decode step of the slots ``< used`` (:meth:`decode` with ``steps=1``): the next token and its
        log-probability of each row run."""
        tokens_kb, logprobs_kb = self.decode(tokens_b, index_b, sampling, used)
        return tokens_kb[0], logprobs_kb[0]

    def decode(self, tokens_b: np.ndarray, index_b: np.ndarray, sampling: SamplingRows,
               used: Optional[int] = None, steps: int = 1) -> Tuple[np.ndarray, np.ndarray]:
        """``steps`` decode steps (1 .. :data:`MAX_STEPS`) of the slots ``< used`` (default: all;
        :meth:`rows_for` rounds it up) in one program: row ``b`` feeds ``tokens_b[b]`` at cache slot
        ``index_b[b]`` (its length so far), then each token it chose. Returns the tokens and their
        log-probabilities, ``(steps, rows)`` host arrays. The caller keeps every busy row's
        ``index_b[b] + steps`` within :attr:`context` (an idle row's index may be anything)."""
        if not 1 <= steps <= MAX_STEPS:
            raise ConfigError(f"{steps} decode steps in one program: give 1 .. {MAX_STEPS}")
        rows = self.rows_for(self.n if used is None else used)
        index_b = np.asarray(index_b[:rows], np.int32)
        span = self.span_for(int(index_b.max()) + steps)
        key = (rows, span)
        if key not in self._decode:
            self._decode[key] = jax.jit(functools.partial(self._decode_fn, rows=rows, span=span),
                                        donate_argnums=(4, 5))
        tokens_kb, logprobs_kb, self.k, self.v = self._decode[key](
            self.engine.params, tokens_b[:rows].astype(np.int32), np.minimum(index_b, span - 1), np.int32(steps),
            self.k, self.v, tuple(a[:rows] for a in _arrays(sampling)))
        tokens_kb, logprobs_kb = jax.device_get((tokens_kb, logprobs_kb))  # one transfer for both
        return tokens_kb[:steps], logprobs_kb[:steps]

    def programs(self) -> Tuple[Tuple[int, int], ...]:
        """Every ``(used, end)`` whose decode program differs: one per (rows, span) pair, for a warm-up."""
        rows, spans, r, s = [], [], 0, 0
        while r < self.n:
            r = self.rows_for(r + 1)
            rows.append(r)
        while s < self.context:
            s = self.span_for(s + 1)
            spans.append(s)
        return tuple((r, s) for r in rows for s in spans)


def _arrays(s: SamplingRows) -> Tuple[np.ndarray, ...]:
    return s.temperature_b, s.top_p_b, s.seed_b, s.step_b
