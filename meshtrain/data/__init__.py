"""Data: token sources (byte-level text, the embedded default corpus, pre-tokenized files), packing
into fixed-length sequences with document boundaries, and a deterministic, resumable, per-process
batch iterator.

Example::

    source = load_source(None)                      # the Python standard library's own source
    train, val = source.split(0.01)
    it = BatchIterator(train, batch_size=16, seq_len=128, seed=0, shardings=plan.batch_shardings)
    batch = next(it)                                # dict of global jax.Arrays, laid out by the plan
    it.state()                                      # {"samples_seen": 16, ...}: JSON, for checkpoints
"""

from meshtrain.data.loader import BatchIterator
from meshtrain.data.packing import pack_window, num_sequences
from meshtrain.data.prepare import prepare_tokens
from meshtrain.data.sources import TokenSource, check_token_ids, default_corpus, load_source, text_source, token_file_source
from meshtrain.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

__all__ = ["BatchIterator", "ByteTokenizer", "load_tokenizer", "prepare_tokens", "train_bpe", "TokenSource", "check_token_ids", "default_corpus", "load_source", "num_sequences", "pack_window",
           "text_source", "token_file_source"]
