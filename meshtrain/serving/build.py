"""Everything ``meshtrain serve`` puts together before it listens: the run's model on the generation
plan (as ``meshtrain generate`` restores it), its slotted cache, the compiled steps (warmed up), the
scheduler and the app.

Example::

    built = build_server("runs/smollm", None, RunConfig().with_values({"serve.max_batch": 4}), devices=1)
    built.app          # an ASGI app: uvicorn.run(built.app)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

from meshtrain.generation.api import load
from meshtrain.generation.runs import generation_recipe, read_run
from meshtrain.serving.app import make_app
from meshtrain.serving.protocol import ServedModel
from meshtrain.serving.scheduler import Scheduler
from meshtrain.serving.slots import MAX_JOIN, MIN_BUCKET, RowSampling, SamplingRows, Slots, join_rows


@dataclasses.dataclass(frozen=True)
class Built:
    app: object
    model: ServedModel
    scheduler: Scheduler
    description: str


def served_model(info, name: str, context: int) -> ServedModel:
    """The run's model as requests are checked against it (tokenizer, chat template, end ids)."""
    tokenizer = info.tokenizer
    template = info.chat_template()
    render = (lambda messages: template.render(messages, add_generation_prompt=True)) if template else None
    return ServedModel(name, context, info.cfg.vocab_size, tuple(info.end_ids),
                       tokenizer.encode if tokenizer is not None else None, render)


def warm_up(slots: Slots) -> None:
    """Compile the short prompts' prefill (1, 4 and 16 joining together) and every decode program
    (:meth:`Slots.programs`: each number of rows run with each cache span read) now, not at a request."""
    for joining in sorted({join_rows(j) for j in range(1, min(slots.n, MAX_JOIN) + 1)}):
        for length in (1, MIN_BUCKET + 1)[:1 + (slots.context > MIN_BUCKET)]:  # the next bucket: most chat prompts
            slots.admit_many([(b, [0] * length, RowSampling()) for b in range(min(joining, slots.n))])
    for used, end in slots.programs():
        slots.decode(np.zeros(slots.n, np.int32), np.full(slots.n, end - 1, np.int32), SamplingRows.empty(slots.n),
                     used)


def build_server(run_dir: str, step: Optional[int], cfg, devices: Optional[int]) -> Built:
    """The served model of ``run_dir`` under run configuration ``cfg`` (its ``serve`` and ``generation``
    sections: recipe, mesh, weight format)."""
    gen, serve = cfg.generation, cfg.serve
    info = read_run(run_dir, step)
    context = serve.context or info.cfg.max_seq_len
    recipe, mesh = gen.recipe, gen.mesh
    layout = cfg.recipe.overrides()  # --replicate-indivisible, --indivisible-heads
    if layout:
        recipe, mesh = generation_recipe(gen.recipe, info.recipe, gen.mesh).with_options(**layout), None
    loaded = load(run_dir, step=info.step, recipe=recipe, mesh=mesh, devices=devices, quantize=gen.quantize)
    slots = Slots(loaded.engine, serve.max_batch, context)
    warm_up(slots)
    name = serve.model_name or os.path.basename(os.path.normpath(str(info.folder or run_dir)))
    model = served_model(info, name, context)
    decode = info.tokenizer.decode if info.tokenizer is not None else (lambda ids: "")
    scheduler = Scheduler(slots, decode, max_queue=serve.max_queue, timeout_s=serve.request_timeout)
    plan = loaded.engine.plan
    description = (f"{slots.n} slots x {context} tokens, recipe {plan.recipe.name} on {plan.mesh.devices.size} "
                   f"device(s), weights {gen.quantize}")
    return Built(make_app(model, scheduler, serve.request_timeout), model, scheduler, description)
