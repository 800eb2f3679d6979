"""Shared test helpers: meshes, abstract states, deterministic batches, runs of N steps, host copies of
states and bit-exact comparisons (the checkpoint, pipeline and resharding tests)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import meshtrain as mt
from meshtrain.generation import Sampling
from meshtrain.parallel.resolved import batch_splits

TINY_BATCH, TINY_SEQ = 16, 64


def mesh_for(recipe: "mt.Recipe | str", n_devices: int = 8, **sizes):
    """The recipe's mesh over the first ``n_devices`` CPU devices (sizes overridable)."""
    recipe = mt.get_recipe(recipe)
    if sizes:
        recipe = recipe.with_mesh(**sizes)
    return recipe, recipe.mesh.build(jax.devices()[:n_devices])


def single_device(recipe: "mt.Recipe | str"):
    """The same knobs as ``recipe`` on one device (the parity baseline)."""
    base = mt.get_recipe(recipe)
    one = mt.get_recipe("dp").with_options(
        remat=base.remat, param_dtype=base.param_dtype, compute_dtype=base.compute_dtype,
        grad_accum=batch_splits(base))
    return one, one.mesh.build(jax.devices()[:1])


def tiny_abstract(tx=None, model="tiny", **overrides):
    tx = tx or optax.adamw(3e-3)
    return mt.abstract_state(mt.models.model_factory(mt.models.get_config(model, **overrides)), tx)


def token_batch(step: int, batch=TINY_BATCH, seq=TINY_SEQ, vocab=256, seed=0, docs=True):
    """A deterministic batch with two packed documents per row (exercises segment masking)."""
    rng = np.random.default_rng((seed, step))
    toks = rng.integers(0, vocab, (batch, seq + 1))
    positions = np.broadcast_to(np.arange(seq), (batch, seq)).copy()
    segments = np.zeros((batch, seq), np.int32)
    if docs:
        cut = seq // 3
        segments[:, cut:] = 1
        positions[:, cut:] -= cut
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": positions, "segment_ids": segments}


def put(batch, plan):
    return {k: jax.device_put(jnp.asarray(v, jnp.int32), plan.batch_shardings[k]) for k, v in batch.items()}


def run_steps(recipe, mesh, steps=10, abstract=None, batch=TINY_BATCH, seq=TINY_SEQ, seed=0):
    """Train ``steps`` steps; returns (losses, plan, final state)."""
    losses, _, plan, state = _train(recipe, mesh, steps, abstract or tiny_abstract(), batch, seq, seed)
    return losses, plan, state


def run_steps_with_grads(recipe, mesh, steps=10, abstract=None, batch=TINY_BATCH, seq=TINY_SEQ, seed=0):
    """:func:`run_steps` that also returns the gradients of the first step (at the seed's initial state, on
    ``token_batch(0)``), as host arrays: ``(losses, grads, plan, final state)``. The optimizer keeps them
    (:func:`with_kept_grads`), so a parity test reads gradients and losses from one compiled train step per
    recipe instead of also initialising again and compiling ``make_grad_fn`` (test_parity: two programs and
    two initialisations per recipe became one of each). ``losses[0]`` is the loss those gradients are of.

    Example: ``losses, grads, plan, _ = run_steps_with_grads(*mesh_for("fsdp"), steps=5)``."""
    abstract = abstract or tiny_abstract()
    tx = with_kept_grads(abstract.tx)   # the same model and optimizer, and a copy of each step's gradients
    kept = dataclasses.replace(abstract, tx=tx, opt_state=jax.eval_shape(tx.init, abstract.params))
    return _train(recipe, mesh, steps, kept, batch, seq, seed, keep_grads=True)


def _train(recipe, mesh, steps, abstract, batch, seq, seed, keep_grads=False):
    plan = mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(batch, seq))
    state = mt.init_state(plan, seed=seed)
    step = mt.make_train_step(plan)
    losses, grads = [], None
    for i in range(steps):
        state, metrics = step(state, put(token_batch(i, batch, seq), plan))
        if keep_grads and i == 0:
            grads = kept_grads(state)
            # not a vacuous comparison: the step applied gradients, and the optimizer kept them
            assert any(np.any(g != 0) for g in jax.tree.leaves(grads)), "the kept gradients are all zero"
        losses.append(float(metrics["loss"]))
    return np.array(losses), grads, plan, state


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def host(state):
    """A host copy that survives buffer donation by later steps."""
    return jax.tree.map(lambda x: np.array(x, copy=True), state)


def assert_bit_exact(expected_host, state):
    exp, got = jax.tree_util.tree_flatten_with_path(expected_host)[0], jax.tree.leaves(state)
    assert len(exp) == len(got)
    for (path, e), g in zip(exp, got):
        g = np.asarray(g)
        assert e.dtype == g.dtype and e.shape == g.shape, jax.tree_util.keystr(path)
        same = np.array_equal(e.reshape(-1).view(np.uint8), g.reshape(-1).view(np.uint8))
        assert same, f"{jax.tree_util.keystr(path)} differs"


def assert_on_mesh(state, plan):
    want = mt.state_shardings(plan)
    for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(want)):
        assert isinstance(x.sharding, NamedSharding), jax.tree_util.keystr(path)
        assert x.sharding.mesh == plan.mesh and x.sharding == s, jax.tree_util.keystr(path)


def random_state(plan, step: int):
    """A host TrainState shaped like the plan's with distinct random values (no compile needed)."""
    rng = np.random.default_rng(step)
    target = mt.abstract_train_state(plan)

    def leaf(x):
        if np.issubdtype(x.dtype, np.floating):
            return rng.standard_normal(x.shape).astype(x.dtype)
        return np.full(x.shape, step, x.dtype)
    return jax.tree.map(leaf, target)


def device(plan, host_state):
    return jax.device_put(host_state, mt.state_shardings(plan))


def built_once(key: str, build) -> str:
    """The folder ``build(folder)`` fills, built once per test session and shared by every test and every
    xdist worker (the others wait on a lock meanwhile): a reference run several test files compare with.
    The folder lives in the session's folder (conftest.py's ``MESHTRAIN_TEST_SESSION``) and goes with it.
    Tests only read it.

    Example: ``run = built_once("tiny-2x2-uninterrupted", lambda folder: launch(folder + "/run"))``."""
    if "MESHTRAIN_TEST_SESSION" not in os.environ:   # outside pytest's conftest: this process only
        os.environ["MESHTRAIN_TEST_SESSION"] = tempfile.mkdtemp(prefix="meshtrain-tests-session-")
    root = os.path.join(os.environ["MESHTRAIN_TEST_SESSION"], "built-once")
    os.makedirs(root, exist_ok=True)
    folder = os.path.join(root, key)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # held while one worker builds; pytest-timeout bounds the wait
        try:
            if not os.path.exists(os.path.join(folder, ".built")):
                shutil.rmtree(folder, ignore_errors=True)   # a build that failed part-way starts over
                os.makedirs(folder)
                build(folder)
                open(os.path.join(folder, ".built"), "w").close()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


#: Prompts of three lengths (left padding in one batch) and the tokens to generate: the generation tests.
GENERATION_PROMPTS = [[10, 20, 30, 40, 50, 60, 70], [5, 6, 7], [101, 102, 103, 104, 105]]
GENERATION_NEW = 8


def assert_same_generations(engine, reference, new: int = GENERATION_NEW, sampling=None, stop_ids=(),
                            tolerance: float = 1e-5):
    """Run both engines on :data:`GENERATION_PROMPTS` for ``new`` tokens: the same tokens, the same rows
    stopped, ``new_logprobs`` within ``tolerance``. Returns ``(reference's result, engine's result)``."""
    sampling = Sampling() if sampling is None else sampling
    a = reference.run(GENERATION_PROMPTS, new, sampling, stop_ids=stop_ids)
    b = engine.run(GENERATION_PROMPTS, new, sampling, stop_ids=stop_ids)
    assert [g.new_ids for g in b.generations] == [g.new_ids for g in a.generations]
    assert [g.stopped for g in b.generations] == [g.stopped for g in a.generations]
    gap = max(float(np.max(np.abs(np.array(x.new_logprobs) - np.array(y.new_logprobs))))
              for x, y in zip(a.generations, b.generations))
    assert gap <= tolerance, gap
    return a, b


def make_decoder(name: str, seed: int = 0):
    """A built-in decoder (``"tiny"``, ``"tiny-moe"``) with concrete weights and no sharding, as ``load`` takes it."""
    with nnx.use_eager_sharding(False):
        return mt.models.Decoder(mt.models.get_config(name), rngs=nnx.Rngs(seed))


#: The tiny Trainer run the Trainer-level parity tests compare with (test_trainer.py, test_context_parallel.py):
#: ``TrainConfig(**TINY_TRAINER_RUN, recipe=..., out=...)``; its one-device losses are conftest's session
#: fixture ``tiny_one_device_losses``.
TINY_TRAINER_RUN = dict(model="tiny", steps=10, batch_size=16, seq_len=64, eval_every=0, progress="none")


def losses_of(run_dir) -> np.ndarray:
    """The per-step training losses in ``run_dir``/metrics.jsonl, in step order."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for rec in map(json.loads, f):
            if "loss" in rec:
                by_step[rec["step"]] = rec["loss"]
    return np.array([by_step[s] for s in sorted(by_step)])


def cli_env() -> dict:
    """The environment for a ``python -m meshtrain`` child: the CPU platform and the CLI's own device count
    (the suite's ``JAX_NUM_CPU_DEVICES`` / ``XLA_FLAGS`` left out; processes.py adds the suite's -O0 back)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def losses_by_step(run_dir) -> dict:
    """``{step: loss}`` from ``run_dir``/metrics.jsonl, ``{}`` before it exists; a killed run's cut last line
    is skipped."""
    by_step = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    for line in open(path) if os.path.exists(path) else ():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in rec:
            by_step[rec["step"]] = rec["loss"]
    return by_step


def kill_then_resume(command, tmp_path, kill_after: int, *, cwd, first=(), bound_s: int = 500):
    """Run ``command(base)`` to the end; start ``command(out, *first)``, SIGKILL it once step ``kill_after`` is
    logged (the wait bounded by ``bound_s``), then run ``command(out, "--resume")`` to the end. Returns the
    uninterrupted and the resumed run's ``{step: loss}`` and the resumed run's folder."""
    import signal
    import time

    import processes

    base, out = tmp_path / "base", tmp_path / "run"
    done = processes.run(command(base), env=cli_env(), cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = processes.start(command(out, *first), env=cli_env(), cwd=cwd, stdout=processes.DEVNULL, stderr=err)
        deadline = time.monotonic() + bound_s
        while max(losses_by_step(out), default=0) < kill_after and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the kill; lengthen its steps"
        proc.send_signal(signal.SIGKILL)
        processes.wait(proc, timeout=60)
    done = processes.run(command(out, "--resume"), env=cli_env(), cwd=cwd, capture_output=True, text=True,
                         timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses_by_step(base), losses_by_step(out), out


# --- g1: children that share the compilation cache from every process ---------------------------------

#: A folder whose ``sitecustomize.py`` lets every process of a multi-process child run write the suite's
#: compilation cache (JAX writes it from process 0 only) and sets the suite's GC thresholds
#: (tests/child_site/sitecustomize.py says why). conftest.py puts it on every child's ``PYTHONPATH``.
CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")


def cache_every_process(env: dict) -> dict:
    """``env`` for a ``python -m meshtrain`` child whose processes 1.. load their programs from the suite's
    compilation cache instead of compiling them in every launch and restart (process 0 already does).
    An environment copied from ``os.environ`` already has it (conftest.py); this adds it to one built otherwise.

    Example: ``processes.run([sys.executable, "-m", "meshtrain", "launch", ...], env=cache_every_process(env))``."""
    path = env.get("PYTHONPATH", "")
    if CHILD_SITE in path.split(os.pathsep):
        return dict(env)
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (CHILD_SITE, path) if p))


#: The in-process tiny run that resume and damaged-folder tests copy (tests/test_run_safety.py,
#: tests/test_faults.py): ``meshtrain train`` with these flags, 4 steps, checkpoints at 2 and 4. Tests that train
#: in-process with the same flags and ``--steps 4`` load its compiled step from the cache.
FINISHED_TINY_FLAGS = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0",
                       "--progress", "none", "--data", os.path.dirname(json.__file__)]


def finished_tiny_run() -> str:
    """The folder of a finished 4-step run (:data:`FINISHED_TINY_FLAGS`), trained once per session in whichever
    worker asks first. Copy it before changing anything in it.

    Example: ``shutil.copytree(finished_tiny_run(), tmp_path / "run")``."""
    from meshtrain.cli import main

    def build(folder):
        run = os.path.join(folder, "done")
        assert main([*FINISHED_TINY_FLAGS, "--steps", "4", "--ckpt-every", "2", "--out", run]) == 0
    return os.path.join(built_once("cli-tiny-4-steps-checkpoints-2-4", build), "done")


# --- g4: gradients from the train step itself (one compiled program for gradients and losses) ---

def with_kept_grads(tx):
    """``tx`` behind a pass-through that keeps the gradients it is given as its state, so the train step's own
    gradients can be read after a step (:func:`kept_grads`) without compiling a separate ``make_grad_fn``
    program: parity tests that compare gradients and losses then compile one program per recipe, not two.
    The updates, and so the losses, are ``tx``'s own.

    Example: ``mt.abstract_state(factory, with_kept_grads(optax.adamw(3e-3)))``."""
    keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
    return optax.chain(keep, tx)


def kept_grads(state):
    """Host copies of the gradients the last step applied (a state whose optimizer is :func:`with_kept_grads`'s)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), state.opt_state[0])
