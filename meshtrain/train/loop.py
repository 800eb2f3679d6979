"""The training loop as a step generator plus hooks.

:func:`train_steps` compiles the train step and yields one :class:`StepInfo` per step (the step's
metrics record, its loss, the new state); it owns only what every step needs: the non-finite
policy, the Ctrl-C check, the compute and data-wait timers. :func:`run_loop` drives it and calls
the hooks (:mod:`meshtrain.train.hooks`): checkpointing, evaluation, metrics, progress, throughput
and preemption are hooks like any a user adds. :class:`Run` is what hooks see of the run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

from meshtrain.errors import MeshtrainError
from meshtrain.interrupts import InterruptGuard
from meshtrain.plan import ShardingPlan
from meshtrain.train.config import TrainConfig, lr_schedule
from meshtrain.train.metrics import MetricsWriter, ProgressDisplay, Stopwatch
from meshtrain.train.step import RESERVED_METRICS, NonFinite


class TrainingError(MeshtrainError):
    """Training cannot go on (a non-finite loss under ``--nonfinite raise``, too many skipped steps)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the loop stopped, a save in flight was finished; ``last_committed`` is the step a
    ``--resume`` continues from (``None``: no checkpoint)."""

    def __init__(self, last_committed: Optional[int], checkpointing: bool = True):
        self.last_committed = last_committed
        if last_committed is not None:
            where = f"last committed step {last_committed}; continue with --resume"
        elif checkpointing:
            where = "no checkpoint was committed yet; a new run starts from step 0"
        else:
            where = "no checkpoint was committed (pass --ckpt-every N to make runs resumable)"
        super().__init__(where)


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    run_dir: str
    steps: int
    first_loss: Optional[float]
    final_loss: Optional[float]
    eval_loss: Optional[float]
    tokens_per_s: Optional[float]
    mfu: Optional[float]
    wall_s: float
    goodput: Dict[str, float]
    preempted: bool = False
    resumed_from: Optional[int] = None
    already_done: bool = False  # --resume of a run already at --steps: nothing trained
    examples_per_s: Optional[float] = None
    eval_metrics: Optional[Dict[str, float]] = None  # the last evaluation's metrics besides the loss


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One trained step. ``record`` is the step's ``metrics.jsonl`` record: hooks that run before
    :class:`~meshtrain.train.hooks.MetricsHook` may add fields to it (evaluation, MFU, your own)."""

    step: int
    loss: Optional[float]          # None: a non-finite step that was skipped
    record: Dict[str, Any]
    state: Any                     # the TrainState after this step
    batch: Any                     # the global batch this step trained on
    step_time_s: float
    last: bool                     # step == config.steps


@dataclasses.dataclass(frozen=True)
class Stop:
    """Returned by a hook's ``on_step``: end the run after this step (the other hooks still see it)."""

    reason: str


@dataclasses.dataclass(frozen=True)
class ThroughputResult:
    """What :class:`~meshtrain.train.hooks.ThroughputHook` measured over the run: the median rate
    (``None`` before a step was timed), the wall time, the goodput breakdown (seconds per activity,
    and ``goodput`` = compute / wall) and the MFU where the peak is known."""

    examples_per_s: Optional[float]
    wall_s: float
    goodput: Dict[str, float]
    mfu: Optional[float] = None
    tokens_per_s: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The last evaluation of :class:`~meshtrain.train.hooks.EvalHook`: mean loss and other metrics."""

    loss: Optional[float]
    metrics: Dict[str, float]


@dataclasses.dataclass
class RunResults:
    """What the hooks leave for the run's summary, one typed field per hook (``None``: it did not run)::

        run.results.evaluation = EvalResult(loss=2.61, metrics={"accuracy": 0.4})
    """

    throughput: Optional[ThroughputResult] = None
    evaluation: Optional[EvalResult] = None
    #: SIGTERM stopped the run (:class:`~meshtrain.train.hooks.PreemptionHook`)
    preempted: bool = False


class Run:
    """What hooks see of one :meth:`Trainer.run`: the config, the plan, the current ``state`` and
    ``step``, the run's ``writer`` (metrics.jsonl), ``progress`` display, goodput ``clock``, the
    training ``data`` feed, and ``results``, where hooks leave what the summary reports."""

    def __init__(self, config: TrainConfig, plan: ShardingPlan, state, start: int, *, run_dir: str, data,
                 writer: MetricsWriter, clock: Stopwatch, tokens_per_example: Optional[int], lost_s: float = 0.0,
                 is_main: bool = True):
        self.config, self.plan, self.state, self.start, self.step = config, plan, state, start, start
        self.run_dir, self.data, self.writer, self.clock, self.is_main = run_dir, data, writer, clock, is_main
        self.examples = plan.batch.batch_size
        self.tokens_per_example = tokens_per_example
        self.lost_s = lost_s  # wall time of steps recomputed after a restart
        self.progress = ProgressDisplay(config.steps, start, config.progress.value, config.log_every,
                                        enabled=is_main)
        self.losses: List[float] = []
        self.results = RunResults()
        self.guard: Optional[InterruptGuard] = None


def train_steps(run: Run, train_step, guard: InterruptGuard) -> Iterator[StepInfo]:
    """Compile ``train_step`` on the first batch, then train from ``run.start + 1`` to
    ``config.steps``, yielding each step; ``run.state`` and ``run.step`` follow."""
    cfg = run.config
    batch = next(run.data)
    t0 = time.perf_counter()
    compiled = train_step.lower(run.state, batch).compile()
    guard.check()
    run.clock.add("compile_s", time.perf_counter() - t0)
    schedule, skips = lr_schedule(cfg), 0
    for step in range(run.start + 1, cfg.steps + 1):
        if step > run.start + 1:
            batch = next(run.data)
        t0 = time.perf_counter()
        run.state, metrics = compiled(run.state, batch)
        loss = float(metrics["loss"])
        step_time = time.perf_counter() - t0
        run.step = step
        run.clock.add("compute_s", step_time)
        finite = bool(metrics["finite"])
        record = _record(run, step, metrics, finite, loss, step_time, float(schedule(step - 1)))
        if not finite:
            skips += 1
            _check_skips(cfg, step, skips)
            record["skipped"] = True
        else:
            skips = 0
            run.losses.append(loss)
        guard.check()
        yield StepInfo(step, loss if finite else None, record, run.state, batch, step_time, step == cfg.steps)


def _record(run: Run, step: int, metrics, finite: bool, loss: float, step_time: float, lr: float) -> Dict[str, Any]:
    record: Dict[str, Any] = {"step": step, "loss": loss if finite else None,
                              "grad_norm": float(metrics["grad_norm"]) if finite else None,
                              "lr": lr, "weight": float(metrics["weight"]),
                              "step_time_s": step_time, "examples_per_s": run.examples / step_time}
    if run.tokens_per_example:
        record["tokens"] = int(metrics["tokens"])
        record["tokens_per_s"] = run.examples * run.tokens_per_example / step_time
    for k, v in metrics.items():   # the loss function's own metrics, already ÷ global weight
        if k not in RESERVED_METRICS:
            record[k] = float(v) if finite else None
    record["data_wait_s"] = run.data.wait_s
    run.clock.add("data_wait_s", run.data.wait_s)
    run.data.wait_s = 0.0
    return record


def _check_skips(cfg: TrainConfig, step: int, skips: int) -> None:
    if cfg.nonfinite is NonFinite.RAISE:
        raise TrainingError(f"non-finite loss or gradients at step {step}; lower --lr, check the "
                            f"data, or pass --nonfinite skip")
    if skips > cfg.max_skips:
        raise TrainingError(f"{skips} non-finite steps in a row (last: step {step}); "
                            f"parameters are unchanged since step {step - skips}")


def run_loop(run: Run, hooks: Sequence, train_step) -> Optional[Stop]:
    """Start the hooks, train, call every hook due at each step (in list order), end the hooks.
    Returns the :class:`Stop` that ended the run early, if any. The caller calls
    :func:`close_loop` whatever happens."""
    for hook in hooks:
        hook.on_start(run)
    run.guard = InterruptGuard()
    if run.guard.sigint_ignored:
        run.progress.print("meshtrain: SIGINT is ignored (inherited from the parent process); stop this run "
                           "with SIGTERM, which saves and exits 0")
    stop = None
    for info in train_steps(run, train_step, run.guard):
        for hook in hooks:
            if info.last or info.step % max(getattr(hook, "every", 1), 1) == 0:
                stop = hook.on_step(run, info) or stop
        if stop is not None:
            break
    for hook in hooks:
        hook.on_end(run)
    return stop


def close_loop(run: Run, hooks: Sequence, failed: bool) -> None:
    """Restore Ctrl-C, stop the display, close the hooks (last first), then the data; every one is
    closed even when one fails (the first error is raised after). On failure, close metrics.jsonl."""
    if run.guard is not None:
        run.guard.restore()
    run.progress.close()
    error = None
    for hook in reversed(hooks):
        try:
            hook.close(run)
        except BaseException as exc:   # noqa: B036 -- every hook must be closed; the first error wins
            error = error or exc
    try:
        run.data.close()
    finally:
        if failed:
            run.writer.close()
    if error is not None:
        raise error


def summary(run: Run, resumed_from: Optional[int]) -> TrainSummary:
    """The run's summary from the hooks' ``run.results``; written as the last record of metrics.jsonl."""
    losses, speed, evaluation = run.losses, run.results.throughput, run.results.evaluation
    if speed is None:   # no throughput hook (a hand-made hook list)
        speed = ThroughputResult(None, run.clock.elapsed(), {})
    s = TrainSummary(run.run_dir, len(losses), losses[0] if losses else None, losses[-1] if losses else None,
                     evaluation.loss if evaluation else None, speed.tokens_per_s, speed.mfu, speed.wall_s,
                     speed.goodput, run.results.preempted, resumed_from, examples_per_s=speed.examples_per_s,
                     eval_metrics=evaluation.metrics if evaluation else None)
    run.writer.write({"event": "summary", **dataclasses.asdict(s)})
    run.writer.close()
    if run.is_main:
        run.progress.print(format_summary(s))
    return s


def format_summary(s: TrainSummary) -> str:
    parts = [f"done: {s.steps} steps in {s.wall_s:.1f}s"]
    if s.first_loss is not None:
        parts.append(f"loss {s.first_loss:.4f} → {s.final_loss:.4f}")
    if s.eval_loss is not None:
        parts.append(f"eval loss {s.eval_loss:.4f}")
    for name, value in (s.eval_metrics or {}).items():
        parts.append(f"eval {name} {value:.4f}")
    if s.tokens_per_s:
        parts.append(f"{s.tokens_per_s:,.0f} tokens/s (median)")
    elif s.examples_per_s:
        parts.append(f"{s.examples_per_s:,.1f} examples/s (median)")
    if s.mfu is not None:
        parts.append(f"MFU {s.mfu:.1%}")
    g = s.goodput
    parts.append(f"goodput {g.get('goodput', 0):.0%} (compile {g.get('compile_s', 0):.1f}s, checkpoint "
                 f"{g.get('checkpoint_s', 0):.1f}s, data {g.get('data_wait_s', 0):.1f}s)")
    return "; ".join(parts) + f"\nrun folder: {s.run_dir}"
