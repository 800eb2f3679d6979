"""`Trainer`: the loop for users who want one. Pick a model and a recipe, get a trained run folder
(``metrics.jsonl``, TensorBoard events, checkpoints)::

    from meshtrain.train import Trainer, TrainConfig
    summary = Trainer(TrainConfig(model="small", recipe="fsdp", steps=100, out="runs/demo")).run()

or with your own model: ``Trainer(cfg, model=lambda rngs: MyModel(rngs=rngs)).run()``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import jax
import optax

from meshtrain.abstract import ModelFactory, abstract_state
from meshtrain.annotate import PathRules
from meshtrain.checkpoint.types import CheckpointError, Verify
import numpy as np

from meshtrain.batch_layout import BatchLayout
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.mesh import MeshSpec, hybrid_layout, select_devices
from meshtrain.models import DecoderConfig
from meshtrain.plan import ShardingPlan, data_parallel_size, make_plan
from meshtrain.recipes import get_recipe
from meshtrain.train.config import MemoryCheckMode, Resume, TrainConfig, default_optimizer, lr_schedule
from meshtrain.models.flops import jaxpr_flops, model_flops_per_token
from meshtrain.train.metrics import MetricsWriter, ProgressDisplay, Stopwatch, peak_flops
from meshtrain.train.preflight import Estimate, check_memory
from meshtrain.train.rundir import RunLock, file_error, inspect_run_dir, read_records, truncate_metrics
from meshtrain.state import init_state
from meshtrain.train.step import RESERVED_METRICS, LossFn, NonFinite, make_eval_step, make_train_step, next_token_loss
from meshtrain.train.tasks import (DataRequest, builtin_task, custom_task, example_layout, language_model_task,
                                   local_rows)


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
    examples_per_s: Optional[float] = None
    eval_metrics: Optional[Dict[str, float]] = None  # the last evaluation's metrics besides the loss


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
        main_thread = threading.current_thread() is threading.main_thread()
        if self.agreement.needs_handler and main_thread:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        # A background job of a non-interactive shell (or `nohup cmd &`) starts with SIGINT ignored. It
        # stays ignored, as in any POSIX tool (a terminal's Ctrl-C was not meant for that job); the run
        # says so, and SIGTERM remains the way to stop it cleanly.
        self.sigint_ignored = main_thread and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        # Ctrl-C raises KeyboardInterrupt wherever Python happens to be; when that is a garbage
        # collector callback (jax's _xla_gc_callback runs often while a pipeline step compiles) or a
        # __del__, Python prints "Exception ignored" and the run went on to the end (exit 0). The
        # handler also records the interrupt, and the loop raises it again at its next check.
        self.interrupted = False
        self._previous_int = None
        self._previous_unraisable = None
        if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_int = signal.signal(signal.SIGINT, self._interrupt)
            self._previous_unraisable = sys.unraisablehook
            sys.unraisablehook = self._unraisable

    def _handle(self, signum, frame):
        self.requested = True

    def _interrupt(self, signum, frame):
        self.interrupted = True
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        """The swallowed KeyboardInterrupt is raised again by :meth:`check_interrupt`: no traceback."""
        if not (self.interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._previous_unraisable(unraisable)

    def check_interrupt(self) -> None:
        """Raise the Ctrl-C that arrived since the start, in case it was swallowed where it landed."""
        if self.interrupted:
            raise KeyboardInterrupt

    def should_stop(self, step: int) -> bool:
        """Call after every step on every process (the same steps everywhere); True: save and stop."""
        return self.agreement.should_stop(step, self.requested)

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        if self._previous_int is not None:
            signal.signal(signal.SIGINT, self._previous_int)
            sys.unraisablehook = self._previous_unraisable


class Trainer:
    """Runs :class:`TrainConfig` end to end: plan, sharded init or resume, compiled step, data,
    evaluation, logging, checkpoints, SIGTERM handling. ``run()`` returns a :class:`TrainSummary`.

    Args:
      config: the run's settings.
      model: a factory ``rngs -> nnx.Module`` (default: the built-in model named by ``config.model``,
        with its data and loss: see :mod:`meshtrain.train.tasks`).
      tx: an optax optimizer (default: AdamW + warmup/cosine + clipping from ``config``).
      loss_fn: ``(model, batch) -> (loss sum, weight)`` or ``(loss sum, weight, {name: sum})``; the
        step divides each by the global weight, so any split gives the one-device value. Default:
        the built-in model's loss, or next-token cross-entropy for your model on token data.
      data: your data: an iterable of numpy batches (this process's rows of each global batch), or
        a function of a :class:`~meshtrain.train.tasks.DataRequest` returning one. ``None``: token
        windows of ``config.data`` (or the built-in model's data). The batch layout comes from the
        first batch (``batch`` on each leading dimension, or ``batch_axes``).
      eval_data: evaluation batches, the same kinds (``None`` with ``data=``: no evaluation).
      batch_axes: logical axes per batch leaf, e.g. ``{"images": ("batch", None, None, None)}``.
      vocab_size: your model's vocabulary, to check token ids when it trains on token data.
      path_rules: logical axes for parameters without them, by path pattern
        (``PathRules([(r".*kernel", ("embed", "mlp")), ...])``), for models you did not write.
      memory_estimate: ``plan -> (bytes per device, description)`` for the pre-flight memory check
        (default: parameters + gradients + optimizer + batch; ``meshtrain train`` adds activations).

    Example (your own model, loss and data)::

        def loss_fn(model, batch):
            logits = model(batch["x"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return ce.sum(), ce.size, {"accuracy": (logits.argmax(-1) == batch["y"]).sum()}

        Trainer(TrainConfig(recipe="fsdp", steps=100, out="runs/mine"),
                model=lambda rngs: MyModel(rngs=rngs), loss_fn=loss_fn, data=my_batches()).run()
    """

    def __init__(self, config: TrainConfig = TrainConfig(), *, model: Optional[ModelFactory] = None,
                 tx: Optional[optax.GradientTransformation] = None, loss_fn: Optional[LossFn] = None,
                 data: Any = None, eval_data: Any = None, batch_axes: Any = None,
                 vocab_size: Optional[int] = None, memory_estimate: Optional[Estimate] = None,
                 path_rules: Optional[PathRules] = None):
        self.cfg = config
        if model is None and data is None:
            task = builtin_task(config)
            if loss_fn is not None:
                task = dataclasses.replace(task, loss_fn=loss_fn, eval_loss_fn=loss_fn)
        elif data is None:
            task = language_model_task(config, model, loss_fn or next_token_loss, vocab_size)
        else:
            if model is None:
                raise ConfigError("data= needs model= (a factory rngs -> nnx.Module) and loss_fn=")
            if loss_fn is None:
                raise ConfigError("data= needs loss_fn=: (model, batch) -> (loss sum, weight[, metrics])")
            task = custom_task(model, loss_fn, data, eval_data, batch_axes=batch_axes)
        self.task = task
        self.memory_estimate = memory_estimate
        self.path_rules = path_rules
        self.factory, self.tx, self.loss_fn = task.factory, tx, task.loss_fn
        self.model_cfg = task.model_cfg if isinstance(task.model_cfg, DecoderConfig) else None
        self.run_dir = config.out or _default_run_dir(config)
        self.is_main = jax.process_index() == 0
        self._lost_s = 0.0  # wall time of steps recomputed after a restart
        self._first_batch = None

    # -- set-up ----------------------------------------------------------------------------------
    def build_plan(self, devices=None) -> ShardingPlan:
        """The run's :class:`ShardingPlan` (recipe + overrides, mesh over the devices, batch layout)."""
        recipe, mesh = self._recipe_and_mesh(devices)
        tx = self.tx or default_optimizer(self.cfg, abstract_state(self.factory, annotations=self.path_rules).param_axes)
        abstract = abstract_state(self.factory, tx, annotations=self.path_rules)
        return make_plan(abstract, recipe, mesh, batch=self._layout())

    def _recipe_and_mesh(self, devices=None):
        cfg = self.cfg
        recipe = get_recipe(cfg.recipe)
        if cfg.mesh:
            recipe = recipe.with_mesh(**MeshSpec.parse(cfg.mesh))
        knobs = {k: getattr(cfg, k) for k in ("compute_dtype", "param_dtype", "remat", "micro_batches", "schedule",
                                              "repeats", "attention", "offload", "layer_loop")
                 if getattr(cfg, k) is not None}
        recipe = recipe.with_options(**knobs) if knobs else recipe
        devices = devices if devices is not None else select_devices(cfg.devices)
        recipe = dataclasses.replace(recipe, mesh=hybrid_layout(recipe.mesh, devices, cfg.dcn))
        return recipe, recipe.mesh.build(devices)

    def batch_multiple(self, devices=None) -> int:
        """The number every global batch size must be a multiple of under this config's recipe and
        mesh: data-parallel size × micro-batches (e.g. 32 for ``pp_fsdp`` on 8 devices with 8
        micro-batches: fsdp=4 × 8). ``meshtrain train`` rounds its default batch up to it."""
        recipe, mesh = self._recipe_and_mesh(devices)
        return data_parallel_size(recipe.axis_rules(), dict(mesh.shape)) * recipe.micro_batches

    def _layout(self) -> BatchLayout:
        cfg = self.cfg
        if self.task.layout is not None:
            return self.task.layout(cfg.batch_size, cfg.seq_len)
        if self._first_batch is None:   # the layout comes from the user's first batch
            request = self._request("train", None)
            self._source = self.task.data(request)
            try:
                self._first_batch = next(iter(self._source))
            except StopIteration:
                raise ConfigError("data yielded no batch at all; pass an iterable of numpy batches") from None
            self._source_iter = self._source
        return example_layout(self._first_batch, jax.process_count(), self.task.batch_axes)

    def _request(self, split: str, plan: Optional[ShardingPlan]) -> DataRequest:
        cfg = self.cfg
        batch = plan.batch.batch_size if plan is not None and plan.batch is not None else cfg.batch_size
        rows = local_rows(plan) if plan is not None else None
        if rows is None:
            per = batch // max(jax.process_count(), 1)
            rows = np.arange(jax.process_index() * per, (jax.process_index() + 1) * per)
        return DataRequest(batch, cfg.seq_len, cfg.seed, jax.process_index(), jax.process_count(), rows, split,
                           plan.batch_shardings if plan is not None else None)

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
            check_memory(plan, self.memory_estimate, remat=plan.recipe.remat.value)
        ckpt = self._checkpointer()
        try:
            resume_step = self._resume_step(ckpt)
            if resume_step is not None and resume_step >= cfg.steps:
                return self._already_done(resume_step)
            evaluate, it = self._data(plan)
            state, start, restart = self._initial_state(plan, ckpt, it)
            writer = self._open_outputs(plan, restart)
        except BaseException:
            if ckpt is not None:
                ckpt.close()
            raise
        clock.add("setup_s", clock.elapsed())  # plan, data, init or restore
        loop = _Loop(self, plan, state, start, it, evaluate, ckpt, writer, clock)
        try:
            loop.run()
        except KeyboardInterrupt:
            try:
                loop.close(failed=True)
            except CheckpointError as exc:
                # the save in flight when Ctrl-C came did not commit; older steps are intact and the
                # interrupt (exit 130, naming the last committed step) is what the user asked for
                self._notice(f"the checkpoint save in flight was abandoned: {exc}")
            raise Interrupted(self._last_committed(ckpt), checkpointing=bool(cfg.ckpt_every)) from None
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
        """(evaluation enabled, the training feed)."""
        cfg = self.cfg
        first, self._first_batch = self._first_batch, None
        it = self.task.feed(self._request("train", plan), plan, first=first)
        evaluate = bool(cfg.eval_every and cfg.eval_batches and self.task.eval_data is not None)
        return evaluate, it

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
                raise file_error(path, exc, "before the first step") from None
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
                            keep_last=cfg.keep_last, keep_every=cfg.keep_every, background_start=True)

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
        if it.restore(restored.data_state) is False:
            self._notice("the data source cannot save its position (no state()/restore() or grain "
                         "get_state()/set_state()): it starts again from its beginning")
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
        changed = _param_dtype_change(restored.metadata, plan)
        if changed is not None:
            saved, now = changed
            self._notice(f"PARAMETER PRECISION CHANGED on resume: step {restored.step} was saved with --param-dtype "
                         f"{saved}, this run trains with --param-dtype {now}. "
                         + ("The parameters are rounded to bfloat16 for the model and their float32 values continue as "
                            "master weights in the optimizer state (no update is lost), but the loss is computed in "
                            "lower precision from here on" if now == "bfloat16" else
                            "The float32 master weights become the parameters")
                         + f"; to continue in {saved} instead, stop now and resume with --param-dtype {saved}")
            restart["param_dtype_changed"] = [saved, now]
        return restored.state, restored.step, restart

    def _work_after(self, step: int):
        """Logged steps after ``step`` since the last restart: work that will be recomputed."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
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

    def _evaluate(self, eval_step, state, plan: ShardingPlan) -> Dict[str, float]:
        """Mean loss and metrics over ``eval_batches`` batches of the evaluation data (the same
        batches every time), each weighted by its weight."""
        val = self.task.feed(self._request("val", plan), plan)
        totals: Dict[str, float] = {}
        weight = 0.0
        try:
            for _ in range(self.cfg.eval_batches):
                out = eval_step(state, next(val))
                w = float(out["weight"])
                weight += w
                for k, v in out.items():
                    if k not in ("weight", "tokens", "finite", "grad_norm"):
                        totals[k] = totals.get(k, 0.0) + float(v) * w
        finally:
            val.close()
        return {k: v / max(weight, 1.0) for k, v in totals.items()}


_STANDARD = ("loss", "grad_norm", "lr", "examples_per_s", "tokens_per_s", "mfu", "eval_loss")


class _Loop:
    """The training loop of one :meth:`Trainer.run`: compile, steps, evaluation, checkpoints, logs."""

    def __init__(self, trainer: Trainer, plan: ShardingPlan, state, start: int, it, evaluate: bool,
                 ckpt, writer: MetricsWriter, clock: Stopwatch):
        cfg = trainer.cfg
        self.t, self.cfg, self.plan, self.state, self.start = trainer, cfg, plan, state, start
        self.it, self.ckpt, self.writer, self.clock = it, ckpt, writer, clock
        self.train_step = make_train_step(plan, loss_fn=trainer.task.loss_fn, nonfinite=cfg.nonfinite)
        self.eval_step = make_eval_step(plan, loss_fn=trainer.task.eval_loss_fn) if evaluate else None
        self.examples = plan.batch.batch_size
        per = trainer.task.tokens_per_example
        self.tokens_per_example = per(plan.batch.seq_len if trainer.task.layout is not None else cfg.seq_len) \
            if per else None
        # FLOPs per example: the decoder's formula (README), else the compiled step's count (after compile)
        self.flops_per_example = (model_flops_per_token(trainer.model_cfg, cfg.seq_len) * self.tokens_per_example
                                  if trainer.model_cfg is not None else None)
        self.peak = cfg.peak_flops_per_device or peak_flops(plan.mesh.devices.flat[0], cfg.hardware,
                                                            plan.num_devices)
        self.schedule = lr_schedule(cfg)
        self.metadata = trainer._metadata(plan)  # the same for every save of this run
        self.progress = ProgressDisplay(cfg.steps, start, cfg.progress.value, cfg.log_every, enabled=trainer.is_main)
        self.losses: List[float] = []
        self.rates: List[float] = []
        self.first_loss = self.final_loss = self.eval_loss = None
        self.eval_metrics: Optional[Dict[str, float]] = None
        self.skips = 0
        self.preempted = False
        self.pending_save: Optional[int] = None
        self.stop = None
        self._closed = False

    def run(self) -> None:
        cfg, plan = self.cfg, self.plan
        self.progress.print(f"meshtrain: {plan.abstract.num_params:,} parameters, recipe {plan.recipe.name}"
                            f"{_knobs_text(plan.recipe)}, mesh "
                            + " × ".join(f"{a}={s}" for a, s in plan.mesh_sizes.items())
                            + f", batch {self.examples}" + (f"×{self.tokens_per_example}" if self.tokens_per_example
                                                             else "")
                            + f", run folder {self.t.run_dir}")
        self.stop = _StopFlag()
        if self.stop.sigint_ignored:
            self.progress.print("meshtrain: SIGINT is ignored (inherited from the parent process); stop this run "
                                "with SIGTERM, which saves and exits 0")
        batch = next(self.it)
        t0 = time.perf_counter()
        compiled = self.train_step.lower(self.state, batch).compile()
        self.stop.check_interrupt()
        self.clock.add("compile_s", time.perf_counter() - t0)
        if self.flops_per_example is None and self.peak:   # counted once, only when MFU is reported
            flops = jaxpr_flops(self.train_step.trace(self.state, batch).jaxpr)
            self.flops_per_example = flops / self.examples if flops else None
        for step in range(self.start + 1, cfg.steps + 1):
            if step > self.start + 1:
                batch = next(self.it)
            record = self._step(compiled, step, batch)
            self.stop.check_interrupt()
            if self.eval_step is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                t1 = time.perf_counter()
                evals = self.t._evaluate(self.eval_step, self.state, plan)
                self.clock.add("eval_s", time.perf_counter() - t1)
                self.eval_loss = evals.pop("loss", None)
                record["eval_loss"] = self.eval_loss
                record.update({f"eval_{k}": v for k, v in evals.items()})
                self.eval_metrics = evals
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
                                  "lr": float(self.schedule(step - 1)), "weight": float(metrics["weight"]),
                                  "step_time_s": step_time, "examples_per_s": self.examples / step_time}
        if self.tokens_per_example:
            record["tokens"] = int(metrics["tokens"])
            record["tokens_per_s"] = self.examples * self.tokens_per_example / step_time
        for k, v in metrics.items():   # the loss function's own metrics, already ÷ global weight
            if k not in RESERVED_METRICS:
                record[k] = float(v) if finite else None
        record["data_wait_s"] = self.it.wait_s
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
            self.rates.append(record["examples_per_s"])
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.final_loss = loss
        if self.peak and self.flops_per_example:
            record["mfu"] = record["examples_per_s"] * self.flops_per_example / (self.peak * self.plan.num_devices)
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
        skip = {"step", "step_time_s", "data_wait_s", "tokens", "weight", "skipped", "ckpt_block_s"}
        scalars = {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in record.items()
                   if k not in skip and isinstance(v, (int, float))}
        self.writer.write(record, scalars)
        loss = record["loss"]
        user = [k for k in record if k not in RESERVED_METRICS and k not in skip and k not in _STANDARD
                and not k.startswith("eval_")]
        rate = (f"{record['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in record
                else f"{record['examples_per_s']:,.1f} ex/s")
        info = ((f"loss {loss:.4f}" if loss is not None else "loss non-finite (skipped)")
                + "".join(f"  {k} {record[k]:.4f}" for k in user if record[k] is not None)
                + f"  {rate}  {record['step_time_s'] * 1e3:.0f} ms/step"
                + (f"  MFU {record['mfu']:.1%}" if "mfu" in record else "")
                + (f"  eval {record['eval_loss']:.4f}" if "eval_loss" in record else "")
                + "".join(f"  eval {k[5:]} {record[k]:.4f}" for k in record
                          if k.startswith("eval_") and k != "eval_loss" and record[k] is not None))
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
        mfu = (median_rate * self.flops_per_example / (self.peak * self.plan.num_devices)
               if (self.peak and median_rate and self.flops_per_example) else None)
        tokens = median_rate * self.tokens_per_example if (median_rate and self.tokens_per_example) else None
        summary = TrainSummary(self.t.run_dir, len(self.losses), self.first_loss, self.final_loss, self.eval_loss,
                               tokens, mfu, wall, goodput, self.preempted, resumed_from, examples_per_s=median_rate,
                               eval_metrics=self.eval_metrics)
        self.writer.write({"event": "summary", **dataclasses.asdict(summary)})
        self.writer.close()
        if self.t.is_main:
            self.progress.print(_format_summary(summary))
        return summary


def _param_dtype_change(metadata: Optional[Dict[str, Any]], plan: ShardingPlan):
    """``(saved, now)`` parameter dtype names when a resume changes them, else ``None``."""
    saved = ((metadata or {}).get("recipe") or {}).get("param_dtype")
    now = getattr(plan.recipe.param_dtype, "value", plan.recipe.param_dtype)
    if saved is None or str(saved) == str(now):
        return None
    return str(saved), str(now)


def _knobs_text(recipe) -> str:
    """`` (attention ulysses, remat full, ...)``: the recipe's knobs that differ from the defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(recipe)}
    parts = []
    for name in ("attention", "remat", "param_dtype", "compute_dtype", "micro_batches", "offload", "layer_loop"):
        value = getattr(recipe, name)
        if value != defaults[name]:
            parts.append(f"{name.replace('_', ' ')} {getattr(value, 'value', value)}")
    return f" ({', '.join(parts)})" if parts else ""


def _format_summary(s: TrainSummary) -> str:
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
