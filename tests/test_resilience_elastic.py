"""``meshtrain launch --max-restarts K --elastic``: a restart after a lost process runs on the processes left
with the same global batch (--grad-accum), a shrunk run grows back when relaunched on more, and a shrink
that cannot fit names the smallest device count that does; a job that fails more than K times gives up."""

import dataclasses
import sys

import processes
import pytest
from launch_jobs import ROOT, TRAIN, env, launch, losses, records

from meshtrain.commands import launch as launch_cmd, launch_fit
from meshtrain.supervisor import Layout, Supervisor


# An elastic restart that finishes on the one process left (same global batch, losses within f32 rounding) is
# checked on the chaos benchmark's elastic mix, the same job and fault:
# tests/test_resilience_supervisor.py::test_chaos_benchmark_reports_its_figures.


@pytest.mark.slow
def test_a_shrunk_run_grows_back_when_relaunched_on_more_processes(uninterrupted, tmp_path):
    """Elastic growth: a 2-process run shrinks to 1 process (--elastic), loses that one too and stops; relaunched
    on 2 processes with --resume it continues on more processes than its last segment had: 3 meshes in the run
    header, the same global batch, the loss curve within f32 rounding of the uninterrupted one."""
    out = tmp_path / "run"
    shrink = launch(out, "--max-restarts", "1", "--restart-backoff", "0", "--elastic",
                    fault="kill@step=2,process=1,attempt=0;kill@step=4,process=0,attempt=1")
    assert shrink.returncode == 137, shrink.stderr[-3000:]
    # the restart limit (moved here from test_resilience_supervisor.py, which launched a job of its own for it):
    # after --max-restarts 1 the launcher gives up with the last attempt's status and names its cause
    events = records(out / "events.jsonl")
    assert [e["event"] for e in events if e["event"] in ("attempt", "failed", "gave_up")] == \
        ["attempt", "failed", "attempt", "failed", "gave_up"]
    assert events[-1]["event"] == "gave_up" and events[-1]["reason"] == "1 restart(s) used"
    assert ("giving up after 2 attempt(s): coordinator (process 0) lost: killed by SIGKILL; exit status 137"
            in shrink.stderr), shrink.stderr[-3000:]
    grow = processes.run([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                          "2", "--grace", "2", "--", *TRAIN, "--out", str(out), "--resume"], env=env(), timeout=900,
                         cwd=ROOT)
    assert grow.returncode == 0, grow.stderr[-3000:]
    starts = [r for r in records(out / "metrics.jsonl") if r.get("event") == "start"]
    assert [(r["mesh"], r["recipe_settings"]["grad_accum"]) for r in starts] == \
        [({"fsdp": 4}, 1), ({"fsdp": 2}, 2), ({"fsdp": 4}, 1)]
    assert [r["run_settings"]["batch_size"] for r in starts] == [8, 8, 8]
    got, want = losses(out), losses(uninterrupted)
    assert got.keys() == want.keys()
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (got, want)


@pytest.fixture(scope="module")
def tiny_fits():
    """The pre-flight estimate of the tiny fsdp job on 2 × 2 and 1 × 2 devices (planned in a child process)."""
    layouts = [Layout(2, 1), Layout(1, 2)]
    given = launch_cmd.parse_train(TRAIN + ["--out", "x"])
    fits = launch_fit.check_layouts(given.config.to_dict(only=given.given), layouts, 2, 2 ** 40)
    assert [(f.processes, f.devices) for f in fits] == [(2, 4), (1, 2)] and fits[0].needs < fits[1].needs
    return layouts, fits


@pytest.mark.parametrize("host, want", [
    ("plenty", None),                                              # fits: the exit 2 had another cause
    ("between", "the smallest device count that fits is 4 (2 process(es) × 2 devices)"),
    ("none", "no layout of this job fits"),
])
def test_an_elastic_shrink_that_does_not_fit_names_the_smallest_device_count(host, want, tiny_fits, tmp_path):
    layouts, fits = tiny_fits
    per_device = {"plenty": 2 ** 40, "between": int(fits[0].needs / 0.9) + 1, "none": fits[0].needs // 2}[host]
    fits = [dataclasses.replace(f, limit=per_device) for f in fits]
    told = launch_fit.explain(fits, layouts[1], 2)
    if want is None:
        assert told is None and launch_fit.explain(fits, layouts[0], 2) is None
        return
    assert told.startswith("--elastic: the run does not fit on 2 devices (1 process(es) × 2, --grad-accum 2): the "
                           "plan needs ~") and want in told, told
    said = []
    sup = Supervisor(lambda k: [(137, 1, False), (2, 0, False)][k], str(tmp_path), 3, 0.0, said.append,
                     layout=lambda k: layouts[min(k, 1)], explain=lambda k, status: told if k else None)
    assert sup.run() == 2 and said[-1] == f"error: {told}"
    assert records(tmp_path / "events.jsonl")[-1]["reason"] == f"status 2 is not retried: {told}"
