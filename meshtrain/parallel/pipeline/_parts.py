"""The pipeline contract: :class:`PipelineParts` (what a model exposes) and the path helpers that
find its layer stack in a state tree."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

from flax import nnx

from meshtrain.errors import ConfigError

STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """What a model exposes for pipelining (see the module docstring for an example).

    Attributes:
      stack: attribute path of the layer stack (an ``nnx.vmap``'ed module, leading ``layers`` axis);
        dotted when nested, e.g. ``"encoder.blocks"``.
      before: ``(*model_call_args) -> (x, side)``: embedding; ``x`` and every ``side`` leaf batch-first.
      layer: ``(layer_module, x, side) -> x``: one layer of the stack.
      after: ``(x, side) -> output``: head; ``output`` is what ``model(...)`` returns.
      sown: ``(values) -> None``, needed when the layers store values with ``nnx.Intermediate`` (MoE
        router statistics, ``Module.sow``): ``values`` is what the stack's layers stored for one
        micro-batch (``nnx.to_pure_dict`` of the popped ``nnx.Intermediate`` state, every leaf with a
        leading ``layers`` axis in the stack's order); store on the model what its own ``__call__``
        would (the decoder: the mean router statistics). Called before ``after``, once per micro-batch.
    """

    stack: str  # attribute path, dotted for a nested module ("encoder.blocks")
    before: Callable[..., Tuple[Any, Any]]
    layer: Callable[[nnx.Module, Any, Any], Any]
    after: Callable[[Any, Any], Any]
    sown: Optional[Callable[[Any], None]] = None


def get_parts(model) -> PipelineParts:
    """The model's :class:`PipelineParts`; ``ConfigError`` naming what to add when it has none."""
    fn = getattr(model, "pipeline_parts", None)
    if fn is None:
        raise ConfigError(
            f"model {type(model).__name__} does not implement the pipeline contract: add a method "
            f"pipeline_parts(self) -> meshtrain.parallel.pipeline.PipelineParts(stack='<attribute of the nnx.vmap'ed "
            f"layer stack>', before=..., layer=..., after=...) (see meshtrain/parallel/pipeline/__init__.py), or pick a recipe "
            f"without the 'pp' strategy")
    parts = fn()
    if not isinstance(parts, PipelineParts):
        raise ConfigError(f"{type(model).__name__}.pipeline_parts() returned {type(parts).__name__}; return a "
                          f"meshtrain.parallel.pipeline.PipelineParts")
    if not isinstance(stack_module(model, parts.stack), nnx.Module):
        raise ConfigError(f"{type(model).__name__}.pipeline_parts().stack = {parts.stack!r} is not an nnx.Module "
                          f"attribute of the model; name the attribute holding the nnx.vmap'ed layer stack")
    return parts


def stack_module(model, path: str):
    """The module at attribute ``path`` (dotted) of ``model``, or ``None``."""
    node = model
    for name in path.split("."):
        node = getattr(node, name, None)
    return node


def get_path(tree, path: str):
    """``tree["a"]["b"]`` for ``path = "a.b"`` (``None`` when absent)."""
    for name in path.split("."):
        if not isinstance(tree, dict) or name not in tree:
            return None
        tree = tree[name]
    return tree


def with_path(tree, path: str, value):
    """A copy of the nested dict ``tree`` with ``path`` (dotted) set to ``value``."""
    head, _, rest = path.partition(".")
    out = dict(tree)
    out[head] = with_path(tree[head], rest, value) if rest else value
    return out


def without_path(tree, path: str):
    """A copy of the nested dict ``tree`` without ``path`` (dotted)."""
    head, _, rest = path.partition(".")
    out = dict(tree)
    if rest:
        out[head] = without_path(tree[head], rest)
    else:
        del out[head]
    return out
