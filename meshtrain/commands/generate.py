"""``meshtrain generate RUN``: continue prompts with a trained run's checkpoint (greedy or sampled),
or score them (``--max-new-tokens 0 --prompt-logprobs``).

The checkpoint is restored onto the generation recipe's plan: ``--recipe`` (no pipeline), else the
run's own recipe unless it has a pipeline, else ``fsdp``. Prompts of different lengths are
left-padded into one batch. Bad input (an empty prompt, one longer than the model's ``max_seq_len``,
``--max-new-tokens`` past it, ``--prompt`` text for a run trained on token ids, an unknown ``--step``,
``--stop-ids`` outside the vocabulary, a run that is not a decoder's or whose header is damaged)
prints one ``error:`` line and exits 2, before anything is restored.
"""

from __future__ import annotations

import json
import sys
from typing import List, Union

from meshtrain.commands.common import add_device_args
from meshtrain.errors import ConfigError
from meshtrain.generation.api import Loaded, load
from meshtrain.generation.engine import check_prompts, check_stop_ids
from meshtrain.generation.runs import read_run
from meshtrain.generation.sampling import Sampling
from meshtrain.generation.weights import WeightFormat, WeightMemory


def add_parser(sub):
    p = sub.add_parser("generate", help="continue or score prompts with a trained run (KV cache, any recipe)",
                       description="Continue prompts with a run's checkpoint: greedy by default, or sampled "
                                   "(--temperature, --top-k, --top-p, --seed). Prompts of different lengths are "
                                   "left-padded into one batch.")
    p.add_argument("run_dir", metavar="RUN", help="run folder (or its checkpoints/ folder)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeat for a batch); "
                     "needs a run with a tokenizer (the embedded corpus and text files are byte-level)")
    src.add_argument("--prompt-ids", action="append", metavar="IDS", help="a prompt as comma-separated token ids, "
                     "e.g. 1,2,3 (repeat for a batch)")
    src.add_argument("--prompts", metavar="FILE", help="one prompt per line: text, or in a .jsonl file a JSON "
                     "string (text) or list of token ids per line")
    p.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate per prompt (0: only "
                   "score the prompts, with --prompt-logprobs)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                   "probability reaches p (1: off)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    p.add_argument("--stop-ids", default=None, metavar="IDS", help="comma-separated token ids that end a prompt's "
                   "generation (the stop token is kept in the output)")
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="also report log p(each prompt token after the first | the tokens before it)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line: new_ids, new_text "
                   "(with a tokenizer), new_logprobs, prompt_logprobs (with --prompt-logprobs)")
    p.add_argument("--quantize", choices=[f.value for f in WeightFormat], default=WeightFormat.NONE.value,
                   help="store the weights as restored (none), in bf16, or int8 weight-only (per-channel scales)")
    p.add_argument("--offload-weights", dest="weight_memory", action="store_const", const=WeightMemory.HOST,
                   default=WeightMemory.DEVICE, help="keep the layer weights in host memory (pinned_host) and copy "
                   "each layer to the devices inside the step when it runs (ZeRO-Inference): device memory holds "
                   "one layer's weights")
    p.add_argument("--recipe", default=None, help="recipe to generate under (default: the run's, or fsdp when "
                   "the run's has a pipeline)")
    p.add_argument("--mesh", default=None, help="mesh size overrides, e.g. fsdp=4,tensor=2 (default: the recipe's)")
    add_device_args(p)
    p.set_defaults(run=run)


def _ids(text: str, flag: str) -> List[int]:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give comma-separated integer token ids, e.g. 1,2,3") from None


def read_prompts(args) -> List[Union[str, List[int]]]:
    if args.prompt is not None:
        return list(args.prompt)
    if args.prompt_ids is not None:
        return [_ids(t, "--prompt-ids") for t in args.prompt_ids]
    try:
        with open(args.prompts, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts {args.prompts!r}: cannot read it ({exc}); give a UTF-8 text file") from None
    if not args.prompts.endswith(".jsonl"):
        return lines
    out = []
    for n, line in enumerate(lines, 1):
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, int) for t in value))):
            raise ConfigError(f"--prompts {args.prompts!r} line {n}: give a JSON string or a list of token ids")
        out.append(value)
    return out


def run(args) -> int:
    info = read_run(args.run_dir, args.step)  # unknown step, not a decoder: before anything is restored
    prompts = read_prompts(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    stop_ids = check_stop_ids(info.cfg, _ids(args.stop_ids, "--stop-ids") if args.stop_ids else [])
    check_prompts(info.cfg, Loaded(None, info.tokenizer, info).encode(prompts), args.max_new_tokens)
    loaded = load(args.run_dir, step=info.step, recipe=args.recipe, mesh=args.mesh, devices=args.devices,
                  quantize=args.quantize, weight_memory=args.weight_memory)
    out = loaded.generate(prompts, args.max_new_tokens, sampling, stop_ids=stop_ids,
                          prompt_logprobs=args.prompt_logprobs)
    for i, g in enumerate(out.generations):
        if args.json:
            print(json.dumps(g.to_dict()))
            continue
        prompt = loaded.tokenizer.decode(g.prompt_ids) if loaded.tokenizer else " ".join(map(str, g.prompt_ids))
        new = g.new_text if g.new_text is not None else " ".join(map(str, g.new_ids))
        print(f"[{i}] {prompt!r} -> {new!r}  (log p {sum(g.new_logprobs):.3f} over {len(g.new_ids)} tokens"
              + (f"; prompt log p {sum(g.prompt_logprobs):.3f}" if g.prompt_logprobs is not None else "") + ")")
    sys.stdout.flush()
    return 0
