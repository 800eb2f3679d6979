"""Which tokenizer a run reads text with: the ``tokenizer.json`` in its folder (a run trained on
prepared data or imported from HuggingFace: :mod:`meshtrain.data.tokenizer`), else bytes for the
built-in language-model data (the embedded corpus and text files: one token per UTF-8 byte,
vocabulary 256); token files (``.npy`` / ``.bin``) carry none."""

from __future__ import annotations

from typing import Optional

from meshtrain.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_path


def tokenizer_for_data(data: Optional[str], vocab_size: int) -> Optional[ByteTokenizer]:
    """The byte tokenizer for a run trained on ``data`` (its ``--data``; ``None``: the embedded corpus)
    without a tokenizer file: bytes for the corpus and text files, none for token files or a
    vocabulary other than 256."""
    if vocab_size != 256:
        return None
    if data is not None and str(data).endswith((".npy", ".bin")):
        return None
    return ByteTokenizer()


def tokenizer_for_run(run_dir: str, data: Optional[str], vocab_size: int):
    """The run folder's ``tokenizer.json`` when it has one, else :func:`tokenizer_for_data`."""
    if tokenizer_path(run_dir) is not None:
        return load_tokenizer(run_dir)
    return tokenizer_for_data(data, vocab_size)
