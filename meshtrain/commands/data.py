"""``meshtrain data``: build a tokenizer (``tokenizer``) and tokenize text into a folder the Trainer
reads (``prepare``).

Example::

    meshtrain data tokenizer --out tok/tokenizer.json --vocab-size 4096      # BPE on the embedded corpus
    meshtrain data prepare --tokenizer tok/tokenizer.json --input 'notes/*.txt' --out data/notes
    meshtrain train --data data/notes
"""

from __future__ import annotations

import os
import sys
import warnings

from meshtrain.data.prepare import InputFiles, gather_inputs, pieces, prepare_tokens
from meshtrain.data.corpus import corpus_texts
from meshtrain.data.tokenizer import load_tokenizer, train_bpe
from meshtrain.errors import ConfigError

#: The vocabulary of `meshtrain data tokenizer` by default: small enough for the `small` model's
#: embedding (4,096 × 256), large enough to cut the embedded corpus's length by about 3x (README).
DEFAULT_VOCAB = 4096
#: `data tokenizer` learns from at most this many MiB of text by default: the trainer's memory grows
#: with the distinct words it has seen (~0.3-0.4 GB for 32 MiB of prose or code, 2.6 GB for 32 MiB
#: of random base64: tools/bench_data_memory.py), its time with the text.
DEFAULT_MAX_TEXT_MB = 32


def add_parser(sub):
    p = sub.add_parser("data", help="build a tokenizer; tokenize text into a folder for --data",
                       description=__doc__.split("\n\n")[0])
    jobs = p.add_subparsers(dest="job", metavar="JOB", parser_class=type(p))
    jobs.required = True
    tok = jobs.add_parser("tokenizer", help="train a byte-level BPE tokenizer (default: on the embedded corpus)")
    tok.add_argument("--out", required=True,
                     help="the tokenizer.json to write (a folder: its tokenizer.json); an existing file is "
                          "replaced only when it is a tokenizer.json")
    tok.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                     help="ids in the vocabulary (258 .. 2^32; capped, with a warning, at what the text can make)")
    tok.add_argument("--input", nargs="+", default=None,
                     help="UTF-8 text / .jsonl files, folders or globs to learn from (default: the embedded corpus)")
    tok.add_argument("--text-field", default="text", help="the key holding the text in JSON lines")
    tok.add_argument("--max-text-mb", type=int, default=DEFAULT_MAX_TEXT_MB,
                     help="learn from at most this many MiB of the input (the same share of each file's start); "
                          "bounds time and memory")
    tok.set_defaults(run=run_tokenizer, setup_devices=False)
    prep = jobs.add_parser("prepare", help="tokenize text / JSON lines into a folder that `train --data` reads")
    prep.add_argument("--tokenizer", required=True,
                      help="a tokenizer.json, or a folder holding one (HuggingFace model folder, run folder)")
    prep.add_argument("--input", nargs="+", required=True,
                      help="UTF-8 text / .jsonl files, folders or glob patterns (each real file read once)")
    prep.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    prep.add_argument("--text-field", default=None,
                      help="the key holding the text in JSON lines (default: text; with --chat: messages)")
    prep.add_argument("--chat", action="store_true",
                      help="JSON lines of conversations ({\"messages\": [{\"role\": ..., \"content\": ...}]}), "
                           "rendered with the tokenizer's chat template; only the assistant's tokens are trained on")
    prep.add_argument("--progress", choices=("auto", "bar", "none"), default="auto",
                      help="a progress bar on stderr (auto: when it is a terminal)")
    prep.set_defaults(run=run_prepare, setup_devices=False)


def run_tokenizer(args) -> int:
    if args.max_text_mb < 1:
        raise ConfigError(f"--max-text-mb {args.max_text_mb}: give at least 1 (MiB of text to learn from)")
    skipped = ""
    if not args.input:
        texts, count, learned = _embedded_corpus()
        source = "the embedded corpus"
    else:
        gathered = gather_inputs(args.input)
        skipped = gathered.skipped_text()
        texts, count, learned = _sampled(gathered.files, args.text_field, args.max_text_mb << 20,
                                         source := f"--input {' '.join(args.input)}")
    tok = train_bpe(texts, args.vocab_size, args.out, text_bytes=learned, source=source)
    print(f"wrote {tok.path}: byte-level BPE, {tok.vocab_size:,} ids (eos {tok.eos_id}), learned from "
          f"{count:,} files{skipped}")
    return 0


def _embedded_corpus():
    """The embedded corpus's texts, its file count and UTF-8 size (under ``--max-text-mb``'s default)."""
    texts = corpus_texts()
    return iter(texts), len(texts), sum(len(t.encode("utf-8")) for t in texts)


def _sampled(files, text_field: str, budget: int, source: str):
    """The texts of ``files``, at most ``budget`` bytes of them (the same share of each file's start:
    every file is represented), the file count and the bytes to be read."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    limits = [None] * len(files)
    if total > budget:
        limits = [size * budget // total for size in sizes]
        warnings.warn(f"{source} holds {total / 2**20:,.1f} MiB; learning from {budget / 2**20:,.0f} MiB (the first "
                      f"{budget / total:.1%} of each file); --max-text-mb raises it")
    texts = (text for f, limit in zip(files, limits) for text, _ in pieces(f, text_field, limit))
    return texts, len(files), sum(size if limit is None else limit for size, limit in zip(sizes, limits))


def run_prepare(args) -> int:
    tok = load_tokenizer(args.tokenizer)
    if args.chat:
        return _prepare_chat(args, tok)
    show = args.progress == "bar" or (args.progress == "auto" and sys.stderr.isatty())
    meta = prepare_tokens(tok, args.input, args.out, text_field=args.text_field or "text", progress=show)
    print(f"wrote {args.out}: {meta['num_tokens']:,} tokens ({meta['dtype']}) in {meta['num_docs']:,} documents "
          f"from {len(meta['inputs']):,} files{InputFiles(meta['inputs'], meta['skipped_inputs']).skipped_text()}; "
          f"vocabulary {meta['vocab_size']:,}; train with "
          f"`meshtrain train --data {args.out}`")
    return 0


def _prepare_chat(args, tok) -> int:
    from meshtrain.data.chat import load_chat_template  # lazy: chat templates (jinja2) only for --chat
    from meshtrain.data.chat_sft import MESSAGES_FIELD, prepare_chat  # lazy: chat templates (jinja2) only for --chat

    folder = os.path.dirname(tok.path)
    template = load_chat_template(folder)
    if template is None:
        raise ConfigError(f"--chat: the tokenizer in {folder!r} has no chat template (no chat_template in its "
                          f"tokenizer_config.json, no chat_template.jinja); pass --tokenizer with a model's folder "
                          f"that has one, or prepare plain text without --chat")
    meta = prepare_chat(tok, template, args.input, args.out, field=args.text_field or MESSAGES_FIELD)
    print(f"wrote {args.out}: {meta['num_docs']:,} conversations, {meta['num_tokens']:,} tokens of which "
          f"{meta['target_tokens']:,} are the assistant's (the only ones trained on), from "
          f"{len(meta['inputs']):,} files; train with `meshtrain train --model RUN --init-from RUN --data {args.out}`")
    return 0
