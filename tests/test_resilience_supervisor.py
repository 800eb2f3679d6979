"""``meshtrain launch --max-restarts``: a killed or hung process restarts the whole job from its last
checkpoint, the run ends like an uninterrupted one (bit for bit), every attempt is in events.jsonl and
no process outlives the launcher. Faults are injected deterministically (``MESHTRAIN_FAULT``).
This file: the launcher's restart flags and the chaos benchmark (whose elastic mix also shows an elastic
restart finishing on the process left); the faults are in tests/test_resilience_faults.py, elastic growth
and the restart limit in tests/test_resilience_elastic.py (split so that two xdist workers share the
launches)."""

import os
import re
import sys

import processes
import pytest
from launch_jobs import ROOT, STEPS, bench, env, losses, records

from meshtrain.cli import main
from meshtrain.commands import launch as launch_cmd
from meshtrain.supervisor import Layout, attempt_config, describe, elastic_layouts


@pytest.mark.parametrize("extra, message", [
    (["--max-restarts", "2", "--", "train", "--steps", "3"], "--max-restarts needs the launched command's --out"),
    (["--max-restarts", "-1", "--", "train", "--out", "x"], "--max-restarts -1: give the number of restarts"),
    (["--max-restarts", "1", "--restart-backoff", "-1", "--", "train", "--out", "x"], "--restart-backoff -1"),
    (["--max-restarts", "1", "--", "plan", "--model", "tiny"], "--max-restarts restarts training runs"),
    (["--elastic", "--", "train", "--out", "x"], "--elastic applies to restarts: add --max-restarts K"),
    (["--elastic", "--max-restarts", "1", "--", "train", "--out", "x"], "--elastic needs the command's --batch-size"),
    (["--elastic", "--max-restarts", "1", "--", "train", "--batch-size", "8", "--mesh", "fsdp=4", "--out", "x"],
     "--elastic: remove --mesh from the command"),
])
def test_restart_flags_are_checked_before_anything_starts(extra, message, capsys, tmp_path):
    assert main(["launch", "--processes", "2", *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("[launch] ")]   # its notes
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], err


@pytest.mark.parametrize("cmd, resume", [
    (["train", "--out", "r"], "no"),
    (["train", "--resume", "--out", "r"], "latest"),
    (["train", "--resume", "no", "--out", "r"], "no"),
    (["train", "--set", "checkpoint.resume=latest", "--out", "r"], "latest"),
])
def test_restarts_resume_and_causes_are_named(cmd, resume):
    """The supervisor changes the typed configuration: a restart resumes, an elastic one scales
    grad_accum; what the command gave is read from its flags, --config or --set."""
    parsed = launch_cmd.parse_train(cmd)
    assert parsed.config.checkpoint.resume.value == resume
    assert attempt_config(parsed.config, 1).checkpoint.resume.value == "latest"
    assert attempt_config(parsed.config, 0) == parsed.config
    shrunk = attempt_config(launch_cmd.parse_train(["train", "--grad-accum", "2", "--out", "r"]).config, 1, Layout(1, 4))
    assert shrunk.recipe.options.grad_accum == 4 and shrunk.checkpoint.out == "r"

    def layouts(argv, n):
        got = launch_cmd.parse_train(["train", *argv])
        return elastic_layouts(got.config, got.given, n)

    assert layouts(["--batch-size", "8"], 2) == [Layout(2, 1), Layout(1, 2)]
    assert layouts(["--batch-size", "8", "--grad-accum=2"], 6) == \
        [Layout(6, 2), Layout(3, 4), Layout(2, 6), Layout(1, 12)]
    assert layouts(["--set", "data.batch_size=8", "--set", "recipe.options.grad_accum=2"], 2) == \
        [Layout(2, 2), Layout(1, 4)]
    assert describe(1, 137) == "process 1 killed by SIGKILL"
    assert describe(0, 134) == "coordinator (process 0) lost: killed by SIGABRT"
    assert describe(0, 75) == "process 0 found a hang (watchdog, exit 75)"
    assert describe(1, 1) == "process 1 exited with status 1"


# The restart limit through a real launch (every attempt killed: the launcher gives up after K restarts with the
# last status and cause) is checked on the elastic job that gives up anyway:
# tests/test_resilience_elastic.py::test_a_shrunk_run_grows_back_when_relaunched_on_more_processes.


@pytest.mark.slow
def test_chaos_benchmark_reports_its_figures(uninterrupted, tmp_path):
    """The benchmark's figures; its job is the tiny one of tests/launch_jobs.py (6 steps of 8 × 32 tokens, a
    checkpoint every step), so that its elastic mix's run also shows, against the session's uninterrupted run,
    that an elastic restart finishes on the process left with the same global batch (moved here from
    tests/test_resilience_elastic.py, which launched the same job and fault for it). That run is also the
    benchmark's reference (``--reference``: the same job, not launched a second time)."""
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "bench_resilience.py"), "--model", "tiny",
                         "--steps", str(STEPS), "--seq-len", "32", "--batch-size", "8", "--ckpt-every", "1",
                         "--mixes", "kill", "kill,elastic", "--work", str(tmp_path),
                         "--reference", str(uninterrupted)], env=env(), timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert re.search(r"kill of process \d at step \d+: RPO \d+ steps, RTO [0-9.]+ s", out.stdout), out.stdout
    assert re.search(r"mix kill: RPO [0-9.]+ steps, RTO [0-9.]+ s, goodput [0-9.]+%, slowdown [0-9.]+x, jitter "
                     r"[0-9.]+, elastic overhead 1.00, resilience 1.00, RS [0-9.]+, attempts 2, .*final state bit-identical", out.stdout)
    assert re.search(r"mix kill,elastic: .*elastic overhead [0-9.]+, resilience 1.00, .*attempts 2", out.stdout)
    assert "load average" in out.stdout and "'w3': 0.2" in out.stdout
    assert re.search(r"--hang-timeout \d+ \(scaled: ", out.stdout), out.stdout   # measured, not a fixed 6 s
    _assert_elastic_restart_finished_on_one_process(tmp_path / "kill-elastic", uninterrupted)


def test_chaos_benchmark_refuses_a_reference_that_is_not_an_uninterrupted_launch(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"event": "attempt", "unix": 1}\n{"event": "failed", "unix": 2}\n')
    with pytest.raises(SystemExit, match="not the folder of an uninterrupted launch .* it has .'attempt', 'failed'"):
        bench().recorded_wall(str(tmp_path))


def _assert_elastic_restart_finished_on_one_process(run, uninterrupted):
    """A 2-process run lost a process; the restart ran on 1 process (2 devices instead of 4) with --grad-accum 2:
    the same batch per device and globally, the loss curve within f32 rounding of the uninterrupted run."""
    attempts = [e for e in records(run / "events.jsonl") if e["event"] == "attempt"]
    assert [(a["processes"], a["grad_accum"]) for a in attempts] == [(2, 1), (1, 2)]
    assert records(run / "events.jsonl")[-1]["event"] == "done"
    starts = [r for r in records(run / "metrics.jsonl") if r.get("event") == "start"]
    assert [(r["mesh"], r["recipe_settings"]["grad_accum"]) for r in starts] == [({"fsdp": 4}, 1), ({"fsdp": 2}, 2)]
    assert [r["run_settings"]["batch_size"] for r in starts] == [8, 8]
    got, want = losses(run), losses(uninterrupted)
    assert got.keys() == want.keys()
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (got, want)
    assert "on 1 process(es) with --grad-accum 2" in open(str(run) + ".log").read()
