"""``meshtrain data``: build a tokenizer (``tokenizer``) and tokenize text into a folder the Trainer
reads (``prepare``).

Example::

    meshtrain data tokenizer --out tok/tokenizer.json --vocab-size 4096      # BPE on the embedded corpus
    meshtrain data prepare --tokenizer tok/tokenizer.json --input 'notes/*.txt' --out data/notes
    meshtrain train --data data/notes
"""

from __future__ import annotations

import sys

from meshtrain.data.prepare import documents, input_files, prepare_tokens
from meshtrain.data.corpus import corpus_texts
from meshtrain.data.tokenizer import load_tokenizer, train_bpe

#: The vocabulary of `meshtrain data tokenizer` by default: small enough for the `small` model's
#: embedding (4,096 × 256), large enough to cut the embedded corpus's length by about 3x (README).
DEFAULT_VOCAB = 4096


def add_parser(sub):
    p = sub.add_parser("data", help="build a tokenizer; tokenize text into a folder for --data",
                       description=__doc__.split("\n\n")[0])
    jobs = p.add_subparsers(dest="job", metavar="JOB", parser_class=type(p))
    jobs.required = True
    tok = jobs.add_parser("tokenizer", help="train a byte-level BPE tokenizer (default: on the embedded corpus)")
    tok.add_argument("--out", required=True, help="the tokenizer.json to write")
    tok.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="ids in the vocabulary (>= 258)")
    tok.add_argument("--input", nargs="+", default=None,
                     help="text / .jsonl files, folders or globs to learn from (default: the embedded corpus)")
    tok.add_argument("--text-field", default="text", help="the key holding the text in JSON lines")
    tok.set_defaults(run=run_tokenizer, setup_devices=False)
    prep = jobs.add_parser("prepare", help="tokenize text / JSON lines into a folder that `train --data` reads")
    prep.add_argument("--tokenizer", required=True,
                      help="a tokenizer.json, or a folder holding one (HuggingFace model folder, run folder)")
    prep.add_argument("--input", nargs="+", required=True, help="text / .jsonl files, folders or glob patterns")
    prep.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    prep.add_argument("--text-field", default="text", help="the key holding the text in JSON lines")
    prep.add_argument("--progress", choices=("auto", "bar", "none"), default="auto",
                      help="a progress bar on stderr (auto: when it is a terminal)")
    prep.set_defaults(run=run_prepare, setup_devices=False)


def run_tokenizer(args) -> int:
    if args.input:
        files = input_files(args.input)
        texts = (doc for f in files for doc in documents(f, args.text_field))
    else:
        files = corpus_texts()   # the embedded corpus's documents (one per file)
        texts = iter(files)
    tok = train_bpe(texts, args.vocab_size, args.out)
    print(f"wrote {args.out}: byte-level BPE, {tok.vocab_size:,} ids (eos {tok.eos_id}), learned from "
          f"{len(files):,} files")
    return 0


def run_prepare(args) -> int:
    tok = load_tokenizer(args.tokenizer)
    show = args.progress == "bar" or (args.progress == "auto" and sys.stderr.isatty())
    meta = prepare_tokens(tok, args.input, args.out, text_field=args.text_field, progress=show)
    print(f"wrote {args.out}: {meta['num_tokens']:,} tokens ({meta['dtype']}) in {meta['num_docs']:,} documents "
          f"from {len(meta['inputs']):,} files; vocabulary {meta['vocab_size']:,}; train with "
          f"`meshtrain train --data {args.out}`")
    return 0
