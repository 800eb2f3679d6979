"""``mt.generate``: generation from a model or a run folder, for notebooks and Trainer hooks.

Example::

    import meshtrain as mt
    out = mt.generate("runs/small", ["def main(", "import os\n"], max_new_tokens=32)
    print(out[0].new_text)
    mt.generate(model, [[1, 2, 3]], max_new_tokens=8, recipe="tp")   # an nnx Decoder
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Sequence, Union

from flax import nnx

from meshtrain.errors import ConfigError
from meshtrain.generation.engine import Engine, Generation
from meshtrain.generation.runs import RunInfo, generation_recipe, params_plan, read_run, restore_params
from meshtrain.generation.sampling import Sampling
from meshtrain.generation.tokenizer import ByteTokenizer, tokenizer_for_data
from meshtrain.generation.weights import WeightFormat, WeightMemory
from meshtrain.mesh import select_devices
from meshtrain.models import Decoder

Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """An :class:`Engine` with the tokenizer of its model (``None``: token ids only) and, for a run
    folder, what the folder said (:class:`RunInfo`)."""

    engine: Engine
    tokenizer: Optional[ByteTokenizer]
    run: Optional[RunInfo] = None

    def encode(self, prompts: Sequence[Prompt]) -> List[List[int]]:
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    where = f"run {str(self.run.directory)!r}" if self.run else "this model"
                    raise ConfigError(f"prompt {i} is text but {where} has no tokenizer (trained on token ids); "
                                      f"give token ids (--prompt-ids 1,2,3)")
                p = self.tokenizer.encode(p)
            out.append(list(p))
        return out

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, sampling: Sampling = Sampling(), *,
                 stop_ids: Sequence[int] = (), prompt_logprobs: bool = False):
        """The engine's :class:`~meshtrain.generation.engine.Output` for text or token-id prompts."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return self.engine.run(self.encode(prompts), max_new_tokens, sampling, stop_ids=stop_ids,
                               prompt_logprobs=prompt_logprobs, decode=decode)


def load(model_or_run: "Decoder | str | os.PathLike", *, step: Optional[int] = None, recipe=None,
         mesh: Optional[str] = None, devices: Optional[int] = None,
         quantize: "WeightFormat | str" = WeightFormat.NONE,
         weight_memory: "WeightMemory | str" = WeightMemory.DEVICE) -> Loaded:
    """An engine for an nnx :class:`~meshtrain.models.Decoder` (its parameters are placed on the plan)
    or a run folder (checkpoint ``step``, default the newest, restored onto the plan). ``recipe``
    default: the run's own unless it has a pipeline, else ``fsdp`` (a model: ``fsdp``); ``mesh``:
    size overrides (``"fsdp=4,tensor=2"``); ``devices``: the first N devices (default: all);
    ``weight_memory="host"``: the layer weights stay in host memory, streamed one layer at a time."""
    chosen = select_devices(devices)
    if isinstance(model_or_run, (str, os.PathLike)):
        info = read_run(os.fspath(model_or_run), step)
        rec = generation_recipe(recipe, info.recipe, mesh)
        params, plan = restore_params(info, rec, chosen)
        return Loaded(Engine(info.cfg, params, plan, weights=quantize, memory=weight_memory), info.tokenizer, info)
    if not isinstance(model_or_run, Decoder):
        raise ConfigError(f"generate: got {type(model_or_run).__name__}; pass a meshtrain Decoder (nnx) or a run "
                          f"folder path")
    if step is not None:
        raise ConfigError("step= applies to a run folder, not to a model")
    cfg = model_or_run.cfg
    plan = params_plan(cfg, generation_recipe(recipe, None, mesh), chosen)
    params = nnx.to_pure_dict(nnx.state(model_or_run, nnx.Param))
    return Loaded(Engine(cfg, params, plan, weights=quantize, memory=weight_memory),
                  tokenizer_for_data(None, cfg.vocab_size))


def generate(model_or_run: "Decoder | str | os.PathLike", prompts: "Prompt | Sequence[Prompt]",
             max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_ids: Sequence[int] = (), prompt_logprobs: bool = False,
             step: Optional[int] = None, recipe=None, mesh: Optional[str] = None, devices: Optional[int] = None,
             quantize: "WeightFormat | str" = WeightFormat.NONE,
             weight_memory: "WeightMemory | str" = WeightMemory.DEVICE) -> List[Generation]:
    """Continue each prompt (text, with a tokenizer, or a list of token ids; one prompt or a list) by up
    to ``max_new_tokens`` tokens: greedy (``temperature=0``) or sampled (``temperature``, ``top_k``,
    ``top_p``, ``seed``), stopping a row after any of ``stop_ids``. Returns one
    :class:`~meshtrain.generation.engine.Generation` per prompt. Prompts are left-padded in the batch
    (:mod:`meshtrain.generation.engine`); ``max_new_tokens=0, prompt_logprobs=True`` only scores them."""
    if isinstance(prompts, str) or (len(prompts) and not isinstance(prompts[0], (str, list, tuple))
                                    and not hasattr(prompts[0], "__len__")):
        prompts = [prompts]  # one prompt: text or a flat list of ids
    loaded = load(model_or_run, step=step, recipe=recipe, mesh=mesh, devices=devices, quantize=quantize,
                  weight_memory=weight_memory)
    sampling = Sampling(temperature, top_k, top_p, seed)
    out = loaded.generate(list(prompts), max_new_tokens, sampling, stop_ids=stop_ids,
                          prompt_logprobs=prompt_logprobs)
    return list(out.generations)
