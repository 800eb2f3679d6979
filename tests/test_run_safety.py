"""Nothing lost and no tracebacks through `meshtrain train`: resume refuses what it cannot continue
safely, one run per folder, token ids and memory checked before step 1, and every bad input exits 2
with `error: ...` naming what to change.

Most cases call the CLI's ``main`` in this process (8 simulated devices from conftest); Ctrl-C
needs a real process.
"""

import hashlib
import json
import os
import shutil
import signal
import processes
from helpers import FINISHED_TINY_FLAGS, finished_tiny_run
import sys
import sysconfig
import threading
import time

import numpy as np
import pytest

from meshtrain.cli import main
from meshtrain.train.rundir import LOCK_FILE, RunLock

ROOT = os.path.dirname(os.path.dirname(__file__))
DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json")  # small: fast start-up
TRAIN = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--progress",
         "none", "--data", DATA]


def train(capsys, *args):
    code = main([*TRAIN, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def step_records(run):
    recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    return [r["step"] for r in recs if "loss" in r]


def tree_digest(folder):
    """sha256 of every file's bytes (lock files excluded: they name the last holder)."""
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".lock"):
                continue
            path = os.path.join(base, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished_run():
    """4 steps, checkpoints at 2 and 4 (these flags: TRAIN), trained once per session and shared with
    tests/test_faults.py (helpers.finished_tiny_run). Tests copy it before changing it."""
    assert TRAIN == FINISHED_TINY_FLAGS
    return finished_tiny_run()


def copy_run(src, dst):
    processes.run(["cp", "-r", src, str(dst)], check=True)
    return str(dst)


@pytest.mark.slow
def test_resume_with_every_checkpoint_corrupt_refuses_and_changes_nothing(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "corrupt")
    for step in ("2", "4"):
        files = sorted((os.path.join(b, f) for b, _, fs in os.walk(os.path.join(run, "checkpoints", step))
                        for f in fs), key=os.path.getsize)
        data = bytearray(open(files[-1], "rb").read())  # the largest file: array data
        data[len(data) // 2] ^= 0xFF
        open(files[-1], "wb").write(data)
    before = tree_digest(run)
    code, out, err = train(capsys, "--steps", "8", "--ckpt-every", "2", "--resume", "--out", run)
    assert code == 2
    assert "none is valid" in err and "step 2: corrupt" in err and "step 4: corrupt" in err
    assert "Traceback" not in err
    assert tree_digest(run) == before  # every checkpoint byte still there, metrics.jsonl unchanged


def test_resume_after_checkpoints_were_removed_refuses(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "removed")
    for entry in os.scandir(os.path.join(run, "checkpoints")):
        shutil.rmtree(entry.path) if entry.is_dir() else os.remove(entry.path)
    before = tree_digest(run)
    code, _, err = train(capsys, "--steps", "8", "--ckpt-every", "2", "--resume", "--out", run)
    assert code == 2 and "committed checkpoints" in err and "Nothing was changed" in err
    assert tree_digest(run) == before


@pytest.mark.slow
def test_resume_in_an_empty_folder_starts_a_new_run_and_says_so(tmp_path, capsys):
    # --steps 4: finished_run's program, loaded from the compilation cache
    code, out, _ = train(capsys, "--steps", "4", "--ckpt-every", "2", "--resume", "--out", str(tmp_path / "typo"))
    assert code == 0 and "no run in" in out and "starting a new run" in out


@pytest.mark.slow
def test_resume_truncates_superseded_metrics_records(finished_run, tmp_path, capsys):
    """A run killed after step 6 whose newest checkpoint is step 4: steps 5-6 are trained again and
    metrics.jsonl keeps one record per step."""
    run = copy_run(finished_run, tmp_path / "killed")
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        for step in (5, 6):
            f.write(json.dumps({"step": step, "loss": 9.0, "step_time_s": 0.1}) + "\n")
        f.write('{"step": 7, "loss": 9.')  # a line cut by the kill
    code, _, _ = train(capsys, "--steps", "6", "--ckpt-every", "2", "--resume", "--out", run)
    assert code == 0
    steps = step_records(run)
    assert steps == [1, 2, 3, 4, 5, 6]
    recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    restart = [r for r in recs if r.get("event") == "restart"][-1]
    assert restart["restored_step"] == 4 and restart["recomputed_steps"] == 2 and restart["superseded_records"] == 2
    assert all(r["loss"] != 9.0 for r in recs if "loss" in r)


def test_steps_at_or_below_the_saved_step(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "again")
    code, out, _ = train(capsys, "--steps", "4", "--ckpt-every", "2", "--resume", "--out", run)
    assert code == 0 and "already at step 4" in out
    code, _, err = train(capsys, "--steps", "3", "--ckpt-every", "2", "--resume", "--out", run)
    assert code == 2 and "already at step 4, past --steps 3" in err


@pytest.mark.slow
def test_resume_with_another_batch_size_and_eval_every(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "changed")
    code, out, err = train(capsys, "--steps", "5", "--ckpt-every", "2", "--resume", "--out", run,
                           "--batch-size", "16", "--eval-every", "5", "--eval-batches", "1")
    assert code == 0, err
    assert "--batch-size changed from 8 to 16" in out and "continues at sample 32" in out
    assert step_records(run) == [1, 2, 3, 4, 5]


def test_a_second_run_on_a_busy_folder_exits_2_naming_the_holder(tmp_path, capsys):
    run = str(tmp_path / "busy")
    holder = RunLock(run)  # another run holds it (flock conflicts across open files, in-process too)
    try:
        code, _, err = train(capsys, "--steps", "2", "--out", run)
    finally:
        holder.release()
    assert code == 2 and f"pid {os.getpid()}" in err and "in use" in err
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    run = tmp_path / "stale"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone-host", "since_unix": 0}))
    with pytest.warns(UserWarning, match="taking over the lock .* pid 999999 on host gone-host"):
        code, _, _ = train(capsys, "--steps", "4", "--out", str(run))   # finished_run's program: from the cache
    assert code == 0 and (run / LOCK_FILE).read_text() == ""  # released cleanly


def write_tokens(path, tokens):
    np.save(path, np.asarray(tokens))
    return str(path)


@pytest.mark.parametrize("case", ["too_large", "negative", "empty_npy", "zero_byte_npy", "short_bin", "unreadable"])
def test_bad_token_files_exit_2_before_step_1(case, tmp_path, capsys, monkeypatch):
    tokens = np.arange(10_000, dtype=np.int32) % 200
    expect = {"too_large": "token id 300 at position 7,777 is >= the model's vocabulary size 256",
              "negative": "token id -3 at position 12 is negative", "empty_npy": "is empty",
              "zero_byte_npy": "not a valid .npy", "short_bin": "fewer than 2 tokens", "unreadable": "cannot read"}
    if case == "too_large":
        tokens[7777] = 300
        data = write_tokens(tmp_path / "t.npy", tokens)
    elif case == "negative":
        tokens[12] = -3
        data = write_tokens(tmp_path / "t.npy", tokens)
    elif case == "empty_npy":
        data = write_tokens(tmp_path / "t.npy", np.zeros(0, np.uint16))
    elif case == "zero_byte_npy":
        data = str(tmp_path / "t.npy")
        open(data, "wb").close()
    elif case == "short_bin":
        data = str(tmp_path / "t.bin")
        open(data, "wb").write(b"x")
    else:  # root reads any file whatever its mode: an unreadable file is simulated
        data = write_tokens(tmp_path / "t.npy", tokens)

        def denied(*a, **k):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(np, "load", denied)
    code = main(["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0",
                 "--progress", "none", "--steps", "2", "--data", data, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and expect[case] in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["--lr", "nan"], "--lr nan: must be a positive finite number"),
    (["--lr", "inf"], "--lr inf: must be a positive finite number"),
    (["--devices", "100000"], "at most 512 simulated CPU devices"),
    (["--model", "llama3-8b", "--recipe", "dp"], "per device"),
    (["--recipe", "bad-rules.yaml"], "rules must be a mapping"),
    (["--recipe", "bad-fraction.yaml"], "max_replicated_fraction='high': use a number, e.g. 0.02"),
    (["--recipe", "bad-strategies.yaml"], "strategies must be a list of names"),
    (["--recipe", "bad-name.yaml"], "names logical axis 'emebd'"),
])
def test_bad_settings_exit_2_naming_the_fix(args, message, tmp_path, capsys, monkeypatch):
    yamls = {"bad-rules.yaml": "strategies: [fsdp]\nrules: 5\n",
             "bad-fraction.yaml": "strategies: [fsdp]\nmax_replicated_fraction: high\n",
             "bad-strategies.yaml": "strategies: fsdp\n",
             "bad-name.yaml": "strategies: [fsdp]\nrules: {params: {emebd: fsdp}}\n"}
    for name, body in yamls.items():
        (tmp_path / name).write_text("name: x\nmesh: {ici: {fsdp: -1}}\n" + body)
    monkeypatch.chdir(tmp_path)
    code, _, err = train(capsys, "--steps", "2", "--out", str(tmp_path / "run"), *[
        str(tmp_path / a) if a.endswith(".yaml") else a for a in args])
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_out_that_is_a_file_and_a_full_disk_for_plan_json(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = train(capsys, "--steps", "2", "--out", str(f))
    assert code == 2 and "is an existing file" in err
    run = tmp_path / "full"
    run.mkdir()
    os.symlink("/dev/full", run / "plan.json")  # every write: ENOSPC
    code, _, err = train(capsys, "--steps", "2", "--out", str(run))
    assert code == 74 and "cannot write" in err and "plan.json" in err and "No space left" in err


def test_metrics_writer_reports_a_full_disk(tmp_path):
    from meshtrain.errors import MeshtrainError
    from meshtrain.train.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path))
    w._file.close()
    w._file = open("/dev/full", "w", buffering=1)
    with pytest.raises(MeshtrainError, match="cannot write .*metrics.jsonl at step 3: No space left"):
        w.write({"step": 3, "loss": 1.0})
    w.close()


def test_abbreviated_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--step", "3"])
    assert exc.value.code == 2 and "unrecognized arguments: --step 3" in capsys.readouterr().err


def test_help_shows_every_default(capsys):
    """Every TrainConfig setting is a `meshtrain train` flag whose help shows its default (the flags are
    generated from the dataclass: a field added there appears here)."""
    from meshtrain.settings import settings_of
    from meshtrain.train.config import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    text = " ".join(text[text.index("options:"):].split())
    expected = {s.flag: s.plain(s.default) for s in settings_of(TrainConfig) if s.cli and s.default is not None}
    assert {"steps": 250, "batch_size": 16, "keep_last": 3, "memory_check": "on", "seed": 0,
            "weight_decay": 0.1, "resume": "no"}.items() <= expected.items()
    for flag, default in expected.items():
        block = text[text.index(" --" + flag.replace("_", "-") + " "):]
        assert f"(default: {default})" in block[:400], flag


def _start_training(run, tmp_path, *extra, shell_prefix=None):
    """``meshtrain train`` for up to 100,000 steps, checkpointing every 3; stdout lines are collected by
    a thread, stderr goes to a file (an unread pipe could fill and stall the child)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    # 2 devices, not the CLI's 8 simulated ones: each step and save costs less, the signals' paths are the same
    argv = [sys.executable, "-m", "meshtrain", *TRAIN, "--devices", "2", "--steps", "100000", "--ckpt-every", "3",
            "--log-every", "1", "--progress", "lines", "--out", run, *extra]
    if shell_prefix:  # e.g. `trap "" INT`: the child inherits SIG_IGN as from a non-interactive shell's `&`
        argv = ["bash", "-c", f'{shell_prefix}; exec "$@"', "bash", *argv]
    err = tmp_path / "stderr.txt"
    proc = processes.start(argv, env=env, cwd=ROOT, stdout=processes.PIPE, stderr=open(err, "w"))
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines, err


def _wait_for_step(proc, lines, step, err):
    deadline = time.monotonic() + 300
    while not any(f"step {step:6d}/" in l for l in lines):
        assert proc.poll() is None, f"exited {proc.returncode} before step {step}: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within 300 s: {err.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_exits_130_naming_the_last_committed_step(tmp_path):
    run = str(tmp_path / "ctrlc")
    proc, lines, err_file = _start_training(run, tmp_path)
    try:
        _wait_for_step(proc, lines, 7, err_file)
        proc.send_signal(signal.SIGINT)
        code = processes.wait(proc, timeout=120)
    finally:
        processes.kill(proc)
    err = err_file.read_text()
    assert code == 130, err
    assert "interrupted; last committed step" in err and "Traceback" not in err, err
    last = int(err.split("last committed step ")[1].split(";")[0])
    assert last >= 6 and last % 3 == 0 and os.path.isdir(os.path.join(run, "checkpoints", str(last)))


@pytest.mark.slow
def test_started_with_sigint_ignored_it_says_so_and_sigterm_still_stops_it(tmp_path):
    """A background job of a non-interactive shell inherits SIG_IGN for SIGINT. meshtrain keeps it
    ignored (as POSIX tools do: the terminal's Ctrl-C was not meant for that job), says so once, and
    SIGTERM still saves and exits 0."""
    run = str(tmp_path / "ignored")
    proc, lines, err_file = _start_training(run, tmp_path, shell_prefix='trap "" INT')
    try:
        _wait_for_step(proc, lines, 4, err_file)
        proc.send_signal(signal.SIGINT)
        _wait_for_step(proc, lines, 7, err_file)  # trains on
        proc.send_signal(signal.SIGTERM)
        code = processes.wait(proc, timeout=120)
    finally:
        processes.kill(proc)
    err = err_file.read_text()
    assert code == 0, err
    assert any("SIGINT is ignored (inherited from the parent process); stop this run with SIGTERM" in l
               for l in lines), lines[:5]
    assert "Traceback" not in err, err
    events = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r.get("event") == "preempted"]
    assert len(events) == 1 and os.path.isdir(os.path.join(run, "checkpoints", str(events[0]["step"])))
