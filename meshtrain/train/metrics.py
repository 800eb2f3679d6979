"""Throughput and MFU, and where metrics go: ``metrics.jsonl``, TensorBoard, a progress display.

MFU (model FLOPs utilisation) = achieved model FLOP/s ÷ (peak FLOP/s per device × devices), with
model FLOPs per token = ``6 · N + 6 · L · T · n_heads · head_dim``: ``N`` is the parameter count
without the input embedding table (a lookup, not a matmul), the factor 6 is forward (2) plus
backward (4) per multiply-add, and the second term is attention's two ``T × T`` matmuls
(``QKᵀ`` and ``AV``, 4·T·n·h per token forward), halved because causal attention needs only the
lower triangle ("causal counted once"), times 3 for forward + backward. Without a known peak
(plain CPU), MFU is omitted, never invented.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, Optional

from meshtrain.models.decoder import DecoderConfig


def decoder_flops_per_token(cfg: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token of the reference decoder (formula in the module docstring)."""
    n_matmul = cfg.num_params() - cfg.vocab_size * cfg.d_model * (0 if cfg.tie_embeddings else 1)
    attention = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6.0 * n_matmul + attention


#: Peak dense bf16 FLOP/s per device by ``device.device_kind`` substring (vendor data sheets).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops(device) -> Optional[float]:
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


class MetricsWriter:
    """One JSON object per line in ``<run>/metrics.jsonl`` plus TensorBoard scalars in ``<run>/``.

    Only process 0 writes (``enabled=False`` elsewhere). The file is appended to, so a resumed run
    continues the same file.
    """

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(run_dir, flush_secs=10)

    def write(self, record: Dict[str, Any], scalars: Optional[Dict[str, float]] = None) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        for key, value in (scalars or {}).items():
            if value is not None:
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tb.close()
            self._file = None


class ProgressDisplay:
    """A live bar (rich) on a terminal, else a plain line every ``every`` steps."""

    def __init__(self, total: int, start: int, style: str, every: int, enabled: bool = True):
        self.total, self.every, self.enabled = total, max(every, 1), enabled
        self.style = style if style != "auto" else ("bar" if sys.stdout.isatty() else "lines")
        self._bar = None
        if enabled and self.style == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total, completed=start, info="compiling…")
            self._bar.start()

    def update(self, step: int, info: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif self.style == "lines" and (step % self.every == 0 or step == self.total or step <= 1):
            print(f"step {step:>6}/{self.total}  {info}", flush=True)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class Stopwatch:
    """Accumulates wall time per bucket (goodput accounting)."""

    def __init__(self):
        self.totals: Dict[str, float] = {}
        self.started = time.perf_counter()

    def add(self, bucket: str, seconds: float) -> None:
        self.totals[bucket] = self.totals.get(bucket, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
