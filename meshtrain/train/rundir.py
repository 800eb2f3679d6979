"""The run folder: one run at a time (an exclusive lock), what it already holds, and a
``metrics.jsonl`` that never holds two records for one step of one timeline.

* :class:`RunLock`: ``<run>/.meshtrain-run.lock``, an exclusive ``flock`` held for the whole run by
  process 0. A second ``train`` on the same folder fails at once naming the holder (host, pid). The
  kernel drops a ``flock`` when its process dies, so a lock left by a killed run is taken over with
  a warning that names the dead holder.
* :func:`inspect_run_dir`: what the folder holds (metrics records, checkpoint step folders), so the
  Trainer can start fresh only when there is no run at all.
* :func:`truncate_metrics`: on resume, records of steps after the restored one are superseded:
  they are removed from ``metrics.jsonl`` (the ``restart`` record says how many were recomputed).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import time
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

from meshtrain.data.tokenizer import TOKENIZER_FILE, copy_tokenizer_files
from meshtrain.errors import ConfigError, DiskError, disk_hint, is_disk_full

LOCK_FILE = ".meshtrain-run.lock"
METRICS_FILE = "metrics.jsonl"


class RunFolderBusy(ConfigError):
    """Another live process holds the run folder's lock."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Exclusive lock on a run folder for the whole run. ``RunLock(run_dir)`` raises
    :class:`RunFolderBusy` naming the holder; :meth:`release` (or process exit) frees it.

    Example::

        lock = RunLock("runs/demo")      # creates runs/demo if needed
        try:
            ...                          # train
        finally:
            lock.release()
    """

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        try:
            os.makedirs(run_dir, exist_ok=True)
            f = open(self.path, "a+")
        except OSError as exc:
            if is_disk_full(exc):
                raise file_error(self.path, exc, "before the run started") from None
            raise ConfigError(f"cannot use run folder {run_dir!r}: {exc.strerror or exc}; pass an --out folder "
                              f"you can write to") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(f)
            f.close()
            raise RunFolderBusy(f"run folder {run_dir!r} is in use by {_describe(holder)}; wait for it to finish, "
                                f"stop it, or pass another --out") from None
        previous = _read_holder(f)
        if previous:   # the last holder died without releasing (killed): its flock went with it
            alive = previous.get("host") == socket.gethostname() and _pid_alive(int(previous.get("pid", -1)))
            state = "still running but not holding the lock" if alive else "no longer running"
            warnings.warn(f"taking over the lock of run folder {run_dir!r} from {_describe(previous)} ({state}; "
                          f"it stopped without releasing it)", stacklevel=2)
        try:
            f.seek(0)
            f.truncate()
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}, f)
            f.flush()
        except OSError as exc:
            try:
                f.close()   # drops the flock: nothing of this run started
            except OSError:   # the same full disk, flushing what json.dump buffered
                pass
            raise file_error(self.path, exc, "before the run started") from None
        self._file = f

    def release(self) -> None:
        """Free the lock and empty the file (an empty file means: released cleanly). Idempotent."""
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.flush()
        except OSError:
            pass
        self._file.close()   # closing drops the flock
        self._file = None


def _read_holder(f) -> dict:
    try:
        f.seek(0)
        text = f.read().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process"
    since = holder.get("since_unix")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{when}"


@dataclasses.dataclass(frozen=True)
class RunContents:
    """What a run folder already holds."""

    exists: bool
    metric_steps: int        # step records in metrics.jsonl
    last_metric_step: Optional[int]
    checkpoint_steps: tuple  # committed step folders (valid or not)
    committed_steps: tuple = ()  # ``checkpoint`` records of metrics.jsonl: steps once committed

    @property
    def has_run(self) -> bool:
        return bool(self.metric_steps or self.checkpoint_steps)

    def describe(self) -> str:
        parts = []
        if self.metric_steps:
            parts.append(f"metrics.jsonl up to step {self.last_metric_step}")
        if self.checkpoint_steps:
            parts.append(f"checkpoint steps {list(self.checkpoint_steps)[-5:]}")
        return ", ".join(parts) or "nothing"


def inspect_run_dir(run_dir: str, checkpoint_dir: Optional[str] = None) -> RunContents:
    """Count the step records of ``metrics.jsonl`` and the step folders under ``checkpoints/``."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"--out {run_dir!r} is an existing file, not a folder; pass a folder path")
    steps, committed = [], []
    path = os.path.join(run_dir, METRICS_FILE)
    if os.path.lexists(path):
        for rec in read_records(path):
            if isinstance(rec.get("step"), int) and "loss" in rec:
                steps.append(rec["step"])
            elif rec.get("event") == "checkpoint":
                committed.append(rec.get("step"))
    ckpt_dir = checkpoint_dir or os.path.join(run_dir, "checkpoints")
    ckpts = tuple(sorted(int(n) for n in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []) if n.isdigit()))
    return RunContents(os.path.isdir(run_dir), len(steps), max(steps) if steps else None, ckpts,
                       tuple(sorted(set(committed))))


def file_error(path: str, exc: OSError, when: str) -> ConfigError:
    """The error for a run file that could not be written: a :class:`DiskError` (its own exit code)
    for a full disk or file-size limit, else a :class:`ConfigError` (e.g. a folder in its place)."""
    reason = exc.strerror or str(exc)
    if is_disk_full(exc):
        return DiskError(f"cannot write {path} {when}: {reason}; {disk_hint(exc)}, then continue with --resume "
                         f"(committed checkpoints are intact)")
    return ConfigError(f"cannot write {path} {when}: {reason}; fix that path or pass another --out")


def read_records(path: str):
    """The JSON objects of a ``metrics.jsonl``, oldest first.

    A torn last line (no newline at the end of the file: the writer was killed mid-line) is skipped;
    that is the only damage a crash leaves. Anything else (bytes that are not text, a line that is
    not a JSON object, a ``step`` that is not a step number, a folder in the file's place) raises
    :class:`ConfigError` naming the file and line, and leaves the file as it is."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is {'a folder' if os.path.isdir(path) else 'not a regular file'}, not meshtrain's "
                          f"metrics log. Nothing was changed: move it away, or pass another --out")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            rec = _parse_line(path, number, raw)
            if rec is not None:
                yield rec


def _parse_line(path: str, number: int, raw: bytes) -> Optional[dict]:
    """One line's record; ``None`` for a blank or torn last line; ConfigError for anything else."""
    if not raw.strip():
        return None
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        problem = "is not text (binary data)"
    except json.JSONDecodeError as exc:
        if not raw.endswith(b"\n"):   # the last line, cut by a kill: its record was never complete
            return None
        problem = f"is not JSON ({exc.msg} at column {exc.colno})"
    else:
        problem = _record_problem(rec)
        if problem is None:
            return rec
    raise ConfigError(f"{path} line {number} {problem}; meshtrain writes one JSON object per line. Nothing was "
                      f"changed: repair or delete that line (a cut last line is ignored), or pass another --out")


def _record_problem(rec) -> Optional[str]:
    if not isinstance(rec, dict):
        return f"is a JSON {type(rec).__name__}, not an object"
    step = rec.get("step")
    needs_step = "loss" in rec or rec.get("event") in ("checkpoint", "preempted")
    if (needs_step or "step" in rec) and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        return f"has step {step!r}, not a step number (an integer >= 0)"
    return None


def truncate_metrics(run_dir: str, restored_step: int) -> int:
    """Drop the records of steps after ``restored_step`` (and partial lines) from ``metrics.jsonl``:
    those steps will be trained again, and one timeline keeps one record per step. Events (restart,
    preempted, summary) of earlier segments stay. Atomic (write + rename). Returns records dropped."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.lexists(path):
        return 0
    kept, dropped = [], 0
    for rec in read_records(path):
        step = rec.get("step")
        if isinstance(step, int) and step > restored_step and rec.get("event") in (None, "checkpoint"):
            dropped += 1
            continue
        kept.append(rec)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            for rec in kept:
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:   # the original is untouched; the partial copy must not take up the space
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise file_error(tmp, exc, "while rewriting the metrics log for the resume") from None
    os.replace(tmp, path)
    return dropped



def resume_step(run_dir: str, resume_latest: bool, ckpt, notice: Callable[[str], None]) -> Optional[int]:
    """The step to resume from, or ``None`` for a new run; refuses (ConfigError) whenever going on
    would lose or overwrite something. Nothing is deleted here."""
    contents = inspect_run_dir(run_dir)
    if not resume_latest:
        if contents.has_run:
            raise ConfigError(f"run folder {run_dir!r} already holds a run ({contents.describe()}); "
                              f"pass --resume to continue it or choose another --out")
        return None
    if not contents.checkpoint_steps and ckpt.peer_step() is None:   # peers: in-memory copies only
        if contents.committed_steps:
            raise ConfigError(
                f"cannot resume {run_dir!r}: its metrics.jsonl records committed checkpoints (steps "
                f"{list(contents.committed_steps)[-5:]}) but checkpoints/ holds no step folder. Nothing was "
                f"changed. Put the checkpoints back, or pass another --out to start a new run")
        if contents.metric_steps:
            notice(f"{run_dir}: the earlier run stopped at step {contents.last_metric_step} before "
                   f"its first checkpoint was committed; starting again from step 0")
        else:
            notice(f"--resume: no run in {run_dir} yet; starting a new run there")
        return None
    step = ckpt.latest_valid_step()
    if step is None:
        found = "; ".join(f"step {s}: {c.status.value} ({c.reason})" for s, c in
                          ((s, ckpt.check(s)) for s in ckpt.all_steps()))
        raise ConfigError(f"cannot resume {run_dir!r}: it holds checkpoints but none is valid: {found}. "
                          f"Nothing was changed. Inspect them with `meshtrain ckpt list "
                          f"{os.path.join(run_dir, 'checkpoints')}`, put a good copy back, or pass "
                          f"another --out to start a new run")
    return step


def work_after(run_dir: str, step: int) -> Tuple[int, float]:
    """Logged steps after ``step`` since the last restart: (how many, their seconds), to be recomputed."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return 0, 0.0
    done: Dict[int, float] = {}
    for rec in read_records(path):   # skips a line cut by a kill
        if "loss" in rec and rec.get("step", 0) > step:
            seconds = rec.get("step_time_s")
            done[rec["step"]] = float(seconds) if isinstance(seconds, (int, float)) else 0.0
        elif rec.get("event") == "restart":
            done = {}
    return len(done), float(sum(done.values()))


def restart_changes(restored, batch_size: int, param_dtype: str, notice: Callable[[str], None]) -> Dict[str, Any]:
    """Say loudly what a resume changes (batch size, parameter dtype); the ``restart`` record's fields."""
    changes: Dict[str, Any] = {}
    saved_batch = (restored.metadata or {}).get("batch_size")
    if saved_batch is not None and saved_batch != batch_size:
        samples = restored.data_state.get("samples_seen")
        notice(f"--batch-size changed from {saved_batch} to {batch_size} on resume: the data continues "
               f"at sample {samples} (no sample is skipped or repeated); steps continue from "
               f"{restored.step}, so each later step sees {batch_size} sequences and the learning-rate "
               f"schedule stays indexed by step")
        changes["batch_size_changed"] = [saved_batch, batch_size]
    saved = ((restored.metadata or {}).get("recipe") or {}).get("param_dtype")
    if saved is not None and str(saved) != param_dtype:
        saved, now = str(saved), param_dtype
        notice(f"PARAMETER PRECISION CHANGED on resume: step {restored.step} was saved with --param-dtype "
               f"{saved}, this run trains with --param-dtype {now}. "
               + ("The parameters are rounded to bfloat16 for the model and their float32 values continue as "
                  "master weights in the optimizer state (no update is lost), but the loss is computed in "
                  "lower precision from here on" if now == "bfloat16" else
                  "The float32 master weights become the parameters")
               + f"; to continue in {saved} instead, stop now and resume with --param-dtype {saved}")
        changes["param_dtype_changed"] = [saved, now]
    return changes


def copy_tokenizer(data: Optional[str], run_dir: str) -> Optional[str]:
    """Copy the tokenizer of a prepared token folder ``data`` (``meshtrain data prepare``) into the
    run folder, so that the run alone says how its ids read as text (``meshtrain generate``); the
    copy's path, or ``None`` when ``data`` has no tokenizer (byte-level text, the embedded corpus)."""
    try:
        return copy_tokenizer_files(data, run_dir)
    except OSError as exc:
        raise file_error(os.path.join(run_dir, TOKENIZER_FILE), exc, "before the first step") from None
