"""Throughput and MFU, and where metrics go: ``metrics.jsonl``, TensorBoard, a progress display.

MFU (model FLOPs utilisation) = achieved model FLOP/s ÷ (peak FLOP/s per device × devices), with
model FLOPs per token from :func:`meshtrain.analysis.model_flops_per_token` (``6·N + 6·L·n·h·T``,
formula in :mod:`meshtrain.analysis.flops`) and the peak from a hardware profile
(:mod:`meshtrain.analysis.hardware`). Without a known peak (plain CPU and no ``--hardware cpu``),
MFU is omitted, never invented.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, Optional

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.summary import scalar

from meshtrain.hardware import get_hardware
from meshtrain.train.rundir import METRICS_FILE, file_error, truncate_metrics

#: ``device.device_kind`` substring → hardware profile (:mod:`meshtrain.analysis.hardware`).
DEVICE_KINDS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200"), ("TPU v4", "tpu-v4"),
                ("TPU v5 lite", "tpu-v5e"), ("TPU v5e", "tpu-v5e"), ("TPU v5", "tpu-v5p"), ("TPU v6", "tpu-v6e"))


def hardware_of(device) -> Optional[str]:
    """The hardware profile of ``device`` by its device kind (``h100``, ``tpu-v5p``, ...); ``None`` for a kind
    without one (a CPU). ``--hardware``'s default in ``train`` (MFU's peak) and ``plan`` (``cpu`` then)."""
    kind = getattr(device, "device_kind", "").lower()
    return next((name for fragment, name in DEVICE_KINDS if fragment.lower() in kind), None)


def peak_flops(device, hardware: Optional[str] = None, num_devices: Optional[int] = None) -> Optional[float]:
    """Peak dense bf16 FLOP/s per device: from the named ``hardware`` profile (``cpu`` is measured
    on this host), else from the device kind; ``None`` when neither is known (plain CPU)."""
    if hardware is not None:
        return get_hardware(hardware, num_devices=num_devices).peak_flops
    name = hardware_of(device)
    return get_hardware(name).peak_flops if name is not None else None


class MetricsWriter:
    """One JSON object per line in ``<run>/metrics.jsonl`` plus TensorBoard scalars in ``<run>/``.

    Only process 0 writes (``enabled=False`` elsewhere). The file is appended to, so a resumed run
    continues the same file. A write that fails (full disk, file-size limit) raises
    :class:`~meshtrain.errors.DiskError` naming the file and the step.

    TensorBoard events are written synchronously (tensorboardX's ``EventsWriter``), not through
    ``SummaryWriter``'s background thread: on a full disk that thread dies with a traceback and the
    next ``add_scalar`` blocks for ever on its full queue (measured: a run hung at step 10).
    """

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path = os.path.join(run_dir, METRICS_FILE)
        try:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
            self._tb = EventsWriter(os.path.join(run_dir, "events"))
            self._tb.flush()
        except OSError as exc:
            failed = getattr(self._tb, "_file_name", None) or exc.filename or self.path
            self.close()
            raise file_error(failed, exc, "before the first step") from None

    def write(self, record: Dict[str, Any], scalars: Optional[Dict[str, float]] = None) -> None:
        if not self.enabled:
            return
        step = record.get("step")
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:
            raise file_error(self.path, exc, f"at step {step}") from None
        if not scalars:
            return
        now = time.time()
        try:
            for key, value in scalars.items():
                if value is not None:
                    self._tb.write_event(event_pb2.Event(wall_time=now, step=step or 0, summary=scalar(key, value)))
            self._tb.flush()
        except OSError as exc:
            raise file_error(self._tb._file_name, exc, f"at step {step}") from None

    def close(self) -> None:
        f, self._file = self._file, None
        tb, self._tb = self._tb, None
        for closable in (f, tb):
            try:
                if closable is not None:
                    closable.close()
            except OSError:   # a full disk on the last flush: already reported by write()
                pass


class ProgressDisplay:
    """A live bar (rich) on a terminal, else a plain line every ``every`` steps."""

    def __init__(self, total: int, start: int, style: str, every: int, enabled: bool = True):
        self.total, self.every, self.enabled = total, max(every, 1), enabled
        self.style = style if style != "auto" else ("bar" if sys.stdout.isatty() else "lines")
        self._bar = None
        if enabled and self.style == "bar":
            # rich only for a terminal's bar: its import is not paid by a logged run
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


def open_outputs(run_dir: str, plan, restart: Optional[Dict[str, Any]], is_main: bool,
                 header: Optional[Dict[str, Any]] = None) -> MetricsWriter:
    """plan.json and metrics.jsonl (truncated to the restored step on resume, then the ``restart``
    record) on process 0; the writer (disabled on other processes). ``header``: more fields of the run
    header (the Trainer's: ``run_settings``, ``model_config``), JSON values."""
    if is_main:
        dropped = truncate_metrics(run_dir, restart["restored_step"] if restart is not None else 0)
        if restart is not None:
            restart["superseded_records"] = dropped
    writer = MetricsWriter(run_dir, enabled=is_main)
    if is_main:
        path = os.path.join(run_dir, "plan.json")
        try:
            with open(path, "w") as f:
                f.write(plan.to_json())
        except OSError as exc:
            writer.close()
            raise file_error(path, exc, "before the first step") from None
    # The run header: every recipe setting this segment trains with (knobs and each dimension's options)
    # and the run's own (``header``).
    writer.write({"event": "start", "recipe": plan.recipe.name, "recipe_settings": plan.recipe.to_dict(),
                  "mesh": {axis: int(size) for axis, size in plan.mesh_sizes.items()}, **(header or {})})
    if restart is not None:
        writer.write({"event": "restart", **restart})
    return writer
