"""Images: the 8x8 handwritten digits bundled with scikit-learn (``sklearn.datasets.load_digits``:
1797 greyscale images, 10 classes; no download), as numpy batches for ``vit-tiny`` / ``vit-small``.

Example::

    train = DigitsBatches(batch_size=64, seed=0)                  # split="train" (80 %)
    batch = next(train)     # {"images": (64, 8, 8, 1) float32, "labels": (64,) int32}
    train.state()           # {"samples_seen": 64, ...}: JSON, for checkpoints; train.restore(state)
    val = DigitsBatches(batch_size=64, split="val", shuffle=False)

Pixels (0..16) are scaled to [0, 1] and standardised with the mean and standard deviation of the
training split's pixels (two scalars), NHWC with one channel. The train/val split is one fixed
permutation (seeded by ``split_seed``), the same on every machine. Iteration is infinite; the order
is :mod:`meshtrain.data.rows`' (reshuffled each epoch by ``(seed, epoch)``).

Processes: ``batch_size`` is the *global* batch; process ``i`` of ``P`` gets the contiguous rows
``[i * B/P, (i + 1) * B/P)`` of each global batch (or the explicit ``rows``), so the processes'
batches stacked in process order are the one-process batch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from meshtrain.data.rows import EpochOrder, check_state, process_rows
from meshtrain.errors import ConfigError

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)


def load_digits_split(split: str = "train", val_fraction: float = 0.2, split_seed: int = 0
                      ) -> Tuple[np.ndarray, np.ndarray]:
    """``(images (N, 8, 8, 1) float32, labels (N,) int32)`` of one split of the digits."""
    try:
        from sklearn.datasets import load_digits  # optional dependency, needed only for this source
    except ImportError:
        raise ConfigError("the digits image source needs scikit-learn: pip install scikit-learn") from None
    if split not in ("train", "val"):
        raise ConfigError(f"split must be 'train' or 'val', not {split!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"validation fraction {val_fraction} must be between 0 and 1")
    digits = load_digits()
    images = (np.asarray(digits.images, np.float32) / 16.0)[..., None]
    labels = np.asarray(digits.target, np.int32)
    perm = np.random.default_rng(split_seed).permutation(len(labels))
    n_val = int(round(len(labels) * val_fraction))
    train_idx, val_idx = perm[n_val:], perm[:n_val]
    mean, std = float(images[train_idx].mean()), float(images[train_idx].std())
    idx = train_idx if split == "train" else val_idx
    return ((images[idx] - mean) / std).astype(np.float32), labels[idx]


class DigitsBatches:
    """Infinite, deterministic, resumable numpy batches ``{"images", "labels"}`` of the digits.

    Args:
      batch_size: the global batch size (a multiple of ``process_count``).
      seed: the shuffle seed (batch ``b`` is a function of ``(seed, b)`` only).
      split / val_fraction / split_seed: which examples (see :func:`load_digits_split`).
      shuffle: reshuffle every epoch (``False``: dataset order, for evaluation).
      process_index / process_count / rows: which rows of each global batch this process yields.
    """

    def __init__(self, batch_size: int, seed: int = 0, *, split: str = "train", val_fraction: float = 0.2,
                 split_seed: int = 0, shuffle: bool = True, process_index: int = 0, process_count: int = 1,
                 rows: Optional[Sequence[int]] = None):
        self.images, self.labels = load_digits_split(split, val_fraction, split_seed)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rows = process_rows(batch_size, process_index, process_count, rows)
        self.order = EpochOrder(len(self.labels), seed, shuffle)
        self.fingerprint = f"sklearn-digits:{split}:{val_fraction}:{split_seed}:{len(self.labels)}"
        self.samples_seen = 0

    @property
    def num_examples(self) -> int:
        return int(self.labels.shape[0])

    def local_batch(self, first_sample: int) -> Dict[str, np.ndarray]:
        """This process's rows of the global batch starting at sample ``first_sample``."""
        idx = np.array([self.order.example(first_sample + int(r)) for r in self.rows])
        return {"images": self.images[idx], "labels": self.labels[idx]}

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        batch = self.local_batch(self.samples_seen)
        self.samples_seen += self.batch_size
        return batch

    def state(self) -> Dict[str, Any]:
        return {"samples_seen": self.samples_seen, "seed": self.seed, "shuffle": self.shuffle,
                "source": self.fingerprint}

    def restore(self, state: Dict[str, Any]) -> None:
        """Continue from a :meth:`state` (the batch size and process count may differ)."""
        check_state(state, {"seed": self.seed, "shuffle": self.shuffle, "source": self.fingerprint}, "image data")
        self.samples_seen = int(state["samples_seen"])
