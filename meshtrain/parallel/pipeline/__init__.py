"""Pipeline parallelism over the ``stage`` mesh axis, inside one jitted SPMD program.

**The contract.** A model that wants a pipeline has a method ``pipeline_parts()`` returning
:class:`PipelineParts`: the attribute holding its stack of identical layers (an ``nnx.vmap``'ed module
whose parameters carry a leading ``layers`` axis), what runs before the stack (embedding), one layer,
and what runs after (head)::

    class MyModel(nnx.Module):
        ...
        def pipeline_parts(self) -> PipelineParts:
            return PipelineParts(
                stack="blocks",                                         # self.blocks: leading `layers` axis
                before=lambda tokens_bt: (self.embed(tokens_bt), {}),   # the model's call args -> (x, side)
                layer=lambda block, x_btd, side: block(x_btd),          # one layer of the stack
                after=lambda x_btd, side: self.head(x_btd),             # -> what model(...) returns
                sown=None)                  # only if the layers store values (nnx.Intermediate), see below

``before`` takes the arguments the loss function passes to ``model(...)`` and returns the stack's
input ``x`` (batch first) and ``side``, a pytree of batch-first arrays every layer reads (positions,
segment ids; ``{}`` if none). The user's ``loss_fn(model, batch)`` stays as it is: under a pipeline it
receives a stand-in model whose call runs ``before`` → the schedule → ``after`` (other attributes are
the real model's, and the real model is its child node). For Linen models wrap the stack with
``nn.scan``/``nnx.bridge`` into an NNX module with a leading ``layers`` axis and expose the same parts.

**Values the layers store** (``nnx.Intermediate``: MoE router statistics, ``Module.sow``) travel with
their micro-batch through every schedule (a small ``(layers, ...)`` buffer passed on with the
activations) and reach ``sown(values)`` (leaves ``(L, ...)``, the layers of one micro-batch) before
``after``; the model stores what its own ``__call__`` would (the decoder: the mean router statistics),
and the loss reads them as usual. The loss then runs once per micro-batch and the step sums: the
result equals gradient accumulation over the same ``m`` micro-batches (router statistics such as the
load-balancing loss are per micro-batch, not over the whole batch). Layers that sow without a
``sown`` part, or that update other state in the forward pass (running batch statistics), get a
``ConfigError`` naming the fix. Dense stacks store nothing and run exactly as before.

**Schedules** (``Recipe.schedule``; ``p`` stages, ``m = Recipe.micro_batches``, ``r = Recipe.repeats``):

* ``gpipe``: every tick each stage runs its layer group on the micro-batch it holds and passes the
  result to its neighbour (``ppermute`` over ``stage``); ``m + p - 1`` ticks, then autodiff runs the
  same ticks backwards. Bubble ``(p-1)/(m+p-1)``; activations of all ``m`` micro-batches are kept.
* ``circular``: the stack is cut into ``r·p`` groups, group ``v`` on stage ``v mod p``; a micro-batch
  loops ``r`` times round the ring. ``r·m + p - 1`` ticks, bubble ``(p-1)/(r·m+p-1)``. Checkpoints keep
  the global layer order, so each step first moves ``(r-1)/r`` of each stage's layer weights into the
  interleaved order (an all-to-all over ``stage``; gradients go back the same way).
* ``1f1b``: each tick every stage runs one forward and one backward (its own VJP, recomputing the
  stage from the stashed input), the loss and head of a micro-batch run as soon as it leaves the last
  stage. ``m + 2p - 2`` ticks, but the first ``p - 1`` have no backward on any stage and the last
  ``p - 1`` no forward, and the head has a micro-batch on ``m`` ticks only: conditionals skip that
  work, so the stack runs ``m + p - 1`` forward and ``m + p - 1`` backward passes and the head ``m``;
  bubble ``(p-1)/(m+p-1)`` as in gpipe. A stage keeps only the *inputs* of the micro-batches in
  flight (at most ``2(p-1-s)+1`` on stage ``s``: a micro-batch's backward returns ``2(p-1-s)`` ticks
  after its forward, one new forward per tick; an SPMD buffer of ``2p`` slots) instead of all
  activations of all ``m``. Nothing crosses ``stage`` but the neighbours' hand-offs: every stage runs
  the head on its own output (the last stage's kept) and the embedding's VJP on its own input
  cotangents (stage 0's kept), and their gradients are reduced over ``stage`` once a step (a model whose
  layers store values, MoE, still hands the last stage's output to every stage on the head ticks).

* ``zero_bubble``: 1f1b's ticks with each backward split into an input-gradient half (1f1b's backward
  slot) and a weight-gradient half that runs on every stage on the ``m`` ticks ``2p-2 ..``, where every
  stage has one: bubble ``(p-1)(1-ω)/(m+(p-1)(1-ω))``, ``ω`` the weight gradient's share of the work;
  a stage also keeps up to ``p`` micro-batches' weight halves (see ``_zero_bubble``).

Every stage computes every tick (SPMD), so the bubble shows up as extra compiled FLOPs:
``FLOPs(pipelined stack) / FLOPs(stack without pipeline) = 1 / (1 - bubble)`` (gpipe, circular:
``ticks / (r·m)``; 1f1b: ``(m+p-1)/m`` of its forward + recompute + backward). The head runs on every
stage (the tick takes as long as the last stage, which needs it anyway).
"""

from meshtrain.parallel.pipeline._parts import (STAGE, PipelineParts, get_parts, get_path, stack_module, with_path,
                                                without_path)
from meshtrain.parallel.pipeline._tables import (PipelineConfig, ScheduleTable, bubble_fraction, bubble_warning,
                                                 config_for, schedule_table, timeline)
from meshtrain.parallel.pipeline._schedules import merge_micro, one_f_one_b, row_split_axes, run_stack, split_micro
from meshtrain.parallel.pipeline._zero_bubble import LayerSplit, layer_split, zero_bubble
from meshtrain.parallel.pipeline._loss import StandIn, pipelined_loss, value_and_grad_1f1b
from meshtrain.recipes import Schedule  # what PipelineConfig takes

__all__ = ["STAGE", "PipelineParts", "get_parts", "get_path", "stack_module", "with_path", "without_path",
           "PipelineConfig", "ScheduleTable", "bubble_fraction", "bubble_warning", "config_for", "schedule_table",
           "timeline", "merge_micro", "one_f_one_b", "row_split_axes", "run_stack", "split_micro", "LayerSplit", "layer_split",
           "zero_bubble", "StandIn", "pipelined_loss",
           "value_and_grad_1f1b", "Schedule"]
