"""Faults and damaged run folders (issue 18): a full disk or file-size limit at every write exits
74 (``EXIT_DISK``) with one line naming the file or checkpoint step, committed checkpoints intact;
a damaged ``metrics.jsonl`` is refused on ``--resume`` naming the file and line (a torn last line
is tolerated); a swallowed Ctrl-C still exits 130; a parameter-precision change on resume is said
loudly.

Disk cases run ``meshtrain train`` in a child (``ulimit -f``, or a 4 MiB tmpfs where this process
may mount one); the others call the CLI's ``main`` in this process (8 simulated devices).
"""

import json
import os
import shutil
import signal
import sys
import sysconfig

import processes
from helpers import FINISHED_TINY_FLAGS, finished_tiny_run
import pytest

from pathlib import Path

from meshtrain.checkpoint import Verify, integrity
from meshtrain.cli import main
from meshtrain.errors import EXIT_DISK

ROOT = os.path.dirname(os.path.dirname(__file__))
DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json")  # small: fast start-up
TRAIN = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--progress",
         "none", "--data", DATA]


def _child_env(write_cache: bool):
    """The suite's compilation cache is read (a program compiled before, by finished_run or another case, loads
    instead of compiling). A child under `ulimit -f` never writes it: an entry cut by the limit would be read
    by every later test (JAX writes an entry only for a compile that took at least
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, and reading writes nothing). A child on the small disk writes
    as usual: the cache is not on the disk it fills."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    if not write_cache:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1e12"
    return env


def _train_child(run, *args, shell_prefix="true", write_cache=False):
    argv = [sys.executable, "-m", "meshtrain", *TRAIN, "--out", run, *args]
    argv = ["bash", "-c", f'{shell_prefix}; exec "$@"', "bash", *argv]
    proc = processes.run(argv, timeout=600, env=_child_env(write_cache), cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def _committed_steps(run):
    """Step folders under checkpoints/, each of which must pass the quick check (intact)."""
    ckdir = Path(run) / "checkpoints"
    if not ckdir.is_dir():
        return []
    steps = sorted(integrity.step_dirs(ckdir))
    for s in steps:
        check = integrity.check_step(ckdir / str(s), s, Verify.QUICK)
        assert check.status.usable, (s, check)
    assert not integrity.tmp_dirs(ckdir)   # a failed save's temporary folder was removed
    return steps


def _error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.mark.slow
@pytest.mark.parametrize("free_kib, args, names, committed", [
    (0, ("--steps", "2"), ".meshtrain-run.lock before the run started: No space left on device", []),
    (12, ("--steps", "2"), "plan.json before the first step: No space left on device; free disk space", []),
    # TensorBoard's background writer used to die here and the next step hung on its full queue
    (28, ("--steps", "60", "--ckpt-every", "0"), "No space left on device; free disk space", []),
    # ~1.5 MiB a checkpoint of the tiny model: steps 2 and 4 fit in 4 MiB, step 6 does not
    (None, ("--steps", "8", "--ckpt-every", "2", "--keep-last", "100"), "not enough disk space to save step 6", None),
])
def test_full_disk_names_the_file_keeps_checkpoints_and_exits_74(small_disk, free_kib, args, names, committed):
    if free_kib is not None:
        with open(small_disk / "filler", "wb") as f:
            f.truncate(0)
        processes.run(["fallocate", "-l", f"{4096 - free_kib}k", str(small_disk / "filler")], check=True)
    run = str(small_disk / "run")
    code, out, err = _train_child(run, *args, write_cache=True)
    assert code == EXIT_DISK, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and names in lines[0], lines
    steps = _committed_steps(run)
    if committed is None:   # the checkpoint case: some committed, each intact, and named in the message
        assert steps and f"{steps}" in lines[0], (steps, lines)
    else:
        assert steps == committed


# -- a damaged metrics.jsonl on --resume ----------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run():
    """4 steps, checkpoints at 2 and 4 (these flags: TRAIN), trained once per session and shared with
    tests/test_run_safety.py (helpers.finished_tiny_run). Tests copy it before changing it."""
    assert TRAIN == FINISHED_TINY_FLAGS
    return finished_tiny_run()


def _copy(finished_run, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(finished_run, run)
    return run


def _lines(run):
    return open(os.path.join(run, "metrics.jsonl"), "rb").read().splitlines(keepends=True)


def _damage(run, kind):
    path = os.path.join(run, "metrics.jsonl")
    lines = _lines(run)
    if kind == "binary":
        lines.insert(2, b"\x89PNG\r\n\x1a\n\xff\xfe garbage\n")
    elif kind == "garbage line":
        lines.insert(2, b"this is not json\n")
    elif kind == "non-integer step":
        rec = json.loads(lines[1])
        rec["step"] = "two"
        lines[1] = (json.dumps(rec) + "\n").encode()
    elif kind == "null checkpoint step":
        lines.append(b'{"event": "checkpoint", "step": null}\n')
    elif kind == "not an object":
        lines.insert(1, b"[1, 2, 3]\n")
    if kind == "directory":
        os.remove(path)
        os.mkdir(path)
        return
    with open(path, "wb") as f:
        f.writelines(lines)


@pytest.mark.parametrize("kind, message", [
    ("binary", "line 3 is not text (binary data)"),
    ("garbage line", "line 3 is not JSON (Expecting value at column 1)"),
    ("non-integer step", "line 2 has step 'two', not a step number"),
    ("null checkpoint step", "has step None, not a step number"),
    ("not an object", "line 2 is a JSON list, not an object"),
    ("directory", "metrics.jsonl is a folder, not meshtrain's metrics log"),
])
def test_damaged_metrics_is_refused_naming_file_and_line(finished_run, tmp_path, capsys, kind, message):
    from test_run_safety import tree_digest

    run = _copy(finished_run, tmp_path)
    _damage(run, kind)
    before = tree_digest(run)
    code = main([*TRAIN, "--steps", "6", "--ckpt-every", "2", "--out", run, "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and os.path.join(run, "metrics.jsonl") in err and "Nothing was changed" in err, err
    assert tree_digest(run) == before   # every byte left on disk


@pytest.mark.slow
def test_torn_last_line_is_tolerated_and_a_param_dtype_change_is_said_loudly(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    with open(os.path.join(run, "metrics.jsonl"), "ab") as f:
        f.write(b'{"step": 5, "loss": 4.1, "grad_')   # the writer was killed mid-line
    code = main([*TRAIN, "--steps", "5", "--ckpt-every", "2", "--out", run, "--resume", "--param-dtype",
                 "bfloat16"])
    out = capsys.readouterr().out
    assert code == 0
    assert ("PARAMETER PRECISION CHANGED on resume: step 4 was saved with --param-dtype float32, this run trains "
            "with --param-dtype bfloat16") in out and "resume with --param-dtype float32" in out, out
    recs = [json.loads(line) for line in _lines(run)]
    restart = [r for r in recs if r.get("event") == "restart"]
    assert restart[-1]["param_dtype_changed"] == ["float32", "bfloat16"]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5]


# -- a file-size limit at every write ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("limit_kib, args, names, committed", [
    # plan.json (16 KiB) is the first file over 8 KiB
    (8, ("--steps", "2"), "plan.json before the first step: File too large; raise the file-size limit", []),
    # metrics.jsonl grows ~300 B a step: past 17 KiB within 60 steps (no checkpoints)
    (17, ("--steps", "60", "--ckpt-every", "0"), "metrics.jsonl at step", []),
    # each checkpoint's data file is ~0.5 MiB: the first save fails in Orbax (OCDBT, EFBIG)
    (200, ("--steps", "4", "--ckpt-every", "2"), "saving step 2 to", []),
])
def test_file_size_limit_names_the_file_and_exits_74(tmp_path, limit_kib, args, names, committed):
    # (after the small-disk cases and finished_run in this file: their programs, --steps 60 and 4, are cached)
    run = str(tmp_path / "run")
    code, out, err = _train_child(run, *args, shell_prefix=f"ulimit -f {limit_kib}")
    assert code == EXIT_DISK, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and names in lines[0] and ("ulimit -f" in lines[0]), lines
    assert _committed_steps(run) == committed


# -- Ctrl-C that lands where Python swallows it -----------------------------------------------------

def test_ctrl_c_swallowed_during_compile_still_exits_130(tmp_path, capsys, monkeypatch):
    """A SIGINT whose KeyboardInterrupt is raised inside a garbage-collector callback (as jax's
    ``_xla_gc_callback`` while a pipeline step compiles) is printed as "Exception ignored" and lost;
    the run used to train to the end and exit 0."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("this process does not have Python's default SIGINT handler")
    import jax.stages

    compile_ = jax.stages.Lowered.compile

    def compile_and_swallow(self, *args, **kwargs):
        try:
            signal.raise_signal(signal.SIGINT)   # the handler raises KeyboardInterrupt here ...
        except KeyboardInterrupt:
            pass                                 # ... where a gc callback or __del__ swallows it
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_and_swallow)
    # --steps 4: finished_run's program, loaded from the cache (a compile of a cached program still goes
    # through Lowered.compile, where the swallowed SIGINT lands)
    code = main([*TRAIN, "--steps", "4", "--ckpt-every", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 130, err
    assert "interrupted; no checkpoint was committed yet" in err and "Traceback" not in err, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # restored
