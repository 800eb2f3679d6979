"""``meshtrain generate RUN``: continue prompts with a trained run's checkpoint (greedy or sampled),
or score them (``--max-new-tokens 0 --prompt-logprobs``).

The checkpoint is restored onto the generation recipe's plan: ``--recipe`` (no pipeline), else the
run's own recipe unless it has a pipeline, else ``fsdp``. Prompts of different lengths are
left-padded into one batch. Bad input (an empty prompt, one longer than the model's ``max_seq_len``,
``--max-new-tokens`` past it, ``--prompt`` text for a run trained on token ids, an unknown ``--step``,
``--stop-ids`` outside the vocabulary, a run that is not a decoder's or whose header is damaged)
prints one ``error:`` line and exits 2, before anything is restored.

``--chat`` renders each text prompt as a user turn through the tokenizer's chat template (with
``--system TEXT`` a system turn before it; ``--messages FILE.json`` gives whole conversations), ending
with the assistant's header (:mod:`meshtrain.data.chat`). Generation stops at the run's
end-of-sequence ids unless ``--stop-ids`` names others (``none``: run to ``--max-new-tokens``). The
speed (prefill and decode tokens/s, compilation not counted: :mod:`meshtrain.generation.speed`)
closes the output; with ``--json`` each row carries it as ``speed``.
"""

from __future__ import annotations

import json
import sys
from typing import List, Union

from meshtrain.commands.common import add_device_args
from meshtrain.commands.run_flags import add_run_flags, preparer, resolved_of
from meshtrain.errors import ConfigError
from meshtrain.generation.api import Loaded, load
from meshtrain.generation.engine import check_prompts, check_stop_ids
from meshtrain.generation.runs import RunInfo, generation_recipe, read_run
from meshtrain.generation.sampling import Sampling
from meshtrain.generation.speed import Speed, compile_seconds
from meshtrain.generation.weights import WeightMemory
from meshtrain.settings import settings_of
from meshtrain.train.run_config import GenerationSection


#: The run configuration's settings `meshtrain generate` reads.
GENERATE_KEYS = tuple(f"generation.{s.name}" for s in settings_of(GenerationSection)) + (
    "distributed.devices", "recipe.options.replicate_indivisible", "recipe.options.indivisible_heads")


def add_parser(sub):
    p = sub.add_parser("generate", help="continue or score prompts with a trained run (KV cache, any recipe)",
                       description="Continue prompts with a run's checkpoint: greedy by default, or sampled "
                                   "(--temperature, --top-k, --top-p, --seed). Prompts of different lengths are "
                                   "left-padded into one batch.")
    p.add_argument("run_dir", metavar="RUN", help="run folder (or its checkpoints/ folder), or a HuggingFace model "
                   "folder (config.json + safetensors): what --model RUN|HF_DIR names for plan and train")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a text prompt (repeat for a batch); "
                     "needs a run with a tokenizer (the embedded corpus and text files are byte-level)")
    src.add_argument("--prompt-ids", action="append", metavar="IDS", help="a prompt as comma-separated token ids, "
                     "e.g. 1,2,3 (repeat for a batch)")
    src.add_argument("--prompts", metavar="FILE", help="one prompt per line: text, or in a .jsonl file a JSON "
                     "string (text) or list of token ids per line")
    src.add_argument("--messages", metavar="FILE.json", help="whole conversations through the tokenizer's chat "
                     "template: a JSON list of messages ([{\"role\": \"user\", \"content\": \"Hi\"}]) or a list "
                     "of such lists (a batch); generation continues as the assistant")
    p.add_argument("--chat", action="store_true", help="render each text prompt as a user turn through the "
                   "tokenizer's chat template (tokenizer_config.json's chat_template, carried by `meshtrain import`)")
    p.add_argument("--system", metavar="TEXT", default=None, help="with --chat: a system turn before each prompt")
    # The generation section of the run configuration: --max-new-tokens, --temperature, --top-k, --top-p,
    # --seed, --stop-ids, --quantize, --recipe, --mesh (help and defaults from there), --config and --set
    add_run_flags(p, GENERATE_KEYS)
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="also report log p(each prompt token after the first | the tokens before it)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line: new_ids, new_text "
                   "(with a tokenizer), new_logprobs, prompt_logprobs (with --prompt-logprobs), speed (the batch's "
                   "prefill and decode tokens/s)")
    p.add_argument("--offload-weights", dest="weight_memory", action="store_const", const=WeightMemory.HOST.value,
                   default=None, help="keep the layer weights in host memory (pinned_host) and copy each layer to "
                   "the devices inside the step when it runs (ZeRO-Inference): device memory holds one layer's "
                   "weights (generation.weight_memory: host)")
    add_device_args(p)
    p.set_defaults(run=run, prepare=preparer(GENERATE_KEYS))



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


def read_conversations(path: str) -> List[List[dict]]:
    """``--messages FILE.json``: one conversation (a list of messages) or a list of them."""
    from meshtrain.data.chat import check_messages  # lazy: chat templates (jinja2) only for --chat/--messages

    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"--messages {path!r}: cannot read it as JSON ({exc}); give a file such as "
                          f"[{{\"role\": \"user\", \"content\": \"Hi\"}}]") from None
    conversations = value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
    for conversation in conversations:
        check_messages(conversation, f"--messages {path!r}")
    return conversations


def chat_prompts(args, info: RunInfo, prompts) -> List[Union[str, List[int]]]:
    """The prompts as the chat template renders them (``--chat``, ``--messages``), else as given."""
    if not (args.chat or args.messages):
        if args.system is not None:
            raise ConfigError("--system TEXT adds a system turn to --chat prompts; add --chat")
        return prompts
    if args.prompt_ids is not None:
        raise ConfigError("--chat renders text prompts through the chat template; give --prompt TEXT, not "
                          "--prompt-ids")
    if args.messages and args.system is not None:
        raise ConfigError("--system with --messages: put the system turn in the file's conversations")
    template = info.chat_template()
    if template is None:
        what = ("has no tokenizer" if info.tokenizer is None or not hasattr(info.tokenizer, "path") else
                "has a tokenizer without a chat template (no chat_template in tokenizer_config.json, no "
                "chat_template.jinja)")
        raise ConfigError(f"--chat: run {str(info.folder)!r} {what}; give the prompt in the model's format without "
                          f"--chat, or import the model with its tokenizer_config.json")
    if args.messages:
        conversations = read_conversations(args.messages)
    else:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        conversations = [system + [{"role": "user", "content": p}] for p in prompts]
    return [template.render(c, add_generation_prompt=True) for c in conversations]


def stop_ids_of(setting, info: RunInfo) -> List[int]:
    """``--stop-ids``: the ids given, ``none`` for none, else the run's end-of-sequence ids."""
    if setting is None:
        return list(info.end_ids)
    if str(setting).strip().lower() == "none":
        return []
    return check_stop_ids(info.cfg, _ids(setting, "--stop-ids"))


def run(args) -> int:
    gen = resolved_of(args, GENERATE_KEYS).config.generation
    if gen.max_new_tokens is None:
        raise ConfigError("give --max-new-tokens N (tokens to generate per prompt; 0: only score the prompts), or "
                          "generation.max_new_tokens in --config / --set")
    info = read_run(args.run_dir, args.step)  # unknown step, not a decoder: before anything is restored
    prompts = chat_prompts(args, info, [] if args.messages else read_prompts(args))
    sampling = Sampling(gen.temperature, gen.top_k, gen.top_p, gen.seed)
    stop_ids = stop_ids_of(gen.stop_ids, info)
    ids = Loaded(None, info.tokenizer, info).encode(prompts)
    check_prompts(info.cfg, ids, gen.max_new_tokens)
    recipe, mesh = gen.recipe, gen.mesh
    layout = resolved_of(args, GENERATE_KEYS).config.recipe.overrides()  # --replicate-indivisible, --indivisible-heads
    if layout:
        recipe, mesh = generation_recipe(gen.recipe, info.recipe, gen.mesh).with_options(**layout), None
    loaded = load(args.run_dir, step=info.step, recipe=recipe, mesh=mesh, devices=args.devices,
                  quantize=gen.quantize, weight_memory=gen.weight_memory)
    sampling.key(0)  # compiles the key helpers now: their compile events name no step (speed.py counts the steps')
    with compile_seconds() as compiled:
        out = loaded.generate(prompts, gen.max_new_tokens, sampling, stop_ids=stop_ids,
                              prompt_logprobs=args.prompt_logprobs)
    gens = out.generations
    speed = Speed.of(out.timing, sum(map(len, ids)), sum(len(g.new_ids) for g in gens),
                     sum(1 for g in gens if g.new_ids), compiled)
    for i, g in enumerate(gens):
        if args.json:
            print(json.dumps({**g.to_dict(), "speed": speed.to_dict()}))
            continue
        prompt = loaded.tokenizer.decode(g.prompt_ids) if loaded.tokenizer else " ".join(map(str, g.prompt_ids))
        new = g.new_text if g.new_text is not None else " ".join(map(str, g.new_ids))
        print(f"[{i}] {prompt!r} -> {new!r}  (log p {sum(g.new_logprobs):.3f} over {len(g.new_ids)} tokens"
              + (f"; prompt log p {sum(g.prompt_logprobs):.3f}" if g.prompt_logprobs is not None else "") + ")")
    if not args.json:
        print(speed.line())
    sys.stdout.flush()
    return 0
