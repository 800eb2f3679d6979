"""`Trainer`: the loop for users who want one. Pick a model and a recipe, get a trained run folder
(``metrics.jsonl``, TensorBoard events, checkpoints)::

    from meshtrain.train import Trainer, TrainConfig
    summary = Trainer(TrainConfig(model="small", recipe="fsdp", steps=100, out="runs/demo")).run()

or with your own model: ``Trainer(cfg, model=lambda rngs: MyModel(rngs=rngs)).run()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import threading
import time
from typing import Any, Dict, List, Optional

import jax
import optax

from meshtrain.abstract import ModelFactory, abstract_state
from meshtrain.checkpoint.types import Verify
from meshtrain.data import BatchIterator, check_token_ids, load_source
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.mesh import MeshSpec, select_devices
from meshtrain.models import DecoderConfig, get_config, model_factory
from meshtrain.plan import BatchSpec, ShardingPlan, make_plan
from meshtrain.recipes import get_recipe
from meshtrain.train.config import MemoryCheckMode, Resume, TrainConfig, default_optimizer, lr_schedule
from meshtrain.analysis.flops import model_flops_per_token
from meshtrain.train.metrics import MetricsWriter, ProgressDisplay, Stopwatch, peak_flops
from meshtrain.train.preflight import check_memory
from meshtrain.train.rundir import RunLock, inspect_run_dir, truncate_metrics
from meshtrain.train.state import init_state
from meshtrain.train.step import LossFn, NonFinite, make_eval_step, make_train_step


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: the loop stopped, a save in flight was finished; ``last_committed`` is the step a
    ``--resume`` continues from (``None``: no checkpoint)."""

    def __init__(self, last_committed: Optional[int]):
        self.last_committed = last_committed
        where = (f"last committed step {last_committed}; continue with --resume" if last_committed is not None
                 else "no checkpoint was committed (pass --ckpt-every N to make runs resumable)")
        super().__init__(where)


class TrainingError(MeshtrainError):
    """Training cannot go on (a non-finite loss under ``--nonfinite raise``, too many skipped steps)."""


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


def _default_run_dir(cfg: TrainConfig) -> str:
    recipe = os.path.splitext(os.path.basename(cfg.recipe))[0]
    return os.path.join("runs", f"{cfg.model}-{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")


class _StopFlag:
    """SIGTERM → finish the current step, save, exit 0; every process stops after the same step.

    One process: a Python SIGTERM handler sets the flag. Several processes: see
    :class:`meshtrain.distributed.StopAgreement` (JAX's preemption sync point by default, which
    catches SIGTERM from the moment ``jax.distributed`` starts; else a per-step max of the flags).
    """

    def __init__(self):
        from meshtrain.distributed import StopAgreement

        self.requested = False
        self._previous = None
        self.agreement = StopAgreement.current()
        if self.agreement.needs_handler and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def should_stop(self, step: int) -> bool:
        """Call after every step on every process (the same steps everywhere); True: save and stop."""
        return self.agreement.should_stop(step, self.requested)

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Trainer:
    """Runs :class:`TrainConfig` end to end: plan, sharded init or resume, compiled step, data,
    evaluation, logging, checkpoints, SIGTERM handling. ``run()`` returns a :class:`TrainSummary`.

    Args:
      config: the run's settings.
      model: a factory ``rngs -> nnx.Module`` (default: the decoder named by ``config.model``).
      tx: an optax optimizer (default: AdamW + warmup/cosine + clipping from ``config``).
      loss_fn: ``(model, batch) -> (loss sum, token count)``; default next-token cross-entropy.
      vocab_size: the model's vocabulary, to check data token ids (known for the built-in decoders).
    """

    def __init__(self, config: TrainConfig = TrainConfig(), *, model: Optional[ModelFactory] = None,
                 tx: Optional[optax.GradientTransformation] = None, loss_fn: Optional[LossFn] = None,
                 vocab_size: Optional[int] = None):
        self.cfg = config
        self.model_cfg: Optional[DecoderConfig] = None
        if model is None:
            self.model_cfg = get_config(config.model)
            if config.seq_len > self.model_cfg.max_seq_len:
                raise ConfigError(f"--seq-len {config.seq_len} is longer than model {config.model!r} supports "
                                  f"(max_seq_len {self.model_cfg.max_seq_len}); use --seq-len <= "
                                  f"{self.model_cfg.max_seq_len}")
            model = model_factory(self.model_cfg)
            vocab_size = self.model_cfg.vocab_size
        self.factory, self.tx, self.loss_fn, self.vocab_size = model, tx, loss_fn, vocab_size
        self.run_dir = config.out or _default_run_dir(config)
        self.is_main = jax.process_index() == 0
        self._lost_s = 0.0  # wall time of steps recomputed after a restart

    # -- set-up ----------------------------------------------------------------------------------
    def build_plan(self, devices=None) -> ShardingPlan:
        cfg = self.cfg
        recipe = get_recipe(cfg.recipe)
        if cfg.mesh:
            recipe = recipe.with_mesh(**MeshSpec.parse(cfg.mesh))
        knobs = {k: getattr(cfg, k) for k in ("compute_dtype", "param_dtype", "remat", "micro_batches")
                 if getattr(cfg, k) is not None}
        recipe = recipe.with_options(**knobs) if knobs else recipe
        devices = devices if devices is not None else select_devices(cfg.devices)
        from meshtrain.distributed import auto_dcn, split_dcn

        layout = (split_dcn(recipe.mesh, len(devices), MeshSpec.parse(cfg.dcn)) if cfg.dcn
                  else auto_dcn(recipe.mesh, devices))
        recipe = dataclasses.replace(recipe, mesh=layout)
        mesh = recipe.mesh.build(devices)
        tx = self.tx or default_optimizer(cfg, abstract_state(self.factory).param_axes)
        abstract = abstract_state(self.factory, tx)
        return make_plan(abstract, recipe, mesh, batch=BatchSpec(cfg.batch_size, cfg.seq_len))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> TrainSummary:
        """Train to ``config.steps``. Holds the run folder's lock throughout; on Ctrl-C raises
        :class:`Interrupted` naming the last committed checkpoint step."""
        lock = self._lock_run_dir()
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _lock_run_dir(self) -> Optional[RunLock]:
        if os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise ConfigError(f"--out {self.run_dir!r} is an existing file, not a folder; pass a folder path")
        return RunLock(self.run_dir) if self.is_main else None

    def _run(self) -> TrainSummary:
        cfg = self.cfg
        clock = Stopwatch()
        plan = self.build_plan()
        if cfg.memory_check is MemoryCheckMode.ON:
            check_memory(plan, self.model_cfg, remat=plan.recipe.remat.value)
        ckpt = self._checkpointer()
        try:
            resume_step = self._resume_step(ckpt)
            if resume_step is not None and resume_step >= cfg.steps:
                return self._already_done(resume_step)
            val_src, it = self._data(plan)
            state, start, restart = self._initial_state(plan, ckpt, it)
            writer = self._open_outputs(plan, restart)
        except BaseException:
            if ckpt is not None:
                ckpt.close()
            raise
        clock.add("setup_s", clock.elapsed())  # plan, data, init or restore
        loop = _Loop(self, plan, state, start, it, val_src, ckpt, writer, clock)
        try:
            loop.run()
        except KeyboardInterrupt:
            loop.close(failed=True)
            raise Interrupted(self._last_committed(ckpt)) from None
        except BaseException:
            loop.close(failed=True)
            raise
        loop.close()
        return loop.summary(resume_step)

    # -- set-up parts -----------------------------------------------------------------------------
    def _resume_step(self, ckpt) -> Optional[int]:
        """The step to resume from, or ``None`` for a new run; refuses (ConfigError) whenever going on
        would lose or overwrite something. Nothing is deleted here."""
        cfg = self.cfg
        contents = inspect_run_dir(self.run_dir)
        if cfg.resume is Resume.NO:
            if contents.has_run:
                raise ConfigError(f"run folder {self.run_dir!r} already holds a run ({contents.describe()}); "
                                  f"pass --resume to continue it or choose another --out")
            return None
        if not contents.checkpoint_steps:
            if contents.committed_steps:
                raise ConfigError(
                    f"cannot resume {self.run_dir!r}: its metrics.jsonl records committed checkpoints (steps "
                    f"{list(contents.committed_steps)[-5:]}) but checkpoints/ holds no step folder. Nothing was "
                    f"changed. Put the checkpoints back, or pass another --out to start a new run")
            if contents.metric_steps:
                self._notice(f"{self.run_dir}: the earlier run stopped at step {contents.last_metric_step} before "
                             f"its first checkpoint was committed; starting again from step 0")
            else:
                self._notice(f"--resume: no run in {self.run_dir} yet; starting a new run there")
            return None
        step = ckpt.latest_valid_step()
        if step is None:
            found = "; ".join(f"step {s}: {c.status.value} ({c.reason})" for s, c in
                              ((s, ckpt.check(s)) for s in ckpt.all_steps()))
            raise ConfigError(f"cannot resume {self.run_dir!r}: it holds checkpoints but none is valid: {found}. "
                              f"Nothing was changed. Inspect them with `meshtrain ckpt list "
                              f"{os.path.join(self.run_dir, 'checkpoints')}`, put a good copy back, or pass "
                              f"another --out to start a new run")
        return step

    def _already_done(self, step: int) -> TrainSummary:
        cfg = self.cfg
        if step > cfg.steps:
            raise ConfigError(f"run {self.run_dir!r} is already at step {step}, past --steps {cfg.steps}; pass "
                              f"--steps > {step} to train further")
        self._notice(f"run {self.run_dir} is already at step {step} (= --steps): nothing to train; pass a larger "
                     f"--steps to continue")
        return TrainSummary(self.run_dir, 0, None, None, None, None, None, 0.0, {}, False, step, True)

    def _data(self, plan: ShardingPlan):
        cfg = self.cfg
        source = load_source(cfg.data)
        if self.vocab_size is not None:
            check_token_ids(source, self.vocab_size)
        # Always split: the training data must not depend on whether (or how often) a run evaluates.
        train_src, val_src = source.split(cfg.val_fraction)
        if not (cfg.eval_every and cfg.eval_batches):
            val_src = None
        it = BatchIterator(train_src, cfg.batch_size, cfg.seq_len, cfg.seed, shardings=plan.batch_shardings,
                           vocab_size=self.vocab_size)
        return val_src, it

    def _open_outputs(self, plan: ShardingPlan, restart: Optional[Dict[str, Any]]) -> MetricsWriter:
        """plan.json and metrics.jsonl (truncated to the restored step on resume) on process 0."""
        if self.is_main:
            restored = restart["restored_step"] if restart is not None else 0
            dropped = truncate_metrics(self.run_dir, restored)
            if restart is not None:
                restart["superseded_records"] = dropped
        writer = MetricsWriter(self.run_dir, enabled=self.is_main)
        if self.is_main:
            path = os.path.join(self.run_dir, "plan.json")
            try:
                with open(path, "w") as f:
                    f.write(plan.to_json())
            except OSError as exc:
                writer.close()
                raise ConfigError(f"cannot write {path}: {exc.strerror or exc}; free disk space or pass another "
                                  f"--out") from None
        if restart is not None:
            writer.write({"event": "restart", **restart})
        return writer

    def _notice(self, text: str) -> None:
        if self.is_main:
            print(f"meshtrain: {text}", flush=True)

    def _last_committed(self, ckpt) -> Optional[int]:
        if ckpt is None:
            return None
        good = [s for s in ckpt.all_steps() if ckpt.check(s, Verify.QUICK).status.usable]
        return good[-1] if good else None

    # -- pieces ----------------------------------------------------------------------------------
    def _checkpointer(self):
        cfg = self.cfg
        if not cfg.ckpt_every and cfg.resume is Resume.NO:
            return None
        from meshtrain.checkpoint import Checkpointer

        return Checkpointer(os.path.join(self.run_dir, "checkpoints"), save_every=cfg.ckpt_every or cfg.steps,
                            keep_last=cfg.keep_last, keep_every=cfg.keep_every)

    def _metadata(self, plan: ShardingPlan) -> Dict[str, Any]:
        return {"recipe": plan.recipe.to_dict(), "mesh": plan.mesh_sizes, "model": self.cfg.model,
                "seed": self.cfg.seed, "batch_size": self.cfg.batch_size, "seq_len": self.cfg.seq_len,
                "num_params": plan.abstract.num_params}

    def _initial_state(self, plan, ckpt, it: BatchIterator):
        """(state, start step, restart record or None)."""
        cfg = self.cfg
        if ckpt is None or cfg.resume is not Resume.LATEST or ckpt.latest_valid_step() is None:
            return init_state(plan, seed=cfg.seed), 0, None
        restored = ckpt.restore(plan)
        it.restore(restored.data_state)
        recomputed, lost = self._work_after(restored.step)
        self._lost_s = lost
        restart = {"restored_step": restored.step, "recomputed_steps": recomputed, "lost_s": lost}
        saved_batch = (restored.metadata or {}).get("batch_size")
        if saved_batch is not None and saved_batch != cfg.batch_size:
            samples = restored.data_state.get("samples_seen")
            self._notice(f"--batch-size changed from {saved_batch} to {cfg.batch_size} on resume: the data continues "
                         f"at sample {samples} (no sample is skipped or repeated); steps continue from "
                         f"{restored.step}, so each later step sees {cfg.batch_size} sequences and the learning-rate "
                         f"schedule stays indexed by step")
            restart["batch_size_changed"] = [saved_batch, cfg.batch_size]
        return restored.state, restored.step, restart

    def _work_after(self, step: int):
        """Logged steps after ``step`` since the last restart: work that will be recomputed."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return 0, 0.0
        done: Dict[int, float] = {}
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                if "loss" in rec and rec.get("step", 0) > step:
                    done[rec["step"]] = rec.get("step_time_s", 0.0)
                elif rec.get("event") == "restart":
                    done = {}
        return len(done), float(sum(done.values()))

    def _evaluate(self, eval_step, state, val_src, plan: ShardingPlan) -> float:
        cfg = self.cfg
        val = BatchIterator(val_src, cfg.batch_size, cfg.seq_len, cfg.seed, shardings=plan.batch_shardings,
                            vocab_size=self.vocab_size, prefetch=0)
        total = tokens = 0.0
        for _ in range(cfg.eval_batches):
            out = eval_step(state, next(val))
            n = float(out["tokens"])
            total += float(out["loss"]) * n
            tokens += n
        return total / max(tokens, 1.0)


class _Loop:
    """The training loop of one :meth:`Trainer.run`: compile, steps, evaluation, checkpoints, logs."""

    def __init__(self, trainer: Trainer, plan: ShardingPlan, state, start: int, it: BatchIterator, val_src,
                 ckpt, writer: MetricsWriter, clock: Stopwatch):
        cfg = trainer.cfg
        self.t, self.cfg, self.plan, self.state, self.start = trainer, cfg, plan, state, start
        self.it, self.val_src, self.ckpt, self.writer, self.clock = it, val_src, ckpt, writer, clock
        self.train_step = make_train_step(plan, loss_fn=trainer.loss_fn, nonfinite=cfg.nonfinite)
        self.eval_step = make_eval_step(plan, loss_fn=trainer.loss_fn) if val_src is not None else None
        self.flops_per_token = (model_flops_per_token(trainer.model_cfg, cfg.seq_len) if trainer.model_cfg
                                else 6.0 * plan.abstract.num_params)
        self.peak = cfg.peak_flops_per_device or peak_flops(plan.mesh.devices.flat[0], cfg.hardware,
                                                            plan.num_devices)
        self.schedule = lr_schedule(cfg)
        self.metadata = trainer._metadata(plan)  # the same for every save of this run
        self.progress = ProgressDisplay(cfg.steps, start, cfg.progress.value, cfg.log_every, enabled=trainer.is_main)
        self.losses: List[float] = []
        self.rates: List[float] = []
        self.first_loss = self.final_loss = self.eval_loss = None
        self.skips = 0
        self.preempted = False
        self.pending_save: Optional[int] = None
        self.stop = None
        self._closed = False

    def run(self) -> None:
        cfg, plan = self.cfg, self.plan
        self.progress.print(f"meshtrain: {plan.abstract.num_params:,} parameters, recipe {plan.recipe.name}, mesh "
                            + " × ".join(f"{a}={s}" for a, s in plan.mesh_sizes.items())
                            + f", batch {cfg.batch_size}×{cfg.seq_len}, run folder {self.t.run_dir}")
        self.stop = _StopFlag()
        batch = next(self.it)
        t0 = time.perf_counter()
        compiled = self.train_step.lower(self.state, batch).compile()
        self.clock.add("compile_s", time.perf_counter() - t0)
        for step in range(self.start + 1, cfg.steps + 1):
            if step > self.start + 1:
                batch = next(self.it)
            record = self._step(compiled, step, batch)
            if self.eval_step is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                t1 = time.perf_counter()
                self.eval_loss = self.t._evaluate(self.eval_step, self.state, self.val_src, plan)
                self.clock.add("eval_s", time.perf_counter() - t1)
                record["eval_loss"] = self.eval_loss
            self._save(step, record, force=step == cfg.steps)
            self._log(step, record)
            if step < cfg.steps and self.stop.should_stop(step):
                self.preempted = True
                self._save(step, None, force=True)
                self.progress.print(f"SIGTERM: stopped after step {step}"
                                    + (", checkpoint saved" if self.ckpt else ""))
                self.writer.write({"event": "preempted", "step": step})
                break
        if self.ckpt is not None:
            t1 = time.perf_counter()
            self.ckpt.wait()
            self.clock.add("checkpoint_s", time.perf_counter() - t1)
            self._note_committed()

    def _step(self, compiled, step: int, batch) -> Dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.state, metrics = compiled(self.state, batch)
        loss = float(metrics["loss"])
        step_time = time.perf_counter() - t0
        self.clock.add("compute_s", step_time)
        finite = bool(metrics["finite"])
        record: Dict[str, Any] = {"step": step, "loss": loss if finite else None,
                                  "grad_norm": float(metrics["grad_norm"]) if finite else None,
                                  "lr": float(self.schedule(step - 1)), "tokens": int(metrics["tokens"]),
                                  "step_time_s": step_time,
                                  "tokens_per_s": cfg.batch_size * cfg.seq_len / step_time,
                                  "data_wait_s": self.it.wait_s}
        self.clock.add("data_wait_s", self.it.wait_s)
        self.it.wait_s = 0.0
        if not finite:
            self.skips += 1
            if cfg.nonfinite is NonFinite.RAISE:
                raise TrainingError(f"non-finite loss or gradients at step {step}; lower --lr, check the "
                                    f"data, or pass --nonfinite skip")
            record["skipped"] = True
            if self.skips > cfg.max_skips:
                raise TrainingError(f"{self.skips} non-finite steps in a row (last: step {step}); "
                                    f"parameters are unchanged since step {step - self.skips}")
        else:
            self.skips = 0
            self.losses.append(loss)
            self.rates.append(record["tokens_per_s"])
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.final_loss = loss
        if self.peak:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / (self.peak * self.plan.num_devices)
        return record

    def _save(self, step: int, record: Optional[Dict[str, Any]], force: bool) -> None:
        if self.ckpt is None:
            return
        res = self.ckpt.maybe_save(step, self.state, data_state=self.it.state(), metadata=self.metadata, force=force)
        self.clock.add("checkpoint_s", res.blocking_s)  # collecting a finished save blocks too
        if res.saved and record is not None:
            record["ckpt_block_s"] = res.blocking_s
        self._note_committed()
        if res.saved:
            self.pending_save = step

    def _note_committed(self) -> None:
        """One ``checkpoint`` record per committed step: a later ``--resume`` can then tell a run whose
        checkpoints were removed from one that never committed any."""
        if self.pending_save is not None and self.ckpt.pending_step != self.pending_save:
            if (self.ckpt.directory / str(self.pending_save)).is_dir():
                self.writer.write({"event": "checkpoint", "step": self.pending_save})
            self.pending_save = None

    def _log(self, step: int, record: Dict[str, Any]) -> None:
        self.writer.write(record, {"train/loss": record["loss"], "train/tokens_per_s": record["tokens_per_s"],
                                   "train/lr": record["lr"], "train/grad_norm": record["grad_norm"],
                                   "train/mfu": record.get("mfu"), "eval/loss": record.get("eval_loss")})
        loss = record["loss"]
        info = ((f"loss {loss:.4f}" if loss is not None else "loss non-finite (skipped)")
                + f"  {record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1e3:.0f} ms/step"
                + (f"  MFU {record['mfu']:.1%}" if "mfu" in record else "")
                + (f"  eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""))
        self.progress.update(step, info)

    def close(self, failed: bool = False) -> None:
        """Stop the display, restore signal handlers, close the data and the Checkpointer (which waits
        for a save in flight). Idempotent; after a success ``summary`` writes the last record."""
        if self._closed:
            return
        self._closed = True
        self.progress.close()
        if self.stop is not None:
            self.stop.restore()
        self.it.close()
        try:
            if self.ckpt is not None:
                self.ckpt.close()
        finally:
            if failed:
                self.writer.close()

    def summary(self, resumed_from: Optional[int]) -> TrainSummary:
        wall = self.clock.elapsed()
        goodput = dict(self.clock.totals, wall_s=wall, lost_s=self.t._lost_s)
        goodput["goodput"] = goodput.get("compute_s", 0.0) / wall if wall else 0.0
        rates = self.rates
        median_rate = statistics.median(rates[1:] or rates) if rates else None
        mfu = (median_rate * self.flops_per_token / (self.peak * self.plan.num_devices)
               if (self.peak and median_rate) else None)
        summary = TrainSummary(self.t.run_dir, len(self.losses), self.first_loss, self.final_loss, self.eval_loss,
                               median_rate, mfu, wall, goodput, self.preempted, resumed_from)
        self.writer.write({"event": "summary", **dataclasses.asdict(summary)})
        self.writer.close()
        if self.t.is_main:
            self.progress.print(_format_summary(summary))
        return summary


def _format_summary(s: TrainSummary) -> str:
    parts = [f"done: {s.steps} steps in {s.wall_s:.1f}s"]
    if s.first_loss is not None:
        parts.append(f"loss {s.first_loss:.4f} → {s.final_loss:.4f}")
    if s.eval_loss is not None:
        parts.append(f"eval loss {s.eval_loss:.4f}")
    if s.tokens_per_s:
        parts.append(f"{s.tokens_per_s:,.0f} tokens/s (median)")
    if s.mfu is not None:
        parts.append(f"MFU {s.mfu:.1%}")
    g = s.goodput
    parts.append(f"goodput {g.get('goodput', 0):.0%} (compile {g.get('compile_s', 0):.1f}s, checkpoint "
                 f"{g.get('checkpoint_s', 0):.1f}s, data {g.get('data_wait_s', 0):.1f}s)")
    return "; ".join(parts) + f"\nrun folder: {s.run_dir}"
