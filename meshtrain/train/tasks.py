"""What the :class:`~meshtrain.train.Trainer` trains: a model factory, a loss and data, as one `Task`.

Built-in tasks follow the model's family (``meshtrain train --model NAME``):

| models | data | loss | reported |
|---|---|---|---|
| decoders (``tiny``, ``small``, ``llama3-*``) | packed token windows (``--data`` or the embedded corpus) | next-token cross-entropy | loss, tokens/s, MFU |
| ``vit-*`` | scikit-learn's handwritten digits (8×8, 10 classes; bundled, no download) | cross-entropy | loss, accuracy |
| ``bert-*`` | masked-LM windows (15 %, 80/10/10) of ``--data`` or the embedded corpus | masked-token cross-entropy | loss, masked accuracy |

Your own: :func:`custom_task` (what ``Trainer(cfg, model=..., loss_fn=..., data=...)`` builds).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from typing import Any, Callable, Iterable, Optional, Tuple

import jax
import numpy as np
from flax import linen, nnx

from meshtrain.annotate import step_context
from meshtrain.batch_layout import BatchLayout, BatchSpec
from meshtrain.data import BatchIterator, check_token_ids, load_source
from meshtrain.data.sources import is_prepared, prepared_meta
from meshtrain.data.feed import DeviceFeed
from meshtrain.data.images import DigitsBatches
from meshtrain.data.mlm import MLMBatches
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.model_source import model_source
from meshtrain.models import model_factory
from meshtrain.models.bert import BertConfig, mlm_loss
from meshtrain.models.decoder import DecoderConfig
from meshtrain.models.vit import ViTConfig, vit_loss
from meshtrain.parallel.context import plan_layout, recording_causality
from meshtrain.train.step import next_token_loss, step_context_for


@dataclasses.dataclass(frozen=True)
class DataRequest:
    """What a data factory is asked for: the *global* ``batch_size`` (and ``seq_len`` where it
    applies), the ``seed``, this process and the rows of each global batch it must yield."""

    batch_size: int
    seq_len: int
    seed: int
    process_index: int
    process_count: int
    rows: np.ndarray
    split: str  # "train" or "val"
    shardings: Any = None  # the plan's batch shardings (None before the plan exists)
    #: for a task whose data reorder themselves (``Task.reorders_seq``): the token order the plan's
    #: attention expects (causal context parallelism with zig-zag load balance: ``batch[:, seq_order]``),
    #: or ``None`` for natural order. Any other task's data come in natural order and the Trainer
    #: reorders every leaf with a ``seq`` axis itself.
    seq_order: Optional[np.ndarray] = None


#: ``request -> iterable of this process's numpy batches``.
DataFactory = Callable[[DataRequest], Iterable]


@dataclasses.dataclass(frozen=True)
class Task:
    """A trainable combination. ``layout`` gives the batch layout for (batch size, seq len), or is
    ``None`` when it comes from the first batch of the data. ``eval_loss_fn`` runs without dropout.
    ``tokens_per_example`` (a function of seq len) turns examples/s into tokens/s where batches hold
    tokens. ``model_cfg`` is the config when it has an analytic FLOPs model (decoders)."""

    name: str
    factory: Callable
    loss_fn: Callable
    eval_loss_fn: Callable
    data: DataFactory
    eval_data: Optional[DataFactory]
    layout: Optional[Callable[[int, int], BatchLayout]] = None
    tokens_per_example: Optional[Callable[[int], int]] = None
    model_cfg: Any = None
    metric_names: tuple = ()
    batch_axes: Any = None
    #: the data honour ``DataRequest.seq_order`` (tokens, positions and segment ids reordered together)
    reorders_seq: bool = False
    #: ``(plan, causal)``: whether this task's model runs causal context-parallel attention under the
    #: last plan asked about (one abstract trace per plan)
    _causality: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def feed(self, request: DataRequest, plan, first=None):
        """The iterator the loop reads: global device batches, ``state()``/``restore()``, ``wait_s``.

        ``first``: a batch already read (to find the batch layout) from the source that the last
        ``self.data(...)`` call returned; that source is continued, so no batch is seen twice."""
        request, seq_order = self._seq_order(request, plan)
        source = None
        if request.split == "train" and first is not None:
            source = self.data.reuse(request) if isinstance(self.data, _Sources) else None
            if source is None:
                first = None  # read for other rows (or from an unknown source): a fresh source starts at batch 0
            elif iter(source) is not source:  # re-iterable (e.g. a list): its next pass restarts, skip `first`
                source = iter(source)
                next(source, None)
        if source is None:
            source = self.data(request) if request.split == "train" else self.eval_data(request)
        if isinstance(source, BatchIterator):
            if seq_order is not None:
                raise ConfigError(f"{self.name} {request.split} data: a meshtrain BatchIterator cannot be reordered "
                                  f"for recipe {plan.recipe.name!r}'s zig-zag context layout; pass no data= (the "
                                  f"Trainer then builds the token batches itself) or numpy batches")
            return source
        return DeviceFeed(source, plan.batch, plan.batch_shardings, first=first, seq_order=seq_order,
                          name=f"{self.name} {request.split} data")

    def _seq_order(self, request: DataRequest, plan) -> Tuple[DataRequest, Optional[np.ndarray]]:
        """``(request, order)``: the sequence order the plan's context-parallel attention expects,
        either in ``request.seq_order`` (data that reorder themselves) or as the ``order`` the feed
        applies to every batch leaf with a ``seq`` axis (``None``: natural order).

        Zig-zag order balances *causal* attention only; bidirectional attention is balanced as it
        is and its result does not depend on the order, so its data stay in natural order (then a
        model that computes positions itself, ``arange(seq)``, is right too)."""
        layout = plan_layout(plan)
        if plan.batch is None or not layout.reorders:
            return request, None
        if self.reorders_seq:
            return dataclasses.replace(request, seq_order=layout.permutation(plan.batch.seq_len)), None
        if not self._attends_causally(plan):
            return request, None
        if all(leaf.seq_dim is None for _, leaf in plan.batch.leaves()):
            raise ConfigError(
                f"recipe {plan.recipe.name!r} runs causal attention {layout.kind.value!r} with zig-zag load balance, "
                f"which needs each sequence in zig-zag order, but no batch leaf has a 'seq' axis to reorder: name it, "
                f"e.g. batch_axes={{'tokens': ('batch', 'seq')}} (positions and masks too), or use --attention "
                f"ulysses / a recipe without cp")
        return request, layout.permutation(plan.batch.seq_len)

    def _attends_causally(self, plan) -> bool:
        memo = self._causality
        if memo.get("plan") is not plan:
            causal = attends_causally(self.loss_fn, plan)
            memo.update(plan=plan, causal=causal)
            if not causal and jax.process_index() == 0:
                print(f"meshtrain: {self.name}: bidirectional attention is balanced over the context devices as it "
                      f"is: the data stay in natural order (the zig-zag order of recipe {plan.recipe.name!r} "
                      f"balances causal attention only)", flush=True)
        return memo["causal"]


def attends_causally(loss_fn, plan) -> bool:
    """Whether ``loss_fn`` runs causal context-parallel attention under ``plan``, from one abstract
    trace of the forward pass (no arrays, nothing compiled)."""
    a = plan.abstract

    def forward(params, model_state, batch):
        return loss_fn(nnx.merge(a.graphdef, params, model_state), batch)

    with recording_causality() as seen, jax.set_mesh(plan.mesh), step_context(step_context_for(plan)):
        jax.eval_shape(forward, a.params, a.model_state, plan.batch.abstract())
    return True in seen


def _eval_variant(loss_fn):
    """``loss_fn(..., deterministic=True)`` when the loss takes it (the built-in losses do)."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return loss_fn
    return functools.partial(loss_fn, deterministic=True) if "deterministic" in params else loss_fn


# -- built-in tasks -----------------------------------------------------------------------------

def builtin_task(cfg) -> Task:
    """The task for ``cfg.model`` (a :class:`~meshtrain.train.TrainConfig`; any ``--model``,
    :mod:`meshtrain.model_source`): a decoder's language model, ViT's or BERT's task; a model factory
    (``file.py:fn``) trains as a language model on token windows of ``cfg.data`` (next-token loss)."""
    source = model_source(cfg.model)
    if source.make is not None:
        return language_model_task(cfg, source.make, next_token_loss, name=source.short_name)
    model_cfg = source.config
    if isinstance(model_cfg, DecoderConfig):
        return _language_model(cfg, model_cfg)
    if isinstance(model_cfg, ViTConfig):
        return _image_classifier(cfg, model_cfg)
    if isinstance(model_cfg, BertConfig):
        return _masked_lm(cfg, model_cfg)
    raise ConfigError(f"model {cfg.model!r} has no built-in task; pass model=, loss_fn= and data= to the Trainer")


def _check_seq_len(cfg, limit: int, model: str, field: str = "max_seq_len") -> None:
    if cfg.seq_len > limit:
        raise ConfigError(f"--seq-len {cfg.seq_len} is longer than model {model!r} supports ({field} {limit}); use "
                          f"--seq-len <= {limit}")


def _language_model(cfg, model_cfg: DecoderConfig) -> Task:
    _check_seq_len(cfg, model_cfg.max_seq_len, cfg.model)
    if is_prepared(cfg.data):
        # Ids from a tokenizer (meshtrain data prepare): the built-in config's vocabulary grows to cover it
        # (`small` is byte-level, 256); the run header's model_config records the size trained.
        vocab = int(prepared_meta(cfg.data)["vocab_size"])
        if vocab > model_cfg.vocab_size:
            model_cfg = dataclasses.replace(model_cfg, vocab_size=vocab)
    return language_model_task(cfg, model_factory(model_cfg), next_token_loss, model_cfg.vocab_size,
                               name=cfg.model, model_cfg=model_cfg)


def language_model_task(cfg, factory, loss_fn, vocab_size: Optional[int] = None, *, name: str = "custom",
                        model_cfg=None) -> Task:
    """Any model on packed token windows of ``cfg.data`` (``inputs / targets / positions /
    segment_ids``, each ``(batch, seq)``); ``vocab_size`` checks every token id before step 1."""
    factory = check_factory(factory)
    sources = {}

    def split(name):
        if not sources:
            source = load_source(cfg.data)
            if vocab_size is not None:
                check_token_ids(source, vocab_size)
            # Always split: the training data must not depend on whether (or how often) a run evaluates.
            sources["train"], sources["val"] = source.split(cfg.val_fraction)
        return sources[name]

    def data(req: DataRequest):
        return _OrderedBatches(split(req.split), req.batch_size, req.seq_len, req.seed,
                               shardings=req.shardings, vocab_size=vocab_size,
                               prefetch=2 if req.split == "train" else 0, seq_order=req.seq_order)

    return Task(name, factory, loss_fn, loss_fn, data, data, layout=lambda b, t: BatchSpec(b, t).layout(),
                tokens_per_example=lambda t: t, model_cfg=model_cfg, reorders_seq=True)


class _OrderedBatches(BatchIterator):
    """Token batches whose sequence dimension comes in ``seq_order`` (every key together: inputs,
    targets, positions and segment ids), so the next-token loss, a sum over tokens, is unchanged
    and RoPE reads the carried positions."""

    def __init__(self, *args, seq_order: Optional[np.ndarray] = None, **kwargs):
        self.seq_order = seq_order
        super().__init__(*args, **kwargs)

    def local_batch(self, first_sample: int):
        batch = super().local_batch(first_sample)
        if self.seq_order is None:
            return batch
        return {k: np.ascontiguousarray(v[:, self.seq_order]) for k, v in batch.items()}


def _image_classifier(cfg, model_cfg: ViTConfig) -> Task:
    if cfg.data is not None:
        raise ConfigError(f"--data is for token data; {cfg.model} trains on the bundled digits images (use the Python "
                          f"API with data= for your own images)")
    if model_cfg.image_size != 8 or model_cfg.channels != 1:
        raise ConfigError(f"model {cfg.model!r} takes {model_cfg.image_size}x{model_cfg.image_size}x"
                          f"{model_cfg.channels} images; the built-in digits are 8x8x1: train vit-tiny or vit-small, "
                          f"or plan {cfg.model} with `meshtrain plan`")

    def data(req: DataRequest):
        return DigitsBatches(req.batch_size, req.seed, split=req.split, shuffle=req.split == "train",
                             val_fraction=0.2, rows=req.rows)

    def layout(b, t):
        return BatchLayout.from_example({"images": jax.ShapeDtypeStruct((b, 8, 8, 1), np.float32),
                                         "labels": jax.ShapeDtypeStruct((b,), np.int32)})

    return Task(cfg.model, model_factory(model_cfg), vit_loss, _eval_variant(vit_loss), data, data, layout=layout,
                model_cfg=model_cfg, metric_names=("accuracy",))


def _masked_lm(cfg, model_cfg: BertConfig) -> Task:
    _check_seq_len(cfg, model_cfg.max_positions, cfg.model, "max_positions")
    sources = {}

    def data(req: DataRequest):
        if not sources:
            source = load_source(cfg.data)
            sources["train"], sources["val"] = source.split(cfg.val_fraction)
        return MLMBatches(sources[req.split], req.batch_size, req.seq_len, req.seed, rows=req.rows)

    def layout(b, t):
        sds = jax.ShapeDtypeStruct((b, t), np.int32)
        return BatchLayout.from_example({"input_ids": sds, "targets": sds, "positions": sds, "segment_ids": sds},
                                        axes={k: ("batch", "seq") for k in ("input_ids", "targets", "positions",
                                                                             "segment_ids")})

    return Task(cfg.model, model_factory(model_cfg), mlm_loss, _eval_variant(mlm_loss), data, data, layout=layout,
                tokens_per_example=lambda t: t, model_cfg=model_cfg, metric_names=("accuracy",))


# -- your own -----------------------------------------------------------------------------------

def custom_task(model, loss_fn, data, eval_data=None, *, batch_axes=None, name: str = "custom",
                eval_loss_fn=None, tokens_per_example=None) -> Task:
    """A task from your parts.

    Args:
      model: a factory ``rngs -> nnx.Module``.
      loss_fn: ``(model, batch) -> (loss sum, weight)`` or ``(loss sum, weight, {name: sum})``; the
        step divides each by the global weight.
      data: an iterable of numpy batches (this process's rows), or a function of a
        :class:`DataRequest` returning one (called once per run, and once per evaluation with
        ``split="val"``). It should repeat (an infinite generator, ``itertools.cycle``): a source
        that ends before the last step stops the run with a clear error.
      eval_data: the same for evaluation (``None``: no evaluation). A function is called afresh for
        each evaluation (the same batches every time); an iterator just continues.
      batch_axes: logical axes per batch leaf, when not ``batch`` on the leading dimension only.
      eval_loss_fn: the loss for evaluation (default: ``loss_fn`` with ``deterministic=True`` when
        it takes that keyword).
    """
    model = check_factory(model)
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be a function (model, batch) -> (loss sum, weight[, metrics]), got "
                          f"{type(loss_fn).__name__}")
    return Task(name, model, loss_fn, eval_loss_fn or _eval_variant(loss_fn), _Sources(_as_factory(data, "data")),
                _as_factory(eval_data, "eval_data") if eval_data is not None else None, layout=None,
                tokens_per_example=tokens_per_example, batch_axes=batch_axes)


_FACTORY_HINT = "e.g. model=lambda rngs: MyModel(..., rngs=rngs)"


def check_factory(model) -> Callable:
    """``model`` as a factory ``rngs -> nnx.Module``; ``ConfigError`` naming what to change when it is
    not one. A class or function whose ``rngs`` is keyword-only (``def __init__(self, *, rngs)``) is
    called as ``model(rngs=rngs)``."""
    if isinstance(model, nnx.Module):
        raise ConfigError(f"model= got a built {type(model).__name__} instance; pass a factory instead "
                          f"({_FACTORY_HINT}): meshtrain builds the model itself, already sharded, from the plan")
    if isinstance(model, linen.Module):
        raise ConfigError(f"model= got the Linen module {type(model).__name__}; wrap it: "
                          f"model=meshtrain.models.from_linen(module, sample_input)")
    if not callable(model):
        raise ConfigError(f"model must be a factory rngs -> nnx.Module ({_FACTORY_HINT}); got {type(model).__name__}")
    try:
        if isinstance(model, type):  # a Module class: its metaclass hides __init__'s signature
            sig = inspect.signature(model.__init__)
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        else:
            sig = inspect.signature(model)
    except (TypeError, ValueError):
        return model  # a builtin or C callable: nothing to check
    name = getattr(model, "__name__", None) or type(model).__name__
    try:
        sig.bind(object())
        return model
    except TypeError:
        pass
    try:
        sig.bind(rngs=object())
    except TypeError:
        raise ConfigError(f"model factory {name}{sig} cannot be called with one argument, an nnx.Rngs; make it take "
                          f"the rngs ({_FACTORY_HINT}) and pass the model's other arguments yourself") from None
    return lambda rngs: model(rngs=rngs)


class _Sources:
    """A custom task's training data factory. It keeps the source that its last training call
    returned: the Trainer reads that source's first batch to find the batch layout, and
    :meth:`Task.feed` continues the same source instead of a second copy (which would repeat it)."""

    def __init__(self, factory: DataFactory):
        self.factory = factory
        self._last = None

    def __call__(self, request: DataRequest):
        source = self.factory(request)
        if request.split == "train":
            self._last = (request, source)
        return source

    def reuse(self, request: DataRequest):
        """The last training source when it was made for the same batch size and rows (else ``None``);
        forgotten either way."""
        last, self._last = self._last, None
        if last is None:
            return None
        made_for, source = last
        same = made_for.batch_size == request.batch_size and np.array_equal(made_for.rows, request.rows)
        return source if same else None


def _as_factory(data, what: str) -> DataFactory:
    if data is None:
        raise ConfigError(f"{what}: pass an iterable of numpy batches or a function of a DataRequest")
    if callable(data) and not hasattr(data, "__next__") and not hasattr(data, "__iter__"):
        return data
    if isinstance(data, (list, tuple)):
        return lambda req: itertools.cycle(data) if req.split == "train" else iter(data)
    if hasattr(data, "__iter__") or hasattr(data, "__next__"):
        return lambda req: data
    raise ConfigError(f"{what}: got {type(data).__name__}; pass an iterable of numpy batches or a function of a "
                      f"DataRequest")


def local_rows(plan) -> Optional[np.ndarray]:
    """The rows of each global batch that this process's devices hold (from the plan's sharding of
    the first leaf with a ``batch`` dimension), or ``None`` when no leaf has one."""
    layout = plan.batch
    if layout is None:
        return None
    shardings = dict(zip([p for p, _ in layout.leaves()], jax.tree.leaves(plan.batch_shardings)))
    for path, leaf in layout.leaves():
        if leaf.batch_dim is None:
            continue
        rows = set()
        for index in shardings[path].addressable_devices_indices_map(leaf.shape).values():
            rows.update(range(leaf.shape[leaf.batch_dim])[index[leaf.batch_dim]])
        return np.array(sorted(rows))
    return None


def example_layout(first, process_count: int, batch_axes=None) -> BatchLayout:
    """The global layout from this process's first batch (``batch`` dimensions × process count)."""
    try:
        local = BatchLayout.from_example(first, axes=batch_axes)
    except MeshtrainError as exc:
        if batch_axes is None:
            raise
        raise type(exc)(f"batch_axes={batch_axes!r} does not fit the first batch: {exc}") from None
    if process_count == 1:
        return local

    def scale(_, leaf):
        shape = list(leaf.shape)
        if leaf.batch_dim is not None:
            shape[leaf.batch_dim] *= process_count
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)

    return BatchLayout.from_example(local.map(scale), axes=batch_axes)
