"""Text <-> token ids for generation. The built-in language-model data are byte-level (the embedded
corpus and text files: one token per UTF-8 byte, vocabulary 256; :mod:`meshtrain.data.sources`);
token files (``.npy`` / ``.bin``) carry no tokenizer."""

from __future__ import annotations

from typing import List, Optional, Sequence


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding replaces an incomplete or invalid sequence with U+FFFD."""

    name = "bytes"

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(t) for t in ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")


def tokenizer_for_data(data: Optional[str], vocab_size: int) -> Optional[ByteTokenizer]:
    """The tokenizer a run trained on ``data`` (its ``--data``; ``None``: the embedded corpus) reads text
    with: bytes for the corpus and text files, none for token files or a vocabulary other than 256."""
    if vocab_size != 256:
        return None
    if data is not None and str(data).endswith((".npy", ".bin")):
        return None
    return ByteTokenizer()
