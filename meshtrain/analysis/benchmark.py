"""Measure train steps of several recipes side by side and compare with the estimated ranking.

Steps are timed round-robin (one step of each recipe per round) so that a slow spell of a shared
machine hits every recipe alike; each recipe reports its median and minimum over the rounds.

Example::

    runs = [compile_recipe(abstract, get_recipe(r), cfg, 16, 128) for r in ("dp", "fsdp", "tp")]
    times = time_round_robin(runs, rounds=5)             # {"dp": [s, s, ...], ...}
    cmp = compare_rankings(estimates, times)             # pairs both orders agree on, Kendall tau

A pair of recipes counts as *distinguishable* when one was faster in every round and by at least
``margin`` (default 15 %) in the median; only those pairs can confirm or refute an estimate. An
estimate that puts a distinguishable pair within ``tie`` (default 5 %) of each other is a *tie*,
reported but not counted as a disagreement (the model cannot resolve that difference).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from meshtrain.plan import BatchSpec, make_plan
from meshtrain.state import TrainState, abstract_train_state, init_state
from meshtrain.train.step import make_train_step


class StateInit(str, enum.Enum):
    """How :func:`compile_recipe` builds the state it times: ``random`` (``init_state``: one more
    compile), ``host`` (parameters ~ N(0, 0.02²) drawn on the host, optimizer state zero, placed with
    ``device_put`` on the plan's shardings: no compile; step time does not depend on the values), or
    ``none`` (compile only)."""

    RANDOM = "random"
    HOST = "host"
    NONE = "none"


@dataclasses.dataclass
class CompiledRun:
    """A compiled step with its live state and batch (the state is replaced after every step)."""

    name: str
    plan: object
    compiled: object
    state: object
    batch: object

    def step(self) -> float:
        import jax

        t = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - t


def compile_recipe(abstract, recipe, cfg, batch_size: int, seq_len: int, *, devices=None, name=None,
                   init: "StateInit | str | bool" = StateInit.RANDOM) -> CompiledRun:
    """Plan, lower and compile ``recipe``'s train step, and build a state and batch per ``init``
    (:class:`StateInit`; ``False`` means ``none``)."""
    import jax
    import jax.numpy as jnp

    mesh = recipe.mesh.build(devices)
    plan = make_plan(abstract, recipe, mesh, batch=BatchSpec(batch_size, seq_len))
    step = make_train_step(plan)
    batch_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_shardings[k])
                 for k, v in plan.batch.abstract().items()}
    compiled = step.lower(abstract_train_state(plan), batch_abs).compile()
    init = StateInit.NONE if init is False else StateInit.RANDOM if init is True else StateInit(init)
    state = batch = None
    if init is not StateInit.NONE:
        if init is StateInit.RANDOM:
            state = init_state(plan, seed=0)
        else:
            target = abstract_train_state(plan)
            rng = np.random.default_rng(0)

            def host(s, scale):
                if scale and np.issubdtype(s.dtype, np.floating):
                    return jax.device_put((rng.standard_normal(s.shape) * scale).astype(s.dtype), s.sharding)
                return jax.device_put(np.zeros(s.shape, s.dtype), s.sharding)

            state = TrainState(host(target.step, 0), jax.tree.map(lambda s: host(s, 0.02), target.params),
                                  jax.tree.map(lambda s: host(s, 0), target.opt_state),
                                  jax.tree.map(lambda s: host(s, 0), target.model_state))
        rng = np.random.default_rng(0)
        toks = rng.integers(0, cfg.vocab_size, (batch_size, seq_len + 1))
        host = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                "positions": np.broadcast_to(np.arange(seq_len), (batch_size, seq_len)),
                "segment_ids": np.zeros((batch_size, seq_len))}
        batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), plan.batch_shardings[k]) for k, v in host.items()}
    return CompiledRun(name or recipe.name, plan, compiled, state, batch)


def time_round_robin(runs: Sequence[CompiledRun], rounds: int = 5, warmup: int = 1) -> Dict[str, List[float]]:
    """Seconds per step for each run, ``rounds`` rounds after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for r in runs:
            r.step()
    times: Dict[str, List[float]] = {r.name: [] for r in runs}
    for _ in range(rounds):
        for r in runs:
            times[r.name].append(r.step())
    return times


@dataclasses.dataclass(frozen=True)
class RankingComparison:
    estimated_order: Tuple[str, ...]
    measured_order: Tuple[str, ...]
    kendall_tau: float
    distinguishable: Tuple[Tuple[str, str], ...]  # (faster, slower) by measurement
    disagreements: Tuple[Tuple[str, str], ...]  # distinguishable pairs the estimate orders the other way
    ties: Tuple[Tuple[str, str], ...] = ()  # distinguishable pairs the estimate cannot separate

    @property
    def agrees(self) -> bool:
        return not self.disagreements


def compare_rankings(estimated: Mapping[str, float], measured: Mapping[str, Sequence[float]],
                     margin: float = 0.15, tie: float = 0.05) -> RankingComparison:
    """Compare estimated seconds per step with measured ones (see the module docstring)."""
    names = [n for n in estimated if n in measured]
    med = {n: float(np.median(measured[n])) for n in names}
    est_order = tuple(sorted(names, key=lambda n: estimated[n]))
    meas_order = tuple(sorted(names, key=lambda n: med[n]))
    concordant = discordant = 0
    dist, bad, ties = [], [], []
    for a, b in itertools.combinations(names, 2):
        sign_e = np.sign(estimated[a] - estimated[b])
        sign_m = np.sign(med[a] - med[b])
        concordant += sign_e == sign_m
        discordant += sign_e == -sign_m
        fast, slow = (a, b) if med[a] < med[b] else (b, a)
        rounds = list(zip(measured[fast], measured[slow]))
        if all(s > f for f, s in rounds) and med[slow] > (1 + margin) * med[fast]:
            dist.append((fast, slow))
            if abs(estimated[fast] - estimated[slow]) <= tie * min(estimated[fast], estimated[slow]):
                ties.append((fast, slow))
            elif estimated[fast] > estimated[slow]:
                bad.append((fast, slow))
    pairs = concordant + discordant
    tau = (concordant - discordant) / pairs if pairs else 0.0
    return RankingComparison(est_order, meas_order, float(tau), tuple(dist), tuple(bad), tuple(ties))
