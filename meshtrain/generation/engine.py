"""Prefill and decode: two compiled steps on the training plan's shardings.

* **prefill** runs a batch of (left-padded) prompts through the decoder in one pass, writes every
  layer's keys and values into the KV cache, returns each prompt token's log-probability given the
  tokens before it, and chooses the first new token from the last position's logits.
* **decode** feeds one token per row, writes it at the next cache slot and chooses the next. By
  default (:class:`~meshtrain.generation.loop.DecodeLoop` ``DEVICE``) every decode step runs inside
  one compiled ``while_loop`` with sampling, each row's stop test and the cache carried inside, and the
  layer weights are stored one array per layer (:mod:`meshtrain.generation.loop` says why: the host
  round trip per token, and the copies XLA:CPU made of a stacked layer's weights). ``HOST``: one
  compiled step per token, the host loops (the reference the loop is tested and benchmarked against).

Both are ``jax.jit`` s whose parameter shardings are the plan's (the recipe's rules: weights where
training keeps them), whose cache follows the activation rules (:mod:`meshtrain.generation.cache`)
and whose activations are constrained exactly as in training (the model's ``constrain`` calls, under
a step context of the plan). The cache is donated to decode, so it is updated in place.

**Padding**: prompts of different lengths are *left*-padded to the longest; every row then writes its
next token at the same cache slot, and each row's positions start at 0 at its first real token, so a
row's tokens and log-probabilities do not depend on the other prompts in the batch (up to float
rounding). The batch is also padded with one-token dummy rows to a multiple of the recipe's
data-parallel size (they are dropped from the results).

**Stop tokens**: a row stops after it emits one of ``stop_ids`` (the stop token is included in its
``new_ids``); the loop ends when every row has stopped or ``max_new_tokens`` are out. Dummy rows
are done from the start.

**Weights in the step**: the layer stack stays as stored (int8, or in host memory with
``WeightMemory.HOST``) and each layer is brought into compute form inside the layer loop, when it runs
(:meth:`Engine._load_layer`); everything outside the stack is converted at the top of the step (bf16 on
XLA:CPU, which converts to f32 for every matmul: once per generation, :attr:`Engine.hoist_bf16`; or, where the
resolved step says ``DecodeMatmul.BF16_ROWS``, not at all: the layers' projections and an untied head are stored
``(out, in)`` and multiplied as stored by :mod:`meshtrain.kernels.bf16_rows`, :attr:`Engine.rows_kernel`). The
logits of an untied head are f32 whatever the weights' format (a tied head shares the embedding table,
which stays in the compute dtype so that the residual stream does too): bf16 logits near the top are
0.03-0.06 apart and tie exactly (argmax then picks the lower token id): 14 of the 17 held-out positions
(of 2,048) where the trained ``small`` model's bf16 argmax left f32's were exact ties.

**MoE**: generation routes *dropless* (no expert capacity): capacity drops depend on the other tokens
of a sequence, future ones included, which one-token decoding cannot reproduce.

Example::

    engine = Engine(cfg, params, plan)
    out = engine.run([[1, 2, 3], [4, 5]], max_new_tokens=16, sampling=Sampling(temperature=0.7, seed=1))
    out.generations[0].new_ids
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from meshtrain.abstract import abstract_state
from meshtrain.annotate import StepContext, step_context
from meshtrain.errors import ConfigError
from meshtrain.generation.cache import REPLICATE_OK, cache_bytes_per_device
from meshtrain.generation.loop import (DecodeLoop, decode_loop, decode_loop_kind, empty_layer_cache, layered_forward,
                                       stacked_cache, stop_mask, traced_cache, unstack_layers)
from meshtrain.generation.sampling import Sampling, choose_with_logprobs, token_logprobs
from meshtrain.generation.weights import (LAYERS, WeightFormat, WeightMemory, dequantize, host_weight_bytes_per_device,
                                          place_layers, store_weights, weight_bytes_per_device, weight_format,
                                          weight_memory)
from meshtrain.kernels import bf16_rows, decode_step
from meshtrain.models.configs import model_factory
from meshtrain.models.decoder import DecoderConfig
from meshtrain.precision import cast_floats
from meshtrain.parallel.resolved import DecodeMatmul, resolve_step


#: the untied output projection: its logits are computed in f32 (see ``Engine._model``)
HEAD = "lm_head_dv"


def generation_config(cfg: DecoderConfig) -> DecoderConfig:
    """``cfg`` as generation runs it: MoE layers dropless (see the module docstring)."""
    return dataclasses.replace(cfg, capacity_factor=None) if cfg.n_experts else cfg


#: the layer weights the row kernel takes, and how many leading dims each contracts (the rest are its outputs)
ROWS_WEIGHTS = {"wq_dnh": 1, "wk_dkh": 1, "wv_dkh": 1, "wo_nhd": 2, "gate_df": 1, "up_df": 1, "down_fd": 1}


def pack_rows(stored, storage="bfloat16"):
    """``stored`` (bf16 weights, the layers one tree per layer) with each layer's dense matmul weights
    (:data:`ROWS_WEIGHTS`; an MoE layer's experts stay as they are) and an untied head as
    :class:`~meshtrain.kernels.bf16_rows.RowsWeight` (stored ``(out, in)``; the head's products in f32, as its
    logits are), in ``storage`` (bf16; f32 for the fused step's row layout). One compiled program: bf16's ``(in, out)``
    arrays are freed after."""

    def pack_layer(tree):
        return {k: (pack_layer(v) if isinstance(v, dict) else
                    bf16_rows.pack(v, ROWS_WEIGHTS[k], v.dtype, storage) if k in ROWS_WEIGHTS
                    and v.ndim == ROWS_WEIGHTS[k] + 1
                    + (k in ("wq_dnh", "wk_dkh", "wv_dkh")) else v) for k, v in tree.items()}

    def pack_all(stored):
        out = {**stored, LAYERS: tuple(pack_layer(layer) for layer in stored[LAYERS])}
        if HEAD in stored:
            out[HEAD] = bf16_rows.pack(stored[HEAD], 1, "float32", storage)
        return out

    # bf16: the stored arrays are the engine's own converted copies, freed here; f32 ones may be the caller's own
    # arrays (device_put onto the same device returns them), which must survive
    return jax.jit(pack_all, donate_argnums=0 if jnp.dtype(storage) == jnp.bfloat16 else ())(stored)


def check_prompts(cfg: DecoderConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> List[List[int]]:
    """The prompts as lists of ints, or a ``ConfigError`` naming the prompt and what to change."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {max_new_tokens!r}: use an integer >= 0")
    if not prompts:
        raise ConfigError("no prompts: give at least one (--prompt, --prompt-ids or --prompts)")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = [int(t) for t in p]
        except (TypeError, ValueError):
            raise ConfigError(f"prompt {i}: give text (with a tokenizer) or a list of integer token ids, not "
                              f"{str(p)[:40]!r}") from None
        if not ids:
            raise ConfigError(f"prompt {i} is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt {i}: token id {bad[0]} is outside the vocabulary of model {cfg.name!r} "
                              f"(0..{cfg.vocab_size - 1})")
        if len(ids) > cfg.max_seq_len:
            raise ConfigError(f"prompt {i} has {len(ids)} tokens, more than max_seq_len {cfg.max_seq_len} of "
                              f"model {cfg.name!r}; shorten it")
        if len(ids) + max_new_tokens > cfg.max_seq_len:
            raise ConfigError(f"prompt {i} ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                              f"max_seq_len {cfg.max_seq_len} of model {cfg.name!r}; use --max-new-tokens <= "
                              f"{cfg.max_seq_len - len(ids)}")
        out.append(ids)
    return out


def check_stop_ids(cfg: DecoderConfig, stop_ids: Sequence[int]) -> List[int]:
    """``stop_ids`` as ints, or a ``ConfigError``: an id outside the vocabulary can never be emitted, so a
    row would silently run to ``max_new_tokens`` (and a negative one is no token at all)."""
    out = []
    for t in stop_ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ConfigError(f"stop id {t!r} (--stop-ids / stop_ids=) is not an integer token id; give ids such "
                              f"as 0,2")
        if not 0 <= t < cfg.vocab_size:
            raise ConfigError(f"stop id {int(t)} (--stop-ids / stop_ids=) is outside the vocabulary of model "
                              f"{cfg.name!r} (ids 0..{cfg.vocab_size - 1}); give ids the model can emit, e.g. its "
                              f"end-of-text id")
        out.append(int(t))
    return out


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's result. ``new_logprobs[i]``: log p(new_ids[i]) under the model (before temperature,
    top-k, top-p); ``prompt_logprobs[j]``: log p(prompt[j + 1] | prompt[: j + 1]) (when asked for);
    ``new_text``: the new tokens decoded, when there is a tokenizer; ``stopped``: ended on a stop id."""

    prompt_ids: Tuple[int, ...]
    new_ids: Tuple[int, ...]
    new_logprobs: Tuple[float, ...]
    prompt_logprobs: Optional[Tuple[float, ...]] = None
    new_text: Optional[str] = None
    stopped: bool = False

    def to_dict(self) -> Dict:
        out = {"new_ids": list(self.new_ids)}
        if self.new_text is not None:
            out["new_text"] = self.new_text
        out["new_logprobs"] = list(self.new_logprobs)
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(self.prompt_logprobs)
        return out


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall seconds of the prefill (from its call until its tokens are ready; with ``DecodeLoop.DEVICE`` the
    decode program is already queued behind it) and of each decode *program run*, each
    ending when its tokens reach the host: one per decode step with ``DecodeLoop.HOST``, one for all
    of them with ``DecodeLoop.DEVICE``; ``sum(decode_s)`` is the decoding's time either way, over
    ``decode_steps`` steps."""

    batch: int
    prompt_tokens: int
    prefill_s: float
    decode_s: Tuple[float, ...]
    decode_steps: int = 0


@dataclasses.dataclass(frozen=True)
class Output:
    generations: Tuple[Generation, ...]
    timing: Timing


class Engine:
    """The compiled prefill and decode steps of decoder ``cfg`` with ``params`` (nested dict, any
    placement: they are put on ``plan.param_shardings``) on ``plan`` (a params plan of the same model:
    :func:`meshtrain.generation.plan_for`). ``weights``: how they are stored (:class:`WeightFormat`);
    ``memory``: where the layer weights live between steps (:class:`WeightMemory`); ``loop``: where
    the decode loop runs (:class:`DecodeLoop`: ``device``, one compiled loop, unless comparing with
    the per-token ``host`` loop). With the layers on the device and the compiled loop, the layer stack
    is stored one array per layer (``layered``); streamed from host memory it stays stacked and scanned.
    ``decode_matmul``: ``None`` lets the resolved step choose (:class:`DecodeMatmul`: bf16 weights on 1 CPU device
    are multiplied as stored by :mod:`meshtrain.kernels.bf16_rows`); ``"xla"`` keeps XLA's dot."""

    def __init__(self, cfg: DecoderConfig, params, plan, *, weights: "WeightFormat | str" = WeightFormat.NONE,
                 memory: "WeightMemory | str" = WeightMemory.DEVICE, loop: "DecodeLoop | str" = DecodeLoop.DEVICE,
                 decode_matmul: Optional[str] = None):
        self.cfg = generation_config(cfg)
        self.plan = plan
        self.weights = weight_format(weights)
        self.memory = weight_memory(memory)
        self.loop = decode_loop_kind(loop)
        self.layered = self.loop is DecodeLoop.DEVICE and self.memory is WeightMemory.DEVICE
        # the plan's step, decoding: dense attention over the cache, and how the layers' matmuls run
        c = self.cfg
        largest = decode_step.largest_projection(c)
        step = resolve_step(plan).for_generation(self.weights.value, plan.mesh.size, self.layered,
                                                 bf16_rows.kernel_ready, decode_matmul, largest,
                                                 decode_step.kernel_ready, decode_step.unsupported(c))
        #: the whole decode step one C++ call (a small f32 model on 1 CPU device: XLA's kernel count bounds its step)
        self.fused_step = step.decode_matmul is DecodeMatmul.FUSED_STEP
        #: how the compiled loop's decode step multiplies (:class:`DecodeMatmul`, the resolved step's choice)
        self.decode_matmul = step.decode_matmul
        #: bf16 weights multiplied as stored (the layers' matmul weights and an untied head kept (out, in))
        self.rows_kernel = step.decode_matmul is DecodeMatmul.BF16_ROWS
        abstract = abstract_state(model_factory(self.cfg))
        self.graphdef, self.model_state = abstract.graphdef, abstract.model_state
        stored = store_weights(jax.device_put(params, plan.param_shardings), self.weights)
        if self.layered:
            stored = {**stored, LAYERS: unstack_layers(stored[LAYERS], self.cfg.n_layers)}
            if self.rows_kernel:
                stored = pack_rows(stored)
            elif self.fused_step and decode_step.rows_layout(largest):
                stored = pack_rows(stored, "float32")  # the kernel's threads each stream a contiguous block
            # the stack's shapes stand in for the blocks when the model is merged (layered_forward runs
            # each block from its own arrays); the graph of one block comes from them
            self._stack_shapes = abstract.params[LAYERS]
            model = nnx.merge(self.graphdef, abstract.params, self.model_state)
            self.block_graphdef = nnx.split(model.blocks)[0]
        self.params = place_layers(stored, self.memory)
        compute = {WeightFormat.NONE: plan.recipe.compute_dtype}.get(self.weights, "bfloat16")
        self.compute_dtype = jnp.dtype(compute)
        r = plan.recipe
        self.ctx = StepContext(plan.mesh, plan.rules, r.replicate_ok() | REPLICATE_OK, step.remat,
                               step.attention.kind, tuple(r.strategies), step.layer_loop, step.scan_unroll,
                               resolved=step)
        self.batch_multiple = plan.data_parallel_size
        #: bf16 weights on XLA:CPU, which has no bf16 matmul and converts each weight to f32 for it: the compiled
        #: loop converts them once per generation (an f32 copy of the weights while it decodes, as transformers'
        #: Flax ``generate`` does), not at every step (which read 2 + wrote 4 + read 4 bytes per weight and token)
        #: (not with the row kernel: it reads the bf16 weights as stored)
        self.hoist_bf16 = (self.weights is WeightFormat.BF16 and self.memory is WeightMemory.DEVICE
                           and plan.mesh.devices.flat[0].platform == "cpu" and not self.rows_kernel)
        self._steps: Dict[Sampling, Tuple] = {}
        self._row_shardings: Dict[Tuple[int, int], NamedSharding] = {}

    # -- figures ----------------------------------------------------------------------------------
    def weight_bytes_per_device(self) -> int:
        """Device memory (with ``WeightMemory.HOST``: one layer of the stack, see :func:`weight_bytes_per_device`)."""
        return weight_bytes_per_device(self.params)

    def host_weight_bytes_per_device(self) -> int:
        return host_weight_bytes_per_device(self.params)

    def cache_bytes_per_device(self, batch: int, seq: int) -> int:
        return cache_bytes_per_device(self.cfg, self.plan, self.padded_batch(batch), seq, self.compute_dtype)

    def empty_cache(self, pad, seq: int):
        """A zero KV cache of ``seq`` slots for rows left-padded by ``pad``, in the layout the steps take."""
        if self.layered:
            return empty_layer_cache(self.cfg, self.plan, pad, seq, self.compute_dtype)
        return stacked_cache(self.cfg, self.plan, pad, seq, self.compute_dtype)

    def traced_cache(self, pad_b, seq: int):
        """:meth:`empty_cache` inside a compiled program (``pad_b`` traced)."""
        return traced_cache(self.cfg, self.plan, pad_b, seq, self.compute_dtype, layered=self.layered)

    def padded_batch(self, batch: int) -> int:
        return -(-batch // self.batch_multiple) * self.batch_multiple

    # -- the two steps ----------------------------------------------------------------------------
    def _compute_form(self, weights):
        return cast_floats(dequantize(weights, self.compute_dtype), self.compute_dtype)

    def _model(self, params):
        """The model with the weights outside the layer stack in compute form; the stack stays as stored
        (int8, in host memory) and :meth:`_load_layer` brings one layer at a time into compute form."""
        weights = {k: (v if k == LAYERS else self._compute_form(v)) for k, v in params.items()}
        if self.layered:
            weights[LAYERS] = self._stack_shapes  # not read: layered_forward runs the blocks
        if HEAD in params and isinstance(params[HEAD], bf16_rows.RowsWeight):
            weights[HEAD] = params[HEAD]  # packed with dtype f32: f32 logits from the bf16 weights as stored
        elif HEAD in params:
            # logits in f32: bf16 logits (8 mantissa bits, ~0.03 apart near |logit| 8) tie exactly, and
            # argmax then takes the lower token id (see the module docstring)
            weights[HEAD] = dequantize(params[HEAD], jnp.float32).astype(jnp.float32)
        return nnx.merge(self.graphdef, weights, self.model_state)

    def _load_layer(self, layer):
        """One layer's stored weights (inside the layer loop) in compute form, on the devices."""
        if self.memory is WeightMemory.HOST:
            layer = jax.device_put(layer, jax.memory.Space.Device)  # this layer's shards: host -> device
        return self._compute_form(layer)

    def _forward(self, params, tokens_bt, cache):
        with step_context(self.ctx):
            model = self._model(params)
            if self.layered:
                return layered_forward(model, self.block_graphdef, params[LAYERS], tokens_bt, cache, self._load_layer)
            return model.cached(tokens_bt, cache, load_layer=self._load_layer)

    def _compiled(self, sampling: Sampling):
        """``(prefill, decode)`` for ``sampling`` (its settings are static: one compile per setting);
        ``decode`` is one step (``DecodeLoop.HOST``) or the whole loop (``DEVICE``, one compile per
        ``n_new``)."""
        if sampling in self._steps:
            return self._steps[sampling]

        def prefill(params, tokens_bt, pad_b, seed, seq):
            # the empty cache is made inside the program (no zeros program, no transfers per generation)
            cache = self.traced_cache(pad_b, seq)
            key = jax.random.fold_in(jax.random.key(seed), 0)  # Sampling.key(0), made in the program: no dispatch
            logits_btv, cache = self._forward(params, tokens_bt, cache)
            prompt_lp = token_logprobs(logits_btv[:, :-1], tokens_bt[:, 1:])
            nxt, nxt_lp = choose_with_logprobs(logits_btv[:, -1], key, sampling)
            return nxt, nxt_lp, prompt_lp, cache

        def decode(params, token_b, cache, key):
            logits_btv, cache = self._forward(params, token_b[:, None], cache)
            return (*choose_with_logprobs(logits_btv[:, 0], key, sampling), cache)

        def decode_all(params, first_b, first_lp_b, cache, limit_b, is_stop_v, seed, n_new):
            # a bf16 model's weights widened to f32 for the fused step, once per generation, before the loop
            kernel_params = decode_step.widened(params, self.compute_dtype) if self.fused_step else params

            def step(tokens_bt, c):
                if self.fused_step:
                    return decode_step.forward(self.cfg, kernel_params, tokens_bt[:, 0], c, self.compute_dtype)
                # the weights pass a barrier with the step's cache index: without it XLA hoists their
                # conversion to compute form (int8 -> bf16 -> f32 on XLA:CPU) out of the loop and holds a
                # converted copy of every weight for the whole decode (int8 would then not stay int8). bf16 on
                # XLA:CPU goes without it (see hoist_bf16): the per-step bf16 -> f32 conversion halved its speed
                # weights stored in compute form (f32 as trained) convert nothing: no barrier either
                # nor with the row kernel (it reads bf16 as stored; only the norms' scales convert)
                stored = params if self.hoist_bf16 or self.rows_kernel or self.weights is WeightFormat.NONE else \
                    jax.lax.optimization_barrier((params, c.index))[0]
                return self._forward(stored, tokens_bt, c)

            return decode_loop(step, first_b, first_lp_b, cache, limit_b, is_stop_v, jax.random.key(seed),
                               n_new=n_new, sampling=sampling)  # (Decoded, cache)

        if self.loop is DecodeLoop.HOST:
            self._steps[sampling] = (jax.jit(prefill, static_argnames=("seq",)), jax.jit(decode, donate_argnums=(2,)))
        else:
            self._steps[sampling] = (jax.jit(prefill, static_argnames=("seq",)),
                                     jax.jit(decode_all, donate_argnums=(3,), static_argnames=("n_new",)))
        return self._steps[sampling]

    def _rows(self, batch: int, per_row: int = 1) -> NamedSharding:
        """Where a ``(batch, per_row)`` array of the rows goes (``per_row`` 0: a ``(batch,)`` vector); kept per
        shape (resolving the rules at every generation cost more host time than a tiny model's decode step)."""
        if (batch, per_row) in self._row_shardings:
            return self._row_shardings[batch, per_row]
        logical, shape = (("batch", None), (batch, per_row)) if per_row else (("batch",), (batch,))
        spec = self.plan.rules.resolve("activations", logical, shape, self.plan.mesh_sizes, path="tokens").spec
        self._row_shardings[batch, per_row] = NamedSharding(self.plan.mesh, spec)
        return self._row_shardings[batch, per_row]

    # -- the loop ---------------------------------------------------------------------------------
    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> List[List[int]]:
        return check_prompts(self.cfg, prompts, max_new_tokens)

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
            stop_ids: Sequence[int] = (), prompt_logprobs: bool = False, decode=None) -> Output:
        """Generate up to ``max_new_tokens`` for each prompt (token id lists). ``decode``: ids -> text."""
        prompts = self.check(prompts, max_new_tokens)
        stop_ids = check_stop_ids(self.cfg, stop_ids)
        n = len(prompts)
        batch = self.padded_batch(n)
        rows = prompts + [[0]] * (batch - n)
        longest = max(len(p) for p in rows)
        pad = np.array([longest - len(p) for p in rows], np.int32)
        tokens = np.zeros((batch, longest), np.int32)
        for b, p in enumerate(rows):
            tokens[b, pad[b]:] = p
        prefill, _ = self._compiled(sampling)
        limit = np.where(np.arange(batch) < n, max(max_new_tokens, 1), 1).astype(np.int32)  # dummy rows: done
        start = time.perf_counter()
        if self.plan.mesh.size > 1:
            tokens, pad_b, limit_b = jax.device_put((tokens, pad, limit), (self._rows(batch), self._rows(batch, 0),
                                                                           self._rows(batch, 0)))
        else:  # one device: the compiled steps take the host arrays as they are (jax.device_put: ~0.1 ms per call)
            pad_b, limit_b = pad, limit
        first, first_lp, prompt_lp, cache = prefill(self.params, tokens, pad_b, np.uint32(sampling.seed),
                                                    seq=longest + max(max_new_tokens - 1, 0))
        if self.loop is DecodeLoop.HOST:
            jax.block_until_ready(first)
            prefill_s = time.perf_counter() - start
            new_bt, lp_bt, length, decode_s = self._decode_host(sampling, first, first_lp, cache, limit, stop_ids,
                                                                max_new_tokens)
        else:
            new_bt, lp_bt, length, prefill_s, decode_s = self._decode_device(sampling, first, first_lp, cache, limit_b,
                                                                             stop_ids, max_new_tokens, start)
        prompt_lp = np.asarray(prompt_lp)
        stops = set(stop_ids)
        gens = tuple(self._result(prompts[b], new_bt[b, :length[b]], lp_bt[b, :length[b]],
                                  prompt_lp[b, pad[b]:] if prompt_logprobs else None, stops, decode)
                     for b in range(n))
        steps = int(max(length[:n], default=0)) - 1 if max_new_tokens else 0
        return Output(gens, Timing(batch, int(batch * longest), prefill_s, tuple(decode_s), max(steps, 0)))

    def _decode_device(self, sampling, first, first_lp, cache, limit_b, stop_ids, max_new_tokens, start):
        """All decode steps in one program run, queued behind the prefill (no host wait between the two):
        ``(new_bt, logprobs_bt, length_b, prefill seconds, [decode seconds])``; the prefill's seconds end when
        its tokens are ready (``start``: when it was called), the decode's when its tokens reach the host."""
        batch = limit_b.shape[0]
        if max_new_tokens == 0:
            jax.block_until_ready(first)
            return (np.zeros((batch, 0), np.int32), np.zeros((batch, 0), np.float32), np.zeros(batch, np.int32),
                    time.perf_counter() - start, [])
        _, decode_all = self._compiled(sampling)
        dispatch_start = time.perf_counter()
        out, _ = decode_all(self.params, first, first_lp, cache, limit_b, stop_mask(stop_ids, self.cfg.vocab_size),
                            np.uint32(sampling.seed), n_new=max_new_tokens)  # the cache (donated) is not needed after
        # the dispatch compiles the decode program on its first call, while the prefill runs: its seconds go to
        # the decode's window (where Speed takes the decode's compile seconds out), not to the prefill's
        dispatch = time.perf_counter() - dispatch_start
        jax.block_until_ready(first)
        prefill_end = time.perf_counter()
        prefill_s = max(prefill_end - start - dispatch, dispatch_start - start)
        new_bt, lp_bt, length = jax.device_get((out.new_bn, out.logprobs_bn, out.length_b))  # one transfer
        return new_bt, lp_bt, length, prefill_s, [time.perf_counter() - prefill_end + dispatch]

    def _decode_host(self, sampling, nxt, lp, cache, limit, stop_ids, max_new_tokens):
        """One program run per decode step, the host reading each token back (the reference loop)."""
        _, decode_step = self._compiled(sampling)
        new, new_lp, decode_s = [np.asarray(nxt)], [np.asarray(lp)], []
        stops = np.asarray(list(stop_ids), np.int32)
        done = np.isin(new[0], stops) | (limit <= 1)
        for step in range(1, max_new_tokens):
            if done.all():
                break
            start = time.perf_counter()
            nxt, lp, cache = decode_step(self.params, nxt, cache, sampling.key(step))
            new.append(np.asarray(nxt))
            new_lp.append(np.asarray(lp))
            decode_s.append(time.perf_counter() - start)
            done |= np.isin(new[-1], stops)
        new_bt = np.stack(new, axis=1)[:, :max_new_tokens]
        return new_bt, np.stack(new_lp, axis=1)[:, :max_new_tokens], np.full(len(limit), new_bt.shape[1]), decode_s

    @staticmethod
    def _result(prompt, new_t, lp_t, prompt_lp, stops, decode) -> Generation:
        ids, lps, stopped = [], [], False
        for t, lp in zip(new_t.tolist(), lp_t.tolist()):
            ids.append(int(t))
            lps.append(float(lp))
            if t in stops:
                stopped = True
                break
        return Generation(tuple(prompt), tuple(ids), tuple(lps),
                          tuple(float(x) for x in prompt_lp) if prompt_lp is not None else None,
                          decode(ids) if decode is not None else None, stopped)
