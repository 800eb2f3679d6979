"""Hooks leave typed results on ``run.results`` (issue 34): the summary reads their fields, not string keys."""

from __future__ import annotations

import types

import pytest

from meshtrain.train.loop import EvalResult, RunResults, ThroughputResult, summary


class _Writer:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


def _run(results: RunResults):
    clock = types.SimpleNamespace(elapsed=lambda: 12.5)
    return types.SimpleNamespace(run_dir="runs/x", losses=[3.0, 2.5], results=results, clock=clock,
                                 writer=_Writer(), is_main=False, progress=None)


def test_the_summary_reads_each_hooks_typed_result():
    results = RunResults()
    results.throughput = ThroughputResult(examples_per_s=4.0, wall_s=10.0, goodput={"goodput": 0.5}, mfu=0.25,
                                          tokens_per_s=512.0)
    results.evaluation = EvalResult(loss=2.6, metrics={"accuracy": 0.4})
    results.preempted = True
    run = _run(results)
    s = summary(run, resumed_from=3)
    assert (s.first_loss, s.final_loss, s.eval_loss, s.eval_metrics) == (3.0, 2.5, 2.6, {"accuracy": 0.4})
    assert (s.tokens_per_s, s.mfu, s.wall_s, s.examples_per_s, s.goodput) == (512.0, 0.25, 10.0, 4.0, {"goodput": 0.5})
    assert s.preempted and s.resumed_from == 3
    assert run.writer.records[-1]["event"] == "summary" and run.writer.closed


def test_a_run_without_throughput_or_evaluation_hooks_still_summarises():
    s = summary(_run(RunResults()), resumed_from=None)
    assert (s.eval_loss, s.tokens_per_s, s.mfu, s.wall_s, s.goodput, s.preempted) == (None, None, None, 12.5, {}, False)


def test_results_are_typed_records():
    with pytest.raises(AttributeError):
        ThroughputResult(1.0, 2.0, {}).wall_s = 3.0   # frozen: a hook replaces its record, never edits another's
    assert not isinstance(RunResults(), dict)
