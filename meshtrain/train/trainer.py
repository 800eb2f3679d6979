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
from meshtrain.data import BatchIterator, load_source
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.mesh import MeshSpec, select_devices
from meshtrain.models import DecoderConfig, get_config, model_factory
from meshtrain.plan import BatchSpec, ShardingPlan, make_plan
from meshtrain.recipes import get_recipe
from meshtrain.train.config import Resume, TrainConfig, default_optimizer, lr_schedule
from meshtrain.analysis.flops import model_flops_per_token
from meshtrain.train.metrics import MetricsWriter, ProgressDisplay, Stopwatch, peak_flops
from meshtrain.train.state import init_state
from meshtrain.train.step import LossFn, NonFinite, make_eval_step, make_train_step


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

    def _check_run_dir(self, has_checkpoints: bool) -> None:
        cfg = self.cfg
        if cfg.resume is Resume.NO and (has_checkpoints or os.path.exists(os.path.join(self.run_dir,
                                                                                       "metrics.jsonl"))):
            raise ConfigError(f"run folder {self.run_dir!r} already holds a run (metrics or checkpoints); "
                              f"pass --resume to continue it or choose another --out")

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> TrainSummary:
        cfg = self.cfg
        clock = Stopwatch()
        plan = self.build_plan()
        ckpt = self._checkpointer()
        self._check_run_dir(bool(ckpt and ckpt.all_steps()))
        source = load_source(cfg.data)
        train_src, val_src = source.split(cfg.val_fraction) if cfg.eval_every and cfg.eval_batches else (source, None)
        it = BatchIterator(train_src, cfg.batch_size, cfg.seq_len, cfg.seed, shardings=plan.batch_shardings,
                           vocab_size=self.vocab_size)
        writer = MetricsWriter(self.run_dir, enabled=self.is_main)
        if self.is_main:
            with open(os.path.join(self.run_dir, "plan.json"), "w") as f:
                f.write(plan.to_json())
        state, start, resumed_from = self._initial_state(plan, ckpt, it, writer)
        train_step = make_train_step(plan, loss_fn=self.loss_fn, nonfinite=cfg.nonfinite)
        eval_step = make_eval_step(plan, loss_fn=self.loss_fn) if val_src is not None else None
        flops_per_token = (model_flops_per_token(self.model_cfg, cfg.seq_len) if self.model_cfg
                           else 6.0 * plan.abstract.num_params)
        peak = cfg.peak_flops_per_device or peak_flops(plan.mesh.devices.flat[0], cfg.hardware, plan.num_devices)
        schedule = lr_schedule(cfg)
        metadata = self._metadata(plan)  # the same for every save of this run
        progress = ProgressDisplay(cfg.steps, start, cfg.progress.value, cfg.log_every, enabled=self.is_main)
        progress.print(f"meshtrain: {plan.abstract.num_params:,} parameters, recipe {plan.recipe.name}, mesh "
                       + " × ".join(f"{a}={s}" for a, s in plan.mesh_sizes.items())
                       + f", batch {cfg.batch_size}×{cfg.seq_len}, run folder {self.run_dir}")
        stop = _StopFlag()
        losses: List[float] = []
        rates: List[float] = []
        first_loss = final_loss = eval_loss = None
        skips = 0
        preempted = False
        clock.add("setup_s", clock.elapsed())  # plan, data, init or restore
        try:
            batch = next(it)
            t0 = time.perf_counter()
            compiled = train_step.lower(state, batch).compile()
            clock.add("compile_s", time.perf_counter() - t0)
            for step in range(start + 1, cfg.steps + 1):
                if step > start + 1:
                    batch = next(it)
                t0 = time.perf_counter()
                state, metrics = compiled(state, batch)
                loss = float(metrics["loss"])
                step_time = time.perf_counter() - t0
                clock.add("compute_s", step_time)
                finite = bool(metrics["finite"])
                record: Dict[str, Any] = {"step": step, "loss": loss if finite else None,
                                          "grad_norm": float(metrics["grad_norm"]) if finite else None,
                                          "lr": float(schedule(step - 1)), "tokens": int(metrics["tokens"]),
                                          "step_time_s": step_time,
                                          "tokens_per_s": cfg.batch_size * cfg.seq_len / step_time,
                                          "data_wait_s": it.wait_s}
                clock.add("data_wait_s", it.wait_s)
                it.wait_s = 0.0
                if not finite:
                    skips += 1
                    if cfg.nonfinite is NonFinite.RAISE:
                        raise TrainingError(f"non-finite loss or gradients at step {step}; lower --lr, check the "
                                            f"data, or pass --nonfinite skip")
                    record["skipped"] = True
                    if skips > cfg.max_skips:
                        raise TrainingError(f"{skips} non-finite steps in a row (last: step {step}); "
                                            f"parameters are unchanged since step {step - skips}")
                else:
                    skips = 0
                    losses.append(loss)
                    rates.append(record["tokens_per_s"])
                    first_loss = loss if first_loss is None else first_loss
                    final_loss = loss
                if peak:
                    record["mfu"] = record["tokens_per_s"] * flops_per_token / (peak * plan.num_devices)
                if eval_step is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                    t1 = time.perf_counter()
                    eval_loss = self._evaluate(eval_step, state, val_src, plan)
                    clock.add("eval_s", time.perf_counter() - t1)
                    record["eval_loss"] = eval_loss
                if ckpt is not None:
                    res = ckpt.maybe_save(step, state, data_state=it.state(), metadata=metadata,
                                          force=step == cfg.steps)
                    clock.add("checkpoint_s", res.blocking_s)  # collecting a finished save blocks too
                    if res.saved:
                        record["ckpt_block_s"] = res.blocking_s
                writer.write(record, {"train/loss": record["loss"], "train/tokens_per_s": record["tokens_per_s"],
                                      "train/lr": record["lr"], "train/grad_norm": record["grad_norm"],
                                      "train/mfu": record.get("mfu"), "eval/loss": record.get("eval_loss")})
                info = (f"loss {loss:.4f}  {record['tokens_per_s']:,.0f} tok/s  {step_time * 1e3:.0f} ms/step"
                        + (f"  MFU {record['mfu']:.1%}" if "mfu" in record else "")
                        + (f"  eval {eval_loss:.4f}" if "eval_loss" in record else ""))
                progress.update(step, info)
                if step < cfg.steps and stop.should_stop(step):
                    preempted = True
                    if ckpt is not None:
                        res = ckpt.maybe_save(step, state, data_state=it.state(), metadata=metadata, force=True)
                        clock.add("checkpoint_s", res.blocking_s)
                    progress.print(f"SIGTERM: stopped after step {step}" + (", checkpoint saved" if ckpt else ""))
                    writer.write({"event": "preempted", "step": step})
                    break
            if ckpt is not None:
                t1 = time.perf_counter()
                ckpt.wait()
                clock.add("checkpoint_s", time.perf_counter() - t1)
        finally:
            progress.close()
            stop.restore()
            it.close()
            if ckpt is not None:
                ckpt.close()
        wall = clock.elapsed()
        goodput = dict(clock.totals, wall_s=wall, lost_s=self._lost_s)
        goodput["goodput"] = goodput.get("compute_s", 0.0) / wall if wall else 0.0
        median_rate = statistics.median(rates[1:] or rates) if rates else None
        mfu = median_rate * flops_per_token / (peak * plan.num_devices) if (peak and median_rate) else None
        summary = TrainSummary(self.run_dir, len(losses), first_loss, final_loss, eval_loss, median_rate, mfu, wall,
                               goodput, preempted, resumed_from)
        writer.write({"event": "summary", **{k: v for k, v in dataclasses.asdict(summary).items()}})
        writer.close()
        if self.is_main:
            progress.print(_format_summary(summary))
        return summary

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

    def _initial_state(self, plan, ckpt, it: BatchIterator, writer: MetricsWriter):
        if ckpt is not None and self.cfg.resume is Resume.LATEST and ckpt.latest_valid_step() is not None:
            restored = ckpt.restore(plan)
            it.restore(restored.data_state)
            recomputed, lost = self._work_after(restored.step)
            self._lost_s = lost
            writer.write({"event": "restart", "restored_step": restored.step, "recomputed_steps": recomputed,
                          "lost_s": lost})
            return restored.state, restored.step, restored.step
        return init_state(plan, seed=self.cfg.seed), 0, None

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
