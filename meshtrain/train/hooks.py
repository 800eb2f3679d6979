"""Hooks: everything the loop does besides the step. One small interface, :class:`Hook`::

    on_start(run)               before the step is compiled
    on_step(run, info)          after each step due (``step % every == 0``, and always the last step);
                                return :class:`~meshtrain.train.loop.Stop` to end the run after it
    on_end(run)                 the loop ended normally (last step, or a Stop: with checkpointing on,
                                that step is saved, so ``--resume`` continues from it)
    close(run)                  always, last hook first: release what the hook holds

``run`` is a :class:`~meshtrain.train.loop.Run`, ``info`` a :class:`~meshtrain.train.loop.StepInfo`.

The :class:`~meshtrain.train.Trainer` runs the built-in hooks in this order, and your hooks
(``Trainer(..., hooks=[...])``) between the checkpoint and the metrics hook:

1. :class:`ThroughputHook`: MFU into the step's record; median throughput and goodput at the end.
2. :class:`EvalHook`: evaluation every ``eval_every`` steps and at the last, into the record.
3. :class:`CheckpointHook`: saves every ``ckpt_every`` steps and at the last; waits for the commit.
4. your hooks: what they add to ``info.record`` is logged like the built-in fields.
5. :class:`MetricsHook`: the record into ``metrics.jsonl`` and TensorBoard.
6. :class:`ProgressHook`: the run's header, then the step's line (after its record is written).
7. :class:`PreemptionHook`: SIGTERM → save (through the checkpoint hook), then stop.

Example: print a sample every 100 steps and stop when the loss is low enough::

    import optax
    from meshtrain.train import Hook, Stop, Trainer, TrainConfig

    class SampleHook(Hook):
        every = 100

        def on_step(self, run, info):
            info.record["param_norm"] = float(optax.global_norm(info.state.params))  # logged too
            print(f"step {info.step}: loss {info.loss}")
            if info.loss is not None and info.loss < 2.0:
                return Stop("loss below 2.0")

    Trainer(TrainConfig(model="tiny", steps=1000, out="runs/hooked"), hooks=[SampleHook()]).run()
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from meshtrain import interrupts
from meshtrain.distributed import StopAgreement
from meshtrain.models.flops import jaxpr_flops
from meshtrain.train.loop import EvalResult, Run, StepInfo, Stop, ThroughputResult
from meshtrain.train.metrics import peak_flops
from meshtrain.train.step import RESERVED_METRICS

# record fields that are not plotted and not shown on the progress line
_NOT_SCALARS = {"step", "step_time_s", "data_wait_s", "tokens", "weight", "skipped", "ckpt_block_s"}
_STANDARD = ("loss", "grad_norm", "lr", "examples_per_s", "tokens_per_s", "mfu", "eval_loss")


class Hook:
    """Base class: override what you need. ``every``: run ``on_step`` every N steps (and the last)."""

    every: int = 1

    def on_start(self, run: Run) -> None:
        pass

    def on_step(self, run: Run, info: StepInfo) -> Optional[Stop]:
        return None

    def on_end(self, run: Run) -> None:
        pass

    def close(self, run: Run) -> None:
        pass


class ThroughputHook(Hook):
    """MFU per step (when the peak FLOP/s is known); median tokens/s, MFU and goodput at the end."""

    def __init__(self, flops_per_example: Optional[float], train_step):
        self.flops_per_example, self.train_step = flops_per_example, train_step
        self.rates: List[float] = []
        self.peak = None

    def on_start(self, run: Run) -> None:
        cfg = run.config
        self.peak = cfg.peak_flops_per_device or peak_flops(run.plan.mesh.devices.flat[0], cfg.hardware,
                                                            run.plan.num_devices)

    def on_step(self, run: Run, info: StepInfo) -> None:
        if self.flops_per_example is None and self.peak:   # counted once, only when MFU is reported
            flops = jaxpr_flops(self.train_step.trace(info.state, info.batch).jaxpr)
            self.flops_per_example = flops / run.examples if flops else None
        if info.loss is not None:
            self.rates.append(info.record["examples_per_s"])
        if self.peak and self.flops_per_example:
            info.record["mfu"] = self._mfu(run, info.record["examples_per_s"])

    def _mfu(self, run: Run, examples_per_s: float) -> float:
        return examples_per_s * self.flops_per_example / (self.peak * run.plan.num_devices)

    def close(self, run: Run) -> None:
        median = statistics.median(self.rates[1:] or self.rates) if self.rates else None
        wall = run.clock.elapsed()
        goodput = dict(run.clock.totals, wall_s=wall, lost_s=run.lost_s)
        goodput["goodput"] = goodput.get("compute_s", 0.0) / wall if wall else 0.0
        run.results.throughput = ThroughputResult(
            examples_per_s=median, wall_s=wall, goodput=goodput,
            mfu=self._mfu(run, median) if (self.peak and median and self.flops_per_example) else None,
            tokens_per_s=median * run.tokens_per_example if (median and run.tokens_per_example) else None)


class EvalHook(Hook):
    """Mean loss and metrics over ``batches`` batches of the evaluation data (the same batches every
    time, each weighted by its weight) every ``every`` steps and at the last step."""

    def __init__(self, eval_step, feed: Callable[[], Any], batches: int, every: int):
        self.eval_step, self.feed, self.batches, self.every = eval_step, feed, batches, every

    def on_step(self, run: Run, info: StepInfo) -> None:
        t0 = time.perf_counter()
        evals = self.evaluate(info.state)
        run.clock.add("eval_s", time.perf_counter() - t0)
        loss = evals.pop("loss", None)
        info.record["eval_loss"] = loss
        info.record.update({f"eval_{k}": v for k, v in evals.items()})
        run.results.evaluation = EvalResult(loss, evals)

    def evaluate(self, state) -> Dict[str, float]:
        val = self.feed()
        totals: Dict[str, float] = {}
        weight = 0.0
        try:
            for _ in range(self.batches):
                out = self.eval_step(state, next(val))
                w = float(out["weight"])
                weight += w
                for k, v in out.items():
                    if k not in ("weight", "tokens", "finite", "grad_norm"):
                        totals[k] = totals.get(k, 0.0) + float(v) * w
        finally:
            val.close()
        return {k: v / max(weight, 1.0) for k, v in totals.items()}


class CheckpointHook(Hook):
    """Saves through the :class:`~meshtrain.checkpoint.Checkpointer` (every ``save_every`` steps, at
    the last, and at the step a :class:`~meshtrain.train.loop.Stop` ended the run), waits for the last commit at the end, and writes one ``checkpoint`` record per
    committed step: a later ``--resume`` can then tell a run whose checkpoints were removed from
    one that never committed any."""

    def __init__(self, checkpointer, metadata: Dict[str, Any]):
        self.ckpt, self.metadata = checkpointer, metadata  # the same metadata for every save of this run
        self.pending: Optional[int] = None
        self.forced: Optional[int] = None  # the last step saved unconditionally

    def on_step(self, run: Run, info: StepInfo) -> None:
        self.save(run, info.step, info.record, force=info.last)

    def save(self, run: Run, step: int, record: Optional[Dict[str, Any]] = None, force: bool = True) -> None:
        res = self.ckpt.maybe_save(step, run.state, data_state=run.data.state(), metadata=self.metadata, force=force)
        self.forced = step if force else self.forced
        run.clock.add("checkpoint_s", res.blocking_s)  # collecting a finished save blocks too
        if res.saved and record is not None:
            record["ckpt_block_s"] = res.blocking_s
        self._note_committed(run)
        if res.saved:
            self.pending = step

    def _note_committed(self, run: Run) -> None:
        if self.pending is not None and self.ckpt.pending_step != self.pending:
            if (self.ckpt.directory / str(self.pending)).is_dir():
                run.writer.write({"event": "checkpoint", "step": self.pending})
            self.pending = None

    def on_end(self, run: Run) -> None:
        if self.forced != run.step:   # a hook's Stop ended the run early: save that step, so it resumes
            self.save(run, run.step)
        t0 = time.perf_counter()
        self.ckpt.wait()
        run.clock.add("checkpoint_s", time.perf_counter() - t0)
        self._note_committed(run)

    def close(self, run: Run) -> None:
        self.ckpt.close()   # waits for a save in flight (after Ctrl-C: may raise CheckpointError)


class MetricsHook(Hook):
    """The step's record as one line of ``metrics.jsonl``, its numbers as TensorBoard scalars
    (``train/<name>``, ``eval/<name>``)."""

    def on_step(self, run: Run, info: StepInfo) -> None:
        scalars = {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in info.record.items()
                   if k not in _NOT_SCALARS and isinstance(v, (int, float))}
        run.writer.write(info.record, scalars)


class ProgressHook(Hook):
    """The run's header line, then a line (or the bar) per step: loss, your metrics, throughput, MFU,
    evaluation."""

    def on_start(self, run: Run) -> None:
        plan = run.plan
        run.progress.print(f"meshtrain: {plan.abstract.num_params:,} parameters, recipe {plan.recipe.name}"
                           f"{plan.recipe.knobs_text()}, mesh "
                           + " × ".join(f"{a}={s}" for a, s in plan.mesh_sizes.items())
                           + f", batch {run.examples}" + (f"×{run.tokens_per_example}" if run.tokens_per_example
                                                          else "")
                           + f", run folder {run.run_dir}")

    def on_step(self, run: Run, info: StepInfo) -> None:
        run.progress.update(info.step, step_line(info.record))


def step_line(record: Dict[str, Any]) -> str:
    loss = record["loss"]
    user = [k for k in record if k not in RESERVED_METRICS and k not in _NOT_SCALARS and k not in _STANDARD
            and not k.startswith("eval_")]
    rate = (f"{record['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in record
            else f"{record['examples_per_s']:,.1f} ex/s")
    return ((f"loss {loss:.4f}" if loss is not None else "loss non-finite (skipped)")
            + "".join(f"  {k} {record[k]:.4f}" for k in user if record[k] is not None)
            + f"  {rate}  {record['step_time_s'] * 1e3:.0f} ms/step"
            + (f"  MFU {record['mfu']:.1%}" if "mfu" in record else "")
            + (f"  eval {record['eval_loss']:.4f}" if "eval_loss" in record else "")
            + "".join(f"  eval {k[5:]} {record[k]:.4f}" for k in record
                      if k.startswith("eval_") and k != "eval_loss" and record[k] is not None))


class PreemptionHook(Hook):
    """SIGTERM → finish the current step, save, exit 0; every process stops after the same step.

    One process: a Python SIGTERM handler sets the flag. Several processes: see
    :class:`meshtrain.distributed.StopAgreement` (JAX's preemption sync point by default, which
    catches SIGTERM from the moment ``jax.distributed`` starts; else a per-step max of the flags).
    Runs after every other hook, so the step's record and line come first.
    """

    def __init__(self, checkpoint: Optional[CheckpointHook]):
        self.checkpoint = checkpoint
        self.requested = False
        self.agreement = None
        self._previous = None

    def on_start(self, run: Run) -> None:
        self.agreement = StopAgreement.current()
        if self.agreement.needs_handler and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def on_step(self, run: Run, info: StepInfo) -> Optional[Stop]:
        interrupts.startup_done()   # a SIGTERM from here on is worth a save (before: exits at once, if asked)
        # a collective with several processes: called after every step on every process
        if info.last or not self.agreement.should_stop(info.step, self.requested):
            return None
        run.results.preempted = True
        interrupts.note_preempted()
        if self.checkpoint is not None:
            self.checkpoint.save(run, info.step)
        run.progress.print(f"SIGTERM: stopped after step {info.step}"
                           + (", checkpoint saved" if self.checkpoint is not None else ""))
        run.writer.write({"event": "preempted", "step": info.step})
        return Stop("SIGTERM")

    def close(self, run: Run) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
