"""`Trainer`: the loop for users who want one. Pick a model and a recipe, get a trained run folder
(``metrics.jsonl``, TensorBoard events, checkpoints)::

    from meshtrain.train import Trainer, TrainConfig
    summary = Trainer(TrainConfig(model="small", recipe="fsdp", steps=100, out="runs/demo")).run()

or with your own model: ``Trainer(cfg, model=lambda rngs: MyModel(rngs=rngs)).run()``. The loop itself
is :mod:`meshtrain.train.loop` (a step generator) plus :mod:`meshtrain.train.hooks`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import jax
import numpy as np
import optax

from meshtrain import fp8
from meshtrain.parallel import grad_compression
from meshtrain.abstract import Annotations, ModelFactory, abstract_state
from meshtrain.annotate import ModelRules, PathRules
from meshtrain.batch_layout import BatchLayout
from meshtrain.checkpoint import Checkpointer
from meshtrain.checkpoint.types import CheckpointError, Verify
from meshtrain.errors import ConfigError
from meshtrain.mesh import MeshSpec, hybrid_layout, select_devices
from meshtrain.models import DecoderConfig
from meshtrain.models.flops import model_flops_per_token
from meshtrain.checkpoint.adapters import LORA_META
from meshtrain.models.lora import lora_factory
from meshtrain.parallel.resolved import batch_splits
from meshtrain.plan import ShardingPlan, data_parallel_size, make_plan
from meshtrain.state import init_state
from meshtrain.settings import plain_settings
from meshtrain.train.config import AdamVariance, MemoryCheckMode, Resume, TrainConfig, default_optimizer
from meshtrain.train.hooks import (CheckpointHook, EvalHook, Hook, MetricsHook, PreemptionHook, ProgressHook,
                                   ThroughputHook)
from meshtrain.train.loop import Interrupted, Run, TrainingError, TrainSummary, close_loop, run_loop, summary
from meshtrain.train.metrics import Stopwatch, open_outputs
from meshtrain.train.preflight import Estimate, check_memory
from meshtrain.train import run_config
from meshtrain.train.rundir import RunLock, copy_tokenizer, file_error, restart_changes, resume_step, work_after
from meshtrain.train.sources import initial_params
from meshtrain.model_source import short_name
from meshtrain.train.step import LossFn, make_eval_step, make_train_step, next_token_loss
from meshtrain.train.tasks import (DataRequest, builtin_task, custom_task, example_layout, language_model_task,
                                   local_rows)
from meshtrain.train.watchdog import Watchdog

__all__ = ["Interrupted", "Trainer", "TrainingError", "TrainSummary"]


def _default_run_dir(cfg: TrainConfig) -> str:
    recipe = os.path.splitext(os.path.basename(cfg.recipe))[0]
    return os.path.join("runs", f"{short_name(cfg.model)}-{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")


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
      rules: model rules as a dict, file or :class:`~meshtrain.ModelRules` (``{"paths": {REGEX: names},
        "logical": {name: mesh axis}}``), before ``config.rules``' file and ``path_rules``.
      memory_estimate: ``plan -> (bytes per device, description)`` for the pre-flight memory check
        (default: parameters + gradients + optimizer + batch; ``meshtrain train`` adds activations).
      hooks: your :class:`~meshtrain.train.hooks.Hook` s, run at each step after the built-in
        throughput, evaluation and checkpoint hooks and before the metrics, progress and preemption
        hooks (order and interface: :mod:`meshtrain.train.hooks`).

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
                 path_rules: Optional[PathRules] = None, hooks: Sequence[Hook] = (), rules: Annotations = None):
        self.cfg = config
        self.user_hooks = tuple(hooks)
        # Only a run that the configuration alone describes gets a config.yaml that `train --config` reruns.
        self._config_only = all(x is None for x in (model, tx, loss_fn, data, eval_data, path_rules, rules))
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
        given = [ModelRules.load(r) for r in (rules, config.rules, path_rules) if r is not None]
        self.path_rules = functools.reduce(ModelRules.combined, given) if given else None  # first ones win
        # LoRA: the task's model with adapters on the targets, every other weight frozen (model state)
        self.factory, self.tx, self.loss_fn = lora_factory(task.factory, config.lora_config()), tx, task.loss_fn
        self.model_cfg = task.model_cfg if isinstance(task.model_cfg, DecoderConfig) else None
        self.run_dir = config.out or _default_run_dir(config)
        self.is_main = jax.process_index() == 0
        self._lost_s = 0.0  # wall time of steps recomputed after a restart
        self._first_batch = None

    # -- set-up ----------------------------------------------------------------------------------
    def build_plan(self, devices=None) -> ShardingPlan:
        """The run's :class:`ShardingPlan` (recipe + overrides, mesh over the devices, batch layout)."""
        recipe, mesh = self._recipe_and_mesh(devices)
        factory = fp8.recipe_factory(self.factory, recipe)  # the recipe's fp8: dense layers get their scales
        factory = grad_compression.feedback_factory(factory, recipe)  # onebit: its error feedback (model state)
        variance = AdamVariance.FREEZES if grad_compression.resolve(recipe).has_feedback else AdamVariance.LEARNT
        model = abstract_state(factory, annotations=self.path_rules)
        tx = self.tx or default_optimizer(self.cfg, model.param_axes, variance)
        return make_plan(model.with_optimizer(tx), recipe, mesh, batch=self._layout())

    def _recipe_and_mesh(self, devices=None):
        cfg = self.cfg
        recipe = cfg.build_recipe()  # the recipe with every knob and dimension option the run overrides
        if cfg.mesh:
            recipe = recipe.with_mesh(**MeshSpec.parse(cfg.mesh))
        devices = devices if devices is not None else select_devices(cfg.devices)
        recipe = dataclasses.replace(recipe, mesh=hybrid_layout(recipe.mesh, devices, cfg.dcn))
        return recipe, recipe.mesh.build(devices)

    def batch_multiple(self, devices=None) -> int:
        """The number every global batch size must be a multiple of under this config's recipe and
        mesh: data-parallel size × micro-batches (e.g. 32 for ``pp_fsdp`` on 8 devices with 8
        micro-batches: fsdp=4 × 8). ``meshtrain train`` rounds its default batch up to it."""
        recipe, mesh = self._recipe_and_mesh(devices)
        return data_parallel_size(recipe.axis_rules(), dict(mesh.shape)) * batch_splits(recipe)

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
        if os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise ConfigError(f"--out {self.run_dir!r} is an existing file, not a folder; pass a folder path")
        lock = RunLock(self.run_dir) if self.is_main else None
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _run(self) -> TrainSummary:
        cfg = self.cfg
        clock = Stopwatch()
        plan = self.build_plan()
        self._announce_optimizer()
        if cfg.memory_check is MemoryCheckMode.ON:
            check_memory(plan, self.memory_estimate, remat=plan.recipe.remat.value)
        ckpt = self._checkpointer()
        try:
            resumed_from = resume_step(self.run_dir, cfg.resume is not Resume.NO, ckpt, self._notice)
            if resumed_from is not None and resumed_from >= cfg.steps:
                return self._already_done(resumed_from)
            if resumed_from is not None:   # a requeued or restarted job says where it picks up
                self._notice(f"resuming {self.run_dir} from step {resumed_from} (its newest valid checkpoint)")
            first, self._first_batch = self._first_batch, None
            data = self.task.feed(self._request("train", plan), plan, first=first)
            state, start, restart = self._initial_state(plan, ckpt, data)
            writer = open_outputs(self.run_dir, plan, restart, self.is_main, self._header())
        except BaseException:
            if ckpt is not None:
                ckpt.close()
            raise
        clock.add("setup_s", clock.elapsed())  # plan, data, init or restore
        run = Run(cfg, plan, state, start, run_dir=self.run_dir, data=data, writer=writer, clock=clock,
                  tokens_per_example=self._tokens_per_example(plan), lost_s=self._lost_s, is_main=self.is_main)
        train_step = make_train_step(plan, loss_fn=self.task.loss_fn, nonfinite=cfg.nonfinite)
        hooks = self._hooks(plan, ckpt, train_step, run.tokens_per_example)
        try:
            run_loop(run, hooks, train_step)
        except KeyboardInterrupt:
            try:
                close_loop(run, hooks, failed=True)
            except CheckpointError as exc:
                # the save in flight when Ctrl-C came did not commit; older steps are intact and the
                # interrupt (exit 130, naming the last committed step) is what the user asked for
                self._notice(f"the checkpoint save in flight was abandoned: {exc}")
            raise Interrupted(self._last_committed(ckpt), checkpointing=bool(cfg.ckpt_every)) from None
        except BaseException:
            close_loop(run, hooks, failed=True)
            raise
        close_loop(run, hooks, failed=False)
        return summary(run, resumed_from)

    def _hooks(self, plan: ShardingPlan, ckpt, train_step, tokens_per_example) -> List[Hook]:
        """The built-in hooks around the user's, in the order of :mod:`meshtrain.train.hooks`."""
        cfg = self.cfg
        # FLOPs per example: the decoder's formula (README), else the compiled step's count
        flops = (model_flops_per_token(self.model_cfg, cfg.seq_len) * tokens_per_example
                 if self.model_cfg is not None else None)
        hooks: List[Hook] = [ThroughputHook(flops, train_step)]
        if cfg.eval_every and cfg.eval_batches and self.task.eval_data is not None:
            eval_step = make_eval_step(plan, loss_fn=self.task.eval_loss_fn)
            hooks.append(EvalHook(eval_step, lambda: self.task.feed(self._request("val", plan), plan),
                                  cfg.eval_batches, cfg.eval_every))
        checkpoint = CheckpointHook(ckpt, self._metadata(plan)) if ckpt is not None else None
        hooks += [checkpoint] if checkpoint is not None else []
        watchdog = Watchdog.from_env(cfg.hang_timeout, cfg.straggler_fraction,   # also injects test faults
                                     disk_faults=ckpt.faults if ckpt is not None else None)
        return hooks + [*self.user_hooks, watchdog, MetricsHook(), ProgressHook(), PreemptionHook(checkpoint)]

    def _tokens_per_example(self, plan: ShardingPlan) -> Optional[int]:
        per = self.task.tokens_per_example
        return per(plan.batch.seq_len if self.task.layout is not None else self.cfg.seq_len) if per else None

    def _already_done(self, step: int) -> TrainSummary:
        cfg = self.cfg
        if step > cfg.steps:
            raise ConfigError(f"run {self.run_dir!r} is already at step {step}, past --steps {cfg.steps}; pass "
                              f"--steps > {step} to train further")
        self._notice(f"run {self.run_dir} is already at step {step} (= --steps): nothing to train; pass a larger "
                     f"--steps to continue")
        return TrainSummary(self.run_dir, 0, None, None, None, None, None, 0.0, {}, False, step, True)

    def _header(self) -> dict:
        """The run header's own fields: every run setting, the built-in model's config (what
        `meshtrain generate` rebuilds the model from); the data's tokenizer is copied beside it."""
        if self.is_main:  # the first of data, weights' source and model folder that has a tokenizer
            any(copy_tokenizer(p, self.run_dir) for p in (self.cfg.data, self.cfg.init_from, self.cfg.model))
        model = dataclasses.asdict(self.task.model_cfg) if dataclasses.is_dataclass(self.task.model_cfg) else None
        if self.is_main and self._config_only:  # the resolved run configuration: a --config file that reruns it
            try:
                run_config.write_record(self.run_dir, self.cfg)
            except OSError as exc:
                path = os.path.join(self.run_dir, run_config.CONFIG_FILE)
                raise file_error(path, exc, "before the first step") from None
        header = {"run_settings": plain_settings(self.cfg, skip=("recipe_options",)), "model_config": model,
                  "run_config": run_config.recorded(self.cfg)}
        if self.tx is None:  # the built-in optimizer: the values it uses, defaults resolved
            cfg = self.cfg
            header["optimizer"] = {"lr": cfg.peak_lr, "warmup_steps": cfg.warmup,
                                   "min_lr": cfg.peak_lr * cfg.min_lr_ratio, "defaults": cfg.optimizer_defaults.name}
        return header

    def _announce_optimizer(self) -> None:
        """The built-in optimizer's schedule on the console (defaults named), and a warning when its
        warmup is longer than half the run."""
        if self.tx is not None or not self.is_main:
            return
        self._notice(self.cfg.schedule_text())
        note = self.cfg.warmup_warning()
        if note:
            warnings.warn(note, stacklevel=2)

    def _notice(self, text: str) -> None:
        if self.is_main:
            print(f"meshtrain: {text}", flush=True)

    def _last_committed(self, ckpt) -> Optional[int]:
        if ckpt is None:
            return None
        good = [s for s in ckpt.all_steps() if ckpt.check(s, Verify.QUICK).status.usable]
        return good[-1] if good else None

    def _checkpointer(self) -> Optional[Checkpointer]:
        if not ((cfg := self.cfg).ckpt_every or cfg.peer_every) and cfg.resume is Resume.NO:
            return None
        return Checkpointer(os.path.join(self.run_dir, "checkpoints"), save_every=cfg.ckpt_every or cfg.steps,
                            keep_last=cfg.keep_last, keep_every=cfg.keep_every, background_start=True,
                            peer_every=cfg.peer_every)

    def _metadata(self, plan: ShardingPlan) -> Dict[str, Any]:
        return {"recipe": plan.recipe.to_dict(), "mesh": plan.mesh_sizes, "model": self.cfg.model,
                "seed": self.cfg.seed, "data": self.cfg.data,  # the tokenizer of `meshtrain generate`
                "batch_size": self.cfg.batch_size, "seq_len": self.cfg.seq_len,
                "num_params": plan.abstract.num_params, **self._lora_metadata()}

    def _lora_metadata(self) -> Dict[str, Any]:
        """A LoRA run's settings (the export and merge-on-load read ``alpha`` from the checkpoint)."""
        lora = self.cfg.lora_config()
        if lora is None:
            return {}
        return {LORA_META: {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
                            "base": lora.base.value, "init_from": self.cfg.init_from}}

    def _base_plan(self, plan: ShardingPlan) -> ShardingPlan:
        """The plan of the model without adapters (LoRA: ``--init-from`` reads the base's weights onto it)."""
        base = getattr(self.factory, "base", None)
        if base is None:
            return plan
        return make_plan(abstract_state(fp8.recipe_factory(base, plan.recipe), annotations=self.path_rules),
                         plan.recipe, plan.mesh, check=False)

    def _initial_state(self, plan: ShardingPlan, ckpt: Optional[Checkpointer], data):
        """(state, start step, restart record or None)."""
        cfg = self.cfg
        if ckpt is None or cfg.resume is not Resume.LATEST or ckpt.latest_valid_step() is None:
            params = initial_params(cfg.init_from, self._base_plan(plan), self.task.model_cfg,
                                    self._notice) if cfg.init_from else None
            return init_state(plan, seed=cfg.seed, params=params), 0, None
        restored = ckpt.restore(plan)
        if data.restore(restored.data_state) is False:
            self._notice("the data source cannot save its position (no state()/restore() or grain "
                         "get_state()/set_state()): it starts again from its beginning")
        recomputed, self._lost_s = work_after(self.run_dir, restored.step)
        restart = {"restored_step": restored.step, "recomputed_steps": recomputed, "lost_s": self._lost_s}
        param_dtype = str(getattr(plan.recipe.param_dtype, "value", plan.recipe.param_dtype))
        restart.update(restart_changes(restored, cfg.batch_size, param_dtype, self._notice))
        return restored.state, restored.step, restart
